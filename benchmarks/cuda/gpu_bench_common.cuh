#pragma once
// What every CUDA benchmark family shares: device buffers, the "no GPU"
// exit, and the cold timing (docs/benchmarks.md, "GPU").
//
// Cold: a 32-layer model's step, each layer with its own state and inputs,
// captured in one CUDA graph; one iteration replays the graph between two
// CUDA events and reports replay / 32 as the manual time, so every figure is
// per layer. Before each replay (outside the events) an untimed graph
// prepares the layers where a step cannot repeat on its own (prefill resets
// its sequences), and a write of twice the L2's size evicts what the last
// replay left there: 32 layers of S5 (7 MiB) would otherwise stay in the
// 50 MB L2 and read as hot. The warm case replays one layer's graph
// back-to-back with no flush. Work that a graph cannot capture (a call that
// waits for the device) runs eagerly instead: the 32 layers' calls between
// the events, which then also time their launches and waits.
//
// Names and scenarios are the host's (bench_common.hpp), prefixed gpu_, so
// scripts/bench_report.py pairs every row with its baseline.
#include <benchmark/benchmark.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../bench_common.hpp"

namespace kvbench {
namespace gpu {

/// Layers per cold replay: a 32-layer model's step.
constexpr int kLayers = 32;

/// Replays of one layer's graph between the events of the warm case: one
/// graph launch of a few microseconds is near the events' resolution.
constexpr int kWarmReplays = 20;

/// Thrown by setup code so a benchmark ends with SkipWithError, not abort.
struct setup_failure {
  std::string what;
};

inline void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw setup_failure{std::string(call) + ": " + cudaGetErrorString(e)};
}

/// Device memory of n elements of T, freed on destruction.
template <class T>
class device_array {
 public:
  explicit device_array(std::size_t n = 0) : n_(n) {
    if (n_) check(cudaMalloc(&p_, n_ * sizeof(T)), "cudaMalloc");
  }
  explicit device_array(const std::vector<T>& host) : device_array(host.size()) { upload(host); }
  ~device_array() {
    if (p_) cudaFree(p_);
  }
  device_array(device_array&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  device_array& operator=(device_array&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;

  T* get() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  std::size_t bytes() const noexcept { return n_ * sizeof(T); }
  void upload(const std::vector<T>& host) {
    if (host.size() != n_) throw setup_failure{"device_array::upload: size mismatch"};
    if (n_) check(cudaMemcpy(p_, host.data(), bytes(), cudaMemcpyHostToDevice), "cudaMemcpy (upload)");
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// Enqueues one layer's work on a stream (a launcher's status).
using layer_work = std::function<cudaError_t(int layer, cudaStream_t stream)>;

/// A graph of `layers` calls of `work`, captured once and replayed.
class layer_graph {
 public:
  layer_graph(cudaStream_t stream, int layers, const layer_work& work) {
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    cudaError_t e = cudaSuccess;
    try {
      for (int l = 0; l < layers && e == cudaSuccess; ++l) e = work(l, stream);
    } catch (...) {
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(stream, &partial);  // leave the stream usable
      if (partial) cudaGraphDestroy(partial);
      throw;
    }
    const cudaError_t end = cudaStreamEndCapture(stream, &graph_);
    check(e, "launch during capture");
    check(end, "cudaStreamEndCapture");
    check(cudaGraphInstantiate(&exec_, graph_, 0), "cudaGraphInstantiate");
  }
  ~layer_graph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  layer_graph(const layer_graph&) = delete;
  layer_graph& operator=(const layer_graph&) = delete;

  cudaError_t launch(cudaStream_t stream) const { return cudaGraphLaunch(exec_, stream); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

/// A stream and two events, created and destroyed with the benchmark.
struct timing_context {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  timing_context() {
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
  }
  ~timing_context() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
  }
  timing_context(const timing_context&) = delete;
  timing_context& operator=(const timing_context&) = delete;
};

/// Twice the device's L2, written before each cold replay.
class l2_flush {
 public:
  l2_flush() {
    int device = 0, l2 = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "cudaDeviceGetAttribute");
    buffer_ = device_array<unsigned char>(std::size_t(l2 > 0 ? l2 : (50 << 20)) * 2);
  }
  cudaError_t enqueue(cudaStream_t stream) const { return cudaMemsetAsync(buffer_.get(), 0x5A, buffer_.size(), stream); }

 private:
  device_array<unsigned char> buffer_;
};

inline int multiprocessors() {
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return sms;
}

/// What a timed run needs besides the graph: the per-layer work the
/// iteration does (items, bytes), an optional untimed preparation before
/// each replay, and a check after the loop (e.g. the status words).
struct cold_run {
  layer_work step;
  layer_work prepare;                     ///< optional, untimed, before each replay
  std::function<std::string()> verify;    ///< optional: a non-empty message fails the benchmark
  std::int64_t items_per_layer = 0;
  std::int64_t bytes_per_layer = 0;
  bool capturable = true;                 ///< false: launched eagerly every iteration
};

/// The layers' calls one after the other on `stream`, eagerly.
inline void enqueue_layers(const layer_work& work, cudaStream_t stream, const char* what) {
  for (int l = 0; l < kLayers; ++l) check(work(l, stream), what);
}

/// After a timed loop: no pending CUDA error, the run's own check, then
/// items and bytes.
inline void finish(benchmark::State& state, const cold_run& run) {
  check(cudaGetLastError(), "after the timed loop");
  if (run.verify) {
    const std::string problem = run.verify();
    if (!problem.empty()) throw setup_failure{problem};
  }
  kvbench::report(state, run.items_per_layer, run.bytes_per_layer);
}

/// Times `run` cold over kLayers layers: manual time = replay / kLayers.
inline void time_cold(benchmark::State& state, timing_context& ctx, const cold_run& run) {
  std::unique_ptr<layer_graph> step, prepare;
  if (run.capturable) {
    step = std::make_unique<layer_graph>(ctx.stream, kLayers, run.step);
    if (run.prepare) prepare = std::make_unique<layer_graph>(ctx.stream, kLayers, run.prepare);
  }
  const auto launch_prepare = [&] {
    if (prepare) check(prepare->launch(ctx.stream), "cudaGraphLaunch (prepare)");
    else if (run.prepare) enqueue_layers(run.prepare, ctx.stream, "prepare");
  };
  const auto launch_step = [&] {
    if (step) check(step->launch(ctx.stream), "cudaGraphLaunch");
    else enqueue_layers(run.step, ctx.stream, "step");
  };
  const l2_flush flush;
  for (int warm_up = 0; warm_up < 2; ++warm_up) {  // graph upload, first-touch costs
    launch_prepare();
    launch_step();
  }
  check(cudaStreamSynchronize(ctx.stream), "warm-up");
  for (auto _ : state) {
    launch_prepare();
    check(flush.enqueue(ctx.stream), "L2 flush");
    check(cudaEventRecord(ctx.start, ctx.stream), "cudaEventRecord");
    launch_step();
    check(cudaEventRecord(ctx.stop, ctx.stream), "cudaEventRecord");
    check(cudaEventSynchronize(ctx.stop), "cudaEventSynchronize");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, ctx.start, ctx.stop), "cudaEventElapsedTime");
    state.SetIterationTime(double(ms) * 1e-3 / kLayers);
  }
  finish(state, run);
}

/// Times one layer's step warm: kWarmReplays back-to-back replays of its
/// graph between the events, manual time = their time / kWarmReplays.
inline void time_warm(benchmark::State& state, timing_context& ctx, const cold_run& run) {
  const layer_graph step(ctx.stream, 1, run.step);
  for (int warm_up = 0; warm_up < 2; ++warm_up) check(step.launch(ctx.stream), "cudaGraphLaunch");
  check(cudaStreamSynchronize(ctx.stream), "warm-up");
  for (auto _ : state) {
    check(cudaEventRecord(ctx.start, ctx.stream), "cudaEventRecord");
    for (int r = 0; r < kWarmReplays; ++r) check(step.launch(ctx.stream), "cudaGraphLaunch");
    check(cudaEventRecord(ctx.stop, ctx.stream), "cudaEventRecord");
    check(cudaEventSynchronize(ctx.stop), "cudaEventSynchronize");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, ctx.start, ctx.stop), "cudaEventElapsedTime");
    state.SetIterationTime(double(ms) * 1e-3 / kWarmReplays);
  }
  finish(state, run);
}

/// Runs a benchmark body, turning setup and CUDA failures (and the
/// library's exceptions) into SkipWithError.
template <class Body>
void guarded(benchmark::State& state, Body&& body) {
  try {
    body();
  } catch (const setup_failure& f) {
    state.SkipWithError(f.what.c_str());
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

/// Registers fn(benchmark::State&), timed by CUDA events (UseManualTime), in us.
template <class Fn>
benchmark::internal::Benchmark* register_gpu(const std::string& name, Fn&& fn) {
  return benchmark::RegisterBenchmark(name.c_str(), std::forward<Fn>(fn))->UseManualTime()->Unit(benchmark::kMicrosecond);
}

/// The bytes of a [B][heads][N] float tensor uploaded once per layer: the
/// same values in every layer (layers differ in where they live, which is
/// what a cold figure needs), generated once on the host.
inline std::vector<device_array<float>> per_layer_copies(const std::vector<float>& host) {
  std::vector<device_array<float>> out;
  out.reserve(kLayers);
  for (int l = 0; l < kLayers; ++l) out.emplace_back(host);
  return out;
}

/// A device-to-device copy of `bytes_touched / 2` bytes per layer: it reads
/// and writes bytes_touched bytes in all, so its bytes/s is the copy
/// bandwidth counted as docs/benchmarks.md counts it (read + written), on the bytes a
/// step touches. One item per layer-step as the step it is the roof of.
struct d2d_copy_layers {
  std::vector<device_array<unsigned char>> src, dst;
  explicit d2d_copy_layers(std::int64_t bytes_touched) {
    const std::size_t half = std::size_t(bytes_touched / 2);
    for (int l = 0; l < kLayers; ++l) {
      src.emplace_back(half);
      dst.emplace_back(half);
      check(cudaMemset(src.back().get(), 0x3C, half), "cudaMemset");
    }
  }
  cudaError_t enqueue(int layer, cudaStream_t stream) const {
    return cudaMemcpyAsync(dst[std::size_t(layer)].get(), src[std::size_t(layer)].get(), src[std::size_t(layer)].size(),
                           cudaMemcpyDeviceToDevice, stream);
  }
};

/// The roof of any family: a cold D2D copy touching `bytes` per layer.
inline void d2d_copy(benchmark::State& state, std::int64_t items, std::int64_t bytes) {
  guarded(state, [&] {
    timing_context ctx;
    const d2d_copy_layers copy(bytes);
    cold_run run;
    run.step = [&](int l, cudaStream_t s) { return copy.enqueue(l, s); };
    run.items_per_layer = items;
    run.bytes_per_layer = bytes;
    time_cold(state, ctx, run);
  });
}

/// A bf16 BHSD K/V cache in device memory, filled with a non-zero pattern
/// (timing on zeros can flatter a kernel).
struct device_kv_cache {
  device_array<kvevict::bfloat16> k, v;
  kvevict::kv_view<kvevict::bfloat16, kvevict::strided_layout> view;

  explicit device_kv_cache(const scenario& sc)
      : k(std::size_t(sc.slots_total()) * std::size_t(sc.head_dim)), v(k.size()) {
    check(cudaMemset(k.get(), 0x3C, k.bytes()), "cudaMemset");
    check(cudaMemset(v.get(), 0x3D, v.bytes()), "cudaMemset");
    view.k = k.get();
    view.v = v.get();
    view.layout = kvevict::strided_layout::bhsd(sc.kv_heads, sc.slots, sc.head_dim);
    view.num_seqs = sc.seqs;
    view.num_heads = sc.kv_heads;
    view.capacity = sc.slots;
    view.head_dim = sc.head_dim;
  }
};

/// The status word of a batched policy as a benchmark's verdict: empty when
/// clear, else the library's message.
template <class Policy>
std::string status_problem(const Policy& policy, const char* call) {
  const std::uint64_t word = policy.status_word();
  if (word == kvevict::batch_status_clear) return {};
  try {
    kvevict::throw_if_error(word, call);
  } catch (const std::exception& e) {
    return e.what();
  }
  return std::string(call) + ": status word not clear";
}

/// The first layer's status problem (each layer has a `policy`), or "": a
/// cold_run's verify.
template <class Layers>
std::string first_status_problem(const Layers& layers, const char* call) {
  for (const auto& layer : layers) {
    std::string problem = status_problem(layer.policy, call);
    if (!problem.empty()) return problem;
  }
  return {};
}

/// main()'s first act: without a device, say so and exit 77 (ctest: skipped).
inline bool device_present() {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s); kvevict_bench_cuda needs a GPU\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0");
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    std::printf("device 0: %s (sm_%d%d, %d SMs, %d MiB L2)\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount, prop.l2CacheSize >> 20);
  return true;
}

}  // namespace gpu
}  // namespace kvbench
