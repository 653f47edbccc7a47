// libFuzzer harness of kvevict's policy API: the per-sequence policies
// (sequence_driver.hpp) and the batched host API (batched_driver.hpp), for
// every policy x layout (BHSD, BSHD, paged NHD / HND) x dtype (float, half,
// bfloat16). The first bytes choose the combination, the shape and the
// configuration; the rest drive up to 64 calls. See docs/reliability.md,
// "Fuzzing", for what is checked and how to run it.
#include <cstddef>
#include <cstdint>
#include <optional>

#include "batched_driver.hpp"
#include "kvevict/dtype/bfloat16.hpp"
#include "kvevict/dtype/half.hpp"
#include "sequence_driver.hpp"
#include "support/fuzz_caches.hpp"
#include "support/fuzz_input.hpp"
#include "support/guarded_call.hpp"
#include "support/policy_configs.hpp"

namespace {

using namespace kvfuzz;

template <class Policy, class T, class Layout>
void run_sequence_api(fuzz_input& in, const typename kvevict::policy_traits<Policy>::config_type& config,
                      const kvevict::policy_shape& shape, const cache_shape& cs) {
  std::optional<Policy> policy;
  if (!guarded_construct("policy constructor", [&] { policy.emplace(shape, config); })) return;
  std::optional<kvevict::kv_cache<T, Layout>> cache;
  if (!guarded_construct("make cache", [&] { cache.emplace(make_cache<T>(cs, static_cast<Layout*>(nullptr))); }))
    return;
  sequence_driver<Policy, T, Layout> driver(in, std::move(*policy), std::move(*cache));
  driver.run();
}

template <class Policy, class T, class Layout>
void run_api(fuzz_input& in, bool batched) {
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
  if (batched) run_batched_api<Policy, T, Layout>(in, config, shape, cs);
  else run_sequence_api<Policy, T, Layout>(in, config, shape, cs);
}

template <class Policy>
void run_policy(fuzz_input& in, int dtype, bool paged, bool batched) {
  switch (dtype) {
    case 0:
      return paged ? run_api<Policy, float, kvevict::paged_layout>(in, batched)
                   : run_api<Policy, float, kvevict::strided_layout>(in, batched);
    case 1:
      return paged ? run_api<Policy, kvevict::half, kvevict::paged_layout>(in, batched)
                   : run_api<Policy, kvevict::half, kvevict::strided_layout>(in, batched);
    default:
      return paged ? run_api<Policy, kvevict::bfloat16, kvevict::paged_layout>(in, batched)
                   : run_api<Policy, kvevict::bfloat16, kvevict::strided_layout>(in, batched);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_input in(data, size);
  const bool batched = in.one_in(2);
  const int policy = in.range(0, 3);
  const int dtype = in.range(0, 2);
  const bool paged = in.one_in(2);
  switch (policy) {
    case 0: run_policy<kvevict::h2o_policy>(in, dtype, paged, batched); break;
    case 1: run_policy<kvevict::recent_window_policy>(in, dtype, paged, batched); break;
    case 2: run_policy<kvevict::random_policy>(in, dtype, paged, batched); break;
    default: run_policy<kvevict::exact_greedy_policy>(in, dtype, paged, batched); break;
  }
  return 0;
}
