#pragma once
// gpu_select: gpu::segmented_select, bottom-k (victims) and top-k (a keep
// set) of every segment at once, over the shapes of S1-S3 (segments = B x
// KV heads, N keys each), k = 20% and 50% of N, indices out in ascending
// position order. Positions are shuffled per segment, as slots hold them
// after reuse, so the output needs its reorder.
//
// Baselines in the same binary, on the same (score, position) keys:
// - cub_radix_sort: cub::DeviceSegmentedRadixSort::SortPairs, a full sort
//   of every segment's (64-bit key, index) pairs;
// - cub_segmented_sort: cub::DeviceSegmentedSort::SortPairs of the same.
// cub_segmented_sort runs eagerly (gpu_bench_common.cuh): above 300-500
// segments DeviceSegmentedSort copies its partition sizes to the host and
// waits for them, which a CUDA graph cannot capture; its time includes that
// wait and 32 layers' launches.
// Each first builds the 64-bit keys of order.hpp (complemented for top-k)
// and the indices in one kernel, inside the timing, as the host baselines
// build their pairs; neither then sorts the k selected by position, which
// favours them. torch.topk rows come from scripts/bench_torch.py.
//
// Timed cold (32 layers, own keys and outputs each). One item = one key
// (segments x N per call); bytes = scores and positions read plus the k
// indices written, the same for every method, so ratios of items/s are
// ratios of time.
#include <cub/device/device_segmented_radix_sort.cuh>
#include <cub/device/device_segmented_sort.cuh>

#include <string>
#include <vector>

#include "gpu_bench_common.cuh"
#include "kvevict/cuda/segmented_select.cuh"

