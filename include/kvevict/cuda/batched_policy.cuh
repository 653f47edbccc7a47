#pragma once
// batched_policy<Policy, device::cuda>: the owning batched policy on CUDA.
// It allocates its state and status word with cudaMalloc and offers the same
// calls as the host specialisation (kvevict/batch/batched_policy.hpp), so an
// engine switches device with one template argument. Calls take a stream,
// never synchronise and never allocate (but fork, whose snapshot comes from
// the stream-ordered pool); launch failures throw cuda_error.
// Inputs, active lists and victims are device memory. Only status_word()
// and check() synchronise (the stream they are given).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "kvevict/batch/batched_policy.hpp"
#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/cuda/append.cuh"
#include "kvevict/cuda/decode_step.cuh"
#include "kvevict/cuda/error.cuh"
#include "kvevict/cuda/fork.cuh"
#include "kvevict/cuda/observe_evict.cuh"
#include "kvevict/cuda/state.cuh"
#include "kvevict/device.hpp"

namespace kvevict {

template <class Policy>
class batched_policy<Policy, device::cuda> {
 public:
  using config_type = typename policy_traits<Policy>::config_type;
  using stream_type = cudaStream_t;

  /// Allocates and initialises the state on `stream` (and waits for it).
  /// exact_greedy also needs `history`; h2o fed key_diff, key_diff_extent(head_dim).
  batched_policy(const policy_shape& shape, const config_type& config, const history_extent& history = {},
                 cudaStream_t stream = nullptr)
      : shape_(shape), bytes_(batch_state_bytes<Policy>(shape, config, history)) {
    gpu::throw_on_error(cudaMalloc(&memory_, bytes_), "cudaMalloc (state)");
    if (cudaMalloc(&status_, sizeof(std::uint64_t)) != cudaSuccess) {
      cudaFree(memory_);
      gpu::throw_on_error(cudaErrorMemoryAllocation, "cudaMalloc (status)");
    }
    state_ = make_batch_state<Policy>(memory_, bytes_, shape, config, history);
    cudaError_t e = gpu::init_batch_state(state_, stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(status_, 0xFF, sizeof(std::uint64_t), stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) {
      release();
      gpu::throw_on_error(e, "batched_policy (initialising the state)");
    }
  }
  ~batched_policy() { release(); }
  batched_policy(batched_policy&& o) noexcept
      : shape_(o.shape_), bytes_(o.bytes_), memory_(std::exchange(o.memory_, nullptr)),
        status_(std::exchange(o.status_, nullptr)), state_(o.state_) {}
  batched_policy(const batched_policy&) = delete;
  batched_policy& operator=(const batched_policy&) = delete;
  batched_policy& operator=(batched_policy&&) = delete;

  const policy_shape& shape() const noexcept { return shape_; }
  /// The state in device memory, for engine kernels that read it in place.
  const batch_state_view& state() const noexcept { return state_; }
  /// The status word in device memory (e.g. to read it inside a CUDA graph).
  std::uint64_t* status_device() const noexcept { return status_; }

  void append(const active_set& active = active_set::all(), cudaStream_t stream = nullptr) {
    gpu::throw_on_error(gpu::batched_append(state_, active, status_, stream), "append");
  }
  template <class T, class Layout>
  void append(const kv_view<T, Layout>& cache, const batch_rows<T>& k_new, const batch_rows<T>& v_new,
              const active_set& active = active_set::all(), cudaStream_t stream = nullptr) {
    gpu::throw_on_error(gpu::batched_append(state_, active, cache, k_new, v_new, status_, stream), "append");
  }
  /// victims: optional [B][H] device array.
  template <class Input>
  void observe_evict(const Input& in, const active_set& active = active_set::all(), std::int32_t* victims = nullptr,
                     cudaStream_t stream = nullptr) {
    gpu::throw_on_error(gpu::batched_observe_evict(state_, active, in, victims, status_, stream), "observe_evict");
  }
  template <class Q, class T, class Layout>
  void observe_evict(const batch_queries<Q>& in, const kv_view<T, Layout>& cache,
                     const active_set& active = active_set::all(), std::int32_t* victims = nullptr,
                     cudaStream_t stream = nullptr) {
    gpu::throw_on_error(gpu::batched_observe_evict(state_, active, in, cache, victims, status_, stream),
                         "observe_evict");
  }
  /// Append + observe + evict in one launch (gpu::batched_step).
  template <class Input>
  void step(const Input& in, const active_set& active = active_set::all(), std::int32_t* victims = nullptr,
            cudaStream_t stream = nullptr) {
    gpu::throw_on_error(gpu::batched_step(state_, active, in, victims, status_, stream), "step");
  }
  /// Forgets the active sequences; streams (device memory): entry i's random stream.
  void reset(const active_set& active, const std::uint64_t* streams = nullptr, cudaStream_t stream = nullptr) {
    gpu::throw_on_error(gpu::reset_batch_sequences(state_, active, streams, status_, stream), "reset");
  }

  /// Forks (batch/fork.hpp, cuda/fork.cuh); the destinations' list, sources
  /// and streams are device memory. The snapshot of the sources comes from
  /// the device's stream-ordered pool (cudaMallocAsync) and goes back there
  /// after the launches, so the call does not synchronise.
  void fork(const active_set& destinations, const std::int32_t* sources, const std::uint64_t* streams = nullptr,
            cudaStream_t stream = nullptr) {
    std::size_t bytes = 0;
    gpu::throw_on_error(gpu::batched_fork(nullptr, bytes, state_, destinations, sources, streams, status_, stream),
                        "fork");
    if (destinations.entries(shape_.num_seqs) == 0) return;
    kvevict::detail::require_not_null(kvevict::detail::site{"cuda", "fork"}, "sources", sources);
    void* workspace = nullptr;
    gpu::throw_on_error(cudaMallocAsync(&workspace, bytes, stream), "fork (workspace)");
    cudaError_t e = cudaSuccess;
    try {  // the size query passed the same checks: nothing should throw here, but the workspace goes back
      e = gpu::batched_fork(workspace, bytes, state_, destinations, sources, streams, status_, stream);
    } catch (...) {
      cudaFreeAsync(workspace, stream);
      throw;
    }
    const cudaError_t freed = cudaFreeAsync(workspace, stream);
    gpu::throw_on_error(e, "fork");
    gpu::throw_on_error(freed, "fork (workspace)");
  }

  /// The status word, after waiting for `stream`.
  std::uint64_t status_word(cudaStream_t stream = nullptr) const {
    std::uint64_t word = batch_status_clear;
    gpu::throw_on_error(cudaMemcpyAsync(&word, status_, sizeof word, cudaMemcpyDeviceToHost, stream), "status_word");
    gpu::throw_on_error(cudaStreamSynchronize(stream), "status_word");
    return word;
  }
  /// Throws for a status that is not clear, after clearing it (waits for `stream`).
  void check(cudaStream_t stream = nullptr) {
    const std::uint64_t word = status_word(stream);
    if (word == batch_status_clear) return;
    gpu::throw_on_error(cudaMemsetAsync(status_, 0xFF, sizeof(std::uint64_t), stream), "check");
    throw_if_error(word, "batched_policy");
  }

 private:
  void release() noexcept {
    if (memory_) cudaFree(memory_);
    if (status_) cudaFree(status_);
    memory_ = nullptr;
    status_ = nullptr;
  }

  policy_shape shape_;
  std::size_t bytes_;
  void* memory_ = nullptr;
  std::uint64_t* status_ = nullptr;
  batch_state_view state_;
};

}  // namespace kvevict
