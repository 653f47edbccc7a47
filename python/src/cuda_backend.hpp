#pragma once
// The CUDA side of the bindings: thin wrappers over kvevict's gpu::
// launchers, defined in the cuda_*.cu files (compiled only when nvcc is
// found; KVEVICT_PY_CUDA is then defined for the bindings). Every function
// enqueues on `stream` (a cudaStream_t, here as void* so that this header
// needs no CUDA header), never synchronises except read_status, and throws
// cuda_failure for a failed launch; argument errors are the launchers' own
// kvevict exceptions, thrown on the host before anything is enqueued.
#include <cstddef>
#include <cstdint>

#include "common.hpp"

namespace kvevict_py {
namespace cuda {

void init(const batch_state_view& st, std::uint64_t* status, void* stream);
void reset(const batch_state_view& st, const kvevict::active_set& active, const std::uint64_t* streams,
           std::uint64_t* status, void* stream);

/// fork from `from` into `to` (the same state or not); workspace null:
/// returns the bytes it needs and enqueues nothing.
std::size_t fork(void* workspace, std::size_t workspace_bytes, const batch_state_view& from,
                 const batch_state_view& to, const kvevict::active_set& destinations, const std::int32_t* sources,
                 const std::uint64_t* streams, std::uint64_t* status, void* stream);

void append(const batch_state_view& st, const kvevict::active_set& active, std::uint64_t* status, void* stream);
void append_kv(const batch_state_view& st, const kvevict::active_set& active, const any_cache& cache,
               const any_array& k_new, const any_array& v_new, std::uint64_t* status, void* stream);

void observe_evict(const batch_state_view& st, const kvevict::active_set& active, const kvevict::batch_probs& in,
                   std::int32_t* victims, std::uint64_t* status, void* stream);
void observe_evict(const batch_state_view& st, const kvevict::active_set& active,
                   const kvevict::batch_head_scores& in, std::int32_t* victims, std::uint64_t* status, void* stream);
void observe_evict(const batch_state_view& st, const kvevict::active_set& active, const kvevict::batch_logits& in,
                   std::int32_t* victims, std::uint64_t* status, void* stream);
/// Append + observe + evict in one launch (gpu::batched_step).
void step(const batch_state_view& st, const kvevict::active_set& active, const kvevict::batch_probs& in,
          std::int32_t* victims, std::uint64_t* status, void* stream);
void step(const batch_state_view& st, const kvevict::active_set& active, const kvevict::batch_head_scores& in,
          std::int32_t* victims, std::uint64_t* status, void* stream);
void step(const batch_state_view& st, const kvevict::active_set& active, const kvevict::batch_logits& in,
          std::int32_t* victims, std::uint64_t* status, void* stream);
/// Queries + LSE (h2o, recent_window, random), or exact_greedy's step.
void observe_evict_queries(const batch_state_view& st, const kvevict::active_set& active, const any_array& q,
                           const kvevict::tensor_view<const float, 2>& lse, float scale, kvevict::lse_base base,
                           const any_cache& cache, std::int32_t* victims, std::uint64_t* status, void* stream);
/// Key norms of the cache's keys, or KeyDiff with `diff` (cache.v is a
/// stand-in, never read).
void observe_evict_keys(const batch_state_view& st, const kvevict::active_set& active, bool diff,
                        const any_cache& cache, std::int32_t* victims, std::uint64_t* status, void* stream);

void append_tokens(const batch_state_view& st, const kvevict::active_set& active, std::int32_t tokens,
                   std::uint64_t* status, void* stream);
void evict_to(const batch_state_view& st, const kvevict::active_set& active, std::int32_t target,
              const any_cache& cache, std::int32_t* freed, std::uint64_t* status, void* stream);
void evict_to_moves(const batch_state_view& st, const kvevict::active_set& active, std::int32_t target,
                    kvevict::slot_move* moves, std::int32_t* move_counts, std::uint64_t* status, void* stream);
/// exact_greedy's greedy evict_to, with the step's queries.
void evict_to_greedy(const batch_state_view& st, const kvevict::active_set& active, std::int32_t target,
                     const any_array& q, const kvevict::tensor_view<const float, 2>& lse, float scale,
                     kvevict::lse_base base, const any_cache& cache, std::int32_t* freed, std::uint64_t* status,
                     void* stream);

/// Batched prefill. workspace == nullptr: returns the workspace bytes the
/// call needs and enqueues nothing; otherwise runs and returns 0. `snap`:
/// SnapKV's parameters, read by the window_* inputs only.
std::size_t prefill(void* workspace, std::size_t workspace_bytes, const batch_state_view& st,
                    const kvevict::active_set& active, const kvevict::prompt_lengths& prompts, prefill_input kind,
                    const any_array& x, const kvevict::tensor_view<const float, 3>& lse, float scale,
                    kvevict::lse_base base, const kvevict::snap_window& snap, const any_cache& cache,
                    std::int32_t* reclaimable, std::uint64_t* status, void* stream);

/// Sets the status word to clear (all ones) on `stream`.
void clear_status(std::uint64_t* status, void* stream);
/// Copies the status word to the host after the work on `stream`: waits for it.
std::uint64_t read_status(const std::uint64_t* status, void* stream);

}  // namespace cuda
}  // namespace kvevict_py
