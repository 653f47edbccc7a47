// The decode cycle on CUDA: init, reset, fork, append (with or without the K/V
// scatter) and observe + evict from every input kind, over kvevict's gpu::
// launchers (cuda_backend.hpp), the key-norm input included.
#include "cuda_backend.hpp"
#include "cuda_common.cuh"

namespace kvevict_py {
namespace cuda {

void init(const batch_state_view& st, std::uint64_t* status, void* stream) {
  throw_on_error(kvevict::gpu::init_batch_state(st, as_stream(stream)), "init_batch_state");
  clear_status(status, stream);
}

void reset(const batch_state_view& st, const kvevict::active_set& active, const std::uint64_t* streams,
           std::uint64_t* status, void* stream) {
  throw_on_error(kvevict::gpu::reset_batch_sequences(st, active, streams, status, as_stream(stream)), "reset");
}

std::size_t fork(void* workspace, std::size_t workspace_bytes, const batch_state_view& from,
                 const batch_state_view& to, const kvevict::active_set& destinations, const std::int32_t* sources,
                 const std::uint64_t* streams, std::uint64_t* status, void* stream) {
  std::size_t bytes = workspace ? workspace_bytes : 0;
  throw_on_error(kvevict::gpu::batched_fork(workspace, bytes, from, to, destinations, sources, streams, status,
                                            as_stream(stream)),
                 "fork");
  return bytes;
}

void append(const batch_state_view& st, const kvevict::active_set& active, std::uint64_t* status, void* stream) {
  throw_on_error(kvevict::gpu::batched_append(st, active, status, as_stream(stream)), "append");
}

void append_kv(const batch_state_view& st, const kvevict::active_set& active, const any_cache& cache,
               const any_array& k_new, const any_array& v_new, std::uint64_t* status, void* stream) {
  visit_cache(cache, [&](auto view) {
    using T = typename decltype(view)::element_type;
    const kvevict::batch_rows<T> k{k_new.view<T, 3>()}, v{v_new.view<T, 3>()};
    throw_on_error(kvevict::gpu::batched_append(st, active, view, k, v, status, as_stream(stream)), "append");
  });
}

void step(const batch_state_view& st, const kvevict::active_set& active, const kvevict::batch_probs& in,
          std::int32_t* victims, std::uint64_t* status, void* stream) {
  throw_on_error(kvevict::gpu::batched_step(st, active, in, victims, status, as_stream(stream)), "step");
}

void step(const batch_state_view& st, const kvevict::active_set& active, const kvevict::batch_head_scores& in,
          std::int32_t* victims, std::uint64_t* status, void* stream) {
  throw_on_error(kvevict::gpu::batched_step(st, active, in, victims, status, as_stream(stream)), "step");
}

void step(const batch_state_view& st, const kvevict::active_set& active, const kvevict::batch_logits& in,
          std::int32_t* victims, std::uint64_t* status, void* stream) {
  throw_on_error(kvevict::gpu::batched_step(st, active, in, victims, status, as_stream(stream)), "step");
}

void observe_evict(const batch_state_view& st, const kvevict::active_set& active, const kvevict::batch_probs& in,
                   std::int32_t* victims, std::uint64_t* status, void* stream) {
  throw_on_error(kvevict::gpu::batched_observe_evict(st, active, in, victims, status, as_stream(stream)),
                 "observe_evict");
}

void observe_evict(const batch_state_view& st, const kvevict::active_set& active,
                   const kvevict::batch_head_scores& in, std::int32_t* victims, std::uint64_t* status, void* stream) {
  throw_on_error(kvevict::gpu::batched_observe_evict(st, active, in, victims, status, as_stream(stream)),
                 "observe_evict");
}

void observe_evict(const batch_state_view& st, const kvevict::active_set& active, const kvevict::batch_logits& in,
                   std::int32_t* victims, std::uint64_t* status, void* stream) {
  throw_on_error(kvevict::gpu::batched_observe_evict(st, active, in, victims, status, as_stream(stream)),
                 "observe_evict");
}

void observe_evict_queries(const batch_state_view& st, const kvevict::active_set& active, const any_array& q,
                           const kvevict::tensor_view<const float, 2>& lse, float scale, kvevict::lse_base base,
                           const any_cache& cache, std::int32_t* victims, std::uint64_t* status, void* stream) {
  visit_queries(q, cache, [&](auto qt, auto view) {
    using Q = decltype(qt);
    const kvevict::batch_queries<Q> in{q.view<Q, 3>(), lse, scale, base};
    throw_on_error(kvevict::gpu::batched_observe_evict(st, active, in, view, victims, status, as_stream(stream)),
                   "observe_evict");
  });
}

void observe_evict_keys(const batch_state_view& st, const kvevict::active_set& active, bool diff,
                        const any_cache& cache, std::int32_t* victims, std::uint64_t* status, void* stream) {
  visit_cache(cache, [&](auto view) {
    using V = decltype(view);
    using E = typename V::element_type;
    using L = typename V::layout_type;
    throw_on_error(diff ? kvevict::gpu::batched_observe_evict(st, active, kvevict::key_diff<E, L>{view}, victims,
                                                              status, as_stream(stream))
                        : kvevict::gpu::batched_observe_evict(st, active, kvevict::key_norms<E, L>{view}, victims,
                                                              status, as_stream(stream)),
                   "observe_evict");
  });
}

void clear_status(std::uint64_t* status, void* stream) {
  throw_on_error(cudaMemsetAsync(status, 0xFF, sizeof(std::uint64_t), as_stream(stream)), "clear_status");
}

std::uint64_t read_status(const std::uint64_t* status, void* stream) {
  std::uint64_t word = kvevict::batch_status_clear;
  throw_on_error(cudaMemcpyAsync(&word, status, sizeof word, cudaMemcpyDeviceToHost, as_stream(stream)),
                 "read_status");
  throw_on_error(cudaStreamSynchronize(as_stream(stream)), "read_status");
  return word;
}

}  // namespace cuda
}  // namespace kvevict_py
