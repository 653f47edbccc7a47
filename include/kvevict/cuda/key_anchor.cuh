#pragma once
// KeyDiff at decode time on CUDA, the launch before observe + evict: each
// active (sequence, KV head) brings its running anchor up to its cached
// keys and writes the step's unit anchor, which every block of the row's
// observe + evict then reads (key_diff_anchor.hpp: the host's
// refresh_key_anchor, with the same bits). One block per row: a warp
// takes each new key (usually the one appended; every cached key when the
// anchor is stale), its lanes adding the unit components to a shared
// integer sum (exact, so the atomics' order cannot change it); a key the
// host would refuse leaves the row unchanged, for observe + evict to
// report.
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/evict_to.hpp"
#include "kvevict/policy/key_diff_anchor.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// blockIdx.x = entry * heads + head. Dynamic shared memory: head_dim
/// 64-bit sums, then head_dim floats.
template <int Threads, class T, class Layout>
__global__ void __launch_bounds__(Threads)
    refresh_key_anchor_kernel(batch_state_view st, active_set active, key_diff<T, Layout> in) {
  static_assert(Threads % 32 == 0, "a warp per key");
  extern __shared__ unsigned long long added[];
  __shared__ int refused;
  __shared__ float anchor_length;
  const std::int32_t row = static_cast<std::int32_t>(blockIdx.x), h = row % st.num_heads();
  const std::int32_t b = entry_sequence(active, row / st.num_heads(), st.num_seqs(), -1, nullptr);
  if (b < 0 || kvevict::detail::observe_skips(st, active, b, h)) return;  // the whole block
  if (kv_scale_problem(in.cache, b, h) != batch_status_clear) return;    // the score pass names it; nothing changes
  const key_anchor_view& a = st.anchors;
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x), d = a.head_dim;
  const std::int64_t bh = st.head_index(b, h);
  const bool stale = a.upto[bh] < 0;
  const std::int32_t first = a.first_new(b, h), length = st.slots.lengths[b];
  const std::int32_t width = kvevict::detail::occupied_end(st.slots.counts[bh], st.slots.next_slots[bh]);
  const std::int32_t* positions = st.slots.positions_of(b, h);
  float* anchor = reinterpret_cast<float*>(added + d);
  const float scale = in.cache.k_scale(h);
  if (t == 0) refused = 0;
  for (std::int32_t e = t; e < d; e += Threads) added[e] = 0;
  __syncthreads();
  // A warp per new key: the lanes find the new slots of 32 positions
  // (coalesced), then take each key's components in turn, so a warp's
  // atomics go to distinct words. Every lane computes the key's norm (the
  // same value; the row is in L1 after the first).
  constexpr unsigned kAll = 0xFFFFFFFFu;
  const std::int32_t lane = t % 32, warp = t / 32;
  for (std::int32_t base = warp * 32; base < width; base += Threads) {  // warp-uniform
    const std::int32_t mine = base + lane;
    unsigned fresh = __ballot_sync(kAll, mine < width && positions[mine] >= first);  // anchored already, or free: no
    while (fresh) {
      const std::int32_t s = base + __ffs(static_cast<int>(fresh)) - 1;
      fresh &= fresh - 1;
      const bool mapped = row_is_mapped(in.cache, b, s);
      const T* k = mapped ? in.cache.k_row(b, h, s) : nullptr;
      const float norm = mapped ? key_length(k, d, scale) : 0.0f;
      if (!mapped || classify_input(norm, false) != batch_code::ok) {  // refused by the host too
        if (lane == 0) atomicOr(&refused, 1);
        continue;
      }
      for (std::int32_t e = lane; e < d; e += 32)  // two's complement: the unsigned sum is the signed one
        atomicAdd(added + e, static_cast<unsigned long long>(key_diff_unit(k, e, scale, norm)));
    }
  }
  __syncthreads();
  if (refused) return;  // every thread sees it: nothing changes
  std::int64_t* sums = a.sums_of(b, h);
  for (std::int32_t e = t; e < d; e += Threads) {
    const std::int64_t sum = (stale ? 0 : sums[e]) + static_cast<std::int64_t>(added[e]);
    sums[e] = sum;
    anchor[e] = key_diff_anchor_value(sum);
  }
  __syncthreads();
  if (t == 0) anchor_length = key_diff_anchor_length(anchor, d);
  __syncthreads();
  float* units = a.units_of(b, h);
  for (std::int32_t e = t; e < d; e += Threads) units[e] = key_diff_unit_anchor(anchor[e], anchor_length);
  if (t == 0) a.upto[bh] = length;
}

/// The refresh of every active row; the caller checked the arguments.
template <class T, class Layout>
cudaError_t launch_refresh_key_anchor(const batch_state_view& st, const active_set& active,
                                      const key_diff<T, Layout>& in, cudaStream_t stream) {
  const std::int64_t blocks = std::int64_t{active.entries(st.num_seqs())} * st.num_heads();
  if (blocks == 0) return cudaSuccess;
  const std::size_t shared = std::size_t(st.anchors.head_dim) * (sizeof(unsigned long long) + sizeof(float));
  refresh_key_anchor_kernel<kBlockThreads, T, Layout>
      <<<static_cast<unsigned>(blocks), kBlockThreads, shared, stream>>>(st, active, in);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace gpu
}  // namespace kvevict
