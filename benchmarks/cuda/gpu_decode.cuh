#pragma once
// gpu_decode: one decode step of batched_policy<P, device::cuda> for the
// whole batch of a layer, launch 1 (gpu::batched_append) + launch 2
// (gpu::batched_observe_evict), per policy (h2o, recent_window, random) and
// input (probs, head_scores increments, logits + LSE, and queries + LSE
// with a bf16 cache at S5), over S0-S5 and the three score distributions.
//
// Set up as the host decode family (bench_decode.cpp): every slot occupied
// (capacity N, budget N - 1: one victim a step keeps the state full, so a
// replayed step is a steady state), recent window 64, 4 sinks where a policy
// has sinks. The cache is filled by one multi-token append of N tokens, then
// each head's slots get a shuffled permutation of the positions (as after
// slot reuse) before the first eviction.
//
// Timed cold (gpu_bench_common.cuh): 32 layers, each with its own state and
// inputs, in one graph; time per layer. Plus h2o_warm: S5, one layer's graph
// replayed back-to-back. The status word of every layer must be clear after
// the timed loop.
//
// One item = one (sequence, KV head) step. Bytes = the inputs read plus 12
// bytes of state a slot (score read and written, position read), as on the
// host; the queries path reads every cached key instead of probabilities.
#include "gpu_bench_common.cuh"

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/cuda/kvevict_cuda.cuh"

namespace kvbench {
namespace gpu {
namespace decode {

using kvevict::batch_status_clear;

constexpr std::int64_t kStateBytesPerSlot = 3 * sizeof(float);

enum class input_kind { probs, head_scores, logits, queries };
inline const char* name_of(input_kind k) {
  switch (k) {
    case input_kind::probs: return "probs";
    case input_kind::head_scores: return "head_scores";
    case input_kind::logits: return "logits";
    case input_kind::queries: return "queries";
  }
  return "?";
}

struct h2o_setup {
  using policy = kvevict::h2o_policy;
  static constexpr const char* name = "h2o";
  static kvevict::h2o_config config(std::int32_t budget) { return {budget - kRecent, kRecent}; }
};
/// h2o through the one-launch step (gpu::batched_step): the same rows as
/// h2o's two launches, the engine's K/V write left out of both.
struct h2o_step_setup : h2o_setup {
  static constexpr const char* name = "h2o_step";
  static constexpr bool one_launch = true;
};
template <class Setup, class = void>
struct is_one_launch : std::false_type {};
template <class Setup>
struct is_one_launch<Setup, std::void_t<decltype(Setup::one_launch)>> : std::true_type {};

struct recent_window_setup {
  using policy = kvevict::recent_window_policy;
  static constexpr const char* name = "recent_window";
  static kvevict::recent_window_config config(std::int32_t budget) { return {kSinks, budget - kSinks}; }
};
struct random_setup {
  using policy = kvevict::random_policy;
  static constexpr const char* name = "random";
  static kvevict::random_config config(std::int32_t budget) { return {budget, kSinks, kRecent, 7}; }
};

inline kvevict::policy_shape shape_of(const scenario& sc) { return {sc.seqs, sc.kv_heads, sc.q_heads(), sc.slots}; }

/// Every head's slots hold a shuffled permutation of [0, N): one host array
/// for the whole batch, shared by the layers.
inline std::vector<std::int32_t> shuffled_slot_positions(const scenario& sc) {
  std::vector<std::int32_t> all;
  all.reserve(std::size_t(sc.slots_total()));
  for (std::int64_t bh = 0; bh < sc.heads_total(); ++bh) {
    const std::vector<std::int32_t> p = shuffled_positions(sc.slots, std::uint32_t(1000 + bh));
    all.insert(all.end(), p.begin(), p.end());
  }
  return all;
}

/// The host side of one step's inputs, shared by every layer.
inline step_inputs make_host_inputs(const scenario& sc, input_kind kind, distribution d) {
  const step_values values = kind == input_kind::head_scores ? step_values::increments
                             : kind == input_kind::logits    ? step_values::logits
                                                             : step_values::probabilities;
  return make_step_inputs(sc, sc.seqs, values, d);
}

/// Queries + LSE with a bf16 BHSD cache of random keys, in host memory.
struct host_queries {
  std::vector<kvevict::bfloat16> keys;  // [B][Hkv][N][D]
  std::vector<kvevict::bfloat16> q;     // [B][Hq][D]
  std::vector<float> lse;               // [B][Hq]
  std::int64_t bytes = 0;

