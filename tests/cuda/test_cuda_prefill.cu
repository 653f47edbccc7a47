// CUDA batched prefill (cuda/prefill.cuh) against the host batched prefill,
// which test_batched_prefill holds to the per-sequence policies: h2o,
// recent_window and random, every input (probs, column sums, queries + LSE,
// none) x dtype x layout x GQA group {1, 4, 8}, ragged prompts (L <= budget,
// L = capacity, several 64-row chunks and column tiles), inactive sequences
// that hold a token, and bad data injected into some calls (NaN, infinities,
// negative probabilities, overflowing columns, non-finite LSE, queries or
// keys, bad lengths, sequences that hold tokens, pages outside the pool, list
// entries outside the batch). After every call the device state (both score
// buffers included), K/V bytes, reclaimable pages and status word must equal
// the host's byte for byte. Also: workspace and state at odd addresses, head
// dims that need more than 48 KiB of shared memory or rows longer than the
// compaction's stage, segments longer than one selection tile, a CUDA graph
// replayed twice, and argument errors that throw before any launch.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/device_mirror.cuh"
#include "kvevict/batch/prefill.hpp"
#include "kvevict/batch/prefill_key_diff.hpp"
#include "kvevict/batch/prefill_key_norms.hpp"
#include "kvevict/batch/prefill_window.hpp"
#include "kvevict/cuda/kvevict_cuda.cuh"
#include "kvevict/cuda/prefill.cuh"
#include "kvevict/cuda/prefill_key_diff.cuh"
#include "kvevict/cuda/prefill_window.cuh"
#include "support/caches.hpp"
#include "support/prefill_fixtures.hpp"

