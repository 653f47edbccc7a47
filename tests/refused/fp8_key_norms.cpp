// Must not compile: key norms read the keys as numbers, and fp8 keys are
// values only with their scales, which this path does not take yet
// (dtype/convert.hpp). ctest expects the compiler's refusal to say so.
#include "kvevict/kvevict.hpp"

void score_fp8_keys(const kvevict::batch_state_view& st, const kvevict::kv_view<kvevict::fp8_e4m3, kvevict::strided_layout>& cache,
                    std::uint64_t* status) {
  kvevict::batched_observe_evict(st, kvevict::active_set::all(), kvevict::key_norms<kvevict::fp8_e4m3, kvevict::strided_layout>{cache},
                                 nullptr, status);
}
