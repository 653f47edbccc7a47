#pragma once
// gpu_evict_to: the multi-token step of chunked prefill on CUDA, as the host
// family (bench_evict_to.cpp): every KV head holds budget tokens, the step
// appends a chunk of N - budget (gpu::batched_append_tokens), observes it
// (gpu::batched_observe_evict, which takes the first victim) and frees the
// surplus at once (gpu::batched_evict_to(budget)), budget 20% or 50% of N,
// recent window 64, h2o. Both forms: `cache` moves the kept rows in a bf16
// BHSD cache, `moves` reports them for the engine. The step ends where it
// started, so the replays are a steady state. The cache stays under 256 MiB
// a layer (cache_slice).
//
// One item = one token freed (N - budget per (sequence, KV head)). Bytes =
// the probabilities plus 12 bytes of state a slot (moved rows not counted),
// as on the host. Baseline: d2d_copy touching the same bytes.
#include <string>
#include <vector>

#include "gpu_bench_common.cuh"
#include "kvevict/cuda/kvevict_cuda.cuh"

namespace kvbench {
namespace gpu {
namespace evict_to {

enum class form { cache, moves };

struct shape {
  scenario sc;  // the slice that runs
  std::int32_t budget, chunk;

  shape(const scenario& full, const keep_fraction& keep)
      : sc(cache_slice(full, sizeof(kvevict::bfloat16))), budget(keep.of(full.slots)), chunk(full.slots - budget) {}
  kvevict::h2o_config config() const { return {budget - kRecent, kRecent}; }
  kvevict::policy_shape policy_shape() const { return {sc.seqs, sc.kv_heads, sc.q_heads(), sc.slots}; }
  std::int64_t items() const { return sc.heads_total() * chunk; }
  std::int64_t bytes() const {
    return std::int64_t(sc.seqs) * sc.q_heads() * sc.slots * 4 + sc.slots_total() * 3 * std::int64_t(sizeof(float));
  }
};

struct layer {
  kvevict::batched_policy<kvevict::h2o_policy, kvevict::device::cuda> policy;
  device_array<float> probs;
  device_kv_cache cache;
  device_array<kvevict::slot_move> moves;
  device_array<std::int32_t> move_counts;

  layer(const shape& p, const std::vector<float>& host_probs)
      : policy(p.policy_shape(), p.config()), probs(host_probs), cache(p.sc),
        moves(std::size_t(p.sc.slots_total())), move_counts(std::size_t(p.sc.heads_total())) {}
};

/// append `tokens` + observe_evict + evict_to(budget) of one layer.
inline cudaError_t multi_token_step(const shape& p, const layer& ly, form f, std::int32_t tokens, cudaStream_t s) {
  const kvevict::batch_state_view& st = ly.policy.state();
  const auto all = kvevict::active_set::all();
  std::uint64_t* status = ly.policy.status_device();
  cudaError_t e = kvevict::gpu::batched_append_tokens(st, all, tokens, status, s);
  if (e != cudaSuccess) return e;
  const kvevict::batch_probs in{
      kvevict::make_tensor_view<const float>(ly.probs.get(), p.sc.seqs, p.sc.q_heads(), p.sc.slots)};
  e = kvevict::gpu::batched_observe_evict(st, all, in, nullptr, status, s);
  if (e != cudaSuccess) return e;
  if (f == form::cache) return kvevict::gpu::batched_evict_to(st, all, p.budget, ly.cache.view, nullptr, status, s);
  return kvevict::gpu::batched_evict_to(st, all, p.budget, ly.moves.get(), ly.move_counts.get(), status, s);
}

inline void batched(benchmark::State& state, scenario full, keep_fraction keep, form f) {
  guarded(state, [&] {
    timing_context ctx;
    const shape p(full, keep);
    const std::vector<float> host_probs =
        probabilities(std::size_t(p.sc.seqs) * p.sc.q_heads() * p.sc.slots, p.sc.slots, distribution::powerlaw, 6);
    std::vector<layer> layers;
    layers.reserve(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      layers.emplace_back(p, host_probs);
      check(multi_token_step(p, layers.back(), f, p.sc.slots, nullptr), "evict_to (fill)");
      layers.back().policy.check();
    }
    cold_run run;
    run.step = [&](int l, cudaStream_t s) { return multi_token_step(p, layers[std::size_t(l)], f, p.chunk, s); };
    run.verify = [&] { return first_status_problem(layers, "gpu evict_to step"); };
    run.items_per_layer = p.items();
    run.bytes_per_layer = p.bytes();
    time_cold(state, ctx, run);
  });
}

inline void register_all() {
  for (const scenario& sc : scenarios())
    for (const keep_fraction& keep : kKeeps) {
      const shape p(sc, keep);
      register_gpu(bench_name("gpu_evict_to", "h2o_batched", "cache", sc.name, keep.name, "powerlaw", "bf16"),
                   [=](benchmark::State& st) { batched(st, sc, keep, form::cache); });
      register_gpu(bench_name("gpu_evict_to", "h2o_batched", "moves", sc.name, keep.name, "powerlaw", "none"),
                   [=](benchmark::State& st) { batched(st, sc, keep, form::moves); });
      register_gpu(bench_name("gpu_evict_to", "d2d_copy", "probs", sc.name, keep.name, "powerlaw", "f32"),
                   [=](benchmark::State& st) { d2d_copy(st, p.items(), p.bytes()); });
    }
}

}  // namespace evict_to
}  // namespace gpu
}  // namespace kvbench