namespace {

using namespace kvevict;
using kvtest::device_buffer;
using kvtest::converted;
using kvtest::draw_prefill_config;
using kvtest::draw_prompts;
using kvtest::layout_kind;
using kvtest::prefill_input;
using kvtest::prompt_batch;
using kvtest::prompt_options;
using kvtest::sequence_bytes;

template <class V>
void fill_cache(std::mt19937& rng, const V& view) {
  using T = typename V::element_type;
  for (std::int32_t s = 0; s < view.num_seqs; ++s)
    for (std::int32_t h = 0; h < view.num_heads; ++h)
      for (std::int32_t slot = 0; slot < view.capacity; ++slot)
        for (std::int32_t e = 0; e < view.head_dim; ++e) {
          view.k_row(s, h, slot)[e] = kvtest::random_value<T>(rng);
          view.v_row(s, h, slot)[e] = kvtest::random_value<T>(rng);
        }
}

void check_same_states(const batch_state_view& want, const batch_state_view& got) {
  for (std::int32_t b = 0; b < want.num_seqs(); ++b) {
    CAPTURE(b);
    CHECK(sequence_bytes(want, b) == sequence_bytes(got, b));
  }
  kvtest::check_same_state(want, got);  // the same again, with names on failure
}

/// A host state in memory of its own.
template <class Policy>
struct host_state {
  std::vector<unsigned char> memory;
  batch_state_view view;
  host_state(const policy_shape& shape, const typename policy_traits<Policy>::config_type& c)
      : memory(batch_state_bytes<Policy>(shape, c)),
        view(make_batch_state<Policy>(memory.data(), memory.size(), shape, c)) {
    init_batch_state(view);
  }
};

/// A device state carved at `offset` bytes into its memory.
template <class Policy>
struct device_state {
  std::size_t bytes;
  device_buffer<unsigned char> memory;
  batch_state_view view;
  device_state(const policy_shape& shape, const typename policy_traits<Policy>::config_type& c, std::size_t offset)
      : bytes(batch_state_bytes<Policy>(shape, c)), memory(bytes + offset),
        view(make_batch_state<Policy>(memory.get() + offset, bytes, shape, c)) {
    KVTEST_CUDA(gpu::init_batch_state(view, nullptr));
  }
};

/// The inputs in device memory, queries as Q.
template <class Q>
struct device_prompts {
  device_buffer<std::int32_t> lengths, list;
  device_buffer<std::uint8_t> flags;
  device_buffer<float> probs, sums, lse;
  device_buffer<Q> q;
  explicit device_prompts(const prompt_batch& d)
      : lengths(d.lengths), list(d.list.empty() ? std::vector<std::int32_t>{-1} : d.list), flags(d.active),
        probs(d.probs), sums(d.sums), lse(d.lse), q(converted<Q>(d.q)) {}
  active_set active(const prompt_batch& d) const {
    return d.use_list ? active_set::of_list(list.get(), std::int32_t(d.list.size())) : active_set::of_flags(flags.get());
  }
};

/// The host batched prefill of kind `kind`.
template <class Q, class V>
void prefill_host(const batch_state_view& st, const prompt_batch& d, prefill_input kind, const V& cache,
                  std::int32_t* reclaimable, std::uint64_t* status) {
  const std::int32_t B = d.B, Hq = d.Hq(), M = d.M, D = d.D;
  const prompt_lengths prompts{d.lengths.data(), M};
  const active_set active = d.active_set_of();
  switch (kind) {
    case prefill_input::probs:
      batched_prefill(st, active, prompts, batch_prefill_probs{make_tensor_view<const float>(d.probs.data(), B, Hq, M, M)},
                      cache, reclaimable, status);
      return;
    case prefill_input::sums:
      batched_prefill(st, active, prompts, batch_prefill_sums{make_tensor_view<const float>(d.sums.data(), B, Hq, M)},
                      cache, reclaimable, status);
      return;
    case prefill_input::queries: {
      const std::vector<Q> q = converted<Q>(d.q);
      batched_prefill(st, active, prompts,
                      batch_prefill_queries<Q>{make_tensor_view<const Q>(q.data(), B, Hq, M, D),
                                               make_tensor_view<const float>(d.lse.data(), B, Hq, M), d.scale, d.base},
                      cache, reclaimable, status);
      return;
    }
    case prefill_input::none: batched_prefill(st, active, prompts, cache, reclaimable, status); return;
  }
}

/// The device call of the same kind, through the two phases.
template <class Q, class V>
cudaError_t prefill_device(void* workspace, std::size_t& bytes, const batch_state_view& st, const prompt_batch& d,
                           const device_prompts<Q>& dp, prefill_input kind, const V& cache, std::int32_t* reclaimable,
                           std::uint64_t* status, cudaStream_t stream) {
  const std::int32_t B = d.B, Hq = d.Hq(), M = d.M, D = d.D;
  const prompt_lengths prompts{dp.lengths.get(), M};
  const active_set active = dp.active(d);
  switch (kind) {
    case prefill_input::probs:
      return gpu::batched_prefill(workspace, bytes, st, active, prompts,
                                  batch_prefill_probs{make_tensor_view<const float>(dp.probs.get(), B, Hq, M, M)}, cache,
                                  reclaimable, status, stream);
    case prefill_input::sums:
      return gpu::batched_prefill(workspace, bytes, st, active, prompts,
                                  batch_prefill_sums{make_tensor_view<const float>(dp.sums.get(), B, Hq, M)}, cache,
                                  reclaimable, status, stream);
    case prefill_input::queries:
      return gpu::batched_prefill(
          workspace, bytes, st, active, prompts,
          batch_prefill_queries<Q>{make_tensor_view<const Q>(dp.q.get(), B, Hq, M, D),
                                   make_tensor_view<const float>(dp.lse.get(), B, Hq, M), d.scale, d.base},
          cache, reclaimable, status, stream);
    case prefill_input::none:
      return gpu::batched_prefill(workspace, bytes, st, active, prompts, cache, reclaimable, status, stream);
  }
  return cudaErrorInvalidValue;
}

/// Asks for the workspace, allocates it (at an odd address when asked) and calls.
template <class Q, class V>
void prefill_device_eager(const batch_state_view& st, const prompt_batch& d, const device_prompts<Q>& dp,
                          prefill_input kind, const V& cache, std::int32_t* reclaimable, std::uint64_t* status,
                          bool misaligned) {
  std::size_t bytes = 0;
  KVTEST_CUDA(prefill_device<Q>(nullptr, bytes, st, d, dp, kind, cache, reclaimable, status, nullptr));
  device_buffer<unsigned char> workspace(bytes + 1);
  KVTEST_CUDA(prefill_device<Q>(workspace.get() + (misaligned ? 1 : 0), bytes, st, d, dp, kind, cache, reclaimable,
                                status, nullptr));
  KVTEST_CUDA(cudaDeviceSynchronize());
}

/// Spoils one thing of one active sequence (or the list): the host and the
/// device must then agree on the status word and on what changed.
template <class V>
void inject(std::mt19937& rng, prompt_batch& d, prefill_input kind, const V& cache, bool& not_empty_of,
            std::int32_t& victim) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<std::int32_t> active;
  for (std::int32_t b = 0; b < d.B; ++b)
    if (d.active[std::size_t(b)]) active.push_back(b);
  const std::int32_t b = active[std::size_t(pick(0, int(active.size()) - 1))];
  victim = b;
  const std::int32_t L = d.lengths[std::size_t(b)], q = pick(0, d.Hq() - 1);
  const std::int32_t i = pick(0, L - 1), p = pick(0, i);
  const float bad[4] = {std::nanf(""), INFINITY, -INFINITY, -0.5f};
  const float x = bad[pick(0, 3)];
  switch (pick(0, 9)) {
    case 0: d.lengths[std::size_t(b)] = pick(0, 1) ? 0 : d.M + pick(1, 3); return;
    case 1: not_empty_of = true; return;
    case 2:
      if constexpr (std::is_same_v<typename V::layout_type, paged_layout>) {
        auto* table = const_cast<std::int32_t*>(cache.layout.page_table);
        table[b * cache.layout.page_table_stride + pick(0, pages_for(L, cache.layout.page_size) - 1)] =
            pick(0, 1) ? -1 : cache.layout.num_pages;
        return;
      }
      break;
    case 3:
      if (d.use_list && std::int32_t(d.list.size()) < d.B) {
        d.list.push_back(d.B + pick(0, 5));  // an entry outside the batch
        return;
      }
      break;
    default: break;
  }
  switch (kind) {
    case prefill_input::probs:
      if (pick(0, 3) == 0)
        for (std::int32_t r = p; r < L; ++r) d.probs[d.at(b, q, r, p)] = 3e38f;  // the column overflows (if L - p > 1)
      else
        d.probs[d.at(b, q, i, p)] = x;
      return;
    case prefill_input::sums:
      if (pick(0, 3) == 0)
        for (std::int32_t r = 0; r < d.g; ++r) d.sums[d.row(b, (q / d.g) * d.g + r, p)] = 3e38f;  // the fold overflows
      else
        d.sums[d.row(b, q, p)] = x;
      return;
    case prefill_input::queries:
      switch (pick(0, 2)) {
        case 0: d.lse[d.row(b, q, i)] = x < 0.0f ? std::nanf("") : x; return;
        case 1: d.q[d.row(b, q, i) * d.D + std::size_t(pick(0, d.D - 1))] = x < 0.0f ? -INFINITY : x; return;
        default:
          using T = typename V::element_type;
          cache.k_row(b, q / d.g, p)[pick(0, d.D - 1)] = from_float<T>(x < 0.0f ? std::nanf("") : x);
          return;
      }
    case prefill_input::none: d.lengths[std::size_t(b)] = 0; return;
  }
}

