#pragma once
// batched_policy<Policy, Device>: a batched policy that owns its state, for
// engines that do not manage the memory themselves. It is the same on every
// device, so an engine switches device with its second template argument:
//
//   template <class Device>
//   void decode_step(kvevict::batched_policy<kvevict::h2o_policy, Device>& layer,
//                    typename Device::stream_type stream, ...) {
//     layer.append(cache, k_new, v_new, active, stream);  // launch 1
//     ...                                                  // attention over slots [0, count)
//     layer.observe_evict(kvevict::batch_logits{...}, active, nullptr, stream);  // launch 2
//   }
//
// This header holds the host specialisation; kvevict/cuda/batched_policy.cuh
// the CUDA one. Bad arguments throw before anything changes; bad data leaves
// the (b, h) concerned unchanged and sets the status word, which check()
// turns into the library's exception.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/device.hpp"
#include "kvevict/policy/policy_shape.hpp"

namespace kvevict {

template <class Policy, class Device = device::host>
class batched_policy;

template <class Policy>
class batched_policy<Policy, device::host> {
 public:
  using config_type = typename policy_traits<Policy>::config_type;
  using stream_type = device::host::stream_type;

  /// exact_greedy also needs `history` (max tokens per sequence, head_dim);
  /// h2o fed key_diff at decode time, key_diff_extent(head_dim).
  batched_policy(const policy_shape& shape, const config_type& config, const history_extent& history = {})
      : shape_(shape), memory_(batch_state_bytes<Policy>(shape, config, history)) {
    state_ = make_batch_state<Policy>(memory_.data(), memory_.size(), shape, config, history);
    init_batch_state(state_);
  }
  batched_policy(const batched_policy&) = delete;  // the view points into memory_
  batched_policy& operator=(const batched_policy&) = delete;

  const policy_shape& shape() const noexcept { return shape_; }
  /// The state, for engine code that reads it in place.
  const batch_state_view& state() const noexcept { return state_; }

  void append(const active_set& active = active_set::all(), stream_type = {}) {
    batched_append(state_, active, &status_);
  }
  template <class T, class Layout>
  void append(const kv_view<T, Layout>& cache, const batch_rows<T>& k_new, const batch_rows<T>& v_new,
              const active_set& active = active_set::all(), stream_type = {}) {
    batched_append(state_, active, cache, k_new, v_new, &status_);
  }
  /// victims: optional [B][H] host array.
  template <class Input>
  void observe_evict(const Input& in, const active_set& active = active_set::all(), std::int32_t* victims = nullptr,
                     stream_type = {}) {
    batched_observe_evict(state_, active, in, victims, &status_);
  }
  template <class Q, class T, class Layout>
  void observe_evict(const batch_queries<Q>& in, const kv_view<T, Layout>& cache,
                     const active_set& active = active_set::all(), std::int32_t* victims = nullptr, stream_type = {}) {
    batched_observe_evict(state_, active, in, cache, victims, &status_);
  }
  /// Forgets the active sequences; streams[i]: entry i's random stream.
  void reset(const active_set& active, const std::uint64_t* streams = nullptr, stream_type = {}) {
    reset_batch_sequences(state_, active, streams);
  }

  /// The status word the calls report to (status.hpp).
  std::uint64_t status_word(stream_type = {}) const noexcept { return status_; }
  /// Throws for a status that is not clear, after clearing it.
  void check(stream_type = {}) {
    const std::uint64_t word = status_;
    status_ = batch_status_clear;
    throw_if_error(word, "batched_policy");
  }

 private:
  policy_shape shape_;
  std::vector<unsigned char> memory_;
  batch_state_view state_;
  std::uint64_t status_ = batch_status_clear;
};

}  // namespace kvevict
