// Multi-token steps on CUDA against the host backend: the append of several
// tokens and evict_to (rows moved in the cache, or moves reported) give the
// host's state, moves and K/V bytes, per policy x dtype x layout. exact_greedy
// observes queries (every appended row joins the history) and its evict_to
// re-scores with them: scores, victims and history rows must be the host's
// bit for bit.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
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

/// The sizes of a stream: capacity, steps, tokens per append at most, and
/// whether evict_to's targets range over [sinks + recent, budget] (many
/// victims per head) rather than the budget and just below.
struct stream_shape {
  std::int32_t cap = kCap, steps = 20, max_tokens = 5;
  bool wide_targets = false;
};

template <class Policy, class T>
void run_multi_token(kvtest::layout_kind layout, const typename kv::policy_traits<Policy>::config_type& config,
                     std::uint32_t seed, const stream_shape& shape_of = {}) {
  const std::int32_t cap = shape_of.cap;
  constexpr bool greedy = std::is_same_v<Policy, kv::exact_greedy_policy>;
  constexpr std::int32_t kGroup = greedy ? 2 : 1;  // exact_greedy sums its errors over a GQA group
  const kv::policy_shape shape{kSeqs, kHeads, kHeads * kGroup, cap};
  const kv::history_extent history = greedy ? kv::history_extent{128, kDim} : kv::history_extent{};
  const std::int32_t budget = kv::policy_traits<Policy>::rule(config).budget;
  std::vector<unsigned char> host_memory(kv::batch_state_bytes<Policy>(shape, config, history));
  const kv::batch_state_view host =
      kv::make_batch_state<Policy>(host_memory.data(), host_memory.size(), shape, config, history);
  kv::init_batch_state(host);
  device_buffer<unsigned char> device_memory(host_memory.size());
  const kv::batch_state_view device =
      kv::make_batch_state<Policy>(device_memory.get(), host_memory.size(), shape, config, history);
  KVTEST_CUDA(kv::gpu::init_batch_state(device, nullptr));
  kvtest::host_state_mirror<Policy> mirror(shape, config, history);
  std::mt19937 rng(seed);
  kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 4, [&](auto view) {
    for (std::int32_t b = 0; b < kSeqs; ++b)
      for (std::int32_t h = 0; h < kHeads; ++h)
        for (std::int32_t s = 0; s < cap; ++s)
          if (kv::row_is_mapped(view, b, s))
            for (std::int32_t d = 0; d < kDim; ++d) {
              view.k_row(b, h, s)[d] = kvtest::random_value<T>(rng);
              view.v_row(b, h, s)[d] = kvtest::random_value<T>(rng);
            }
    kvtest::device_cache<T, decltype(view.layout)> cache(view);
    std::vector<float> inc(std::size_t(kSeqs) * kHeads * cap);
    device_buffer<float> d_inc(inc.size());
    std::vector<float> q(std::size_t(kSeqs) * kHeads * kGroup * kDim), lse(std::size_t(kSeqs) * kHeads * kGroup);
    device_buffer<float> d_q(q.size()), d_lse(std::vector<float>(lse.size(), 0.0f));
    const auto queries_of = [&](const float* qs, const float* lses) {
      return kv::batch_queries<float>{kv::make_tensor_view<const float>(qs, kSeqs, kHeads * kGroup, kDim),
                                      kv::make_tensor_view<const float>(lses, kSeqs, kHeads * kGroup), 0.5f};
    };
    const kv::batch_queries<float> host_queries = queries_of(q.data(), lse.data());
    const kv::batch_queries<float> device_queries = queries_of(d_q.get(), d_lse.get());
    std::vector<std::uint8_t> flags(kSeqs);
    device_buffer<std::uint8_t> d_flags(flags.size());
    std::vector<kv::slot_move> moves(std::size_t(kSeqs) * kHeads * cap);
    std::vector<std::int32_t> counts(std::size_t(kSeqs) * kHeads);
    // The kernels write only active heads and their first move_counts moves:
    // start the device buffers equal to the host's, so whole downloads compare
    // defined bytes (initcheck) and inactive heads keep equal values.
    device_buffer<kv::slot_move> d_moves(moves);
    device_buffer<std::int32_t> d_counts(counts);
    std::uint64_t host_status = kv::batch_status_clear;
    device_buffer<std::uint64_t> d_status(std::vector<std::uint64_t>{kv::batch_status_clear});
    for (std::int32_t step = 0; step < shape_of.steps; ++step) {
      const std::int32_t tokens = 1 + std::int32_t(rng() % std::uint32_t(shape_of.max_tokens));
      for (auto& f : flags) f = rng() % 4 != 0;
      d_flags.upload(flags);
      const auto active_host = kv::active_set::of_flags(flags.data());
      const auto active_device = kv::active_set::of_flags(d_flags.get());
      kv::batched_append_tokens(host, active_host, tokens, &host_status);
      KVTEST_CUDA(kv::gpu::batched_append_tokens(device, active_device, tokens, d_status.get(), nullptr));
      for (float& x : inc) x = static_cast<float>(rng() % 8) / 8.0f;
      d_inc.upload(inc);
      for (float& x : q) x = static_cast<float>(rng() % 33) / 16.0f - 1.0f;
      d_q.upload(q);
      if constexpr (greedy) {
        kv::batched_observe_evict(host, active_host, host_queries, view, nullptr, &host_status);
        KVTEST_CUDA(kv::gpu::batched_observe_evict(device, active_device, device_queries, cache.view, nullptr,
                                                   d_status.get(), nullptr));
      } else {
        kv::batched_observe_evict(
            host, active_host,
            kv::batch_head_scores{kv::make_tensor_view<const float>(inc.data(), kSeqs, kHeads, cap)}, nullptr,
            &host_status);
        KVTEST_CUDA(kv::gpu::batched_observe_evict(
            device, active_device,
            kv::batch_head_scores{kv::make_tensor_view<const float>(d_inc.get(), kSeqs, kHeads, cap)}, nullptr,
            d_status.get(), nullptr));
      }
      const kv::protection protect = kv::policy_traits<Policy>::rule(config).protect;
      const std::int32_t lowest = protect.sinks + protect.recent;
      const std::int32_t target = shape_of.wide_targets
                                      ? lowest + std::int32_t(rng() % std::uint32_t(budget - lowest + 1))
                                      : budget - std::int32_t(rng() % 3);
      if (step % 2 == 0) {
        if constexpr (greedy) {
          kv::batched_evict_to(host, active_host, target, host_queries, view, counts.data(), &host_status);
          KVTEST_CUDA(kv::gpu::batched_evict_to(device, active_device, target, device_queries, cache.view,
                                                d_counts.get(), d_status.get(), nullptr));
        } else {
          kv::batched_evict_to(host, active_host, target, view, counts.data(), &host_status);
          KVTEST_CUDA(kv::gpu::batched_evict_to(device, active_device, target, cache.view, d_counts.get(),
                                                d_status.get(), nullptr));
        }
      } else {
        if constexpr (greedy) {
          kv::batched_evict_to(host, active_host, target, host_queries, moves.data(), counts.data(), &host_status);
          KVTEST_CUDA(kv::gpu::batched_evict_to(device, active_device, target, device_queries, d_moves.get(),
                                                d_counts.get(), d_status.get(), nullptr));
        } else {
          kv::batched_evict_to(host, active_host, target, moves.data(), counts.data(), &host_status);
          KVTEST_CUDA(kv::gpu::batched_evict_to(device, active_device, target, d_moves.get(), d_counts.get(),
                                                d_status.get(), nullptr));
        }
        const std::vector<kv::slot_move> got = d_moves.download();
        for (std::size_t bh = 0; bh < counts.size(); ++bh)
          for (std::int32_t i = 0; i < counts[bh]; ++i) {
            CHECK(got[bh * cap + std::size_t(i)].from == moves[bh * cap + std::size_t(i)].from);
            CHECK(got[bh * cap + std::size_t(i)].to == moves[bh * cap + std::size_t(i)].to);
          }
      }
      KVTEST_CUDA(cudaDeviceSynchronize());
      CHECK(d_counts.download() == counts);
      CHECK(d_status.download()[0] == host_status);
      REQUIRE(host_status == kv::batch_status_clear);  // the streams are valid: every head stepped
      mirror.read(device);
      kvtest::check_same_state(host, mirror.view);
      if constexpr (greedy)  // the recorded history rows, bit for bit (the rest is uninitialised on the device)
        for (std::int64_t bh = 0; bh < std::int64_t{kSeqs} * kHeads; ++bh) {
          const std::size_t first = std::size_t(bh) * history.max_tokens * kDim;
          const std::size_t bytes = std::size_t(host.history.rows[bh]) * kDim * sizeof(float);
          CHECK(std::memcmp(mirror.view.history.keys + first, host.history.keys + first, bytes) == 0);
          CHECK(std::memcmp(mirror.view.history.values + first, host.history.values + first, bytes) == 0);
        }
      if (step % 2 == 0) CHECK(cache.same_bytes_as(view));
      else {  // the engine moves its rows: keep the device cache in step with the host's
        for (std::int32_t b = 0; b < kSeqs; ++b) {
          // An inactive head's move count is not written: what it holds is
          // an earlier call's (a victim count, after the cache form).
          if (!flags[std::size_t(b)]) continue;
          for (std::int32_t h = 0; h < kHeads; ++h)
            for (std::int32_t i = 0; i < counts[std::size_t(b * kHeads + h)]; ++i) {
              const kv::slot_move m = moves[std::size_t(b * kHeads + h) * cap + std::size_t(i)];
              REQUIRE((m.from >= 0 && m.from < cap && m.to >= 0 && m.to < cap));
              std::memcpy(view.k_row(b, h, m.to), view.k_row(b, h, m.from), sizeof(T) * kDim);
              std::memcpy(view.v_row(b, h, m.to), view.v_row(b, h, m.from), sizeof(T) * kDim);
            }
        }
        cache.k.upload(std::vector<T>(view.k, view.k + kvtest::span_elements(view)));
        cache.v.upload(std::vector<T>(view.v, view.v + kvtest::span_elements(view)));
      }
    }
  });
}

