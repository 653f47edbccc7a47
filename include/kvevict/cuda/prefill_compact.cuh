#pragma once
// Steps 3 and 5 of a batched prefill call on CUDA (cuda/prefill.cuh): how
// many to keep per (entry, head), then the order-preserving compaction of
// the kept rows and the new slot table.
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/prefill_rules.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/prefill_workspace.cuh"
#include "kvevict/kv_view.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

// ---- 3. plan ----

template <int Threads>
__global__ void __launch_bounds__(Threads)
    prefill_plan_kernel(batch_state_view st, active_set active, prompt_lengths prompts, prefill_workspace ws,
                        std::int32_t segments) {
  const std::int32_t segment = static_cast<std::int32_t>(blockIdx.x) * Threads + static_cast<std::int32_t>(threadIdx.x);
  if (segment >= segments) return;
  const std::int32_t entry = segment / st.num_heads();
  const std::int32_t b = kvevict::detail::check_entry(active, entry, st.num_seqs()).sequence;  // repeats step nothing
  std::int32_t candidates = 0, take = 0;
  if (b >= 0 && ws.seq_bad[entry] == 0) {
    const kvevict::detail::prefill_plan plan = kvevict::detail::plan_prefill(st.rule, prompts.lengths[b]);
    if (plan.select) {
      candidates = plan.candidates();
      take = plan.take;
    }
  }
  ws.candidates[segment] = candidates;
  ws.takes[segment] = take;
}

// ---- 5. compaction ----

/// Moves the kept rows of (b, h) to slots [0, kept) in ascending slots.
/// Every thread of the block calls it.
template <int Threads, class T, class Layout>
__device__ void move_kept_rows(const kv_view<T, Layout>& cache, std::int32_t b, std::int32_t h,
                               const kvevict::detail::prefill_plan& plan, const std::int32_t* chosen,
                               unsigned char* stage) {
  const std::int32_t d = cache.head_dim;
  const std::int64_t row_bytes = (std::int64_t{d} * static_cast<std::int64_t>(sizeof(T)) + 15) / 16 * 16;
  const std::int32_t per_pass = static_cast<std::int32_t>(kPrefillStageBytes / (2 * row_bytes));
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x), warp = t / 32, lane = t % 32;
  constexpr std::int32_t warps = Threads / 32;
  // Slots below plan.lo keep their rows. A pass reads all its source rows
  // (a warp per K or V row) before any of its destinations is written; a
  // later pass's sources lie at or above its own slots, beyond every slot
  // written so far.
  if (per_pass > 0) {
    for (std::int32_t s0 = plan.lo; s0 < plan.kept; s0 += per_pass) {
      const std::int32_t rows = plan.kept - s0 < per_pass ? plan.kept - s0 : per_pass;
      for (std::int32_t r = warp; r < 2 * rows; r += warps) {
        const std::int32_t s = s0 + r / 2, from = plan.source(s, chosen);
        if (from == s) continue;
        T* staged = reinterpret_cast<T*>(stage + r * row_bytes);
        copy_row(staged, r % 2 ? cache.v_row(b, h, from) : cache.k_row(b, h, from), d, lane, 32);
      }
      __syncthreads();
      for (std::int32_t r = warp; r < 2 * rows; r += warps) {
        const std::int32_t s = s0 + r / 2, from = plan.source(s, chosen);
        if (from == s) continue;
        const T* staged = reinterpret_cast<const T*>(stage + r * row_bytes);
        copy_row(r % 2 ? cache.v_row(b, h, s) : cache.k_row(b, h, s), staged, d, lane, 32);
      }
      __syncthreads();
    }
  } else {  // a row longer than half the stage: one slot at a time, straight (two rows never overlap)
    for (std::int32_t s = plan.lo; s < plan.kept; ++s) {
      const std::int32_t from = plan.source(s, chosen);
      if (from != s) {
        copy_row(cache.k_row(b, h, s), cache.k_row(b, h, from), d, t, Threads);
        copy_row(cache.v_row(b, h, s), cache.v_row(b, h, from), d, t, Threads);
      }
      __syncthreads();
    }
  }
}

template <int Threads, class T, class Layout, bool Move, bool Scores>
__global__ void __launch_bounds__(Threads)
    prefill_compact_kernel(batch_state_view st, active_set active, prompt_lengths prompts, kv_view<T, Layout> cache,
                           prefill_workspace ws, std::int32_t* reclaimable) {
  __shared__ __align__(16) unsigned char stage[kPrefillStageBytes];
  const prefill_head at(st, active, static_cast<std::int32_t>(blockIdx.x));
  if (at.b < 0) return;  // the whole block
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x);
  if (ws.seq_bad[at.entry]) {
    if (at.h == 0 && t == 0 && reclaimable) reclaimable[at.b] = 0;
    return;  // the whole block
  }
  const std::int32_t length = prompts.lengths[at.b];
  const kvevict::detail::prefill_plan plan = kvevict::detail::plan_prefill(st.rule, length);
  const std::int64_t segment = at.segment(st);
  const std::int32_t* chosen = ws.chosen + segment * ws.index_stride;
  if constexpr (Move) move_kept_rows<Threads>(cache, at.b, at.h, plan, chosen, stage);
  (void)stage;
  const float* score = Scores ? ws.scores + segment * ws.max_length : nullptr;
  kvevict::detail::commit_prefill_slots(
      st, at.b, at.h, plan, chosen, [&](std::int32_t p) { return Scores ? score[p] : 0.0f; }, t, Threads);
  if (t == 0) {
    kvevict::detail::commit_prefill_counters(st, at.b, at.h, plan.kept, length);
    if (at.h == 0) {
      st.slots.lengths[at.b] = length;
      if (reclaimable)
        reclaimable[at.b] =
            Move ? kvevict::detail::prefill_reclaimable_pages(cache, st.rule.budget, st.capacity(), length) : 0;
    }
  }
}

}  // namespace detail
}  // namespace gpu
}  // namespace kvevict
