// fuzz_policy_api, per-sequence half: builds the policy and the cache the
// input asks for (refusals of bad configurations and shapes are checked to
// be kvevict errors) and runs sequence_driver.hpp over them.
#include <optional>
#include <utility>

#include "policy_dispatch.hpp"
#include "sequence_driver.hpp"
#include "support/guarded_call.hpp"

namespace kvfuzz {
namespace {

struct sequence_runner {
  template <class Policy, class T, class Layout>
  static void run(fuzz_input& in, const typename kvevict::policy_traits<Policy>::config_type& config,
                  const kvevict::policy_shape& shape, const cache_shape& cs) {
    std::optional<Policy> policy;
    if (!guarded_construct("policy constructor", [&] { policy.emplace(shape, config); })) return;
    std::optional<kvevict::kv_cache<T, Layout>> cache;
    if (!guarded_construct("make cache", [&] { cache.emplace(make_cache<T>(cs, static_cast<Layout*>(nullptr))); }))
      return;
    sequence_driver<Policy, T, Layout> driver(in, std::move(*policy), std::move(*cache));
    driver.run();
  }
};

}  // namespace

void run_sequence_api(fuzz_input& in) { dispatch_policy_api<sequence_runner>(in); }

}  // namespace kvfuzz