/// Every policy x layout x seed for one dtype; under KVEVICT_TEST_QUICK one
/// combination in quick_stride(3) (`combination` counts across the dtypes,
/// so each dtype meets every policy).
template <class T>
void all_policies_and_layouts(int& combination) {
  const int stride = kvtest::quick_stride(3);
  for (const auto layout : {kvtest::layout_kind::bhsd, kvtest::layout_kind::bshd, kvtest::layout_kind::paged_nhd,
                            kvtest::layout_kind::paged_hnd})
    for (std::uint32_t seed = 1; seed <= 2; ++seed) {
      CAPTURE(kvtest::name(layout));
      if (combination++ % stride == 0) run_multi_token<kv::h2o_policy, T>(layout, {8, 4}, seed);
      if (combination++ % stride == 0) run_multi_token<kv::recent_window_policy, T>(layout, {2, 10}, seed);
      if (combination++ % stride == 0) run_multi_token<kv::random_policy, T>(layout, {12, 1, 3, 4242}, seed);
      if (combination++ % stride == 0) run_multi_token<kv::exact_greedy_policy, T>(layout, {12, 3, 1}, seed);
    }
}

}  // namespace

TEST_CASE("CUDA multi-token append and evict_to equal the host backend, every policy x dtype x layout") {
  // exact_greedy included: multi-row observe and the greedy evict_to.
  int combination = 0;
  all_policies_and_layouts<float>(combination);
  all_policies_and_layouts<kv::half>(combination);
  all_policies_and_layouts<kv::bfloat16>(combination);
}