struct totals {
  std::int64_t calls = 0, bad_calls = 0, compressed = 0;
};

template <class Policy, class T, class Q>
void run_case(std::uint32_t seed, layout_kind layout, std::int32_t group, prefill_input kind, totals& tot) {
  std::mt19937 rng(seed);
  std::int32_t budget = 0;
  const auto config = draw_prefill_config<Policy>(rng, budget);
  const std::int32_t B = std::uniform_int_distribution<int>(1, 5)(rng);
  const std::int32_t H = std::uniform_int_distribution<int>(1, 3)(rng);
  const std::int32_t D = std::uniform_int_distribution<int>(0, 1)(rng) ? 16 : 24;
  const std::int32_t page = std::uniform_int_distribution<int>(1, 9)(rng);
  const std::int32_t longest = seed % 3 == 0 ? 300 : 100;  // 300: two column tiles of 256, five chunks
  const std::int32_t cap = std::uniform_int_distribution<int>(budget + 1, std::max(budget + 1, longest))(rng);
  prompt_batch d = draw_prompts(rng, B, H, group, D, budget, cap);
  const policy_shape shape{B, H, H * group, cap};
  host_state<Policy> ref(shape, config);
  device_state<Policy> dev(shape, config, seed % 2);  // odd state addresses too
  kvtest::host_state_mirror<Policy> mirror(shape, config);
  if constexpr (std::is_same_v<Policy, random_policy>) {
    std::vector<std::uint64_t> streams(static_cast<std::size_t>(B));
    for (std::int32_t b = 0; b < B; ++b) streams[std::size_t(b)] = rng() % 2 ? std::uint64_t(b) : 500 + 3 * std::uint64_t(b) + seed;
    reset_batch_sequences(ref.view, active_set::all(), streams.data());
    const device_buffer<std::uint64_t> ds(streams);
    KVTEST_CUDA(gpu::reset_batch_sequences(dev.view, active_set::all(), ds.get(), nullptr, nullptr));
  }
  kvtest::with_cache<T>(layout, B, H, cap, D, page, [&](const auto& view) {
    fill_cache(rng, view);
    const bool bad = rng() % 4 == 0;
    bool not_empty = false;
    std::int32_t victim = -1;
    if (bad) inject(rng, d, kind, view, not_empty, victim);
    tot.bad_calls += bad;
    kvtest::device_cache dcache(view);  // after the injection: the same bytes and page table
    std::uint64_t host_status = batch_status_clear;
    device_buffer<std::uint64_t> status(std::vector<std::uint64_t>{batch_status_clear});
    // Inactive sequences (and, when injected, an active one) hold a token.
    for (std::int32_t b = 0; b < B; ++b)
      if ((!d.active[std::size_t(b)] && rng() % 2) || (not_empty && b == victim)) {
        batched_append(ref.view, active_set::of_list(&b, 1), &host_status);
        const device_buffer<std::int32_t> one(std::vector<std::int32_t>{b});
        KVTEST_CUDA(gpu::batched_append(dev.view, active_set::of_list(one.get(), 1), status.get(), nullptr));
      }
    REQUIRE(host_status == batch_status_clear);
    const device_prompts<Q> dp(d);
    std::vector<std::int32_t> want(std::size_t(B), -7);
    device_buffer<std::int32_t> got(want);
    prefill_host<Q>(ref.view, d, kind, view, want.data(), &host_status);
    prefill_device_eager<Q>(dev.view, d, dp, kind, dcache.view, got.get(), status.get(), seed % 4 == 1);
    CHECK(status.download()[0] == host_status);
    if (!bad) CHECK(host_status == batch_status_clear);
    mirror.read(dev.view);
    check_same_states(ref.view, mirror.view);
    CHECK(got.download() == want);
    CHECK(dcache.same_bytes_as(view));
    for (std::int32_t b = 0; b < B; ++b) tot.compressed += d.active[std::size_t(b)] && d.lengths[std::size_t(b)] > budget;
  });
  ++tot.calls;
}

template <class Policy>
void run_policy(const char* policy_name, std::initializer_list<prefill_input> kinds, int seeds) {
  totals tot;
  std::uint32_t seed = 1;
  const int stride = kvtest::quick_stride(5);
  for (prefill_input kind : kinds)
    for (layout_kind layout : kvtest::all_layouts)
      for (std::int32_t group : {1, 4, 8})
        for (int dtype = 0; dtype < 4; ++dtype)
          for (int i = 0; i < seeds; ++i, ++seed) {
            if (seed % stride != 0) continue;
            CAPTURE(seed);
            CAPTURE(std::string(name(kind)));
            CAPTURE(std::string(kvtest::name(layout)));
            CAPTURE(group);
            CAPTURE(dtype);
            const bool float_queries = seed % 2 == 0;
            switch (dtype) {
              case 0: run_case<Policy, float, float>(seed, layout, group, kind, tot); break;
              case 1:
                if (float_queries) run_case<Policy, kvevict::half, float>(seed, layout, group, kind, tot);
                else run_case<Policy, kvevict::half, kvevict::half>(seed, layout, group, kind, tot);
                break;
              case 2:
                if (float_queries) run_case<Policy, bfloat16, float>(seed, layout, group, kind, tot);
                else run_case<Policy, bfloat16, bfloat16>(seed, layout, group, kind, tot);
                break;
              default: run_case<Policy, fp8_e4m3, float>(seed, layout, group, kind, tot); break;  // per-head scales
            }
          }
  MESSAGE(std::string(policy_name), ": ", tot.calls, " calls (", tot.bad_calls, " with bad data), ", tot.compressed,
          " prompts compressed");
  CHECK(tot.compressed > 100 * seeds / stride);
}

}  // namespace