  explicit host_queries(const scenario& sc) {
    const std::vector<kvevict::bfloat16> rows =
        random_rows<kvevict::bfloat16>(std::size_t(sc.slots) * sc.head_dim, 1.0f, 3);
    keys.reserve(std::size_t(sc.slots_total()) * sc.head_dim);
    for (std::int64_t bh = 0; bh < sc.heads_total(); ++bh) keys.insert(keys.end(), rows.begin(), rows.end());
    q = random_rows<kvevict::bfloat16>(std::size_t(sc.seqs) * sc.q_heads() * sc.head_dim, 1.0f, 5);
    // |q . k| * scale <= sqrt(head_dim) with entries in [-1, 1]: an LSE above
    // that keeps every recomputed probability in (0, 1].
    lse.assign(std::size_t(sc.seqs) * sc.q_heads(), std::sqrt(float(sc.head_dim)) + 1.0f);
    bytes = sc.slots_total() * std::int64_t(sc.head_dim) * 2 + std::int64_t(q.size() * 2 + lse.size() * 4);
  }
};

/// One layer: its policy state (with status word) and its own inputs.
template <class Setup>
struct layer {
  kvevict::batched_policy<typename Setup::policy, kvevict::device::cuda> policy;
  device_array<float> values, lse;
  device_array<kvevict::bfloat16> keys, values_rows, q;

  explicit layer(const scenario& sc) : policy(shape_of(sc), Setup::config(sc.slots - 1)) {}
};

template <class Setup>
class decode_layers {
 public:
  decode_layers(const scenario& sc, input_kind kind, distribution d, int count) : sc_(sc), kind_(kind) {
    const std::vector<std::int32_t> positions = shuffled_slot_positions(sc);
    step_inputs in;
    std::unique_ptr<host_queries> hq;
    if (kind == input_kind::queries) {
      hq = std::make_unique<host_queries>(sc);
      bytes_ = hq->bytes + sc.slots_total() * kStateBytesPerSlot;
    } else {
      in = make_host_inputs(sc, kind, d);
      rows_per_seq_ = in.rows_per_seq;
      bytes_ = in.bytes + sc.slots_total() * kStateBytesPerSlot;
    }
    layers_.reserve(std::size_t(count));
    for (int l = 0; l < count; ++l) {
      layers_.emplace_back(sc);
      layer<Setup>& ly = layers_.back();
      if (hq) {
        ly.keys = device_array<kvevict::bfloat16>(hq->keys);
        ly.values_rows = device_array<kvevict::bfloat16>(hq->keys.size());  // V: allocated, never read here
        ly.q = device_array<kvevict::bfloat16>(hq->q);
        ly.lse = device_array<float>(hq->lse);
      } else {
        ly.values = device_array<float>(in.values);
        if (!in.lse.empty()) ly.lse = device_array<float>(in.lse);
      }
      fill(ly, positions);
    }
  }

  std::int64_t items() const { return sc_.heads_total(); }
  std::int64_t bytes() const { return bytes_; }
  int count() const { return int(layers_.size()); }

  /// Launch 1 + launch 2 of layer l, or the one launch.
  cudaError_t step(int l, cudaStream_t stream) {
    layer<Setup>& ly = layers_[std::size_t(l)];
    if constexpr (is_one_launch<Setup>::value) return one_launch(ly, stream);
    const kvevict::batch_state_view& st = ly.policy.state();
    const cudaError_t e = kvevict::gpu::batched_append(st, kvevict::active_set::all(), ly.policy.status_device(), stream);
    if (e != cudaSuccess) return e;
    return observe_evict(ly, stream);
  }

  /// Empty when every layer's status word is clear.
  std::string problems() {
    for (layer<Setup>& ly : layers_) {
      const std::string problem = status_problem(ly.policy, "gpu decode step");
      if (!problem.empty()) return problem;
    }
    return {};
  }

 private:
  /// call(in) with layer ly's input of the scenario's kind (queries + LSE:
  /// call(in, cache)).
  template <class Call>
  cudaError_t with_input(const layer<Setup>& ly, Call call) const {
    const auto values = kvevict::make_tensor_view<const float>(ly.values.get(), sc_.seqs, rows_per_seq_, sc_.slots);
    const auto lse = kvevict::make_tensor_view<const float>(ly.lse.get(), sc_.seqs, sc_.q_heads());
    switch (kind_) {
      case input_kind::probs: return call(kvevict::batch_probs{values});
      case input_kind::head_scores: return call(kvevict::batch_head_scores{values});
      case input_kind::logits: return call(kvevict::batch_logits{values, lse});
      case input_kind::queries:
        return call(kvevict::batch_queries<kvevict::bfloat16>{
                        kvevict::make_tensor_view<const kvevict::bfloat16>(ly.q.get(), sc_.seqs, sc_.q_heads(),
                                                                           sc_.head_dim),
                        lse, 1.0f / std::sqrt(float(sc_.head_dim))},
                    cache_of(ly));
    }
    return cudaErrorInvalidValue;
  }

  cudaError_t observe_evict(layer<Setup>& ly, cudaStream_t stream) const {
    const kvevict::batch_state_view& st = ly.policy.state();
    std::uint64_t* status = ly.policy.status_device();
    return with_input(ly, [&](const auto& in, const auto&... cache) {
      return kvevict::gpu::batched_observe_evict(st, kvevict::active_set::all(), in, cache..., nullptr, status, stream);
    });
  }