TEST_CASE("CUDA evict_to on long rows equals the host: multi-block selection and refill, many victims per head") {
  // 6000 slots: the victims come from the selection's several-blocks-per-row
  // path (rows above 4096 keys), up to 1500 tokens arrive per step and the
  // targets go down to sinks + recent, so the refill spreads its moves over
  // several blocks, and paged rows are checked in several chunks.
  const stream_shape large{6000, 12, 1500, true};
  for (const auto layout : {kvtest::layout_kind::bhsd, kvtest::layout_kind::paged_hnd}) {
    CAPTURE(kvtest::name(layout));
    run_multi_token<kv::h2o_policy, kv::bfloat16>(layout, {3000, 1000}, 7, large);
    run_multi_token<kv::recent_window_policy, kv::half>(layout, {4, 3996}, 8, large);
    run_multi_token<kv::random_policy, float>(layout, {4000, 4, 100, 99}, 9, large);
  }
}

TEST_CASE("CUDA observe + evict refuses an input narrower than a head's tokens, as the host does") {
  // After a multi-token append a head holds more than the budget + 1
  // columns the argument check asks for: the kernel must report
  // narrow_input and leave the state as it was, not read past the input.
  const kv::policy_shape shape{kSeqs, kHeads, kHeads, kCap};
  const kv::h2o_config config{4, 2};  // budget 6: 7 columns pass the argument check
  std::vector<unsigned char> host_memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config));
  const kv::batch_state_view host =
      kv::make_batch_state<kv::h2o_policy>(host_memory.data(), host_memory.size(), shape, config);
  kv::init_batch_state(host);
  device_buffer<unsigned char> device_memory(host_memory.size());
  const kv::batch_state_view device =
      kv::make_batch_state<kv::h2o_policy>(device_memory.get(), host_memory.size(), shape, config);
  KVTEST_CUDA(kv::gpu::init_batch_state(device, nullptr));
  std::uint64_t host_status = kv::batch_status_clear;
  device_buffer<std::uint64_t> d_status(std::vector<std::uint64_t>{kv::batch_status_clear});
  kv::batched_append_tokens(host, kv::active_set::all(), 10, &host_status);
  KVTEST_CUDA(kv::gpu::batched_append_tokens(device, kv::active_set::all(), 10, d_status.get(), nullptr));
  const std::vector<float> inc(std::size_t(kSeqs) * kHeads * 7, 0.25f);
  device_buffer<float> d_inc(inc);
  kv::batched_observe_evict(host, kv::active_set::all(),
                            kv::batch_head_scores{kv::make_tensor_view<const float>(inc.data(), kSeqs, kHeads, 7)},
                            nullptr, &host_status);
  KVTEST_CUDA(kv::gpu::batched_observe_evict(
      device, kv::active_set::all(),
      kv::batch_head_scores{kv::make_tensor_view<const float>(d_inc.get(), kSeqs, kHeads, 7)}, nullptr,
      d_status.get(), nullptr));
  KVTEST_CUDA(cudaDeviceSynchronize());
  CHECK(kv::batch_status::unpack(host_status).code == kv::batch_code::narrow_input);
  CHECK(d_status.download()[0] == host_status);
  kvtest::host_state_mirror<kv::h2o_policy> mirror(shape, config, kv::history_extent{});
  mirror.read(device);
  kvtest::check_same_state(host, mirror.view);
  CHECK(host.slots.counts[0] == 10);
}