TEST_CASE("cuda prefill h2o equals the host backend byte for byte") {
  run_policy<h2o_policy>("h2o", {prefill_input::probs, prefill_input::sums, prefill_input::queries}, 2);
}
TEST_CASE("cuda prefill recent_window equals the host backend byte for byte") {
  run_policy<recent_window_policy>(
      "recent_window", {prefill_input::none, prefill_input::probs, prefill_input::sums, prefill_input::queries}, 1);
}
TEST_CASE("cuda prefill random equals the host backend byte for byte, request streams included") {
  run_policy<random_policy>("random",
                            {prefill_input::none, prefill_input::probs, prefill_input::sums, prefill_input::queries}, 2);
}

namespace {

/// One call on a fixed shape: host against device.
template <class Policy, class T, class Layout, class Q = float>
void run_shape(const char* what, const typename policy_traits<Policy>::config_type& config, std::int32_t budget,
               std::int32_t B, std::int32_t H, std::int32_t g, std::int32_t D, std::int32_t cap, prefill_input kind,
               std::uint32_t seed) {
  CAPTURE(std::string(what));
  std::mt19937 rng(seed);
  prompt_batch d = draw_prompts(rng, B, H, g, D, budget, cap, prompt_options{false, kind != prefill_input::sums});
  const policy_shape shape{B, H, H * g, cap};
  host_state<Policy> ref(shape, config);
  device_state<Policy> dev(shape, config, 0);
  kvtest::host_state_mirror<Policy> mirror(shape, config);
  auto run = [&](const kv_view<T, Layout>& view) {
    fill_cache(rng, view);
    kvtest::device_cache dcache(view);
    std::uint64_t host_status = batch_status_clear;
    device_buffer<std::uint64_t> status(std::vector<std::uint64_t>{batch_status_clear});
    const device_prompts<Q> dp(d);
    std::vector<std::int32_t> want(std::size_t(B), -7);
    device_buffer<std::int32_t> got(want);
    prefill_host<Q>(ref.view, d, kind, view, want.data(), &host_status);
    prefill_device_eager<Q>(dev.view, d, dp, kind, dcache.view, got.get(), status.get(), true);
    REQUIRE(host_status == batch_status_clear);
    CHECK(status.download()[0] == host_status);
    mirror.read(dev.view);
    check_same_states(ref.view, mirror.view);
    CHECK(got.download() == want);
    CHECK(dcache.same_bytes_as(view));
  };
  if constexpr (std::is_same_v<Layout, paged_layout>) {
    auto cache = make_paged_cache<T>(B, H, cap, D, 16, page_order::nhd);
    run(cache.view());
  } else {
    auto cache = make_bshd_cache<T>(B, H, cap, D);
    run(cache.view());
  }
}

}  // namespace

TEST_CASE("cuda prefill: large head dims, rows longer than the stage, segments longer than a selection tile") {
  // head_dim 256 in float: the queries kernel's tile needs more than 48 KiB of shared memory.
  run_shape<h2o_policy, float, strided_layout>("head_dim 256, float", h2o_config{20, 10}, 30, 2, 2, 2, 256, 140,
                                               prefill_input::queries, 1);
  run_shape<random_policy, float, paged_layout>("head_dim 256, float, random", random_config{30, 2, 5, 9}, 30, 2, 1,
                                                4, 256, 100, prefill_input::queries, 2);
  // A row of 2100 floats (8400 bytes): two do not fit the 16 KiB stage, rows move one slot at a time.
  run_shape<h2o_policy, float, paged_layout>("rows of 8400 bytes", h2o_config{5, 4}, 9, 2, 2, 1, 2100, 60,
                                             prefill_input::sums, 3);
  // 5000 candidates per (sequence, head): the selection's multi-block path.
  run_shape<h2o_policy, bfloat16, strided_layout>("5000-token prompts", h2o_config{700, 100}, 800, 2, 2, 2, 8, 5000,
                                                  prefill_input::sums, 4);
  run_shape<random_policy, kvevict::half, paged_layout>("5000-token prompts, random", random_config{900, 4, 50, 3},
                                                        900, 2, 2, 1, 8, 5000, prefill_input::none, 5);
  // Several 64-row chunks and two column tiles of the probabilities, GQA 8.
  run_shape<h2o_policy, kvevict::half, paged_layout>("600-token causal matrices", h2o_config{40, 20}, 60, 1, 1, 8, 16,
                                                     600, prefill_input::probs, 6);
}

