// Multi-token steps on CUDA against the host backend: the append of several
// tokens and evict_to (rows moved in the cache, or moves reported) give the
// host's state, moves and K/V bytes, per policy x dtype x layout.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kvevict/batch/multi_token.hpp"
#include "kvevict/cuda/kvevict_cuda.cuh"
#include "kvevict/cuda/multi_token.cuh"
#include "cuda/device_mirror.cuh"
#include "support/caches.hpp"

namespace kv = kvevict;
using kvtest::device_buffer;

namespace {

constexpr std::int32_t kSeqs = 4, kHeads = 3, kDim = 16, kCap = 24;

template <class Policy, class T>
void run_multi_token(kvtest::layout_kind layout, const typename kv::policy_traits<Policy>::config_type& config,
                     std::uint32_t seed) {
  const kv::policy_shape shape{kSeqs, kHeads, kHeads, kCap};
  const std::int32_t budget = kv::policy_traits<Policy>::rule(config).budget;
  std::vector<unsigned char> host_memory(kv::batch_state_bytes<Policy>(shape, config));
  const kv::batch_state_view host = kv::make_batch_state<Policy>(host_memory.data(), host_memory.size(), shape, config);
  kv::init_batch_state(host);
  device_buffer<unsigned char> device_memory(host_memory.size());
  const kv::batch_state_view device =
      kv::make_batch_state<Policy>(device_memory.get(), host_memory.size(), shape, config);
  KVTEST_CUDA(kv::gpu::init_batch_state(device, nullptr));
  kvtest::host_state_mirror<Policy> mirror(shape, config);
  std::mt19937 rng(seed);
  kvtest::with_cache<T>(layout, kSeqs, kHeads, kCap, kDim, 4, [&](auto view) {
    for (std::int32_t b = 0; b < kSeqs; ++b)
      for (std::int32_t h = 0; h < kHeads; ++h)
        for (std::int32_t s = 0; s < kCap; ++s)
          if (kv::row_is_mapped(view, b, s))
            for (std::int32_t d = 0; d < kDim; ++d) {
              view.k_row(b, h, s)[d] = kvtest::random_value<T>(rng);
              view.v_row(b, h, s)[d] = kvtest::random_value<T>(rng);
            }
    kvtest::device_cache<T, decltype(view.layout)> cache(view);
    std::vector<float> inc(std::size_t(kSeqs) * kHeads * kCap);
    device_buffer<float> d_inc(inc.size());
    std::vector<std::uint8_t> flags(kSeqs);
    device_buffer<std::uint8_t> d_flags(flags.size());
    std::vector<kv::slot_move> moves(std::size_t(kSeqs) * kHeads * kCap);
    std::vector<std::int32_t> counts(std::size_t(kSeqs) * kHeads);
    device_buffer<kv::slot_move> d_moves(moves.size());
    device_buffer<std::int32_t> d_counts(counts.size());
    std::uint64_t host_status = kv::batch_status_clear;
    device_buffer<std::uint64_t> d_status(std::vector<std::uint64_t>{kv::batch_status_clear});
    for (std::int32_t step = 0; step < 20; ++step) {
      const std::int32_t tokens = 1 + std::int32_t(rng() % 5);
      for (auto& f : flags) f = rng() % 4 != 0;
      d_flags.upload(flags);
      const auto active_host = kv::active_set::of_flags(flags.data());
      const auto active_device = kv::active_set::of_flags(d_flags.get());
      kv::batched_append_tokens(host, active_host, tokens, &host_status);
      KVTEST_CUDA(kv::gpu::batched_append_tokens(device, active_device, tokens, d_status.get(), nullptr));
      for (float& x : inc) x = static_cast<float>(rng() % 8) / 8.0f;
      d_inc.upload(inc);
      kv::batched_observe_evict(
          host, active_host, kv::batch_head_scores{kv::make_tensor_view<const float>(inc.data(), kSeqs, kHeads, kCap)},
          nullptr, &host_status);
      KVTEST_CUDA(kv::gpu::batched_observe_evict(
          device, active_device,
          kv::batch_head_scores{kv::make_tensor_view<const float>(d_inc.get(), kSeqs, kHeads, kCap)}, nullptr,
          d_status.get(), nullptr));
      const std::int32_t target = budget - std::int32_t(rng() % 3);
      if (step % 2 == 0) {
        kv::batched_evict_to(host, active_host, target, view, counts.data(), &host_status);
        KVTEST_CUDA(kv::gpu::batched_evict_to(device, active_device, target, cache.view, d_counts.get(), d_status.get(),
                                              nullptr));
      } else {
        kv::batched_evict_to(host, active_host, target, moves.data(), counts.data(), &host_status);
        KVTEST_CUDA(kv::gpu::batched_evict_to(device, active_device, target, d_moves.get(), d_counts.get(),
                                              d_status.get(), nullptr));
        const std::vector<kv::slot_move> got = d_moves.download();
        for (std::size_t bh = 0; bh < counts.size(); ++bh)
          for (std::int32_t i = 0; i < counts[bh]; ++i) {
            CHECK(got[bh * kCap + std::size_t(i)].from == moves[bh * kCap + std::size_t(i)].from);
            CHECK(got[bh * kCap + std::size_t(i)].to == moves[bh * kCap + std::size_t(i)].to);
          }
      }
      KVTEST_CUDA(cudaDeviceSynchronize());
      CHECK(d_counts.download() == counts);
      CHECK(d_status.download()[0] == host_status);
      mirror.read(device);
      kvtest::check_same_state(host, mirror.view);
      if (step % 2 == 0) CHECK(cache.same_bytes_as(view));
      else {  // the engine moves its rows: keep the device cache in step with the host's
        for (std::int32_t b = 0; b < kSeqs; ++b)
          for (std::int32_t h = 0; h < kHeads; ++h)
            for (std::int32_t i = 0; i < counts[std::size_t(b * kHeads + h)]; ++i) {
              const kv::slot_move m = moves[std::size_t(b * kHeads + h) * kCap + std::size_t(i)];
              std::memcpy(view.k_row(b, h, m.to), view.k_row(b, h, m.from), sizeof(T) * kDim);
              std::memcpy(view.v_row(b, h, m.to), view.v_row(b, h, m.from), sizeof(T) * kDim);
            }
        cache.k.upload(std::vector<T>(view.k, view.k + kvtest::span_elements(view)));
        cache.v.upload(std::vector<T>(view.v, view.v + kvtest::span_elements(view)));
      }
    }
  });
}

template <class T>
void all_policies_and_layouts() {
  for (const auto layout : {kvtest::layout_kind::bhsd, kvtest::layout_kind::bshd, kvtest::layout_kind::paged_nhd,
                            kvtest::layout_kind::paged_hnd})
    for (std::uint32_t seed = 1; seed <= 2; ++seed) {
      CAPTURE(kvtest::name(layout));
      run_multi_token<kv::h2o_policy, T>(layout, {8, 4}, seed);
      run_multi_token<kv::recent_window_policy, T>(layout, {2, 10}, seed);
      run_multi_token<kv::random_policy, T>(layout, {12, 1, 3, 4242}, seed);
    }
}

}  // namespace

TEST_CASE("CUDA multi-token append and evict_to equal the host backend, every policy x dtype x layout") {
  all_policies_and_layouts<float>();
  all_policies_and_layouts<kv::half>();
  all_policies_and_layouts<kv::bfloat16>();
}
