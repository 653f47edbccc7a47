#pragma once
// Decodes which policy x dtype x layout an input drives, its configuration,
// shape and cache, and hands them to a runner (the per-sequence or the
// batched driver). Shared by the two halves of fuzz_policy_api, which are
// separate translation units so the harness builds on two cores at once.
#include <cstdint>
#include <type_traits>

#include "kvevict/dtype/bfloat16.hpp"
#include "kvevict/dtype/half.hpp"
#include "kvevict/layout.hpp"
#include "kvevict/policy/exact_greedy.hpp"
#include "kvevict/policy/h2o.hpp"
#include "kvevict/policy/random.hpp"
#include "kvevict/policy/recent_window.hpp"
#include "support/fuzz_caches.hpp"
#include "support/fuzz_input.hpp"
#include "support/policy_configs.hpp"

namespace kvfuzz {

/// Runner: template <class Policy, class T, class Layout> static void
/// run(fuzz_input&, const config_type&, const policy_shape&, const cache_shape&).
template <class Runner, class Policy, class T, class Layout>
void dispatch_shapes(fuzz_input& in) {
  using config_type = typename kvevict::policy_traits<Policy>::config_type;
  const config_type config = decode_config<Policy>(in);
  const kvevict::policy_shape shape = decode_shape(in, config_budget(config));
  cache_shape cs;
  cs.seqs = shape.num_seqs;
  cs.heads = shape.num_kv_heads;
  cs.capacity = shape.capacity;
  cs.head_dim = in.range(4, 16);
  cs.page_size = in.range(1, 8);
  cs.layout = std::is_same_v<Layout, kvevict::paged_layout>
                  ? (in.one_in(2) ? layout_kind::paged_hnd : layout_kind::paged_nhd)
                  : (in.one_in(2) ? layout_kind::bshd : layout_kind::bhsd);
  if (in.one_in(48)) cs.capacity -= 1;  // a cache smaller than the policy: every view is refused
  Runner::template run<Policy, T, Layout>(in, config, shape, cs);
}

template <class Runner, class Policy>
void dispatch_dtype(fuzz_input& in, int dtype, bool paged) {
  using kvevict::paged_layout;
  using kvevict::strided_layout;
  switch (dtype) {
    case 0:
      return paged ? dispatch_shapes<Runner, Policy, float, paged_layout>(in)
                   : dispatch_shapes<Runner, Policy, float, strided_layout>(in);
    case 1:
      return paged ? dispatch_shapes<Runner, Policy, kvevict::half, paged_layout>(in)
                   : dispatch_shapes<Runner, Policy, kvevict::half, strided_layout>(in);
    default:
      return paged ? dispatch_shapes<Runner, Policy, kvevict::bfloat16, paged_layout>(in)
                   : dispatch_shapes<Runner, Policy, kvevict::bfloat16, strided_layout>(in);
  }
}

template <class Runner>
void dispatch_policy_api(fuzz_input& in) {
  const int policy = in.range(0, 3);
  const int dtype = in.range(0, 2);
  const bool paged = in.one_in(2);
  switch (policy) {
    case 0: return dispatch_dtype<Runner, kvevict::h2o_policy>(in, dtype, paged);
    case 1: return dispatch_dtype<Runner, kvevict::recent_window_policy>(in, dtype, paged);
    case 2: return dispatch_dtype<Runner, kvevict::random_policy>(in, dtype, paged);
    default: return dispatch_dtype<Runner, kvevict::exact_greedy_policy>(in, dtype, paged);
  }
}

/// The two halves, one translation unit each.
void run_sequence_api(fuzz_input& in);
void run_batched_api(fuzz_input& in);

}  // namespace kvfuzz
