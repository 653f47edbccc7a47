// Must not compile: a prompt's queries in fp8 (no scale to read them by),
// into an fp8 cache that would be fine with float queries.
#include "kvevict/kvevict.hpp"

void compress_fp8_queries(const kvevict::batch_state_view& st, const kvevict::prompt_lengths& prompts,
                          const kvevict::batch_prefill_queries<kvevict::fp8_e5m2>& in,
                          const kvevict::kv_view<kvevict::fp8_e5m2, kvevict::strided_layout>& cache,
                          std::uint64_t* status) {
  kvevict::batched_prefill(st, kvevict::active_set::all(), prompts, in, cache, nullptr, status);
}
