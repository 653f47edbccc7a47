#pragma once
// gpu_prefill: gpu::batched_prefill of h2o from column sums the engine
// computed, every sequence of the layer at once: score N prompt tokens, keep
// budget = 20% or 50% of N per KV head (recent window 64) and compact the
// kept rows of a bf16 BHSD cache into slots [0, budget). As the host family
// (bench_prefill.cpp), the cache stays under 256 MiB a layer by running on
// the first sequences of a scenario (cache_slice); items/s stays per
// (sequence, KV head, prompt token).
//
// Prefill needs empty sequences: an untimed graph resets every layer's
// sequences before each replay (gpu_bench_common.cuh), so the timing holds
// the prefill call alone.
//
// One item = one (sequence, KV head, prompt token). Bytes = the column sums
// read plus the kept K and V rows read and written once (an upper bound:
// rows already in place stay). Baseline: d2d_copy touching the same bytes.
#include <string>
#include <vector>

#include "gpu_bench_common.cuh"
#include "kvevict/cuda/kvevict_cuda.cuh"

namespace kvbench {
namespace gpu {
namespace prefill {

struct shape {
  scenario sc;  // the slice that runs
  std::int32_t budget;

  shape(const scenario& full, const keep_fraction& keep)
      : sc(cache_slice(full, sizeof(kvevict::bfloat16))), budget(keep.of(full.slots)) {}
  kvevict::h2o_config config() const { return {budget - kRecent, kRecent}; }
  kvevict::policy_shape policy_shape() const { return {sc.seqs, sc.kv_heads, sc.q_heads(), sc.slots}; }
  std::int64_t items() const { return sc.slots_total(); }
  std::int64_t bytes() const {
    const std::int64_t sums = std::int64_t(sc.seqs) * sc.q_heads() * sc.slots * 4;
    const std::int64_t moved = sc.heads_total() * budget * 2 * 2 * std::int64_t(sc.head_dim) * 2;  // K, V; read, write
    return sums + moved;
  }
};

struct layer {
  kvevict::batched_policy<kvevict::h2o_policy, kvevict::device::cuda> policy;
  device_array<float> sums;
  device_array<std::int32_t> lengths;
  device_kv_cache cache;
  device_array<unsigned char> workspace;

  layer(const shape& p, const std::vector<float>& host_sums)
      : policy(p.policy_shape(), p.config()), sums(host_sums),
        lengths(std::vector<std::int32_t>(std::size_t(p.sc.seqs), p.sc.slots)), cache(p.sc) {}
};

inline void batched_sums(benchmark::State& state, scenario full, keep_fraction keep) {
  guarded(state, [&] {
    timing_context ctx;
    const shape p(full, keep);
    const std::vector<float> host_sums =
        probabilities(std::size_t(p.sc.seqs) * p.sc.q_heads() * p.sc.slots, 1, distribution::powerlaw, 2);
    std::vector<layer> layers;
    layers.reserve(kLayers);
    for (int l = 0; l < kLayers; ++l) layers.emplace_back(p, host_sums);
    const auto all = kvevict::active_set::all();
    const kvevict::prompt_lengths prompts_of0{layers[0].lengths.get(), p.sc.slots};
    auto input_of = [&](const layer& ly) {
      return kvevict::batch_prefill_sums{
          kvevict::make_tensor_view<const float>(ly.sums.get(), p.sc.seqs, p.sc.q_heads(), p.sc.slots)};
    };
    std::size_t workspace_bytes = 0;
    check(kvevict::gpu::batched_prefill(nullptr, workspace_bytes, layers[0].policy.state(), all, prompts_of0,
                                        input_of(layers[0]), layers[0].cache.view, nullptr,
                                        layers[0].policy.status_device(), nullptr),
          "batched_prefill (size)");
    for (layer& ly : layers) ly.workspace = device_array<unsigned char>(workspace_bytes);
    cold_run run;
    run.prepare = [&](int l, cudaStream_t s) {
      const layer& ly = layers[std::size_t(l)];
      return kvevict::gpu::reset_batch_sequences(ly.policy.state(), all, nullptr, ly.policy.status_device(), s);
    };
    run.step = [&](int l, cudaStream_t s) {
      const layer& ly = layers[std::size_t(l)];
      std::size_t bytes = workspace_bytes;
      return kvevict::gpu::batched_prefill(ly.workspace.get(), bytes, ly.policy.state(), all,
                                           kvevict::prompt_lengths{ly.lengths.get(), p.sc.slots}, input_of(ly),
                                           ly.cache.view, nullptr, ly.policy.status_device(), s);
    };
    run.verify = [&] { return first_status_problem(layers, "gpu prefill"); };
    run.items_per_layer = p.items();
    run.bytes_per_layer = p.bytes();
    time_cold(state, ctx, run);
  });
}

inline void register_all() {
  for (const scenario& sc : scenarios())
    for (const keep_fraction& keep : kKeeps) {
      const shape p(sc, keep);
      register_gpu(bench_name("gpu_prefill", "h2o_batched", "column_sums", sc.name, keep.name, "powerlaw", "bf16"),
                   [=](benchmark::State& st) { batched_sums(st, sc, keep); });
      register_gpu(bench_name("gpu_prefill", "d2d_copy", "column_sums", sc.name, keep.name, "powerlaw", "bf16"),
                   [=](benchmark::State& st) { d2d_copy(st, p.items(), p.bytes()); });
    }
}

}  // namespace prefill
}  // namespace gpu
}  // namespace kvbench
