#pragma once
// Batched KeyDiff prefill on CUDA: the call of kvevict/batch/prefill_key_diff.hpp
// with the same results. One block per (entry, KV head) scores its prompt
// keys in three passes over them: the key norms (kept in the workspace's
// score row), the anchor (a thread per component; integer sums, so the
// order of the terms cannot change it, key_diff.hpp), then each key's
// score. Keep set, selection and compaction are every prefill's
// (prefill.cuh). A prompt is read three times by one block: prefill is
// not the decode path, and this form has not been tuned on a GPU.
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "kvevict/batch/prefill_key_diff.hpp"
#include "kvevict/batch/prefill_rules.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/prefill.cuh"
#include "kvevict/cuda/prefill_workspace.cuh"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/key_diff.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// blockIdx.x = entry * heads + head. Dynamic shared memory: the unit
/// anchor, head_dim floats.
template <int Threads, class T, class Layout>
__global__ void __launch_bounds__(Threads)
    prefill_key_diff_kernel(batch_state_view st, active_set active, prompt_lengths prompts, key_diff<T, Layout> in,
                            prefill_workspace ws, std::uint64_t* status) {
  extern __shared__ float unit[];
  __shared__ std::int32_t first_bad;
  __shared__ float anchor_length;
  const prefill_head head(st, active, static_cast<std::int32_t>(blockIdx.x));
  const std::int64_t segment = head.segment(st);
  if (head.b < 0 || ws.head_refused[segment]) return;  // the whole block
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x), d = in.cache.head_dim;
  const std::int32_t length = prompts.lengths[head.b];
  float* norms = ws.scores + segment * ws.max_length;  // the norms first, then the scores in their place
  const float scale = in.cache.k_scale(head.h);        // checked good by prepare
  if (t == 0) first_bad = INT_MAX;
  __syncthreads();
  for (std::int32_t p = t; p < length; p += Threads) {
    const float norm = key_length(in.cache.k_row(head.b, head.h, p), d, scale);
    norms[p] = norm;
    if (classify_input(norm, false) != batch_code::ok) atomicMin(&first_bad, p);
  }
  __syncthreads();
  if (first_bad != INT_MAX) {  // every thread sees it: the whole block leaves
    if (t == 0) {
      report(status, pack_status(head.b, head.h, first_bad, batch_code::non_finite_kv));
      mark_bad(ws, head.entry);
    }
    return;
  }
  for (std::int32_t e = t; e < d; e += Threads) {  // a warp reads consecutive components of one key
    std::int64_t sum = 0;
    for (std::int32_t p = 0; p < length; ++p)
      sum += key_diff_unit(in.cache.k_row(head.b, head.h, p), e, scale, norms[p]);
    unit[e] = key_diff_anchor_value(sum);
  }
  __syncthreads();
  if (t == 0) anchor_length = key_diff_anchor_length(unit, d);
  __syncthreads();
  for (std::int32_t e = t; e < d; e += Threads) unit[e] = key_diff_unit_anchor(unit[e], anchor_length);
  __syncthreads();
  for (std::int32_t p = t; p < length; p += Threads)
    norms[p] = key_diff_score(in.cache.k_row(head.b, head.h, p), unit, d, scale);  // the anchor pass ended at a barrier
}

template <class T, class Layout>
struct scoring_key_diff {
  static constexpr bool has_scores = true;
  key_diff<T, Layout> in;

  static std::int64_t per_pair(std::int32_t) { return 0; }
  void require_grid(const kvevict::detail::site&, std::int64_t, const batch_state_view&, std::int32_t) const {}
  cudaError_t launch(const prefill_launch& l) const {
    const std::int64_t blocks = std::int64_t{l.entries} * l.st.num_heads();  // run_prefill checked it fits
    const std::size_t shared = std::size_t(in.cache.head_dim) * sizeof(float);
    prefill_key_diff_kernel<kBlockThreads, T, Layout>
        <<<static_cast<unsigned>(blocks), kBlockThreads, shared, l.stream>>>(l.st, l.active, l.prompts, in, l.ws,
                                                                             l.status);
    return cudaGetLastError();
  }
};

}  // namespace detail

/// KeyDiff prefill compression of every active sequence from its cached
/// prompt keys (slots [0, L) of in.cache, device memory); the kept rows
/// move to slots [0, kept). The same results as kvevict::batched_prefill
/// on the host (kvevict/batch/prefill_key_diff.hpp). workspace == nullptr:
/// only sets workspace_bytes.
template <class T, class Layout>
cudaError_t batched_prefill(void* workspace, std::size_t& workspace_bytes, const batch_state_view& st,
                            const active_set& active, const prompt_lengths& prompts, const key_diff<T, Layout>& in,
                            std::int32_t* reclaimable_pages, std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "prefill"};
  kvevict::detail::require_prefill_call(w, st, active, prompts, status);
  kvevict::detail::require_cache(w, st, in.cache);
  if (std::size_t(in.cache.head_dim) * sizeof(float) > 48 * 1024)
    kvevict::detail::fail<invalid_argument>(w, "in.cache.head_dim", "= ", in.cache.head_dim,
                                            " needs more than 48 KiB of shared memory for KeyDiff's anchor");
  return detail::run_prefill<true>(w, workspace, workspace_bytes, st, active, prompts,
                                   detail::scoring_key_diff<T, Layout>{in},
                                   kvevict::detail::prefill_key_checks<T, Layout>{in.cache}, in.cache,
                                   reclaimable_pages, status, stream);
}

}  // namespace gpu
}  // namespace kvevict