TEST_CASE("CUDA launchers refuse a null victim_scratch, malformed input strides and edited rule enums, changing nothing") {
  // The batched reliability checks (tests/test_batched_reliability.cpp on
  // the host) at the CUDA entry points: each throws before any launch,
  // naming the argument, and the device state stays as it was.
  const kv::policy_shape shape{kSeqs, kHeads, kHeads, kCap};
  const kv::h2o_config config{4, 2};
  std::vector<unsigned char> host_memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config));
  device_buffer<unsigned char> device_memory(host_memory.size());
  const kv::batch_state_view device =
      kv::make_batch_state<kv::h2o_policy>(device_memory.get(), host_memory.size(), shape, config);
  KVTEST_CUDA(kv::gpu::init_batch_state(device, nullptr));
  device_buffer<std::uint64_t> d_status(std::vector<std::uint64_t>{kv::batch_status_clear});
  KVTEST_CUDA(kv::gpu::batched_append(device, kv::active_set::all(), d_status.get(), nullptr));
  KVTEST_CUDA(cudaDeviceSynchronize());
  const std::vector<unsigned char> before = device_memory.download();
  const std::vector<float> inc(std::size_t(kSeqs) * kHeads * kCap, 0.25f);
  device_buffer<float> d_inc(inc);
  const auto scores = kv::make_tensor_view<const float>(d_inc.get(), kSeqs, kHeads, kCap);
  const auto throws = [&](auto call, const char* arg) {
    CAPTURE(arg);
    try {
      call();
      FAIL("accepted");
    } catch (const kv::error& e) {
      CHECK(std::string(e.what()).find(arg) != std::string::npos);
    }
    KVTEST_CUDA(cudaDeviceSynchronize());
    CHECK(device_memory.download() == before);
  };
  // A null victim_scratch: evict_to writes through it.
  kv::batch_state_view edited = device;
  edited.victim_scratch = nullptr;
  device_buffer<kv::slot_move> d_moves(std::size_t(kSeqs) * kHeads * kCap);
  device_buffer<std::int32_t> d_counts(std::size_t(kSeqs) * kHeads);
  throws([&] { (void)kv::gpu::batched_evict_to(edited, kv::active_set::all(), 6, d_moves.get(), d_counts.get(),
                                               d_status.get(), nullptr); },
         "'state.victim_scratch'");
  // Input strides: negative, and zero on an extent above 1.
  kv::batch_head_scores bad{scores};
  bad.scores.strides[0] = -bad.scores.strides[0];
  throws([&] { (void)kv::gpu::batched_observe_evict(device, kv::active_set::all(), bad, nullptr, d_status.get(),
                                                    nullptr); },
         "'scores.strides[0]'");
  bad = kv::batch_head_scores{scores};
  bad.scores.strides[2] = 0;
  throws([&] { (void)kv::gpu::batched_observe_evict(device, kv::active_set::all(), bad, nullptr, d_status.get(),
                                                    nullptr); },
         "'scores.strides[2]'");
  // Rule enums outside their range, read as a default before.
  edited = device;
  edited.rule.reduce = static_cast<kv::group_reduce>(9);
  throws([&] { (void)kv::gpu::batched_observe_evict(edited, kv::active_set::all(), kv::batch_head_scores{scores},
                                                    nullptr, d_status.get(), nullptr); },
         "'state.rule.reduce'");
  edited = device;
  edited.rule.victim = static_cast<kv::victim_rule>(7);
  throws([&] { (void)kv::gpu::batched_append(edited, kv::active_set::all(), d_status.get(), nullptr); },
         "'state.rule.victim'");
  CHECK(d_status.download()[0] == kv::batch_status_clear);
}

