// Multi-token steps on CUDA: append of several tokens and evict_to (rows
// moved in the cache, or the moves reported; exact_greedy's greedy form).
#include "cuda_backend.hpp"
#include "cuda_common.cuh"

namespace kvevict_py {
namespace cuda {

void append_tokens(const batch_state_view& st, const kvevict::active_set& active, std::int32_t tokens,
                   std::uint64_t* status, void* stream) {
  throw_on_error(kvevict::gpu::batched_append_tokens(st, active, tokens, status, as_stream(stream)),
                 "append_tokens");
}

void evict_to(const batch_state_view& st, const kvevict::active_set& active, std::int32_t target,
              const any_cache& cache, std::int32_t* freed, std::uint64_t* status, void* stream) {
  visit_cache(cache, [&](auto view) {
    throw_on_error(kvevict::gpu::batched_evict_to(st, active, target, view, freed, status, as_stream(stream)),
                   "evict_to");
  });
}

void evict_to_moves(const batch_state_view& st, const kvevict::active_set& active, std::int32_t target,
                    kvevict::slot_move* moves, std::int32_t* move_counts, std::uint64_t* status, void* stream) {
  throw_on_error(
      kvevict::gpu::batched_evict_to(st, active, target, moves, move_counts, status, as_stream(stream)),
      "evict_to");
}

void evict_to_greedy(const batch_state_view& st, const kvevict::active_set& active, std::int32_t target,
                     const any_array& q, const kvevict::tensor_view<const float, 2>& lse, float scale,
                     kvevict::lse_base base, const any_cache& cache, std::int32_t* freed, std::uint64_t* status,
                     void* stream) {
  visit_queries(q, cache, [&](auto qt, auto view) {
    using Q = decltype(qt);
    const kvevict::batch_queries<Q> in{q.view<Q, 3>(), lse, scale, base};
    throw_on_error(
        kvevict::gpu::batched_evict_to(st, active, target, in, view, freed, status, as_stream(stream)),
        "evict_to");
  });
}

}  // namespace cuda
}  // namespace kvevict_py
