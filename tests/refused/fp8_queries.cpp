// Must not compile: queries are numbers without a scale, so an fp8 query
// tensor is refused (dtype/convert.hpp); fp8 is a K/V cache format, read
// through a kv_view with its scales.
#include "kvevict/kvevict.hpp"

void score_fp8_queries(kvevict::batched_policy<kvevict::h2o_policy>& layer,
                       const kvevict::batch_queries<kvevict::fp8_e4m3>& in,
                       const kvevict::kv_view<kvevict::fp8_e4m3, kvevict::paged_layout>& cache) {
  layer.observe_evict(in, cache);
}