TEST_CASE("CUDA evict_to that frees nothing leaves the KeyDiff anchor stale, as the host does") {
  // The host regression of tests/test_key_diff_decode.cpp on the device:
  // after a cached key is rewritten, evict_to to the count itself frees
  // nothing, and the next KeyDiff step must count the anchor afresh.
  const kv::policy_shape shape{1, 1, 1, 8};
  const kv::h2o_config config = kv::key_norm_config(3, 1, 1);  // budget 5
  const kv::history_extent extent = kv::key_diff_extent(4);
  std::vector<unsigned char> host_memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config, extent));
  const kv::batch_state_view host =
      kv::make_batch_state<kv::h2o_policy>(host_memory.data(), host_memory.size(), shape, config, extent);
  kv::init_batch_state(host);
  device_buffer<unsigned char> device_memory(host_memory.size());
  const kv::batch_state_view device =
      kv::make_batch_state<kv::h2o_policy>(device_memory.get(), host_memory.size(), shape, config, extent);
  KVTEST_CUDA(kv::gpu::init_batch_state(device, nullptr));
  auto cache = kv::make_bhsd_cache<float>(1, 1, 8, 4);
  device_buffer<float> d_k(cache.k_storage().size()), d_v(cache.v_storage().size());
  const auto d_view = [&] {
    kv::kv_view<float, kv::strided_layout> v = cache.view();
    v.k = d_k.get();
    v.v = d_v.get();
    return v;
  };
  std::uint64_t host_status = kv::batch_status_clear;
  device_buffer<std::uint64_t> d_status(std::vector<std::uint64_t>{kv::batch_status_clear});
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const auto step = [&] {
    float* k = cache.view().k_row(0, 0, host.slots.next_slots[0]);
    for (std::int32_t e = 0; e < 4; ++e) k[e] = 1.0f + 0.5f * n(rng);
    d_k.upload(cache.k_storage());
    kv::batched_append(host, kv::active_set::all(), &host_status);
    kv::batched_observe_evict(host, kv::active_set::all(), kv::key_diff<float, kv::strided_layout>{cache.view()},
                              nullptr, &host_status);
    KVTEST_CUDA(kv::gpu::batched_append(device, kv::active_set::all(), d_status.get(), nullptr));
    KVTEST_CUDA(kv::gpu::batched_observe_evict(device, kv::active_set::all(),
                                               kv::key_diff<float, kv::strided_layout>{d_view()}, nullptr,
                                               d_status.get(), nullptr));
  };
  for (int t = 0; t < 8; ++t) step();
  std::int32_t rewritten = -1;  // the oldest cached token that is not the sink
  for (std::int32_t s = 0; s < 8; ++s)
    if (host.slots.positions[s] > 0 && (rewritten < 0 || host.slots.positions[s] < host.slots.positions[rewritten]))
      rewritten = s;
  REQUIRE(rewritten >= 0);
  for (std::int32_t e = 0; e < 4; ++e) cache.view().k_row(0, 0, rewritten)[e] *= -1.0f;
  d_k.upload(cache.k_storage());
  device_buffer<std::int32_t> d_freed(1);
  std::int32_t freed = -1;
  kv::batched_evict_to(host, kv::active_set::all(), 5, cache.view(), &freed, &host_status);
  KVTEST_CUDA(kv::gpu::batched_evict_to(device, kv::active_set::all(), 5, d_view(), d_freed.get(), d_status.get(),
                                        nullptr));
  step();  // scored against the keys cached now, on both
  KVTEST_CUDA(cudaDeviceSynchronize());
  CHECK(freed == 0);
  CHECK(d_freed.download()[0] == 0);
  CHECK(host_status == kv::batch_status_clear);
  CHECK(d_status.download()[0] == host_status);
  kvtest::host_state_mirror<kv::h2o_policy> mirror(shape, config, extent);
  mirror.read(device);
  kvtest::check_same_state(host, mirror.view);
}