TEST_CASE("cuda prefill: a captured graph replays to the host's result, twice") {
  const std::int32_t B = 3, H = 2, g = 4, D = 16, cap = 130;
  const h2o_config config{12, 8, group_reduce::max};
  std::mt19937 rng(17);
  prompt_batch d = draw_prompts(rng, B, H, g, D, 20, cap);
  const policy_shape shape{B, H, H * g, cap};
  host_state<h2o_policy> ref(shape, config);
  device_state<h2o_policy> dev(shape, config, 8);
  kvtest::host_state_mirror<h2o_policy> mirror(shape, config);
  auto cache = make_paged_cache<bfloat16>(B, H, cap, D, 8, page_order::hnd);
  fill_cache(rng, cache.view());
  kvtest::device_cache dcache(cache.view());
  const std::vector<bfloat16> k0 = cache.k_storage(), v0 = cache.v_storage();
  const device_prompts<float> dp(d);
  std::uint64_t host_status = batch_status_clear;
  std::vector<std::int32_t> want(std::size_t(B), -7);
  prefill_host<float>(ref.view, d, prefill_input::queries, cache.view(), want.data(), &host_status);
  REQUIRE(host_status == batch_status_clear);

  device_buffer<std::uint64_t> status(std::vector<std::uint64_t>{batch_status_clear});
  device_buffer<std::int32_t> got(std::vector<std::int32_t>(std::size_t(B), -7));
  cudaStream_t stream;
  KVTEST_CUDA(cudaStreamCreate(&stream));
  std::size_t bytes = 0;
  KVTEST_CUDA(prefill_device<float>(nullptr, bytes, dev.view, d, dp, prefill_input::queries, dcache.view, got.get(),
                                    status.get(), stream));
  device_buffer<unsigned char> workspace(bytes + 3);
  cudaGraph_t graph;
  KVTEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  KVTEST_CUDA(prefill_device<float>(workspace.get() + 3, bytes, dev.view, d, dp, prefill_input::queries, dcache.view,
                                    got.get(), status.get(), stream));
  KVTEST_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  KVTEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    CAPTURE(replay);
    if (replay > 0) {  // a fresh start: empty sequences, the prompt rows back in place
      KVTEST_CUDA(gpu::reset_batch_sequences(dev.view, active_set::all(), nullptr, nullptr, stream));
      KVTEST_CUDA(cudaMemcpyAsync(dcache.k.get(), k0.data(), k0.size() * sizeof(bfloat16), cudaMemcpyHostToDevice, stream));
      KVTEST_CUDA(cudaMemcpyAsync(dcache.v.get(), v0.data(), v0.size() * sizeof(bfloat16), cudaMemcpyHostToDevice, stream));
    }
    KVTEST_CUDA(cudaGraphLaunch(exec, stream));
    KVTEST_CUDA(cudaStreamSynchronize(stream));
    CHECK(status.download()[0] == batch_status_clear);
    mirror.read(dev.view);
    check_same_states(ref.view, mirror.view);
    CHECK(got.download() == want);
    CHECK(dcache.same_bytes_as(cache.view()));
  }
  KVTEST_CUDA(cudaGraphExecDestroy(exec));
  KVTEST_CUDA(cudaGraphDestroy(graph));
  KVTEST_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("cuda prefill: arguments throw before any launch; exact_greedy is refused") {
  const std::int32_t B = 2, H = 2, cap = 12;
  const policy_shape shape{B, H, 4, cap};
  device_state<h2o_policy> dev(shape, h2o_config{2, 3}, 0);
  kvtest::host_state_mirror<h2o_policy> before(shape, h2o_config{2, 3}), after(shape, h2o_config{2, 3});
  before.read(dev.view);
  auto host_cache = make_bhsd_cache<float>(B, H, cap, 4);
  kvtest::device_cache dcache(host_cache.view());
  const device_buffer<std::int32_t> lengths(std::vector<std::int32_t>{10, 12});
  const device_buffer<float> sums(std::vector<float>(std::size_t(B) * 4 * cap, 0.5f));
  device_buffer<std::uint64_t> status(std::vector<std::uint64_t>{batch_status_clear});
  const batch_prefill_sums in{make_tensor_view<const float>(sums.get(), B, 4, cap)};
  const prompt_lengths prompts{lengths.get(), cap};
  std::size_t bytes = 0;
  CHECK_THROWS_AS(gpu::batched_prefill(nullptr, bytes, dev.view, active_set::all(), prompts, in, dcache.view, nullptr,
                                       nullptr, nullptr),
                  invalid_argument);
  CHECK_THROWS_AS(gpu::batched_prefill(nullptr, bytes, dev.view, active_set::all(), prompt_lengths{lengths.get(), cap + 1},
                                       in, dcache.view, nullptr, status.get(), nullptr),
                  out_of_range);
  CHECK_THROWS_AS(gpu::batched_prefill(nullptr, bytes, dev.view, active_set::all(), prompts,
                                       batch_prefill_sums{make_tensor_view<const float>(sums.get(), B, 4, cap - 1)},
                                       dcache.view, nullptr, status.get(), nullptr),
                  invalid_argument);
  CHECK_THROWS_AS(gpu::batched_prefill(nullptr, bytes, dev.view, active_set::all(), prompts, dcache.view, nullptr,
                                       status.get(), nullptr),
                  invalid_argument);  // h2o needs scores
  KVTEST_CUDA(gpu::batched_prefill(nullptr, bytes, dev.view, active_set::all(), prompts, in, dcache.view, nullptr,
                                   status.get(), nullptr));
  device_buffer<unsigned char> workspace(bytes);
  std::size_t short_bytes = bytes - 1;
  CHECK_THROWS_AS(gpu::batched_prefill(workspace.get(), short_bytes, dev.view, active_set::all(), prompts, in,
                                       dcache.view, nullptr, status.get(), nullptr),
                  invalid_argument);
  {  // A queries tile the device cannot hold (float, head_dim 1024: over 300 KiB of shared memory per block)
     // is refused before the call's memset and prepare kernel run.
    const std::int32_t wide_dim = 1024;
    auto wide = make_bhsd_cache<float>(B, H, cap, wide_dim);
    kvtest::device_cache dwide(wide.view());
    const device_buffer<float> q(std::vector<float>(std::size_t(B) * 4 * cap * wide_dim, 0.01f));
    const device_buffer<float> lse(std::vector<float>(std::size_t(B) * 4 * cap, 1.0f));
    const batch_prefill_queries<float> wide_in{make_tensor_view<const float>(q.get(), B, 4, cap, wide_dim),
                                               make_tensor_view<const float>(lse.get(), B, 4, cap), 0.125f};
    std::size_t wide_bytes = 0;
    CHECK_THROWS_AS(gpu::batched_prefill(nullptr, wide_bytes, dev.view, active_set::all(), prompts, wide_in,
                                         dwide.view, nullptr, status.get(), nullptr),
                    invalid_argument);
  }
  KVTEST_CUDA(cudaDeviceSynchronize());
  after.read(dev.view);
  for (std::int32_t b = 0; b < B; ++b) CHECK(sequence_bytes(before.view, b) == sequence_bytes(after.view, b));
  CHECK(dcache.same_bytes_as(host_cache.view()));
  CHECK(status.download()[0] == batch_status_clear);

  exact_greedy_config c;
  c.budget = 3;
  const history_extent history{6, 4};
  const std::size_t eg_bytes = batch_state_bytes<exact_greedy_policy>(policy_shape{1, 1, 1, 6}, c, history);
  device_buffer<unsigned char> eg_memory(eg_bytes);
  const batch_state_view eg =
      make_batch_state<exact_greedy_policy>(eg_memory.get(), eg_bytes, policy_shape{1, 1, 1, 6}, c, history);
  auto eg_cache = make_bhsd_cache<float>(1, 1, 6, 4);
  kvtest::device_cache eg_dcache(eg_cache.view());
  CHECK_THROWS_AS(gpu::batched_prefill(nullptr, bytes, eg, active_set::all(), prompt_lengths{lengths.get(), 6},
                                       batch_prefill_sums{make_tensor_view<const float>(sums.get(), 1, 1, 6)},
                                       eg_dcache.view, nullptr, status.get(), nullptr),
                  invalid_argument);
}

