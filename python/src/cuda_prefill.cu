// Batched prefill compression on CUDA, from the causal probabilities, column
// sums, queries + LSE, the norms of the cached keys, KeyDiff's cosines of
// the cached keys (kvevict/cuda/prefill_key_diff.cuh), no scores
// (recent_window, random), or SnapKV's observation window (probabilities,
// logits + LSE, queries + LSE; kvevict/cuda/prefill_window.cuh).
#include "cuda_backend.hpp"
#include "cuda_common.cuh"

namespace kvevict_py {
namespace cuda {

std::size_t prefill(void* workspace, std::size_t workspace_bytes, const batch_state_view& st,
                    const kvevict::active_set& active, const kvevict::prompt_lengths& prompts, prefill_input kind,
                    const any_array& x, const kvevict::tensor_view<const float, 3>& lse, float scale,
                    kvevict::lse_base base, const kvevict::snap_window& snap, const any_cache& cache,
                    std::int32_t* reclaimable, std::uint64_t* status, void* stream) {
  std::size_t bytes = workspace ? workspace_bytes : 0;
  const cudaStream_t s = as_stream(stream);
  auto run = [&](auto view) {
    switch (kind) {
      case prefill_input::probs:
        return kvevict::gpu::batched_prefill(workspace, bytes, st, active, prompts,
                                             kvevict::batch_prefill_probs{x.view<float, 4>()}, view, reclaimable,
                                             status, s);
      case prefill_input::sums:
        return kvevict::gpu::batched_prefill(workspace, bytes, st, active, prompts,
                                             kvevict::batch_prefill_sums{x.view<float, 3>()}, view, reclaimable,
                                             status, s);
      case prefill_input::none:
        return kvevict::gpu::batched_prefill(workspace, bytes, st, active, prompts, view, reclaimable, status, s);
      case prefill_input::key_norms: {
        using V = decltype(view);
        const kvevict::key_norms<typename V::element_type, typename V::layout_type> in{view};
        return kvevict::gpu::batched_prefill(workspace, bytes, st, active, prompts, in, reclaimable, status, s);
      }
      case prefill_input::key_diff: {
        using V = decltype(view);
        const kvevict::key_diff<typename V::element_type, typename V::layout_type> in{view};
        return kvevict::gpu::batched_prefill(workspace, bytes, st, active, prompts, in, reclaimable, status, s);
      }
      case prefill_input::window_probs:
        return kvevict::gpu::batched_prefill(workspace, bytes, st, active, prompts,
                                             kvevict::batch_window_probs{x.view<float, 4>(), snap}, view,
                                             reclaimable, status, s);
      case prefill_input::window_logits:
        return kvevict::gpu::batched_prefill(workspace, bytes, st, active, prompts,
                                             kvevict::batch_window_logits{x.view<float, 4>(), lse, scale, base, snap},
                                             view, reclaimable, status, s);
      case prefill_input::queries:
      case prefill_input::window_queries: break;
    }
    return cudaErrorInvalidValue;  // queries go through visit_queries below
  };
  cudaError_t e;
  if (kind == prefill_input::queries) {
    e = visit_queries(x, cache, [&](auto qt, auto view) {
      using Q = decltype(qt);
      const kvevict::batch_prefill_queries<Q> in{x.view<Q, 4>(), lse, scale, base};
      return kvevict::gpu::batched_prefill(workspace, bytes, st, active, prompts, in, view, reclaimable, status, s);
    });
  } else if (kind == prefill_input::window_queries) {
    e = visit_queries(x, cache, [&](auto qt, auto view) {
      using Q = decltype(qt);
      const kvevict::batch_window_queries<Q> in{x.view<Q, 4>(), lse, scale, base, snap};
      return kvevict::gpu::batched_prefill(workspace, bytes, st, active, prompts, in, view, reclaimable, status, s);
    });
  } else {
    e = visit_cache(cache, run);
  }
  throw_on_error(e, "prefill");
  return workspace ? 0 : bytes;
}

}  // namespace cuda
}  // namespace kvevict_py