namespace kvbench {
namespace gpu {
namespace select {

using kvevict::select_end;

/// The selection problem of one layer, in device memory.
struct keys_layer {
  device_array<float> scores;
  device_array<std::int32_t> positions;
};

/// Host keys of a scenario's shape: segments x N scores and shuffled positions.
struct host_keys {
  std::int32_t segments, n;
  std::vector<float> scores;
  std::vector<std::int32_t> positions;
  host_keys(const scenario& sc, distribution d)
      : segments(std::int32_t(sc.heads_total())), n(sc.slots),
        scores(kvbench::scores(std::size_t(sc.slots_total()), d, 11)) {
    positions.reserve(scores.size());
    for (std::int32_t i = 0; i < segments; ++i) {
      const std::vector<std::int32_t> p = shuffled_positions(n, std::uint32_t(100 + i));
      positions.insert(positions.end(), p.begin(), p.end());
    }
  }
  std::int64_t items() const { return std::int64_t(segments) * n; }
  std::int64_t bytes(std::int32_t k) const { return std::int64_t(segments) * (std::int64_t(n) * 8 + std::int64_t(k) * 4); }
};

inline std::vector<keys_layer> upload_layers(const host_keys& h) {
  std::vector<keys_layer> layers;
  layers.reserve(kLayers);
  for (int l = 0; l < kLayers; ++l) layers.push_back({device_array<float>(h.scores), device_array<std::int32_t>(h.positions)});
  return layers;
}

inline void kvevict_select(benchmark::State& state, scenario sc, std::int32_t k, select_end end, distribution d) {
  guarded(state, [&] {
    timing_context ctx;
    const host_keys h(sc, d);
    const std::vector<keys_layer> layers = upload_layers(h);
    const kvevict::selection_count count{k, nullptr};
    auto keys_of = [&](int l) {
      const keys_layer& ly = layers[std::size_t(l)];
      return kvevict::segment_set{ly.scores.get(), ly.positions.get(), h.n, nullptr, h.n, h.segments};
    };
    std::vector<device_array<std::int32_t>> indices;
    std::vector<device_array<std::uint64_t>> status;
    for (int l = 0; l < kLayers; ++l) {
      indices.emplace_back(std::size_t(h.segments) * std::size_t(k));
      status.emplace_back(1);
      check(cudaMemset(status.back().get(), 0xFF, sizeof(std::uint64_t)), "cudaMemset");
    }
    auto output_of = [&](int l) { return kvevict::selection_output{indices[std::size_t(l)].get(), k, nullptr, 0}; };
    std::size_t workspace_bytes = 0;
    check(kvevict::gpu::segmented_select(nullptr, workspace_bytes, keys_of(0), end, count, output_of(0), nullptr,
                                         nullptr),
          "segmented_select (size)");
    std::vector<device_array<unsigned char>> workspace;
    for (int l = 0; l < kLayers; ++l) workspace.emplace_back(workspace_bytes);
    cold_run run;
    run.step = [&](int l, cudaStream_t s) {
      std::size_t bytes = workspace_bytes;
      return kvevict::gpu::segmented_select(workspace[std::size_t(l)].get(), bytes, keys_of(l), end, count,
                                            output_of(l), status[std::size_t(l)].get(), s);
    };
    run.verify = [&]() -> std::string {
      for (const device_array<std::uint64_t>& word : status) {
        std::uint64_t w = 0;
        check(cudaMemcpy(&w, word.get(), sizeof w, cudaMemcpyDeviceToHost), "cudaMemcpy (status)");
        if (w != kvevict::batch_status_clear) return "segmented_select reported a bad segment";
      }
      return {};
    };
    run.items_per_layer = h.items();
    run.bytes_per_layer = h.bytes(k);
    time_cold(state, ctx, run);
  });
}

/// (64-bit key, index) pairs of every segment, complemented for top-k so
/// that an ascending sort puts the selected first.
__global__ void build_pairs_kernel(const float* scores, const std::int32_t* positions, std::int32_t n,
                                   std::int64_t total, std::uint64_t flip, std::uint64_t* keys, std::int32_t* indices) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    keys[i] = kvevict::eviction_key(scores[i], positions[i]) ^ flip;
    indices[i] = std::int32_t(i % n);
  }
}

enum class cub_method { radix_sort, segmented_sort };
inline const char* name_of(cub_method m) { return m == cub_method::radix_sort ? "cub_radix_sort" : "cub_segmented_sort"; }

struct sort_layer {
  device_array<std::uint64_t> keys_in, keys_out;
  device_array<std::int32_t> values_in, values_out;
  device_array<unsigned char> temp;
};

inline cudaError_t cub_sort(cub_method m, void* temp, std::size_t& temp_bytes, const sort_layer& ly,
                            std::int64_t items, std::int32_t segments, const std::int32_t* offsets, cudaStream_t s) {
  if (m == cub_method::radix_sort)
    return cub::DeviceSegmentedRadixSort::SortPairs(temp, temp_bytes, ly.keys_in.get(), ly.keys_out.get(),
                                                    ly.values_in.get(), ly.values_out.get(), items, segments, offsets,
                                                    offsets + 1, 0, 64, s);
  return cub::DeviceSegmentedSort::SortPairs(temp, temp_bytes, ly.keys_in.get(), ly.keys_out.get(), ly.values_in.get(),
                                             ly.values_out.get(), items, segments, offsets, offsets + 1, s);
}

inline void cub_full_sort(benchmark::State& state, scenario sc, std::int32_t k, select_end end, distribution d,
                          cub_method m) {
  guarded(state, [&] {
    timing_context ctx;
    const host_keys h(sc, d);
    const std::vector<keys_layer> layers = upload_layers(h);
    std::vector<std::int32_t> offsets(std::size_t(h.segments) + 1);
    for (std::int32_t i = 0; i <= h.segments; ++i) offsets[std::size_t(i)] = i * h.n;
    const device_array<std::int32_t> d_offsets(offsets);
    const std::int64_t items = h.items();
    std::vector<sort_layer> sorts(kLayers);
    std::size_t temp_bytes = 0;
    for (sort_layer& ly : sorts) {
      ly.keys_in = device_array<std::uint64_t>(std::size_t(items));
      ly.keys_out = device_array<std::uint64_t>(std::size_t(items));
      ly.values_in = device_array<std::int32_t>(std::size_t(items));
      ly.values_out = device_array<std::int32_t>(std::size_t(items));
    }
    check(cub_sort(m, nullptr, temp_bytes, sorts[0], items, h.segments, d_offsets.get(), nullptr), "cub sort (size)");
    for (sort_layer& ly : sorts) ly.temp = device_array<unsigned char>(temp_bytes);
    const std::uint64_t flip = end == select_end::top ? ~std::uint64_t{0} : 0;
    const int blocks = multiprocessors() * 8;
    cold_run run;
    run.step = [&](int l, cudaStream_t s) {
      const sort_layer& ly = sorts[std::size_t(l)];
      build_pairs_kernel<<<blocks, 256, 0, s>>>(layers[std::size_t(l)].scores.get(),
                                                layers[std::size_t(l)].positions.get(), h.n, items, flip,
                                                ly.keys_in.get(), ly.values_in.get());
      const cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
      std::size_t bytes = temp_bytes;
      return cub_sort(m, ly.temp.get(), bytes, ly, items, h.segments, d_offsets.get(), s);
    };
    run.items_per_layer = items;
    run.bytes_per_layer = h.bytes(k);
    run.capturable = m == cub_method::radix_sort;
    time_cold(state, ctx, run);
  });
}

inline void register_all() {
  const std::pair<select_end, const char*> ends[] = {{select_end::bottom, "bottom"}, {select_end::top, "top"}};
  for (const scenario& sc : scenarios()) {
    const std::string s = sc.name;
    if (s != "S1" && s != "S2" && s != "S3") continue;
    for (const keep_fraction& keep : kKeeps)
      for (const auto& [end, end_name] : ends)
        for (distribution d : kDistributions) {
          // Every distribution for bottom-k at 20%, power law elsewhere (as the host).
          if (!(end == select_end::bottom && keep.percent == 20) && d != distribution::powerlaw) continue;
          const std::int32_t k = keep.of(sc.slots);
          const select_end e = end;
          register_gpu(bench_name("gpu_select", "kvevict", end_name, sc.name, keep.name, kvbench::name_of(d), "f32"),
                       [=](benchmark::State& st) { kvevict_select(st, sc, k, e, d); });
          for (cub_method m : {cub_method::radix_sort, cub_method::segmented_sort})
            register_gpu(bench_name("gpu_select", name_of(m), end_name, sc.name, keep.name, kvbench::name_of(d), "f32"),
                         [=](benchmark::State& st) { cub_full_sort(st, sc, k, e, d, m); });
        }
  }
}

}  // namespace select
}  // namespace gpu
}  // namespace kvbench
