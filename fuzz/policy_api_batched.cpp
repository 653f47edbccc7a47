// fuzz_policy_api, batched half: builds the batched_policy (exact_greedy
// with a history extent, sometimes a bad one) and the cache the input asks
// for, and runs batched_driver.hpp over them.
#include <memory>
#include <optional>
#include <utility>

#include "batched_driver.hpp"
#include "policy_dispatch.hpp"
#include "support/guarded_call.hpp"

namespace kvfuzz {
namespace {

struct batched_runner {
  template <class Policy, class T, class Layout>
  static void run(fuzz_input& in, const typename kvevict::policy_traits<Policy>::config_type& config,
                  const kvevict::policy_shape& shape, const cache_shape& cs) {
    kvevict::history_extent history;
    if constexpr (std::is_same_v<Policy, kvevict::exact_greedy_policy>) {
      history.max_tokens = shape.capacity + in.range(0, 48);
      history.head_dim = in.one_in(24) ? in.range(0, 20) : cs.head_dim;
      if (in.one_in(32)) history.max_tokens = shape.capacity - 1;
  }
  using batched = kvevict::batched_policy<Policy, kvevict::device::host>;
  std::unique_ptr<batched> policy;
  if (!guarded_construct("batched_policy constructor",
                         [&] { policy = std::make_unique<batched>(shape, config, history); }))
    return;
  std::optional<kvevict::kv_cache<T, Layout>> cache;
  if (!guarded_construct("make cache", [&] { cache.emplace(make_cache<T>(cs, static_cast<Layout*>(nullptr))); }))
    return;
  kvevict::group_reduce reduce = kvevict::group_reduce::sum;
  std::int32_t recent = 0;
  if constexpr (std::is_same_v<Policy, kvevict::h2o_policy>) reduce = config.reduce, recent = config.recent;
  batched_driver<Policy, T, Layout> driver(in, std::move(policy), std::move(*cache), reduce, recent);
  driver.run();
  }
};

}  // namespace

void run_batched_api(fuzz_input& in) { dispatch_policy_api<batched_runner>(in); }

}  // namespace kvfuzz