TEST_CASE("cuda prefill, slot table only, equals the host's") {
  std::mt19937 rng(29);
  const std::int32_t B = 4, H = 2, g = 2, cap = 200;
  const random_config config{12, 2, 3, 77};
  prompt_batch d = draw_prompts(rng, B, H, g, 8, 12, cap, prompt_options{false, false});
  const policy_shape shape{B, H, H * g, cap};
  host_state<random_policy> ref(shape, config);
  device_state<random_policy> dev(shape, config, 5);
  kvtest::host_state_mirror<random_policy> mirror(shape, config);
  const device_prompts<float> dp(d);
  std::uint64_t host_status = batch_status_clear;
  batched_prefill(ref.view, d.active_set_of(), prompt_lengths{d.lengths.data(), d.M},
                  batch_prefill_sums{make_tensor_view<const float>(d.sums.data(), B, H * g, d.M)}, &host_status);
  device_buffer<std::uint64_t> status(std::vector<std::uint64_t>{batch_status_clear});
  const prompt_lengths prompts{dp.lengths.get(), d.M};
  const batch_prefill_sums in{make_tensor_view<const float>(dp.sums.get(), B, H * g, d.M)};
  std::size_t bytes = 0;
  KVTEST_CUDA(gpu::batched_prefill(nullptr, bytes, dev.view, dp.active(d), prompts, in, status.get(), nullptr));
  device_buffer<unsigned char> workspace(bytes);
  KVTEST_CUDA(gpu::batched_prefill(workspace.get(), bytes, dev.view, dp.active(d), prompts, in, status.get(), nullptr));
  KVTEST_CUDA(cudaDeviceSynchronize());
  CHECK(status.download()[0] == host_status);
  mirror.read(dev.view);
  check_same_states(ref.view, mirror.view);
}

