#pragma once
// Test support for the gpu tests: device buffers, a device copy of a host
// cache view (same layout, same bytes), and the host reading of a device
// batched state, so every CUDA result can be compared with the host
// backend's byte for byte.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kvevict/cuda/kvevict_cuda.cuh"

namespace kvtest {

/// KVEVICT_TEST_QUICK=n (the compute-sanitizer runs of the GPU check,
/// scripts/gpu-run.sh): the stream tests run one combination in n x
/// `stride`, so a run that is 10-100x slower still takes seconds; unset or
/// 0: every combination.
inline int quick_stride(int stride) {
  const char* q = std::getenv("KVEVICT_TEST_QUICK");
  const int n = q ? std::atoi(q) : 0;
  return n > 0 ? stride * n : 1;
}

#define KVTEST_CUDA(call)                                                                \
  do {                                                                                   \
    const cudaError_t kvtest_err = (call);                                               \
    REQUIRE_MESSAGE(kvtest_err == cudaSuccess, #call, ": ", cudaGetErrorString(kvtest_err)); \
  } while (0)

template <class T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t n = 0) : n_(n) {
    if (n_) KVTEST_CUDA(cudaMalloc(&p_, n_ * sizeof(T)));
  }
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size()) { upload(host); }
  ~device_buffer() {
    if (p_) cudaFree(p_);
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; }

  T* get() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  void upload(const std::vector<T>& host) {
    REQUIRE(host.size() == n_);
    if (n_) KVTEST_CUDA(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_) KVTEST_CUDA(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// Elements from a view's k (or v) pointer to the end of its last row.
template <class T, class Layout>
std::size_t span_elements(const kvevict::kv_view<T, Layout>& v) {
  const auto& l = v.layout;
  if constexpr (std::is_same_v<Layout, kvevict::paged_layout>) {
    return std::size_t((l.num_pages - 1) * l.stride_page + (v.num_heads - 1) * l.stride_head +
                       (l.page_size - 1) * l.stride_slot + v.head_dim);
  } else {
    return std::size_t((v.num_seqs - 1) * l.stride_seq + (v.num_heads - 1) * l.stride_head +
                       (v.capacity - 1) * l.stride_slot + v.head_dim);
  }
}

/// A device cache with the layout and the bytes of a host view.
template <class T, class Layout>
struct device_cache {
  device_buffer<T> k, v;
  device_buffer<std::int32_t> page_table;
  device_buffer<float> k_scales, v_scales;  // an fp8 cache's, in device memory as the kernels read them
  kvevict::kv_view<T, Layout> view;

  explicit device_cache(const kvevict::kv_view<T, Layout>& host)
      : k(std::vector<T>(host.k, host.k + span_elements(host))),
        v(std::vector<T>(host.v, host.v + span_elements(host))),
        page_table(page_entries(host)),
        k_scales(scales_of(host, host.scales.k)),
        v_scales(scales_of(host, host.scales.v)),
        view(host) {
    view.k = k.get();
    view.v = v.get();
    if (host.scales.k) view.scales.k = k_scales.get();
    if (host.scales.v) view.scales.v = v_scales.get();
    if constexpr (std::is_same_v<Layout, kvevict::paged_layout>) {
      page_table.upload(std::vector<std::int32_t>(host.layout.page_table, host.layout.page_table + page_entries(host)));
      view.layout.page_table = page_table.get();
    }
  }
  static std::vector<float> scales_of(const kvevict::kv_view<T, Layout>& host, const float* scales) {
    if (!scales) return {0.0f};
    return std::vector<float>(scales, scales + host.scales.count(host.num_heads));
  }
  static std::size_t page_entries(const kvevict::kv_view<T, Layout>& host) {
    if constexpr (std::is_same_v<Layout, kvevict::paged_layout>)
      return std::size_t(host.num_seqs) * std::size_t(host.layout.page_table_stride);
    return 0;
  }
  /// True when the device K and V bytes equal the host view's.
  bool same_bytes_as(const kvevict::kv_view<T, Layout>& host) const {
    const std::vector<T> dk = k.download(), dv = v.download();
    const std::size_t n = span_elements(host);
    return std::memcmp(dk.data(), host.k, n * sizeof(T)) == 0 && std::memcmp(dv.data(), host.v, n * sizeof(T)) == 0;
  }
};

/// Host memory shaped like a batched state, to read a device state into.
template <class Policy>
struct host_state_mirror {
  std::vector<unsigned char> memory;
  kvevict::batch_state_view view;

  host_state_mirror(const kvevict::policy_shape& shape, const typename kvevict::policy_traits<Policy>::config_type& c,
                    const kvevict::history_extent& history = {})
      : memory(kvevict::batch_state_bytes<Policy>(shape, c, history)),
        view(kvevict::make_batch_state<Policy>(memory.data(), memory.size(), shape, c, history)) {}

  void read(const kvevict::batch_state_view& device) {
    KVTEST_CUDA(kvevict::gpu::copy_batch_state(view, device, cudaMemcpyDeviceToHost, nullptr));
    KVTEST_CUDA(cudaDeviceSynchronize());
  }
};

/// Compares two states: slot tables, appended flags, lengths, streams,
/// history rows, KeyDiff anchors, and the current scores of occupied slots
/// bit for bit.
inline void check_same_state(const kvevict::batch_state_view& want, const kvevict::batch_state_view& got) {
  for (std::int32_t b = 0; b < want.num_seqs(); ++b) {
    REQUIRE(got.slots.lengths[b] == want.slots.lengths[b]);
    for (std::int32_t w = 0; w < want.marks.words; ++w) {  // the row marks at the current parity
      const std::int64_t i = (std::int64_t{want.slots.lengths[b] & 1} * want.num_seqs() + b) * want.marks.words + w;
      CHECK(got.marks.full[i] == want.marks.full[i]);
    }
    if (want.streams) CHECK(got.streams[b] == want.streams[b]);
    for (std::int32_t h = 0; h < want.num_heads(); ++h) {
      const std::int64_t bh = want.head_index(b, h);
      CAPTURE(b);
      CAPTURE(h);
      REQUIRE(got.slots.counts[bh] == want.slots.counts[bh]);
      CHECK(got.slots.next_slots[bh] == want.slots.next_slots[bh]);
      CHECK(got.marks.lengths[bh] == want.marks.lengths[bh]);
      CHECK(got.appended[bh] == want.appended[bh]);
      if (want.history.rows) CHECK(got.history.rows[bh] == want.history.rows[bh]);
      if (want.anchors.upto) {  // KeyDiff's running anchor, where it is current
        REQUIRE(got.anchors.upto[bh] == want.anchors.upto[bh]);
        if (want.anchors.upto[bh] >= 0) {
          const std::size_t d = std::size_t(want.anchors.head_dim);
          CHECK(std::memcmp(got.anchors.sums_of(b, h), want.anchors.sums_of(b, h), d * 8) == 0);
          CHECK(std::memcmp(got.anchors.units_of(b, h), want.anchors.units_of(b, h), d * 4) == 0);
        }
      }
      for (std::int32_t s = 0; s < want.capacity(); ++s) {
        const std::int32_t p = want.slots.positions_of(b, h)[s];
        REQUIRE(got.slots.positions_of(b, h)[s] == p);
        if (p >= 0) CHECK(std::memcmp(&got.scores_of(b, h)[s], &want.scores_of(b, h)[s], sizeof(float)) == 0);
      }
    }
  }
}

}  // namespace kvtest
