// kvevict demo on CUDA: the demo's synthetic decode stream (same flags, same
// table as kvevict_demo) run through the batched API for the whole ragged
// batch, on the GPU and on the host side by side. On the GPU, h2o,
// recent_window and random take the one-launch step: the demo's own kernel
// writes the new K/V rows to the state's next slots (as an engine's append
// kernel does with its slot mapping), then gpu::batched_step appends,
// observes and evicts in one kernel; the host runs append, then observe +
// evict, so the table also checks that the two cycles agree. exact_greedy
// reads the cache and keeps the launch pair.
// Each policy runs as batched_policy<Policy, device::cuda> and as
// batched_policy<Policy, device::host> on identical inputs; the table adds
// the GPU's time per step and whether the two devices' slot tables, scores
// and K/V bytes stayed bit-identical.
//
// The attention that feeds the policies is computed on the host from the
// host cache (this is a demo of the eviction kernels, not of attention): its
// probabilities are copied to the device each step.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/cuda/kvevict_cuda.cuh"

#include "demo_options.hpp"
#include "demo_report.hpp"

namespace {

using demo::options;
using kvevict::gpu::throw_on_error;

template <class T>
struct device_array {
  T* ptr = nullptr;
  explicit device_array(std::size_t n) { throw_on_error(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc"); }
  ~device_array() { cudaFree(ptr); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  void upload(const T* host, std::size_t n, cudaStream_t s) {
    throw_on_error(cudaMemcpyAsync(ptr, host, n * sizeof(T), cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
  }
};

/// The engine's append kernel of the one-launch cycle: the new K and V rows of
/// each active (b, h) (block (b, h)) go to its next slot, read in place from
/// the state; a head with no free slot (-1) writes nothing, its sequence's
/// step being refused.
template <class T, class Layout>
__global__ void write_next_rows(kvevict::batch_state_view st, const std::uint8_t* active,
                                kvevict::kv_view<T, Layout> cache, const T* k_new, const T* v_new) {
  const std::int32_t b = static_cast<std::int32_t>(blockIdx.x) / st.num_heads();
  const std::int32_t h = static_cast<std::int32_t>(blockIdx.x) % st.num_heads();
  const std::int32_t slot = st.slots.next_slots[st.head_index(b, h)];
  if (!active[b] || slot < 0) return;
  const std::size_t row = (std::size_t(b) * st.num_heads() + h) * std::size_t(cache.head_dim);
  for (std::int32_t d = static_cast<std::int32_t>(threadIdx.x); d < cache.head_dim; d += blockDim.x) {
    cache.k_row(b, h, slot)[d] = k_new[row + d];
    cache.v_row(b, h, slot)[d] = v_new[row + d];
  }
}

/// One policy on both devices, each with its own cache.
template <class Policy, class T, class Layout>
struct runner {
  std::string name;
  kvevict::batched_policy<Policy, kvevict::device::host> host;
  kvevict::batched_policy<Policy, kvevict::device::cuda> gpu;
  kvevict::kv_cache<T, Layout> host_cache;
  device_array<T> k, v;
  device_array<std::int32_t> page_table;
  kvevict::kv_view<T, Layout> gpu_cache;
  std::vector<unsigned char> mirror_memory;
  kvevict::batch_state_view mirror;
  demo::metrics m;
  float gpu_ms = 0.0f;
  bool identical = true;

  runner(std::string n, const kvevict::policy_shape& shape, const typename kvevict::policy_traits<Policy>::config_type& c,
         const kvevict::history_extent& history, kvevict::kv_cache<T, Layout> cache)
      : name(std::move(n)), host(shape, c, history), gpu(shape, c, history), host_cache(std::move(cache)),
        k(host_cache.k_storage().size()), v(host_cache.v_storage().size()), page_table(host_cache.page_table().size()),
        gpu_cache(host_cache.view()),
        mirror_memory(kvevict::batch_state_bytes<Policy>(shape, c, history)),
        mirror(kvevict::make_batch_state<Policy>(mirror_memory.data(), mirror_memory.size(), shape, c, history)) {
    k.upload(host_cache.k_storage().data(), host_cache.k_storage().size(), nullptr);
    v.upload(host_cache.v_storage().data(), host_cache.v_storage().size(), nullptr);
    gpu_cache.k = k.ptr;
    gpu_cache.v = v.ptr;
    if constexpr (std::is_same_v<Layout, kvevict::paged_layout>) {
      page_table.upload(host_cache.page_table().data(), host_cache.page_table().size(), nullptr);
      gpu_cache.layout.page_table = page_table.ptr;
    }
  }

  /// Whether the GPU's state and cache equal the host's, bit for bit.
  void compare() {
    throw_on_error(kvevict::gpu::copy_batch_state(mirror, gpu.state(), cudaMemcpyDeviceToHost, nullptr), "copy");
    std::vector<T> gk(host_cache.k_storage().size()), gv(gk.size());
    throw_on_error(cudaMemcpy(gk.data(), k.ptr, gk.size() * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    throw_on_error(cudaMemcpy(gv.data(), v.ptr, gv.size() * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    const kvevict::batch_state_view& h = host.state();
    bool same = std::memcmp(gk.data(), host_cache.k_storage().data(), gk.size() * sizeof(T)) == 0 &&
                std::memcmp(gv.data(), host_cache.v_storage().data(), gv.size() * sizeof(T)) == 0;
    for (std::int32_t b = 0; b < h.num_seqs(); ++b)
      for (std::int32_t hh = 0; hh < h.num_heads(); ++hh) {
        const std::int64_t bh = h.head_index(b, hh);
        same = same && h.slots.counts[bh] == mirror.slots.counts[bh] && h.slots.lengths[b] == mirror.slots.lengths[b];
        for (std::int32_t s = 0; s < h.capacity(); ++s) {
          const std::int32_t p = h.slots.positions_of(b, hh)[s];
          same = same && p == mirror.slots.positions_of(b, hh)[s];
          if (p >= 0) same = same && std::memcmp(&h.scores_of(b, hh)[s], &mirror.scores_of(b, hh)[s], 4) == 0;
        }
      }
    identical = identical && same && gpu.status_word() == kvevict::batch_status_clear &&
                host.status_word() == kvevict::batch_status_clear;
  }
};

template <class T, class MakeCache>
void run(const options& o, MakeCache make_cache) {
  using namespace kvevict;
  const std::int32_t B = o.seqs, H = o.heads, Hq = o.heads * o.group, D = o.head_dim, L = o.steps;
  const std::int32_t budget = o.budget_tokens(), capacity = budget + 1;
  const policy_shape shape{B, H, Hq, capacity};
  demo::full_reference<T> ref(o);
  const std::vector<std::int32_t>& length = ref.lengths();
  using layout = typename decltype(make_cache(shape))::view_type::layout_type;
  exact_greedy_config greedy;
  greedy.budget = budget;
  greedy.recent = o.half_budget();
  runner<h2o_policy, T, layout> h2o("h2o", shape, {o.half_budget(), o.half_budget()}, {}, make_cache(shape));
  runner<recent_window_policy, T, layout> window("recent_window", shape, {4, budget - 4}, {}, make_cache(shape));
  runner<random_policy, T, layout> random("random", shape, {budget, 0, 0, o.seed}, {}, make_cache(shape));
  runner<exact_greedy_policy, T, layout> oracle("exact_greedy", shape, greedy, {L, D}, make_cache(shape));

  cudaStream_t stream;
  throw_on_error(cudaStreamCreate(&stream), "cudaStreamCreate");
  cudaEvent_t start, stop;
  throw_on_error(cudaEventCreate(&start), "cudaEventCreate");
  throw_on_error(cudaEventCreate(&stop), "cudaEventCreate");
  device_array<std::uint8_t> flags_gpu{static_cast<std::size_t>(B)};
  device_array<T> k_gpu(ref.new_k.size()), v_gpu(ref.new_v.size());
  device_array<float> probs_gpu(std::size_t(B) * Hq * capacity), q_gpu(ref.q.size()), lse_gpu(std::size_t(B) * Hq);
  std::vector<std::uint8_t> flags(static_cast<std::size_t>(B));
  std::vector<float> probs(std::size_t(B) * Hq * capacity), out(std::size_t(Hq) * D), lse(std::size_t(B) * Hq, 0.0f);
  lse_gpu.upload(lse.data(), lse.size(), stream);

  auto step = [&](auto& r, std::int32_t t, const active_set& host_active, const active_set& gpu_active) {
    constexpr bool greedy = std::is_same_v<std::decay_t<decltype(r.host)>, batched_policy<exact_greedy_policy>>;
    const auto rows = [&](const T* p) { return batch_rows<T>{make_tensor_view<const T>(p, B, H, D)}; };
    r.host.append(r.host_cache.view(), rows(ref.new_k.data()), rows(ref.new_v.data()), host_active);
    if constexpr (greedy) {
      r.gpu.append(r.gpu_cache, rows(k_gpu.ptr), rows(v_gpu.ptr), gpu_active, stream);
    } else {  // the one-launch cycle: the engine writes the rows to the next slots itself
      write_next_rows<<<B * H, 64, 0, stream>>>(r.gpu.state(), flags_gpu.ptr, r.gpu_cache, k_gpu.ptr, v_gpu.ptr);
      throw_on_error(cudaGetLastError(), "write_next_rows");
    }
    // Attention over the occupied slots [0, count): the engine's part.
    const batch_state_view& st = r.host.state();
    const auto view = r.host_cache.view();
    std::fill(probs.begin(), probs.end(), 0.0f);
    for (std::int32_t b = 0; b < B; ++b) {
      if (!flags[std::size_t(b)]) continue;
      for (std::int32_t qh = 0; qh < Hq; ++qh) {
        const std::int32_t h = qh / o.group, count = st.slots.counts[st.head_index(b, h)];
        float* p = &probs[(std::size_t(b) * Hq + qh) * capacity];
        demo::attend(
            &ref.q[(std::size_t(b) * Hq + qh) * D], count, D, ref.scale(),
            [&](std::int32_t s, bool key) -> const T* { return key ? view.k_row(b, h, s) : view.v_row(b, h, s); }, p,
            out.data());
        if (t + 1 > budget)
          demo::add_sample(r.m, out.data(), &ref.out[(std::size_t(b) * Hq + qh) * D], D,
                           &ref.probs[(std::size_t(b) * Hq + qh) * L], count,
                           [&](std::int32_t s) { return st.slots.positions_of(b, h)[s]; });
      }
    }
    const auto host_start = std::chrono::steady_clock::now();
    if constexpr (greedy) {
      const auto lse_view = [&](const float* p) { return make_tensor_view<const float>(p, B, Hq); };
      r.host.observe_evict(batch_queries<float>{make_tensor_view<const float>(ref.q.data(), B, Hq, D),
                                                lse_view(lse.data()), ref.scale()},
                           view, host_active);
      r.m.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start).count();
      throw_on_error(cudaEventRecord(start, stream), "cudaEventRecord");
      r.gpu.observe_evict(batch_queries<float>{make_tensor_view<const float>(q_gpu.ptr, B, Hq, D),
                                               lse_view(lse_gpu.ptr), ref.scale()},
                          r.gpu_cache, gpu_active, nullptr, stream);
    } else {
      r.host.observe_evict(batch_probs{make_tensor_view<const float>(probs.data(), B, Hq, capacity)}, host_active);
      r.m.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start).count();
      probs_gpu.upload(probs.data(), probs.size(), stream);
      throw_on_error(cudaEventRecord(start, stream), "cudaEventRecord");
      r.gpu.step(batch_probs{make_tensor_view<const float>(probs_gpu.ptr, B, Hq, capacity)}, gpu_active, nullptr,
                 stream);
    }
    throw_on_error(cudaEventRecord(stop, stream), "cudaEventRecord");
    throw_on_error(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0.0f;
    throw_on_error(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    r.gpu_ms += ms;
    ++r.m.steps;
    if (t % 256 == 255 || t + 1 == L) r.compare();
  };

  for (std::int32_t t = 0; t < L; ++t) {
    for (std::int32_t b = 0; b < B; ++b) {
      flags[std::size_t(b)] = t < length[std::size_t(b)];
      if (flags[std::size_t(b)]) ref.step(b, t);
    }
    flags_gpu.upload(flags.data(), flags.size(), stream);
    k_gpu.upload(ref.new_k.data(), ref.new_k.size(), stream);
    v_gpu.upload(ref.new_v.data(), ref.new_v.size(), stream);
    q_gpu.upload(ref.q.data(), ref.q.size(), stream);
    const active_set host_active = active_set::of_flags(flags.data()), gpu_active = active_set::of_flags(flags_gpu.ptr);
    step(h2o, t, host_active, gpu_active);
    step(window, t, host_active, gpu_active);
    step(random, t, host_active, gpu_active);
    step(oracle, t, host_active, gpu_active);
  }

  const std::size_t full = demo::full_bytes(o, sizeof(T));
  demo::print_header(o, dtype_traits<T>::name, "     gpu us/step   gpu == host");
  demo::print_full_row(full);
  auto row = [&](auto& r) {
    char extra[64];
    std::snprintf(extra, sizeof extra, " %15.1f   %s", 1e3 * r.gpu_ms / double(std::max<std::int64_t>(r.m.steps, 1)),
                  r.identical ? "bit for bit" : "DIFFERENT");
    demo::print_row(r.name, r.host_cache.bytes(), full, r.m, extra);
  };
  row(h2o);
  row(window);
  row(random);
  row(oracle);
  demo::print_footer("the host's observe + evict for the whole batch per step; gpu us/step the same call on the "
                     "GPU (one launch, CUDA events)");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  if (!(h2o.identical && window.identical && random.identical && oracle.identical)) throw kvevict::state_error("the devices differ");
}

template <class T>
void run_dtype(const options& o) {
  using namespace kvevict;
  if (o.layout == "bhsd") {
    run<T>(o, [&](const policy_shape& s) { return make_bhsd_cache<T>(s.num_seqs, s.num_kv_heads, s.capacity, o.head_dim); });
  } else if (o.layout == "bshd") {
    run<T>(o, [&](const policy_shape& s) { return make_bshd_cache<T>(s.num_seqs, s.num_kv_heads, s.capacity, o.head_dim); });
  } else {
    run<T>(o, [&](const policy_shape& s) {
      return make_paged_cache<T>(s.num_seqs, s.num_kv_heads, s.capacity, o.head_dim, o.page_size, page_order::nhd);
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  const options o = demo::parse(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "kvevict_demo_cuda: no CUDA device; kvevict_demo runs the same workload on the host\n");
    return 3;
  }
  try {
    if (o.dtype == "float") run_dtype<float>(o);
    else if (o.dtype == "half") run_dtype<kvevict::half>(o);
    else run_dtype<kvevict::bfloat16>(o);
  } catch (const kvevict::error& e) {
    std::fprintf(stderr, "kvevict_demo_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
