// Must not compile: queries + LSE recompute the logits from the cached
// keys, and fp8 keys need their scales (dtype/convert.hpp).
#include "kvevict/kvevict.hpp"

void score_fp8_queries(kvevict::batched_policy<kvevict::h2o_policy>& layer, const kvevict::batch_queries<float>& in,
                       const kvevict::kv_view<kvevict::fp8_e5m2, kvevict::paged_layout>& cache) {
  layer.observe_evict(in, cache);
}
