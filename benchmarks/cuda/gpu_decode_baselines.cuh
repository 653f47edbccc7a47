#pragma once
// The baselines of gpu_decode, in the same binary and timed the same way
// (cold, 32 layers, per layer):
//
// - d2d_copy: cudaMemcpyAsync device-to-device touching the bytes the h2o
//   probabilities step touches (half of them copied: read + written), the
//   memory roof;
// - read_kv: a kernel that reads the scenario's whole bf16 K and V cache
//   once (head_dim of the scenario), what attention over the cache costs at
//   least, for scale;
// - cub_argmin: cub::DeviceSegmentedReduce::ArgMin over the scores, one
//   segment per (sequence, KV head): a library's single-victim search
//   without the update;
// - fused_kernel: a minimal fused observe + evict, the practical limit: one
//   launch, one pass that folds the group's increments, adds them to the
//   scores and keeps the lowest (score, position) key outside the recent
//   window; several blocks per (sequence, head) and the last block to finish
//   publishes the victim (its score reset, the newest position written). No
//   checks, no status; h2o's semantics on the same bytes.
//
// Items and bytes per layer as gpu_decode (bench_common.hpp), except read_kv
// (bytes = K and V) and cub_argmin (bytes = the scores read).
#include <cub/block/block_reduce.cuh>
#include <cub/device/device_segmented_reduce.cuh>

#include <algorithm>

#include "gpu_decode.cuh"