TEST_CASE("CUDA KeyDiff launchers refuse a state view with null or mis-sized anchors, changing nothing") {
  const kv::policy_shape shape{kSeqs, kHeads, kHeads, kCap};
  const kv::h2o_config config = kv::key_norm_config(4, 2);
  const kv::history_extent extent = kv::key_diff_extent(kDim);
  const std::size_t bytes = kv::batch_state_bytes<kv::h2o_policy>(shape, config, extent);
  device_buffer<unsigned char> device_memory(bytes);
  const kv::batch_state_view device = kv::make_batch_state<kv::h2o_policy>(device_memory.get(), bytes, shape, config, extent);
  KVTEST_CUDA(kv::gpu::init_batch_state(device, nullptr));
  device_buffer<std::uint64_t> d_status(std::vector<std::uint64_t>{kv::batch_status_clear});
  KVTEST_CUDA(kv::gpu::batched_append(device, kv::active_set::all(), d_status.get(), nullptr));
  KVTEST_CUDA(cudaDeviceSynchronize());
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, kCap, kDim);
  device_buffer<float> d_k(cache.k_storage().size()), d_v(cache.v_storage().size());
  kv::kv_view<float, kv::strided_layout> view = cache.view();
  view.k = d_k.get();
  view.v = d_v.get();
  const std::vector<unsigned char> before = device_memory.download();
  const auto refused = [&](const kv::batch_state_view& edited, const char* arg) {
    CAPTURE(arg);
    try {
      (void)kv::gpu::batched_observe_evict(edited, kv::active_set::all(), kv::key_diff<float, kv::strided_layout>{view},
                                           nullptr, d_status.get(), nullptr);
      FAIL("accepted");
    } catch (const kv::invalid_argument& e) {
      CHECK(std::string(e.what()).find(arg) != std::string::npos);
    }
    KVTEST_CUDA(cudaDeviceSynchronize());
    CHECK(device_memory.download() == before);
  };
  kv::batch_state_view v = device;
  v.anchors.sums = nullptr;
  refused(v, "'state.anchors.sums'");
  v = device;
  v.anchors.units = nullptr;
  refused(v, "'state.anchors.units'");
  v = device;
  v.anchors.num_heads = kHeads + 1;
  refused(v, "'state.anchors.num_heads'");
}
