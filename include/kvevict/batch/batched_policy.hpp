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
// or, in one launch, with the engine writing the new K/V rows to
// next_slots itself before its attention over slots [0, count + 1):
//
//     layer.step(kvevict::batch_logits{...}, active, nullptr, stream);
//
// This header holds the host specialisation; kvevict/cuda/batched_policy.cuh
// the CUDA one. Bad arguments throw before anything changes; bad data leaves
// the (b, h) concerned unchanged and sets the status word, which check()
// turns into the library's exception.
#include <cstdint>

#include "kvevict/batch/fork.hpp"
#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/host_state.hpp"
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
  /// h2o fed key_diff at decode time, key_diff_extent(head_dim). Copies are
  /// the same state in memory of their own.
  batched_policy(const policy_shape& shape, const config_type& config, const history_extent& history = {})
      : shape_(shape) {
    batch_state_bytes<Policy>(shape, config, history);  // validates every argument
    const decode_rule rule = policy_traits<Policy>::rule(config);
    memory_ = detail::host_state(shape, rule, history, detail::parts_of<Policy>(rule, history),
                                 detail::site{policy_traits<Policy>::name, "batched_policy"});
    init_batch_state(memory_.view());
  }

  const policy_shape& shape() const noexcept { return shape_; }
  /// The state, for engine code that reads it in place.
  const batch_state_view& state() const noexcept { return memory_.view(); }

  void append(const active_set& active = active_set::all(), stream_type = {}) {
    batched_append(state(), active, &status_);
  }
  template <class T, class Layout>
  void append(const kv_view<T, Layout>& cache, const batch_rows<T>& k_new, const batch_rows<T>& v_new,
              const active_set& active = active_set::all(), stream_type = {}) {
    batched_append(state(), active, cache, k_new, v_new, &status_);
  }
  /// victims: optional [B][H] host array.
  template <class Input>
  void observe_evict(const Input& in, const active_set& active = active_set::all(), std::int32_t* victims = nullptr,
                     stream_type = {}) {
    batched_observe_evict(state(), active, in, victims, &status_);
  }
  template <class Q, class T, class Layout>
  void observe_evict(const batch_queries<Q>& in, const kv_view<T, Layout>& cache,
                     const active_set& active = active_set::all(), std::int32_t* victims = nullptr, stream_type = {}) {
    batched_observe_evict(state(), active, in, cache, victims, &status_);
  }
  /// Append + observe + evict in one call (batched_step).
  template <class Input>
  void step(const Input& in, const active_set& active = active_set::all(), std::int32_t* victims = nullptr,
            stream_type = {}) {
    batched_step(state(), active, in, victims, &status_);
  }
  /// Forgets the active sequences; streams[i]: entry i's random stream.
  void reset(const active_set& active, const std::uint64_t* streams = nullptr, stream_type = {}) {
    reset_batch_sequences(state(), active, streams);
  }

  /// Forks (batch/fork.hpp): entry i's destination becomes a copy of
  /// sources[i], every source read as before the call; streams[i]: random's
  /// new stream (default: the destination index).
  void fork(const active_set& destinations, const std::int32_t* sources, const std::uint64_t* streams = nullptr,
            stream_type = {}) {
    batched_fork(state(), destinations, sources, streams);
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
  detail::host_state memory_;
  std::uint64_t status_ = batch_status_clear;
};

}  // namespace kvevict
