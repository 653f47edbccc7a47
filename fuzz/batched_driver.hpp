#pragma once
#include "kvevict/policy/policy_shape.hpp"
#include "support/fuzz_caches.hpp"
namespace kvfuzz {
template <class Policy, class T, class Layout, class C>
void run_batched_api(fuzz_input&, const C&, const kvevict::policy_shape&, const cache_shape&) {}
}