namespace {

/// `poison` as an element of T. fp8 encoding saturates an infinity to the
/// largest finite value (as __NV_SATFINITE), so e5m2's infinity is its code.
template <class T>
T poison_code(float poison) {
  if constexpr (std::is_same_v<T, fp8_e5m2>) {
    if (std::isinf(poison)) return fp8_e5m2::from_bits(poison > 0 ? 0x7C : 0xFC);
  }
  return from_float<T>(poison);
}

/// A prefill scored by the prompt keys alone (Input: key norms or KeyDiff)
/// on CUDA and on the host, from seed on: bhsd and paged_hnd x every dtype,
/// GQA 1 and 4, rows beyond a selection tile in the second half; the last
/// call plants `poison` in a prompt key of sequence 0 (its heads refused,
/// non_finite_kv, the rest compressed).
template <template <class, class> class Input, class Config>
void run_key_scored_prefill(std::uint32_t seed, Config config_for, float poison) {
  const int stride = kvtest::quick_stride(1);
  for (const layout_kind layout : {layout_kind::bhsd, layout_kind::paged_hnd})
    for (const std::int32_t g : {1, 4})
      for (int dtype = 0; dtype < 4; ++dtype, ++seed) {
        if (seed % stride != 0) continue;
        const auto run = [&](auto tag) {
          using T = decltype(tag);
          CAPTURE(seed);
          CAPTURE(std::string(kvtest::name(layout)));
          CAPTURE(g);
          std::mt19937 rng(seed);
          const std::int32_t B = 3, H = 2, budget = 6 + std::int32_t(rng() % 40);
          const std::int32_t cap = seed % 2 ? budget + 1 + std::int32_t(rng() % 30) : 5000;
          const h2o_config config = config_for(budget);
          prompt_batch d = draw_prompts(rng, B, H, g, 16, budget, cap, prompt_options{false, false});
          const policy_shape shape{B, H, H * g, cap};
          host_state<h2o_policy> ref(shape, config);
          device_state<h2o_policy> dev(shape, config, 3);
          kvtest::host_state_mirror<h2o_policy> mirror(shape, config);
          const device_prompts<float> dp(d);
          kvtest::with_cache<T>(layout, B, H, cap, 16, 16, [&](const auto& view) {
            using L = std::decay_t<decltype(view.layout)>;
            for (int call = 0; call < 2; ++call) {
              fill_cache(rng, view);
              if (call == 1) view.k_row(0, 1, 0)[2] = poison_code<T>(poison);
              kvtest::device_cache dcache(view);
              std::uint64_t host_status = batch_status_clear;
              std::vector<std::int32_t> want_pages(std::size_t(B), -5);
              init_batch_state(ref.view);
              KVTEST_CUDA(gpu::init_batch_state(dev.view, nullptr));
              batched_prefill(ref.view, d.active_set_of(), d.prompts(), Input<T, L>{view}, want_pages.data(),
                              &host_status);
              device_buffer<std::uint64_t> status(std::vector<std::uint64_t>{batch_status_clear});
              device_buffer<std::int32_t> pages(std::vector<std::int32_t>(std::size_t(B), -5));
              const prompt_lengths prompts{dp.lengths.get(), d.M};
              std::size_t bytes = 0;
              KVTEST_CUDA(gpu::batched_prefill(nullptr, bytes, dev.view, dp.active(d), prompts,
                                               Input<T, L>{dcache.view}, pages.get(), status.get(), nullptr));
              device_buffer<unsigned char> workspace(bytes);
              KVTEST_CUDA(gpu::batched_prefill(workspace.get(), bytes, dev.view, dp.active(d), prompts,
                                               Input<T, L>{dcache.view}, pages.get(), status.get(), nullptr));
              KVTEST_CUDA(cudaDeviceSynchronize());
              CHECK(status.download()[0] == host_status);
              if (call == 1 && d.active[0] && d.lengths[0] > 0)
                CHECK(batch_status::unpack(host_status).code == batch_code::non_finite_kv);
              CHECK(pages.download() == want_pages);
              mirror.read(dev.view);
              check_same_states(ref.view, mirror.view);
              CHECK(dcache.same_bytes_as(view));
            }
          });
        };
        if (dtype == 0) run(float{});
        else if (dtype == 1) run(kvevict::half{});
        else if (dtype == 2) run(kvevict::bfloat16{});
        else run(kvevict::fp8_e5m2{});  // e5m2 has infinities; per-head scales
      }
}

}  // namespace

TEST_CASE("cuda prefill by key norms equals the host's: state, K/V bytes, pages, a NaN key") {
  run_key_scored_prefill<key_norms>(40, [](std::int32_t budget) { return key_norm_config(budget - 3, 2, 1); },
                                    std::nanf(""));
}

TEST_CASE("cuda prefill by KeyDiff equals the host's: state, K/V bytes, pages, an infinite key") {
  run_key_scored_prefill<key_diff>(
      80, [](std::int32_t budget) { return h2o_config{budget - 3, 2, group_reduce::sum, 1.0f, 1}; },
      std::numeric_limits<float>::infinity());
}


namespace {

/// SnapKV's window inputs of a drawn prompt batch: probabilities, logits,
/// LSE and queries of the last w rows, [B][Hq][w][M] (queries [..][D]).
struct window_batch {
  std::vector<float> probs, logits, lse, q;
};

window_batch draw_window(std::mt19937& rng, const prompt_batch& d, std::int32_t w) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const std::size_t rows = std::size_t(d.B) * d.Hq() * w;
  window_batch x;
  x.probs.resize(rows * d.M);
  x.logits.resize(rows * d.M);
  for (std::size_t i = 0; i < x.probs.size(); ++i) {
    x.probs[i] = u(rng) < 0.15 ? 0.25f : static_cast<float>(std::pow(u(rng), 4.0));
    x.logits[i] = static_cast<float>(8.0 * u(rng) - 4.0);
  }
  x.lse.resize(rows);
  for (float& v : x.lse) v = static_cast<float>(1.0 + 3.0 * u(rng));
  x.q.resize(rows * d.D);
  for (float& v : x.q) v = static_cast<float>(std::int32_t(u(rng) * 32.0)) / 16.0f - 1.0f;
  return x;
}

}  // namespace