namespace kvbench {
namespace gpu {
namespace decode {

// ---- read_kv ----

__global__ void read_kv_kernel(const uint4* k, const uint4* v, std::int64_t vectors, unsigned* sink) {
  unsigned acc = 0;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride) {
    const uint4 a = k[i], b = v[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // never true for the fill pattern; keeps the loads
}

/// Distinct K/V buffers for read_kv: all 32 layers' caches of S1, S2 or S4
/// would take 32-64 GiB, so layers share buffers beyond 8 GiB in all. A
/// shared buffer is then at least 256 MiB (5x the L2) and was last read
/// several layers earlier: still cold.
inline int distinct_kv_buffers(std::size_t bytes_per_layer) {
  const std::size_t limit = std::size_t(8) << 30;
  return int(std::max<std::size_t>(1, std::min<std::size_t>(kLayers, limit / std::max<std::size_t>(1, bytes_per_layer))));
}

inline void read_kv(benchmark::State& state, scenario sc) {
  guarded(state, [&] {
    timing_context ctx;
    const std::size_t bytes_each = std::size_t(sc.slots_total()) * std::size_t(sc.head_dim) * 2;  // bf16
    const int distinct = distinct_kv_buffers(2 * bytes_each);
    std::vector<device_array<unsigned char>> k, v;
    for (int l = 0; l < distinct; ++l) {
      k.emplace_back(bytes_each);
      v.emplace_back(bytes_each);
      check(cudaMemset(k.back().get(), 0x3C, bytes_each), "cudaMemset");
      check(cudaMemset(v.back().get(), 0x3D, bytes_each), "cudaMemset");
    }
    device_array<unsigned> sink(1);
    const int blocks = multiprocessors() * 8;
    cold_run run;
    run.step = [&](int l, cudaStream_t s) {
      const std::size_t i = std::size_t(l % distinct);
      read_kv_kernel<<<blocks, 256, 0, s>>>(reinterpret_cast<const uint4*>(k[i].get()),
                                           reinterpret_cast<const uint4*>(v[i].get()), std::int64_t(bytes_each / 16),
                                           sink.get());
      return cudaGetLastError();
    };
    run.items_per_layer = sc.heads_total();
    run.bytes_per_layer = std::int64_t(2 * bytes_each);
    time_cold(state, ctx, run);
  });
}

// ---- cub_argmin ----

inline void cub_argmin(benchmark::State& state, scenario sc) {
  guarded(state, [&] {
    timing_context ctx;
    using pair = cub::KeyValuePair<int, float>;
    const std::int64_t segments = sc.heads_total();
    std::vector<std::int32_t> offsets(std::size_t(segments + 1));
    for (std::int64_t i = 0; i <= segments; ++i) offsets[std::size_t(i)] = std::int32_t(i * sc.slots);
    const device_array<std::int32_t> d_offsets(offsets);
    const std::vector<device_array<float>> scores =
        per_layer_copies(probabilities(std::size_t(sc.slots_total()), sc.slots, distribution::powerlaw, 4));
    std::vector<device_array<pair>> out;
    for (int l = 0; l < kLayers; ++l) out.emplace_back(std::size_t(segments));
    std::size_t temp_bytes = 0;
    check(cub::DeviceSegmentedReduce::ArgMin(nullptr, temp_bytes, scores[0].get(), out[0].get(), segments,
                                             d_offsets.get(), d_offsets.get() + 1),
          "DeviceSegmentedReduce::ArgMin (size)");
    std::vector<device_array<unsigned char>> temp;
    for (int l = 0; l < kLayers; ++l) temp.emplace_back(temp_bytes);
    cold_run run;
    run.step = [&](int l, cudaStream_t s) {
      std::size_t bytes = temp_bytes;
      const std::size_t i = std::size_t(l);
      return cub::DeviceSegmentedReduce::ArgMin(temp[i].get(), bytes, scores[i].get(), out[i].get(), segments,
                                                d_offsets.get(), d_offsets.get() + 1, s);
    };
    run.items_per_layer = segments;
    run.bytes_per_layer = sc.slots_total() * 4 + segments * std::int64_t(sizeof(pair));
    time_cold(state, ctx, run);
  });
}

// ---- fused_kernel ----

constexpr int kFusedThreads = 256;
constexpr int kFusedChunk = kFusedThreads * 4;  // slots per block: one float4 per thread

/// One layer of the minimal kernel's state, [B * Hkv][N] unless noted.
struct fused_view {
  float* scores;
  std::int32_t* positions;
  const float* increments;        // [B][rows][N], rows = Hkv * group
  std::int32_t* next_position;    // [B * Hkv]: the position the next token takes
  unsigned long long* partial_key;  // [B * Hkv][chunks]
  std::int32_t* partial_slot;     // [B * Hkv][chunks]
  unsigned* finished;             // [B * Hkv]: blocks done this step
  std::int32_t slots, chunks;
};

__device__ inline void consider(float score, std::int32_t position, std::int32_t slot, std::int32_t oldest_protected,
                                unsigned long long& best, std::int32_t& best_slot) {
  if (position >= oldest_protected) return;
  const unsigned long long key = kvevict::eviction_key(score, position);
  if (key < best) {
    best = key;
    best_slot = slot;
  }
}

struct lowest_key {
  __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const { return b < a ? b : a; }
};

template <int Group>
__global__ void __launch_bounds__(kFusedThreads) fused_observe_evict_kernel(fused_view f) {
  using reduce = cub::BlockReduce<unsigned long long, kFusedThreads>;
  __shared__ typename reduce::TempStorage temp;
  __shared__ unsigned long long block_best;
  __shared__ std::int32_t block_slot;
  __shared__ bool last;
  const std::int32_t bh = std::int32_t(blockIdx.x) / f.chunks, chunk = std::int32_t(blockIdx.x) % f.chunks;
  const std::int64_t n = f.slots;
  float* s = f.scores + bh * n;
  const std::int32_t* pos = f.positions + bh * n;
  const float* inc = f.increments + std::int64_t(bh) * Group * n;  // (b * Hkv + h) * group rows
  const std::int32_t oldest_protected = f.next_position[bh] - kRecent;
  unsigned long long best = ~0ull;
  std::int32_t best_slot = -1;
  const std::int32_t j = chunk * kFusedChunk + std::int32_t(threadIdx.x) * 4;
  if (j < n) {  // N is a multiple of 4 in every scenario
    float4 x = *reinterpret_cast<const float4*>(inc + j);
#pragma unroll
    for (int g = 1; g < Group; ++g) {
      const float4 y = *reinterpret_cast<const float4*>(inc + g * n + j);
      x.x += y.x;
      x.y += y.y;
      x.z += y.z;
      x.w += y.w;
    }
    float4 sc = *reinterpret_cast<const float4*>(s + j);
    const int4 p = *reinterpret_cast<const int4*>(pos + j);  // before the store: no second round trip
    sc.x += x.x;
    sc.y += x.y;
    sc.z += x.z;
    sc.w += x.w;
    *reinterpret_cast<float4*>(s + j) = sc;
    consider(sc.x, p.x, j, oldest_protected, best, best_slot);
    consider(sc.y, p.y, j + 1, oldest_protected, best, best_slot);
    consider(sc.z, p.z, j + 2, oldest_protected, best, best_slot);
    consider(sc.w, p.w, j + 3, oldest_protected, best, best_slot);
  }
  const unsigned long long lowest = reduce(temp).Reduce(best, lowest_key{});
  if (threadIdx.x == 0) {
    block_best = lowest;
    block_slot = -1;
  }
  __syncthreads();
  if (best == block_best && best_slot >= 0) block_slot = best_slot;  // keys are unique: one thread
  __syncthreads();
  auto commit = [&](std::int32_t victim) {
    if (victim >= 0) {
      s[victim] = 0.0f;
      f.positions[bh * n + victim] = f.next_position[bh];
    }
    f.next_position[bh] += 1;
  };
  if (f.chunks == 1) {  // a row in one block: no fence, atomic or reload
    if (threadIdx.x == 0) commit(block_slot);
    return;
  }
  if (threadIdx.x == 0) {
    f.partial_key[blockIdx.x] = block_best;
    f.partial_slot[blockIdx.x] = block_slot;
    __threadfence();
    last = atomicAdd(&f.finished[bh], 1u) == unsigned(f.chunks - 1);
  }
  __syncthreads();
  if (!last) return;
  // The last block of this (b, h): every partial is visible after the fence;
  // its threads load them side by side and reduce.
  unsigned long long mine = ~0ull;
  std::int32_t mine_slot = -1;
  for (std::int32_t c = std::int32_t(threadIdx.x); c < f.chunks; c += kFusedThreads) {
    const std::int64_t i = std::int64_t(bh) * f.chunks + c;
    const unsigned long long key = __ldcg(f.partial_key + i);
    if (key < mine) {
      mine = key;
      mine_slot = __ldcg(f.partial_slot + i);
    }
  }
  __syncthreads();  // temp is reused
  const unsigned long long winner = reduce(temp).Reduce(mine, lowest_key{});
  if (threadIdx.x == 0) {
    block_best = winner;
    block_slot = -1;
  }
  __syncthreads();
  if (mine == block_best && mine_slot >= 0) block_slot = mine_slot;
  __syncthreads();
  if (threadIdx.x == 0) {
    commit(block_best == ~0ull ? -1 : block_slot);
    f.finished[bh] = 0;
  }
}

struct fused_layer {
  device_array<float> scores, increments;
  device_array<std::int32_t> positions, next_position, partial_slot;
  device_array<unsigned long long> partial_key;
  device_array<unsigned> finished;
};

inline void fused_kernel(benchmark::State& state, scenario sc, bool head_scores, distribution d, bool warm) {
  guarded(state, [&] {
    timing_context ctx;
    const int group = head_scores ? 1 : sc.group;
    if (group != 1 && group != 4) throw setup_failure{"fused_kernel: group sizes 1 and 4 only"};
    const step_inputs in = make_host_inputs(sc, head_scores ? input_kind::head_scores : input_kind::probs, d);
    const std::vector<std::int32_t> positions = shuffled_slot_positions(sc);
    const std::int64_t heads = sc.heads_total();
    const std::int32_t chunks = (sc.slots + kFusedChunk - 1) / kFusedChunk;
    const int count = warm ? 1 : kLayers;
    std::vector<fused_layer> layers(static_cast<std::size_t>(count));
    for (fused_layer& ly : layers) {
      ly.scores = device_array<float>(std::size_t(sc.slots_total()));
      check(cudaMemset(ly.scores.get(), 0, ly.scores.bytes()), "cudaMemset");
      ly.increments = device_array<float>(in.values);
      ly.positions = device_array<std::int32_t>(positions);
      ly.next_position = device_array<std::int32_t>(std::vector<std::int32_t>(std::size_t(heads), sc.slots));
      ly.partial_key = device_array<unsigned long long>(std::size_t(heads * chunks));
      ly.partial_slot = device_array<std::int32_t>(std::size_t(heads * chunks));
      ly.finished = device_array<unsigned>(std::vector<unsigned>(std::size_t(heads), 0u));
    }
    cold_run run;
    run.step = [&](int l, cudaStream_t s) {
      fused_layer& ly = layers[std::size_t(l)];
      const fused_view f{ly.scores.get(),        ly.positions.get(),    ly.increments.get(), ly.next_position.get(),
                         ly.partial_key.get(),   ly.partial_slot.get(), ly.finished.get(),   sc.slots,
                         chunks};
      const unsigned blocks = unsigned(heads * chunks);
      if (group == 4)
        fused_observe_evict_kernel<4><<<blocks, kFusedThreads, 0, s>>>(f);
      else
        fused_observe_evict_kernel<1><<<blocks, kFusedThreads, 0, s>>>(f);
      return cudaGetLastError();
    };
    run.items_per_layer = heads;
    run.bytes_per_layer = in.bytes + sc.slots_total() * kStateBytesPerSlot;
    if (warm)
      time_warm(state, ctx, run);
    else
      time_cold(state, ctx, run);
  });
}

/// h2o's probabilities step bytes: the d2d_copy roof of every decode row.
inline std::int64_t h2o_probs_bytes(const scenario& sc) {
  return sc.slots_total() * std::int64_t(sc.group) * 4 + sc.slots_total() * kStateBytesPerSlot;
}

inline void register_baselines() {
  for (const scenario& sc : scenarios()) {
    const distribution pl = distribution::powerlaw;
    for (distribution d : kDistributions)
      register_gpu(name("fused_kernel", "probs", sc, d, "f32"),
                   [=](benchmark::State& st) { fused_kernel(st, sc, false, d, false); });
    register_gpu(name("fused_kernel", "head_scores", sc, pl, "f32"),
                 [=](benchmark::State& st) { fused_kernel(st, sc, true, pl, false); });
    register_gpu(name("d2d_copy", "probs", sc, pl, "f32"),
                 [=](benchmark::State& st) { d2d_copy(st, sc.heads_total(), h2o_probs_bytes(sc)); });
    register_gpu(name("read_kv", "kv", sc, pl, "bf16"), [=](benchmark::State& st) { read_kv(st, sc); });
    register_gpu(name("cub_argmin", "scores", sc, pl, "f32"), [=](benchmark::State& st) { cub_argmin(st, sc); });
    if (std::string(sc.name) == "S5")
      register_gpu(name("fused_kernel_warm", "probs", sc, pl, "f32"),
                   [=](benchmark::State& st) { fused_kernel(st, sc, false, pl, true); });
  }
}

}  // namespace decode
}  // namespace gpu
}  // namespace kvbench
