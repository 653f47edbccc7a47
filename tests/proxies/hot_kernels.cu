// The hot kernels of a decode step and of the segmented selection, for the
// static proxies (check_proxies.py): compiled for sm_90 with ptxas' resource
// report, never run. Calling each launcher from a function nobody calls
// instantiates exactly the kernels an engine's decode step and selection
// launch.
#include "kvevict/cuda/kvevict_cuda.cuh"

namespace {

using namespace kvevict;

[[maybe_unused]] void instantiate(const batch_state_view& st, std::uint64_t* status, cudaStream_t stream) {
  const active_set all = active_set::all();
  const tensor_view<const float, 3> values{};
  const tensor_view<const float, 2> lse{};
  // The one-launch step (the kernel the decode targets are for) and the
  // two-launch pair it replaces.
  (void)gpu::batched_step(st, all, batch_probs{values}, nullptr, status, stream);
  (void)gpu::batched_step(st, all, batch_head_scores{values}, nullptr, status, stream);
  (void)gpu::batched_step(st, all, batch_logits{values, lse}, nullptr, status, stream);
  (void)gpu::batched_append(st, all, status, stream);
  (void)gpu::batched_observe_evict(st, all, batch_probs{values}, nullptr, status, stream);
  // The selection on evict_to's and the benchmark's keys.
  std::size_t bytes = 0;
  (void)gpu::segmented_select(nullptr, bytes, segment_set{}, select_end::bottom, selection_count{}, selection_output{},
                              status, stream);
}

}  // namespace