TEST_CASE("cuda SnapKV prefill equals the host's for probs, logits + LSE and queries + LSE") {
  // bhsd and paged_hnd x every dtype x GQA 1 and 4 x the three inputs;
  // windows up to 40 rows (query rows staged in several passes), every
  // pooling width; prompts shorter than the window among the draws
  // (bad_length); the second call plants a NaN in sequence 0's input.
  std::uint32_t seed = 60;
  const int stride = kvtest::quick_stride(1);
  for (const layout_kind layout : {layout_kind::bhsd, layout_kind::paged_hnd})
    for (const std::int32_t g : {1, 4})
      for (int dtype = 0; dtype < 4; ++dtype)
        for (int input = 0; input < 3; ++input, ++seed) {
          if (seed % stride != 0) continue;
          const auto run = [&](auto tag) {
            using T = decltype(tag);
            CAPTURE(seed);
            CAPTURE(std::string(kvtest::name(layout)));
            CAPTURE(g);
            CAPTURE(input);
            std::mt19937 rng(seed);
            snap_window snap;
            snap.window = 1 + std::int32_t(rng() % 40);
            snap.pool_width = 1 + 2 * std::int32_t(rng() % 4);
            snap.pooling = rng() % 2 ? snap_pooling::max : snap_pooling::mean;
            CAPTURE(snap.window);
            const std::int32_t B = 3, H = 2, D = 16, budget = snap.window + 4 + std::int32_t(rng() % 40);
            const std::int32_t cap = seed % 2 ? budget + 1 + std::int32_t(rng() % 30) : 3000;
            h2o_config config{budget - 3, 2, seed % 3 ? group_reduce::sum : group_reduce::max, 1.0f, 1};
            if (seed % 4 == 0) config.decay = 0.5f;
            prompt_batch d = draw_prompts(rng, B, H, g, D, budget, cap, prompt_options{false, false});
            d.M = std::max(d.M, snap.window);  // a max_length below the window is an argument error (tested on the host)
            const std::int32_t w = snap.window, Hq = d.Hq();
            const policy_shape shape{B, H, Hq, cap};
            host_state<h2o_policy> ref(shape, config);
            device_state<h2o_policy> dev(shape, config, 3);
            kvtest::host_state_mirror<h2o_policy> mirror(shape, config);
            const device_prompts<float> dp(d);
            kvtest::with_cache<T>(layout, B, H, cap, D, 16, [&](const auto& view) {
              for (int call = 0; call < 2; ++call) {
                window_batch x = draw_window(rng, d, w);
                if (call == 1) {  // sequence 0, query head Hq - 1, row w - 1, column 0
                  const std::size_t row = std::size_t(Hq - 1) * w + std::size_t(w - 1);
                  x.probs[row * d.M] = x.logits[row * d.M] = std::nanf("");
                  x.q[row * D] = std::nanf("");
                }
                fill_cache(rng, view);
                kvtest::device_cache dcache(view);
                const device_buffer<float> probs(x.probs), logits(x.logits), lse(x.lse), q(x.q);
                std::uint64_t host_status = batch_status_clear;
                std::vector<std::int32_t> want_pages(std::size_t(B), -5);
                init_batch_state(ref.view);
                KVTEST_CUDA(gpu::init_batch_state(dev.view, nullptr));
                device_buffer<std::uint64_t> status(std::vector<std::uint64_t>{batch_status_clear});
                device_buffer<std::int32_t> pages(std::vector<std::int32_t>(std::size_t(B), -5));
                const prompt_lengths prompts{dp.lengths.get(), d.M};
                const auto both = [&](const auto& host_in, const auto& device_in, const auto& device_cache) {
                  batched_prefill(ref.view, d.active_set_of(), d.prompts(), host_in, view, want_pages.data(), &host_status);
                  std::size_t bytes = 0;
                  KVTEST_CUDA(gpu::batched_prefill(nullptr, bytes, dev.view, dp.active(d), prompts, device_in,
                                                   device_cache, pages.get(), status.get(), nullptr));
                  device_buffer<unsigned char> workspace(bytes);
                  KVTEST_CUDA(gpu::batched_prefill(workspace.get(), bytes, dev.view, dp.active(d), prompts, device_in,
                                                   device_cache, pages.get(), status.get(), nullptr));
                  KVTEST_CUDA(cudaDeviceSynchronize());  // before the workspace is freed, so an error is seen
                };
                const auto host_lse = make_tensor_view<const float>(x.lse.data(), B, Hq, w);
                const auto device_lse = make_tensor_view<const float>(lse.get(), B, Hq, w);
                if (input == 0)
                  both(batch_window_probs{make_tensor_view<const float>(x.probs.data(), B, Hq, w, d.M), snap},
                       batch_window_probs{make_tensor_view<const float>(probs.get(), B, Hq, w, d.M), snap}, dcache.view);
                if (input == 1)
                  both(batch_window_logits{make_tensor_view<const float>(x.logits.data(), B, Hq, w, d.M), host_lse,
                                           d.scale, d.base, snap},
                       batch_window_logits{make_tensor_view<const float>(logits.get(), B, Hq, w, d.M), device_lse,
                                           d.scale, d.base, snap},
                       dcache.view);
                if (input == 2)
                  both(batch_window_queries<float>{make_tensor_view<const float>(x.q.data(), B, Hq, w, D), host_lse,
                                                   d.scale, d.base, snap},
                       batch_window_queries<float>{make_tensor_view<const float>(q.get(), B, Hq, w, D), device_lse,
                                                   d.scale, d.base, snap},
                       dcache.view);
                KVTEST_CUDA(cudaDeviceSynchronize());
                CHECK(status.download()[0] == host_status);
                if (call == 1 && d.active[0] && d.lengths[0] >= w)
                  CHECK(batch_status::unpack(host_status).sequence == 0);
                CHECK(pages.download() == want_pages);
                mirror.read(dev.view);
                check_same_states(ref.view, mirror.view);
                CHECK(dcache.same_bytes_as(view));
              }
            });
          };
          if (dtype == 0) run(float{});
          else if (dtype == 1) run(kvevict::half{});
          else if (dtype == 2) run(kvevict::bfloat16{});
          else run(kvevict::fp8_e4m3{});
        }
}