  cudaError_t one_launch(layer<Setup>& ly, cudaStream_t stream) const {
    const kvevict::batch_state_view& st = ly.policy.state();
    std::uint64_t* status = ly.policy.status_device();
    return with_input(ly, [&](const auto& in, const auto&... cache) {
      if constexpr (sizeof...(cache) == 0)
        return kvevict::gpu::batched_step(st, kvevict::active_set::all(), in, nullptr, status, stream);
      else
        return cudaErrorInvalidValue;  // queries keep the two launches
    });
  }

  kvevict::kv_view<kvevict::bfloat16, kvevict::strided_layout> cache_of(const layer<Setup>& ly) const {
    kvevict::kv_view<kvevict::bfloat16, kvevict::strided_layout> v;
    v.k = ly.keys.get();
    v.v = ly.values_rows.get();
    v.layout = kvevict::strided_layout::bhsd(sc_.kv_heads, sc_.slots, sc_.head_dim);
    v.num_seqs = sc_.seqs;
    v.num_heads = sc_.kv_heads;
    v.capacity = sc_.slots;
    v.head_dim = sc_.head_dim;
    return v;
  }

  // N tokens in one multi-token append, shuffled positions, the first
  // eviction: from here on every step appends one token and frees one slot.
  void fill(layer<Setup>& ly, const std::vector<std::int32_t>& positions) {
    const kvevict::batch_state_view& st = ly.policy.state();
    check(kvevict::gpu::batched_append_tokens(st, kvevict::active_set::all(), sc_.slots, ly.policy.status_device(),
                                              nullptr),
          "batched_append_tokens (fill)");
    check(cudaMemcpy(st.slots.positions, positions.data(), positions.size() * sizeof(std::int32_t),
                     cudaMemcpyHostToDevice),
          "cudaMemcpy (shuffled positions)");
    check(observe_evict(ly, nullptr), "batched_observe_evict (fill)");
    ly.policy.check();
  }

  scenario sc_;
  input_kind kind_;
  std::int32_t rows_per_seq_ = 0;
  std::int64_t bytes_ = 0;
  std::vector<layer<Setup>> layers_;
};

template <class Setup>
void step_cold(benchmark::State& state, scenario sc, input_kind kind, distribution d) {
  guarded(state, [&] {
    timing_context ctx;
    decode_layers<Setup> layers(sc, kind, d, kLayers);
    cold_run run;
    run.step = [&](int l, cudaStream_t s) { return layers.step(l, s); };
    run.verify = [&] { return layers.problems(); };
    run.items_per_layer = layers.items();
    run.bytes_per_layer = layers.bytes();
    time_cold(state, ctx, run);
  });
}

template <class Setup>
void step_warm(benchmark::State& state, scenario sc, input_kind kind, distribution d) {
  guarded(state, [&] {
    timing_context ctx;
    decode_layers<Setup> layers(sc, kind, d, 1);
    cold_run run;
    run.step = [&](int l, cudaStream_t s) { return layers.step(l, s); };
    run.verify = [&] { return layers.problems(); };
    run.items_per_layer = layers.items();
    run.bytes_per_layer = layers.bytes();
    time_warm(state, ctx, run);
  });
}

inline std::string name(const std::string& method, const std::string& input, const scenario& sc, distribution d,
                        const char* dtype) {
  return bench_name("gpu_decode", method, input, sc.name, "evict1", kvbench::name_of(d), dtype);
}

template <class Setup>
void register_step(const scenario& sc, input_kind kind, distribution d) {
  const char* dtype = kind == input_kind::queries ? "bf16" : "f32";
  register_gpu(name(Setup::name, decode::name_of(kind), sc, d, dtype),
               [=](benchmark::State& st) { step_cold<Setup>(st, sc, kind, d); });
}

/// Every kvevict decode row (the baselines register in gpu_decode_baselines.cuh).
inline void register_all() {
  for (const scenario& sc : scenarios()) {
    for (distribution d : kDistributions) register_step<h2o_setup>(sc, input_kind::probs, d);
    const distribution pl = distribution::powerlaw;
    register_step<h2o_setup>(sc, input_kind::head_scores, pl);
    register_step<h2o_setup>(sc, input_kind::logits, pl);
    register_step<h2o_step_setup>(sc, input_kind::probs, pl);
    register_step<h2o_step_setup>(sc, input_kind::head_scores, pl);
    register_step<h2o_step_setup>(sc, input_kind::logits, pl);
    register_step<recent_window_setup>(sc, input_kind::probs, pl);
    register_step<random_setup>(sc, input_kind::probs, pl);
    if (std::string(sc.name) == "S5") {
      // The queries path reads every cached key (S1's keys are 512 MiB a
      // layer): at the latency scenario only.
      register_step<h2o_setup>(sc, input_kind::queries, distribution::uniform);
      register_gpu(name("h2o_warm", "probs", sc, pl, "f32"),
                   [=](benchmark::State& st) { step_warm<h2o_setup>(st, sc, input_kind::probs, pl); });
    }
  }
}

}  // namespace decode
}  // namespace gpu
}  // namespace kvbench
