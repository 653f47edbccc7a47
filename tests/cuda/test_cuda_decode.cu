// CUDA decode step (append + observe + evict) against the host backend, which
// test_batched_host holds to the per-sequence policies: h2o, recent_window
// and random, every input kind x dtype x layout x GQA group {1, 4, 8}, ragged
// batches with idle sequences and injected bad inputs. After every step the
// device state, victims, status word and K/V bytes must equal the host's bit
// for bit. Also: capacities up to 128K slots (and sizes that are not
// multiples of the block), all-equal scores, state carved from misaligned
// caller memory through the raw launchers, and a CUDA graph replayed against
// eager launches. Compiling this file instantiates every decode kernel for
// every dtype x layout x policy.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/cuda/kvevict_cuda.cuh"
#include "support/batch_streams.hpp"
#include "support/caches.hpp"
#include "support/h2o_draws.hpp"
#include "support/state_invariants.hpp"
#include "cuda/device_mirror.cuh"

namespace {

using namespace kvevict;
using kvtest::device_buffer;
using kvtest::input_kind;
using kvtest::layout_kind;

template <class Policy>
typename policy_traits<Policy>::config_type draw_config(std::mt19937& rng, std::int32_t& budget) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  if constexpr (std::is_same_v<Policy, h2o_policy>) {
    const h2o_config c = kvtest::draw_h2o_config(pick, 6, 6);
    budget = static_cast<std::int32_t>(c.budget());
    return c;
  } else if constexpr (std::is_same_v<Policy, recent_window_policy>) {
    recent_window_config c{pick(0, 3), pick(1, 8)};
    budget = c.sinks + c.window;
    return c;
  } else {
    random_config c{pick(2, 12), 0, 0, std::uint64_t(rng())};
    c.sinks = pick(0, std::min(2, c.budget - 1));
    c.recent = pick(0, c.budget - 1 - c.sinks);
    budget = c.budget;
    return c;
  }
}

/// The batched calls of the CUDA backend over caller memory at an odd
/// offset, through the raw launchers (the owning class aligns its own).
template <class Policy>
class raw_device_policy {
 public:
  raw_device_policy(const policy_shape& shape, const typename policy_traits<Policy>::config_type& c)
      : bytes_(batch_state_bytes<Policy>(shape, c)), memory_(bytes_ + 1), status_(1) {
    state_ = make_batch_state<Policy>(memory_.get() + 1, bytes_, shape, c);
    KVTEST_CUDA(gpu::init_batch_state(state_, nullptr));
    KVTEST_CUDA(cudaMemset(status_.get(), 0xFF, 8));
  }
  const batch_state_view& state() const { return state_; }
  template <class T, class Layout>
  void append(const kv_view<T, Layout>& cache, const batch_rows<T>& k, const batch_rows<T>& v, const active_set& a) {
    KVTEST_CUDA(gpu::batched_append(state_, a, cache, k, v, status_.get(), nullptr));
  }
  /// Every later observe + evict splits each row into chunks of `tiles`
  /// tiles (the launchers choose by the SM count; small rows take one).
  void force_split(std::int32_t tiles) {
    split_ = split_by_tiles(state_.capacity(), tiles);
    forced_ = true;
  }
  template <class Input>
  void observe_evict(const Input& in, const active_set& a, std::int32_t* victims) {
    if (forced_)
      KVTEST_CUDA(gpu::detail::observe_evict_split(state_, a, in, victims, status_.get(), nullptr, split_));
    else
      KVTEST_CUDA(gpu::batched_observe_evict(state_, a, in, victims, status_.get(), nullptr));
  }
  template <class Input>
  void step(const Input& in, const active_set& a, std::int32_t* victims) {
    if (forced_) KVTEST_CUDA(gpu::detail::step_split(state_, a, in, victims, status_.get(), nullptr, split_));
    else KVTEST_CUDA(gpu::batched_step(state_, a, in, victims, status_.get(), nullptr));
  }
  template <class Q, class T, class Layout>
  void observe_evict(const batch_queries<Q>& in, const kv_view<T, Layout>& cache, const active_set& a,
                     std::int32_t* victims) {
    if (forced_)
      KVTEST_CUDA(gpu::detail::observe_evict_split(state_, a, in, cache, victims, status_.get(), nullptr, split_));
    else
      KVTEST_CUDA(gpu::batched_observe_evict(state_, a, in, cache, victims, status_.get(), nullptr));
  }
  void reset(const active_set& a, const std::uint64_t* streams) {
    KVTEST_CUDA(gpu::reset_batch_sequences(state_, a, streams, status_.get(), nullptr));
  }
  std::uint64_t status_word() const { return status_.download()[0]; }
  void clear_status() { KVTEST_CUDA(cudaMemset(status_.get(), 0xFF, 8)); }

 private:
  std::size_t bytes_;
  device_buffer<unsigned char> memory_;
  device_buffer<std::uint64_t> status_;
  batch_state_view state_;
  row_split split_;
  bool forced_ = false;
};

/// The owning CUDA policy with the raw policy's test interface.
template <class Policy>
struct owning_device_policy : batched_policy<Policy, device::cuda> {
  using batched_policy<Policy, device::cuda>::batched_policy;
  void clear_status() {
    try {
      this->check();
    } catch (const error&) {
    }
  }
};

/// One step's inputs in device memory.
template <class T>
struct device_step {
  device_buffer<std::int32_t> list;
  device_buffer<std::uint8_t> flags;
  device_buffer<T> k_new, v_new;
  device_buffer<float> probs, logits, increments, lse, q;

  explicit device_step(const kvtest::batch_step<T>& st)
      : list(st.list.empty() ? std::vector<std::int32_t>{-1} : st.list), flags(st.flags), k_new(st.k_new),
        v_new(st.v_new), probs(st.probs), logits(st.logits), increments(st.increments), lse(st.lse), q(st.q) {}
  active_set active(const kvtest::batch_step<T>& st) const {
    return st.use_list ? active_set::of_list(list.get(), std::int32_t(st.list.size())) : active_set::of_flags(flags.get());
  }
};

/// One step (Step) or observe + evict of kind `kind` from probabilities,
/// per-head increments or logits, host or device buffers.
template <bool Step, class P>
void feed(P& p, input_kind kind, const kvtest::batch_dims& dm, const float* probs, const float* logits,
          const float* increments, const float* lse, float scale, const active_set& active, std::int32_t* victims) {
  const std::int32_t B = dm.seqs, Hq = dm.q_heads(), H = dm.heads, W = dm.width();
  auto call = [&](const auto& in) {
    if constexpr (Step) p.step(in, active, victims);
    else p.observe_evict(in, active, victims);
  };
  if (kind == input_kind::probs) call(batch_probs{make_tensor_view<const float>(probs, B, Hq, W)});
  else if (kind == input_kind::head_scores) call(batch_head_scores{make_tensor_view<const float>(increments, B, H, W)});
  else
    call(batch_logits{make_tensor_view<const float>(logits, B, Hq, W), make_tensor_view<const float>(lse, B, Hq),
                      scale});
}

/// Feeds one observe + evict of kind `kind` to a policy p, from host or
/// device buffers.
template <class P, class View>
void observe(P& p, input_kind kind, const kvtest::batch_dims& dm, const float* probs, const float* logits,
             const float* increments, const float* lse, const float* q, float scale, const View& cache,
             const active_set& active, std::int32_t* victims) {
  if (kind != input_kind::queries)
    return feed<false>(p, kind, dm, probs, logits, increments, lse, scale, active, victims);
  // an fp8 cache's keys are code x its per-head scales (support/caches.hpp)
  p.observe_evict(batch_queries<float>{make_tensor_view<const float>(q, dm.seqs, dm.q_heads(), dm.head_dim),
                                       make_tensor_view<const float>(lse, dm.seqs, dm.q_heads()), scale},
                  cache, active, victims);
}

/// Spoils one input of one active (b, h) of the step: NaN, inf or a
/// negative probability, in the input kind that is used.
template <class T>
void inject_bad_input(std::mt19937& rng, kvtest::batch_step<T>& st, const kvtest::batch_dims& dm, input_kind kind) {
  std::vector<std::int32_t> active;
  for (std::int32_t b = 0; b < dm.seqs; ++b)
    if (st.active(b)) active.push_back(b);
  if (active.empty()) return;
  const std::int32_t b = active[rng() % active.size()], q = std::int32_t(rng() % std::uint32_t(dm.q_heads()));
  const std::int32_t s = std::int32_t(rng() % std::uint32_t(dm.width()));
  const float bad[3] = {std::nanf(""), INFINITY, -0.5f};
  const float x = bad[rng() % 3];
  switch (kind) {
    case input_kind::probs: st.probs[(std::size_t(b) * dm.q_heads() + q) * dm.width() + s] = x; break;
    case input_kind::head_scores:  // increments may be negative: NaN or an infinity
      st.increments[(std::size_t(b) * dm.heads + q / dm.group) * dm.width() + s] = x < 0.0f ? -INFINITY : x;
      break;
    case input_kind::logits:
      if (rng() % 2) st.logits[(std::size_t(b) * dm.q_heads() + q) * dm.width() + s] = x;
      else st.lse[std::size_t(b) * dm.q_heads() + q] = std::nanf("");
      break;
    case input_kind::queries: st.q[(std::size_t(b) * dm.q_heads() + q) * dm.head_dim] = std::nanf(""); break;
  }
}

struct totals {
  std::int64_t streams = 0, steps = 0, evictions = 0, bad_steps = 0;
};

template <class Policy, class T, class DevicePolicy>
void run_stream(std::uint32_t seed, layout_kind layout, std::int32_t group, input_kind kind, bool equal_probs,
                totals& tot) {
  std::mt19937 rng(seed);
  std::int32_t budget = 0;
  const auto config = draw_config<Policy>(rng, budget);
  kvtest::batch_dims dm;
  dm.seqs = std::uniform_int_distribution<int>(1, 5)(rng);
  dm.heads = std::uniform_int_distribution<int>(1, 3)(rng);
  dm.group = group;
  dm.head_dim = std::uniform_int_distribution<int>(0, 1)(rng) ? 16 : 24;
  dm.capacity = budget + 1 + std::uniform_int_distribution<int>(0, 2)(rng);
  const std::int32_t page = std::uniform_int_distribution<int>(1, 5)(rng);
  const std::int32_t steps = std::uniform_int_distribution<int>(40, 100)(rng);
  const policy_shape shape{dm.seqs, dm.heads, dm.q_heads(), dm.capacity};
  batched_policy<Policy> ref(shape, config);
  DevicePolicy dev(shape, config);
  kvtest::host_state_mirror<Policy> mirror(shape, config);
  const std::int32_t B = dm.seqs, H = dm.heads, D = dm.head_dim;
  kvtest::with_cache<T>(layout, B, H, dm.capacity, D, page, [&](const auto& view) {
    kvtest::device_cache dcache(view);
    device_buffer<std::int32_t> victims(std::size_t(B) * H);
    for (std::int32_t step = 0; step < steps; ++step) {
      CAPTURE(step);
      kvtest::batch_step<T> st = kvtest::draw_step<T>(rng, dm, 0.25);
      if (equal_probs) std::fill(st.probs.begin(), st.probs.end(), 0.125f);
      const bool bad = rng() % 20 == 0;
      if (bad) inject_bad_input(rng, st, dm, kind);
      tot.bad_steps += bad;
      if constexpr (std::is_same_v<Policy, random_policy>) {
        if (step == steps / 2) {  // a new request with its own stream on the first sequence
          const std::int32_t zero = 0;
          const std::uint64_t stream = 77 + seed;
          ref.reset(active_set::of_list(&zero, 1), &stream);
          const device_buffer<std::int32_t> dl(std::vector<std::int32_t>{0});
          const device_buffer<std::uint64_t> ds(std::vector<std::uint64_t>{stream});
          dev.reset(active_set::of_list(dl.get(), 1), ds.get());
        }
      }
      const device_step<T> ds(st);
      ref.append(view, batch_rows<T>{make_tensor_view<const T>(st.k_new.data(), B, H, D)},
                 batch_rows<T>{make_tensor_view<const T>(st.v_new.data(), B, H, D)}, st.active_set());
      dev.append(dcache.view, batch_rows<T>{make_tensor_view<const T>(ds.k_new.get(), B, H, D)},
                 batch_rows<T>{make_tensor_view<const T>(ds.v_new.get(), B, H, D)}, ds.active(st));
      std::vector<std::int32_t> want(std::size_t(B) * H, -7);
      KVTEST_CUDA(cudaMemcpy(victims.get(), want.data(), want.size() * 4, cudaMemcpyHostToDevice));
      observe(ref, kind, dm, st.probs.data(), st.logits.data(), st.increments.data(), st.lse.data(), st.q.data(),
              st.scale, view, st.active_set(), want.data());
      observe(dev, kind, dm, ds.probs.get(), ds.logits.get(), ds.increments.get(), ds.lse.get(), ds.q.get(), st.scale,
              dcache.view, ds.active(st), victims.get());
      CHECK(victims.download() == want);
      const std::uint64_t want_status = ref.status_word(), got_status = dev.status_word();
      CHECK(got_status == want_status);
      if (!bad) REQUIRE(want_status == batch_status_clear);
      mirror.read(dev.state());
      kvtest::check_same_state(ref.state(), mirror.view);
      if (want_status != batch_status_clear) {
        // The spoiled (b, h) was left as it was: its sequence starts a new
        // request on both devices, so the stream goes on with a clean state.
        try {
          ref.check();
        } catch (const error&) {
        }
        dev.clear_status();
        const std::int32_t b = batch_status::unpack(want_status).sequence;
        const device_buffer<std::int32_t> db(std::vector<std::int32_t>{b});
        ref.reset(active_set::of_list(&b, 1));
        dev.reset(active_set::of_list(db.get(), 1), nullptr);
      }
      mirror.read(dev.state());
      kvtest::check_same_state(ref.state(), mirror.view);
      CHECK(dcache.same_bytes_as(view));
      for (std::int32_t x : want) tot.evictions += x >= 0;
      ++tot.steps;
    }
  });
  ++tot.streams;
}

template <class Policy>
void run_policy(const char* name, int seeds_per_combo) {
  totals tot;
  std::uint32_t seed = 1;
  const int stride = kvtest::quick_stride(6);
  for (input_kind kind : kvtest::all_inputs)
    for (layout_kind layout : kvtest::all_layouts)
      for (std::int32_t group : {1, 4, 8})
        for (int i = 0; i < seeds_per_combo; ++i, ++seed) {
          if (seed % stride != 0) continue;
          CAPTURE(seed);
          CAPTURE(std::string(kvtest::name(kind)));
          CAPTURE(std::string(kvtest::name(layout)));
          CAPTURE(group);
          const bool equal = seed % 7 == 0;
          const bool raw = seed % 5 == 0;  // misaligned caller memory through the raw launchers
          auto run = [&](auto tag) {
            using T = decltype(tag);
            if (raw) run_stream<Policy, T, raw_device_policy<Policy>>(seed, layout, group, kind, equal, tot);
            else run_stream<Policy, T, owning_device_policy<Policy>>(seed, layout, group, kind, equal, tot);
          };
          // The dtype cycles over the seeds that run, so quick mode (the sanitizer
          // runs) covers half, bfloat16 and fp8 too.
          switch ((seed / stride) % 5) {
            case 0: run(float{}); break;
            case 1: run(kvevict::half{}); break;
            case 2: run(kvevict::bfloat16{}); break;
            case 3: run(kvevict::fp8_e4m3{}); break;
            default: run(kvevict::fp8_e5m2{}); break;
          }
        }
  MESSAGE(std::string(name), ": ", tot.streams, " streams, ", tot.steps, " steps (", tot.bad_steps,
          " with a bad input), ", tot.evictions, " evictions compared");
  CHECK(tot.evictions > 2000 / stride);
}

}  // namespace

TEST_CASE("cuda h2o equals the host backend bit for bit") { run_policy<h2o_policy>("h2o", 2); }
TEST_CASE("cuda recent_window equals the host backend bit for bit") {
  run_policy<recent_window_policy>("recent_window", 1);
}
TEST_CASE("cuda random equals the host backend bit for bit, request streams included") {
  run_policy<random_policy>("random", 2);
}

namespace {

/// A full state with `count` = budget tokens at shuffled positions below
/// `length` and random scores with ties, written on the host, copied to the
/// device.
template <class Policy>
void fill_state(const batch_state_view& st, std::mt19937& rng, std::int32_t length, std::int32_t count = -1) {
  if (count < 0) count = st.rule.budget;
  for (std::int32_t b = 0; b < st.num_seqs(); ++b) {
    st.slots.lengths[b] = length;
    for (std::int32_t h = 0; h < st.num_heads(); ++h) {
      std::vector<std::int32_t> pos(static_cast<std::size_t>(length));
      for (std::int32_t p = 0; p < length; ++p) pos[std::size_t(p)] = p;
      std::shuffle(pos.begin(), pos.end() - 1, rng);  // keep the newest: nothing breaks the recent window
      std::swap(pos[0], pos.back());
      std::int32_t* slots = st.slots.positions_of(b, h);
      for (std::int32_t s = 0; s < st.capacity(); ++s) {
        slots[s] = s < count ? pos[std::size_t(s)] : -1;
        st.scores_of(b, h)[s] = s < count ? float(rng() % 64) / 8.0f : 0.0f;
      }
      st.slots.counts[st.head_index(b, h)] = count;
      kvevict::detail::set_next_slot(st, b, h, count, length);
    }
  }
}

template <class Policy>
void run_large(std::int32_t capacity, std::int32_t seqs, std::int32_t heads,
               typename policy_traits<Policy>::config_type config) {
  CAPTURE(capacity);
  std::mt19937 rng{std::uint32_t(capacity)};
  const policy_shape shape{seqs, heads, heads * 2, capacity};
  batched_policy<Policy> ref(shape, config);
  batched_policy<Policy, device::cuda> dev(shape, config);
  fill_state<Policy>(ref.state(), rng, capacity + 5);
  KVTEST_CUDA(gpu::copy_batch_state(dev.state(), ref.state(), cudaMemcpyHostToDevice, nullptr));
  kvtest::host_state_mirror<Policy> mirror(shape, config);
  const std::size_t n = std::size_t(seqs) * heads * 2 * capacity;
  for (int step = 0; step < 4; ++step) {
    std::vector<float> probs(n);
    for (float& x : probs) x = float(rng() % 16) / 64.0f;  // many exact ties
    const device_buffer<float> dprobs(probs);
    ref.append();
    dev.append();
    ref.observe_evict(batch_probs{make_tensor_view<const float>(probs.data(), seqs, heads * 2, capacity)});
    dev.observe_evict(batch_probs{make_tensor_view<const float>(dprobs.get(), seqs, heads * 2, capacity)});
    REQUIRE(dev.status_word() == batch_status_clear);
    mirror.read(dev.state());
    kvtest::check_same_state(ref.state(), mirror.view);
  }
}

}  // namespace

namespace {

/// Long rows split over several blocks, for every input kind: rows of 4K to
/// 6.6K slots start full (fill_state), each observe + evict runs with one or
/// two tiles per chunk, and the last step spoils one input at a random slot,
/// so a problem may sit in any chunk; state, victims, status and K/V bytes
/// must equal the host's.
template <class Policy, class T>
void run_split(std::uint32_t seed, input_kind kind, layout_kind layout) {
  CAPTURE(seed);
  CAPTURE(std::string(kvtest::name(kind)));
  CAPTURE(std::string(kvtest::name(layout)));
  std::mt19937 rng(seed);
  kvtest::batch_dims dm;
  dm.seqs = 2;
  dm.heads = 2;
  dm.group = kind == input_kind::head_scores ? 1 : 2;
  dm.head_dim = 16;
  dm.capacity = 2 * decode_tuning::tile + 1 + std::int32_t(rng() % 2500);
  const std::int32_t cap = dm.capacity, B = dm.seqs, H = dm.heads, D = dm.head_dim;
  typename policy_traits<Policy>::config_type config{};
  if constexpr (std::is_same_v<Policy, h2o_policy>) config = h2o_config{cap / 2, cap - 1 - cap / 2};
  else if constexpr (std::is_same_v<Policy, recent_window_policy>) config = recent_window_config{4, cap - 5};
  else config = random_config{cap - 1, 2, 8, seed};
  const policy_shape shape{B, H, dm.q_heads(), cap};
  batched_policy<Policy> ref(shape, config);
  raw_device_policy<Policy> dev(shape, config);
  dev.force_split(1 + std::int32_t(seed % 2));
  fill_state<Policy>(ref.state(), rng, cap + 5);
  KVTEST_CUDA(gpu::copy_batch_state(dev.state(), ref.state(), cudaMemcpyHostToDevice, nullptr));
  kvtest::host_state_mirror<Policy> mirror(shape, config);
  kvtest::with_cache<T>(layout, B, H, cap, D, 16, [&](const auto& view) {
    for (std::int32_t b = 0; b < B; ++b)
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t s = 0; s < cap; ++s)
          if (row_is_mapped(view, b, s))
            for (std::int32_t d = 0; d < D; ++d) {
              view.k_row(b, h, s)[d] = kvtest::random_value<T>(rng);
              view.v_row(b, h, s)[d] = kvtest::random_value<T>(rng);
            }
    kvtest::device_cache dcache(view);
    device_buffer<std::int32_t> victims(std::size_t(B) * H);
    for (std::int32_t step = 0; step < 4; ++step) {
      CAPTURE(step);
      kvtest::batch_step<T> st = kvtest::draw_step<T>(rng, dm, 0.0);
      if (step == 3) inject_bad_input(rng, st, dm, kind);
      const device_step<T> ds(st);
      ref.append(view, batch_rows<T>{make_tensor_view<const T>(st.k_new.data(), B, H, D)},
                 batch_rows<T>{make_tensor_view<const T>(st.v_new.data(), B, H, D)}, st.active_set());
      dev.append(dcache.view, batch_rows<T>{make_tensor_view<const T>(ds.k_new.get(), B, H, D)},
                 batch_rows<T>{make_tensor_view<const T>(ds.v_new.get(), B, H, D)}, ds.active(st));
      std::vector<std::int32_t> want(std::size_t(B) * H, -7);
      KVTEST_CUDA(cudaMemcpy(victims.get(), want.data(), want.size() * 4, cudaMemcpyHostToDevice));
      observe(ref, kind, dm, st.probs.data(), st.logits.data(), st.increments.data(), st.lse.data(), st.q.data(),
              st.scale, view, st.active_set(), want.data());
      observe(dev, kind, dm, ds.probs.get(), ds.logits.get(), ds.increments.get(), ds.lse.get(), ds.q.get(), st.scale,
              dcache.view, ds.active(st), victims.get());
      CHECK(victims.download() == want);
      CHECK(dev.status_word() == ref.status_word());
      if (step < 3) REQUIRE(ref.status_word() == batch_status_clear);
      mirror.read(dev.state());
      kvtest::check_same_state(ref.state(), mirror.view);
      CHECK(dcache.same_bytes_as(view));
    }
  });
}

/// The key-scored inputs (key_norm_config): key norms, or KeyDiff (a state
/// sized with key_diff_extent, whose running anchors must match too): host
/// and CUDA from the same keys, short rows filled from empty or long rows
/// (several blocks each) filled at the start (KeyDiff's anchors then start
/// stale: the first step counts every key); at step `bad` a NaN goes into
/// an occupied key of (0, 0) in both caches, a non_finite_kv that leaves
/// that head unchanged (an fp8 cache on odd seeds: head 0's K scale
/// becomes 0, a bad_kv_scale, read from device memory).
template <class T, bool KeyDiff>
void run_key_scores(std::uint32_t seed, layout_kind layout, std::int32_t group, bool long_rows) {
  CAPTURE(KeyDiff);
  CAPTURE(seed);
  CAPTURE(std::string(kvtest::name(layout)));
  CAPTURE(group);
  CAPTURE(long_rows);
  std::mt19937 rng(seed);
  kvtest::batch_dims dm;
  dm.seqs = 3;
  dm.heads = 2;
  dm.group = group;
  dm.head_dim = 16;
  dm.capacity = long_rows ? 2 * decode_tuning::tile + 1 + std::int32_t(rng() % 2500) : 6 + std::int32_t(rng() % 10);
  const std::int32_t cap = dm.capacity, B = dm.seqs, H = dm.heads, D = dm.head_dim;
  const std::int32_t sinks = std::int32_t(rng() % 3), recent = 1 + std::int32_t(rng() % 3);
  const h2o_config config = key_norm_config(cap - 1 - sinks - recent, recent, sinks);
  const policy_shape shape{B, H, dm.q_heads(), cap};
  const history_extent extent = KeyDiff ? key_diff_extent(dm.head_dim) : history_extent{};
  batched_policy<h2o_policy> ref(shape, config, extent);
  batched_policy<h2o_policy, device::cuda> dev(shape, config, extent);
  if (long_rows) {
    fill_state<h2o_policy>(ref.state(), rng, cap + 5);
    KVTEST_CUDA(gpu::copy_batch_state(dev.state(), ref.state(), cudaMemcpyHostToDevice, nullptr));
  }
  kvtest::host_state_mirror<h2o_policy> mirror(shape, config, extent);
  const std::int32_t steps = long_rows ? 4 : 24, bad = steps - 2;
  kvtest::with_cache<T>(layout, B, H, cap, D, 16, [&](const auto& view) {
    using L = std::decay_t<decltype(view.layout)>;
    for (std::int32_t b = 0; b < B; ++b)
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t s = 0; s < cap; ++s)
          if (row_is_mapped(view, b, s))
            for (std::int32_t d = 0; d < D; ++d) {
              // even seeds: keys of -1, 0 and 1, whose norms tie often
              view.k_row(b, h, s)[d] = seed % 2 ? kvtest::random_value<T>(rng) : from_float<T>(float(int(rng() % 3) - 1));
              view.v_row(b, h, s)[d] = kvtest::random_value<T>(rng);
            }
    kvtest::device_cache dcache(view);
    device_buffer<std::int32_t> victims(std::size_t(B) * H);
    std::int64_t evictions = 0;
    for (std::int32_t step = 0; step < steps; ++step) {
      CAPTURE(step);
      kvtest::batch_step<T> st = kvtest::draw_step<T>(rng, dm, 0.25);
      const device_step<T> ds(st);
      ref.append(view, batch_rows<T>{make_tensor_view<const T>(st.k_new.data(), B, H, D)},
                 batch_rows<T>{make_tensor_view<const T>(st.v_new.data(), B, H, D)}, st.active_set());
      dev.append(dcache.view, batch_rows<T>{make_tensor_view<const T>(ds.k_new.get(), B, H, D)},
                 batch_rows<T>{make_tensor_view<const T>(ds.v_new.get(), B, H, D)}, ds.active(st));
      if (step == bad && !(is_fp8_v<T> && seed % 2 == 1)) {  // an occupied slot of (0, 0), in both caches
        const std::int32_t s = std::int32_t(rng() % std::uint32_t(std::max(1, ref.state().slots.counts[0])));
        view.k_row(0, 0, s)[3] = from_float<T>(std::nanf(""));
        // The same element offset in the device copy (its k_row would read
        // the device page table on the host).
        const std::ptrdiff_t at = view.k_row(0, 0, s) + 3 - view.k;
        KVTEST_CUDA(cudaMemcpy(dcache.view.k + at, view.k + at, sizeof(T), cudaMemcpyHostToDevice));
      }
      std::vector<std::int32_t> want(std::size_t(B) * H, -7);
      KVTEST_CUDA(cudaMemcpy(victims.get(), want.data(), want.size() * 4, cudaMemcpyHostToDevice));
      using Input = std::conditional_t<KeyDiff, key_diff<T, L>, key_norms<T, L>>;
      auto host_view = view;
      auto device_view = dcache.view;
      const bool bad_scale = is_fp8_v<T> && seed % 2 == 1 && step == bad;
      const std::vector<float> zero_scales(std::size_t(H), 0.0f);
      const device_buffer<float> zero_on_device(zero_scales);
      if (bad_scale) {  // head 0's K scale is 0 (per-head scales: support/caches.hpp)
        host_view.scales.k = zero_scales.data();
        device_view.scales.k = zero_on_device.get();
      }
      ref.observe_evict(Input{host_view}, st.active_set(), want.data());
      dev.observe_evict(Input{device_view}, ds.active(st), victims.get());
      CHECK(victims.download() == want);
      CHECK(dev.status_word() == ref.status_word());
      if (step == bad && st.active(0))
        CHECK(batch_status::unpack(ref.status_word()).code ==
              (bad_scale ? batch_code::bad_kv_scale : batch_code::non_finite_kv));
      for (std::int32_t x : want) evictions += x >= 0;
      mirror.read(dev.state());
      kvtest::check_same_state(ref.state(), mirror.view);
      CHECK(dcache.same_bytes_as(view));
      if (step == bad) break;  // (0, 0) now waits for a retry: the stream ends
      ref.check();
      dev.check();
    }
    CHECK(evictions > 0);
  });
}

}  // namespace

TEST_CASE("cuda split rows: several blocks per row, every input kind and policy, a bad input in any chunk") {
  std::uint32_t seed = 1;
  const int stride = kvtest::quick_stride(3);
  for (input_kind kind : kvtest::all_inputs)
    for (layout_kind layout : {layout_kind::bhsd, layout_kind::paged_nhd})
      for (int policy = 0; policy < 3; ++policy, ++seed) {
        if (seed % stride != 0) continue;
        auto run = [&](auto tag) {
          using T = decltype(tag);
          if (policy == 0) run_split<h2o_policy, T>(seed, kind, layout);
          else if (policy == 1) run_split<recent_window_policy, T>(seed, kind, layout);
          else run_split<random_policy, T>(seed, kind, layout);
        };
        switch ((seed / stride) % 3) {
          case 0: run(float{}); break;
          case 1: run(kvevict::half{}); break;
          default: run(kvevict::bfloat16{}); break;
        }
      }
}

TEST_CASE("cuda key_norms equals the host backend bit for bit: short and split rows, every dtype, a NaN key or scale") {
  // One instantiation per dtype x layout kind (strided, paged): bhsd and
  // paged_hnd; GQA 1 and 4 (the group plays no part in the score).
  std::uint32_t seed = 1;
  const int stride = kvtest::quick_stride(1);
  for (const layout_kind layout : {layout_kind::bhsd, layout_kind::paged_hnd})
    for (const std::int32_t group : {1, 4})
      for (const bool long_rows : {false, true})
        for (int dtype = 0; dtype < 4; ++dtype, ++seed) {
          if (seed % stride != 0) continue;
          if (dtype == 0) run_key_scores<float, false>(seed, layout, group, long_rows);
          else if (dtype == 1) run_key_scores<kvevict::half, false>(seed, layout, group, long_rows);
          else if (dtype == 2) run_key_scores<kvevict::bfloat16, false>(seed, layout, group, long_rows);
          else run_key_scores<kvevict::fp8_e4m3, false>(seed, layout, group, long_rows);
        }
}

TEST_CASE("cuda KeyDiff decode equals the host backend bit for bit: anchors, split rows, a bad key or scale") {
  std::uint32_t seed = 101;
  const int stride = kvtest::quick_stride(1);
  for (const layout_kind layout : {layout_kind::bhsd, layout_kind::paged_hnd})
    for (const std::int32_t group : {1, 4})
      for (const bool long_rows : {false, true})
        for (int dtype = 0; dtype < 4; ++dtype, ++seed) {
          if (seed % stride != 0) continue;
          if (dtype == 0) run_key_scores<float, true>(seed, layout, group, long_rows);
          else if (dtype == 1) run_key_scores<kvevict::half, true>(seed, layout, group, long_rows);
          else if (dtype == 2) run_key_scores<kvevict::bfloat16, true>(seed, layout, group, long_rows);
          else run_key_scores<kvevict::fp8_e4m3, true>(seed, layout, group, long_rows);
        }
}

TEST_CASE("cuda: capacities from 2 to 128K slots, including sizes that are not multiples of the block") {
  const std::int32_t caps[] = {2, 3, 255, 256, 257, 1000, 4097, 32768, 100003, 131072};
  const int stride = kvtest::quick_stride(1);  // quick mode: the first, the last, one in `stride` between
  for (std::size_t i = 0; i < std::size(caps); ++i) {
    if (i % std::size_t(stride) != 0 && i + 1 != std::size(caps)) continue;
    const std::int32_t cap = caps[i];
    CAPTURE(cap);
    run_large<h2o_policy>(cap, 2, 2, h2o_config{cap / 2, cap - 1 - cap / 2});
    run_large<recent_window_policy>(cap, 1, 2, recent_window_config{cap > 8 ? 4 : 0, cap - 1 - (cap > 8 ? 4 : 0)});
    run_large<random_policy>(cap, 2, 1, random_config{cap - 1, 0, cap > 4 ? 1 : 0, 5});
  }
}

TEST_CASE("cuda: captured graphs of append + observe + evict (two nodes) and of the step (one) replay to the eager result") {
  const std::int32_t B = 4, H = 2, Hq = 8, cap = 33;
  const policy_shape shape{B, H, Hq, cap};
  const h2o_config config{16, 16};
  batched_policy<h2o_policy, device::cuda> eager(shape, config), graphed(shape, config), one(shape, config);
  std::mt19937 rng(3);
  device_buffer<float> probs(std::size_t(B) * Hq * cap);
  const auto view = make_tensor_view<const float>(probs.get(), B, Hq, cap);
  cudaStream_t stream;
  KVTEST_CUDA(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  KVTEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  graphed.append(active_set::all(), stream);
  graphed.observe_evict(batch_probs{view}, active_set::all(), nullptr, stream);
  KVTEST_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  KVTEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  // The one-launch step, captured too: one graph node a step, against two.
  cudaGraph_t one_graph;
  KVTEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  one.step(batch_probs{view}, active_set::all(), nullptr, stream);
  KVTEST_CUDA(cudaStreamEndCapture(stream, &one_graph));
  std::size_t nodes = 0, one_nodes = 0;
  KVTEST_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
  KVTEST_CUDA(cudaGraphGetNodes(one_graph, nullptr, &one_nodes));
  CHECK(nodes == 2);
  CHECK(one_nodes == 1);
  cudaGraphExec_t one_exec;
  KVTEST_CUDA(cudaGraphInstantiate(&one_exec, one_graph, 0));
  kvtest::host_state_mirror<h2o_policy> a(shape, config), b(shape, config), c(shape, config);
  for (int step = 0; step < 100; ++step) {
    std::vector<float> p(probs.size());
    for (float& x : p) x = float(rng() % 100) / 128.0f;
    KVTEST_CUDA(cudaMemcpyAsync(probs.get(), p.data(), p.size() * 4, cudaMemcpyHostToDevice, stream));
    KVTEST_CUDA(cudaStreamSynchronize(stream));  // p is a stack buffer
    KVTEST_CUDA(cudaGraphLaunch(exec, stream));
    KVTEST_CUDA(cudaGraphLaunch(one_exec, stream));
    eager.append(active_set::all(), stream);
    eager.observe_evict(batch_probs{view}, active_set::all(), nullptr, stream);
  }
  KVTEST_CUDA(cudaStreamSynchronize(stream));
  CHECK(graphed.status_word(stream) == batch_status_clear);
  a.read(eager.state());
  b.read(graphed.state());
  kvtest::check_same_state(a.view, b.view);
  CHECK(one.status_word(stream) == batch_status_clear);
  c.read(one.state());
  kvtest::check_same_state(a.view, c.view);
  CHECK(a.view.slots.lengths[0] == 100);
  KVTEST_CUDA(cudaGraphExecDestroy(exec));
  KVTEST_CUDA(cudaGraphDestroy(graph));
  KVTEST_CUDA(cudaGraphExecDestroy(one_exec));
  KVTEST_CUDA(cudaGraphDestroy(one_graph));
  KVTEST_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("cuda: list entries outside the batch and heads without a free slot are reported like the host does") {
  const policy_shape shape{3, 1, 1, 4};
  batched_policy<h2o_policy> ref(shape, h2o_config{1, 2});
  batched_policy<h2o_policy, device::cuda> dev(shape, h2o_config{1, 2});
  const std::vector<std::int32_t> list = {2, 9, 0};
  const device_buffer<std::int32_t> dlist(list);
  ref.append(active_set::of_list(list.data(), 3));
  dev.append(active_set::of_list(dlist.get(), 3));
  CHECK(dev.status_word() == ref.status_word());
  const batch_status bad = batch_status::unpack(dev.status_word());
  CHECK(bad.code == batch_code::bad_sequence);
  CHECK(bad.entry == 1);  // the list position
  CHECK_THROWS_AS(dev.check(), out_of_range);
  CHECK_THROWS_AS(ref.check(), out_of_range);
  for (int i = 0; i < 4; ++i) {  // the fourth finds no free slot: evict never ran
    ref.append(active_set::of_list(list.data(), 1));
    dev.append(active_set::of_list(dlist.get(), 1));
  }
  CHECK(dev.status_word() == ref.status_word());
  CHECK(batch_status::unpack(dev.status_word()).code == batch_code::no_free_slot);
  kvtest::host_state_mirror<h2o_policy> mirror(shape, h2o_config{1, 2});
  mirror.read(dev.state());
  kvtest::check_same_state(ref.state(), mirror.view);
  CHECK(mirror.view.slots.lengths[2] == 4);
  CHECK(mirror.view.slots.lengths[0] == 1);
  CHECK_THROWS_AS(dev.check(), state_error);
}

TEST_CASE("cuda: a sequence named twice in the list steps for no entry; a retry set skips heads that stepped") {
  // Repeats: every batched call of both devices leaves sequence 1 alone,
  // steps the others, and reports the second entry's position.
  const policy_shape shape{3, 2, 4, 9};
  const h2o_config config{4, 4};
  batched_policy<h2o_policy> ref(shape, config);
  batched_policy<h2o_policy, device::cuda> dev(shape, config);
  kvtest::host_state_mirror<h2o_policy> mirror(shape, config);
  const std::vector<std::int32_t> list = {1, 0, 1};
  const device_buffer<std::int32_t> dlist(list);
  const std::vector<float> probs(std::size_t(3) * 4 * 9, 0.125f);
  const device_buffer<float> dprobs(probs);
  const auto host_in = batch_probs{make_tensor_view<const float>(probs.data(), 3, 4, 9)};
  const auto dev_in = batch_probs{make_tensor_view<const float>(dprobs.get(), 3, 4, 9)};
  for (int step = 0; step < 12; ++step) {
    ref.append(active_set::of_list(list.data(), 3));
    dev.append(active_set::of_list(dlist.get(), 3));
    ref.observe_evict(host_in, active_set::of_list(list.data(), 3));
    dev.observe_evict(dev_in, active_set::of_list(dlist.get(), 3));
  }
  CHECK(dev.status_word() == ref.status_word());
  const batch_status repeat = batch_status::unpack(dev.status_word());
  CHECK(repeat.code == batch_code::repeated_sequence);
  CHECK(repeat.sequence == 1);
  mirror.read(dev.state());
  kvtest::check_same_state(ref.state(), mirror.view);
  CHECK(mirror.view.slots.lengths[1] == 0);   // never stepped
  CHECK(mirror.view.slots.lengths[0] == 12);  // stepped every time
  CHECK_THROWS_AS(dev.check(), invalid_argument);
  CHECK_THROWS_AS(ref.check(), invalid_argument);

  // Retry: a bad probability refuses one head; the retry with corrected
  // input steps only the heads still waiting and ends with a clear status.
  ref.append();
  dev.append();
  std::vector<float> bad = probs;
  bad[(std::size_t(0) * 4 + 3) * 9 + 4] = std::nanf("");  // sequence 0 (all 9 slots occupied), query head 3: KV head 1
  const device_buffer<float> dbad(bad);
  ref.observe_evict(batch_probs{make_tensor_view<const float>(bad.data(), 3, 4, 9)});
  dev.observe_evict(batch_probs{make_tensor_view<const float>(dbad.get(), 3, 4, 9)});
  CHECK(dev.status_word() == ref.status_word());
  CHECK(batch_status::unpack(dev.status_word()).code == batch_code::nan_input);
  CHECK_THROWS_AS(ref.check(), non_finite_error);
  CHECK_THROWS_AS(dev.check(), non_finite_error);
  ref.observe_evict(host_in, active_set::all().as_retry());
  dev.observe_evict(dev_in, active_set::all().as_retry());
  CHECK(ref.status_word() == batch_status_clear);
  CHECK(dev.status_word() == batch_status_clear);
  mirror.read(dev.state());
  kvtest::check_same_state(ref.state(), mirror.view);
  CHECK_THROWS_AS(dev.append(active_set::all().as_retry()), invalid_argument);  // only observe + evict takes one
}

TEST_CASE("cuda fork equals the host's: a beam permutation with KeyDiff anchors, random's streams, bad entries") {
  // h2o by KeyDiff (anchors) and random (streams), 10 steps on both devices,
  // then the same forks: 0, 3 and 4 become copies of 2, 2 of 0.
  constexpr std::int32_t B = 5, H = 2, Hq = 4, C = 9, D = 8;
  const policy_shape shape{B, H, Hq, C};
  const std::vector<std::int32_t> destinations = {0, 2, 3, 4}, sources = {2, 0, 2, 2};
  const device_buffer<std::int32_t> ddest(destinations), dsrc(sources);
  std::mt19937 rng(17);
  auto cache = make_bhsd_cache<float>(B, H, C, D);
  kvtest::device_cache<float, strided_layout> dcache(cache.view());
  const auto steps = [&](auto& ref, auto& dev, auto observe) {
    for (int step = 0; step < 10; ++step) {
      std::vector<float> k(std::size_t(B) * H * D), v(k.size());
      for (float& x : k) x = kvtest::random_value<float>(rng);
      for (float& x : v) x = kvtest::random_value<float>(rng);
      const device_buffer<float> dk(k), dv(v);
      ref.append(cache.view(), batch_rows<float>{make_tensor_view<const float>(k.data(), B, H, D)},
                 batch_rows<float>{make_tensor_view<const float>(v.data(), B, H, D)});
      dev.append(dcache.view, batch_rows<float>{make_tensor_view<const float>(dk.get(), B, H, D)},
                 batch_rows<float>{make_tensor_view<const float>(dv.get(), B, H, D)});
      observe(ref, dev);
    }
  };
  SUBCASE("h2o by KeyDiff") {
    const h2o_config config = key_norm_config(4, 1, 1);
    batched_policy<h2o_policy> ref(shape, config, key_diff_extent(D));
    batched_policy<h2o_policy, device::cuda> dev(shape, config, key_diff_extent(D));
    steps(ref, dev, [&](auto& r, auto& d) {
      r.observe_evict(key_diff<float, strided_layout>{cache.view()});
      d.observe_evict(key_diff<float, strided_layout>{dcache.view});
    });
    ref.fork(active_set::of_list(destinations.data(), 4), sources.data());
    dev.fork(active_set::of_list(ddest.get(), 4), dsrc.get());
    CHECK(dev.status_word() == batch_status_clear);
    kvtest::host_state_mirror<h2o_policy> mirror(shape, config, key_diff_extent(D));
    mirror.read(dev.state());
    kvtest::check_same_state(ref.state(), mirror.view);
    // Bad entries: destination 1 named twice (neither forks), 3's source
    // outside the batch; the others fork, the lowest offence is reported.
    const std::vector<std::int32_t> bad_dest = {1, 3, 1, 4}, bad_src = {0, 7, 2, 0};
    const device_buffer<std::int32_t> dbd(bad_dest), dbs(bad_src);
    dev.fork(active_set::of_list(dbd.get(), 4), dbs.get());
    const batch_status s = batch_status::unpack(dev.status_word());
    CHECK(s.code == batch_code::repeated_sequence);
    CHECK(s.sequence == 1);
    CHECK_THROWS_AS(dev.check(), invalid_argument);
    const std::int32_t good_dest = 4, good_src = 0;
    ref.fork(active_set::of_list(&good_dest, 1), &good_src);
    mirror.read(dev.state());
    kvtest::check_same_state(ref.state(), mirror.view);
    const std::vector<std::int32_t> src_only = {7};
    const device_buffer<std::int32_t> dso(src_only), dd3(std::vector<std::int32_t>{3});
    dev.fork(active_set::of_list(dd3.get(), 1), dso.get());
    const batch_status s2 = batch_status::unpack(dev.status_word());
    CHECK(s2.code == batch_code::bad_fork_source);
    CHECK(s2.sequence == 3);
    CHECK(s2.index == 7);
    CHECK_THROWS_AS(dev.check(), out_of_range);
  }
  SUBCASE("random, with streams and by default") {
    const random_config config{5, 1, 1, 99};
    batched_policy<random_policy> ref(shape, config);
    batched_policy<random_policy, device::cuda> dev(shape, config);
    const std::vector<float> probs(std::size_t(B) * Hq * C, 0.125f);
    const device_buffer<float> dprobs(probs);
    steps(ref, dev, [&](auto& r, auto& d) {
      r.observe_evict(batch_probs{make_tensor_view<const float>(probs.data(), B, Hq, C)});
      d.observe_evict(batch_probs{make_tensor_view<const float>(dprobs.get(), B, Hq, C)});
    });
    const std::vector<std::uint64_t> streams = {40, 41, 42, 43};
    const device_buffer<std::uint64_t> dstreams(streams);
    ref.fork(active_set::of_list(destinations.data(), 4), sources.data(), streams.data());
    dev.fork(active_set::of_list(ddest.get(), 4), dsrc.get(), dstreams.get());
    const std::vector<std::uint8_t> flags = {0, 1, 0, 0, 1};
    const std::vector<std::int32_t> by_seq = {-9, 4, -9, -9, 1};  // 1 and 4 swap; unflagged entries are not read
    const device_buffer<std::uint8_t> dflags(flags);
    const device_buffer<std::int32_t> dby(by_seq);
    ref.fork(active_set::of_flags(flags.data()), by_seq.data());
    dev.fork(active_set::of_flags(dflags.get()), dby.get());
    steps(ref, dev, [&](auto& r, auto& d) {
      r.observe_evict(batch_probs{make_tensor_view<const float>(probs.data(), B, Hq, C)});
      d.observe_evict(batch_probs{make_tensor_view<const float>(dprobs.get(), B, Hq, C)});
    });
    CHECK(dev.status_word() == batch_status_clear);
    kvtest::host_state_mirror<random_policy> mirror(shape, config);
    mirror.read(dev.state());
    kvtest::check_same_state(ref.state(), mirror.view);
    CHECK(mirror.view.streams[1] == 1);
    CHECK(mirror.view.streams[2] == 41);
    // Across states: the batch doubled, 2k and 2k + 1 copies of k.
    const policy_shape grown{2 * B, H, Hq, C};
    batched_policy<random_policy> ref2(grown, config);
    batched_policy<random_policy, device::cuda> dev2(grown, config);
    std::vector<std::int32_t> twice(2 * B);
    for (std::int32_t j = 0; j < 2 * B; ++j) twice[std::size_t(j)] = j / 2;
    const device_buffer<std::int32_t> dtwice(twice);
    batched_fork(ref.state(), ref2.state(), active_set::all(), twice.data());
    std::size_t bytes = 0;
    KVTEST_CUDA(gpu::batched_fork(nullptr, bytes, dev.state(), dev2.state(), active_set::all(), dtwice.get(), nullptr,
                                  dev2.status_device(), nullptr));
    device_buffer<unsigned char> workspace(bytes);
    KVTEST_CUDA(gpu::batched_fork(workspace.get(), bytes, dev.state(), dev2.state(), active_set::all(), dtwice.get(),
                                  nullptr, dev2.status_device(), nullptr));
    CHECK(dev2.status_word() == batch_status_clear);
    kvtest::host_state_mirror<random_policy> mirror2(grown, config);
    mirror2.read(dev2.state());
    kvtest::check_same_state(ref2.state(), mirror2.view);
  }
  CHECK(dcache.same_bytes_as(cache.view()));
}

TEST_CASE("cuda: a tensor-parallel shard (first_kv_head) draws random's victims as the host shard does") {
  // test_tensor_parallel holds host shards to the unsharded layer; here the
  // CUDA shard's decode and prefill draws follow first_kv_head as the host's.
  constexpr std::int32_t B = 3, H = 2, Hq = 4, C = 12, D = 8;
  const policy_shape shape{B, H, Hq, C, 6};
  const random_config config{5, 1, 1, 1234};
  batched_policy<random_policy> ref(shape, config);
  batched_policy<random_policy, device::cuda> dev(shape, config);
  std::mt19937 rng(5);
  auto cache = make_bhsd_cache<float>(B, H, C, D);
  for (std::int32_t b = 0; b < B; ++b)
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t s = 0; s < C; ++s)
        for (std::int32_t d = 0; d < D; ++d) cache.view().k_row(b, h, s)[d] = kvtest::random_value<float>(rng);
  kvtest::device_cache<float, strided_layout> dcache(cache.view());
  const std::int32_t prompts[B] = {12, 7, 3};
  const device_buffer<std::int32_t> dprompts(std::vector<std::int32_t>(prompts, prompts + B));
  std::uint64_t status = batch_status_clear;
  batched_prefill(ref.state(), active_set::all(), prompt_lengths{prompts, C}, cache.view(), nullptr, &status);
  REQUIRE(status == batch_status_clear);
  std::size_t bytes = 0;
  const prompt_lengths dev_prompts{dprompts.get(), C};
  KVTEST_CUDA(gpu::batched_prefill(nullptr, bytes, dev.state(), active_set::all(), dev_prompts, dcache.view, nullptr,
                                   dev.status_device(), nullptr));
  device_buffer<unsigned char> workspace(bytes);
  KVTEST_CUDA(gpu::batched_prefill(workspace.get(), bytes, dev.state(), active_set::all(), dev_prompts, dcache.view,
                                   nullptr, dev.status_device(), nullptr));
  const std::vector<float> probs(std::size_t(B) * Hq * C, 0.25f);
  const device_buffer<float> dprobs(probs);
  for (int step = 0; step < 12; ++step) {
    ref.append();
    dev.append();
    ref.observe_evict(batch_probs{make_tensor_view<const float>(probs.data(), B, Hq, C)});
    dev.observe_evict(batch_probs{make_tensor_view<const float>(dprobs.get(), B, Hq, C)});
  }
  CHECK(ref.status_word() == batch_status_clear);
  CHECK(dev.status_word() == batch_status_clear);
  kvtest::host_state_mirror<random_policy> mirror(shape, config);
  mirror.read(dev.state());
  kvtest::check_same_state(ref.state(), mirror.view);
  CHECK(dcache.same_bytes_as(cache.view()));
}

namespace {

template <class Policy>
void clear_host_status(batched_policy<Policy>& p) {
  try {
    p.check();
  } catch (const error&) {
  }
}

/// Host batched_step against gpu::batched_step over many steps: short rows
/// filled from empty (`heads` 70: two mark words a sequence), or long rows
/// (several blocks each, so the appended slot may sit in any chunk) filled
/// at the start, full or just below a chunk's end so that the step's count
/// crosses into the next chunk; bad inputs leave heads full, whose
/// sequences the next steps refuse whole until a retry of the waiting heads
/// (on both, now and then) catches them up. State (row marks included),
/// victims and status equal after every step. Returns the sequences refused.
template <class Policy>
std::int64_t run_one_launch(std::uint32_t seed, input_kind kind, bool long_rows, std::int32_t heads = 0) {
  CAPTURE(seed);
  CAPTURE(std::string(kvtest::name(kind)));
  CAPTURE(long_rows);
  std::mt19937 rng(seed);
  std::int32_t budget = 0;
  auto config = draw_config<Policy>(rng, budget);
  kvtest::batch_dims dm;
  dm.seqs = 1 + std::int32_t(rng() % 4);
  dm.heads = heads > 0 ? heads : 1 + std::int32_t(rng() % 3);
  dm.group = kind == input_kind::head_scores ? 1 : 1 + std::int32_t(rng() % 2);
  dm.capacity = budget + 1 + std::int32_t(rng() % 3);
  if (long_rows) {
    dm.capacity = 2 * decode_tuning::tile + 1 + std::int32_t(rng() % 2500);
    const std::int32_t cap = dm.capacity;
    if constexpr (std::is_same_v<Policy, h2o_policy>) config = h2o_config{cap / 2, cap - 1 - cap / 2};
    else if constexpr (std::is_same_v<Policy, recent_window_policy>) config = recent_window_config{4, cap - 5};
    else config = random_config{cap - 1, 2, 8, seed};
  }
  const std::int32_t B = dm.seqs, H = dm.heads;
  const policy_shape shape{B, H, dm.q_heads(), dm.capacity};
  batched_policy<Policy> ref(shape, config);
  raw_device_policy<Policy> dev(shape, config);
  if (long_rows) {
    const std::int32_t tiles = 1 + std::int32_t(seed % 2);
    dev.force_split(tiles);
    // Full, or one below a chunk's end with room to grow past it.
    const std::int32_t count = seed % 3 == 0 ? tiles * decode_tuning::tile - 1 : -1;
    fill_state<Policy>(ref.state(), rng, dm.capacity + 5, count);
    KVTEST_CUDA(gpu::copy_batch_state(dev.state(), ref.state(), cudaMemcpyHostToDevice, nullptr));
  }
  kvtest::host_state_mirror<Policy> mirror(shape, config);
  device_buffer<std::int32_t> victims(std::size_t(B) * H);
  std::int64_t refused = 0;
  for (std::int32_t step = 0; step < (long_rows ? 6 : 30); ++step) {
    CAPTURE(step);
    kvtest::batch_step<float> st = kvtest::draw_step<float>(rng, dm, 0.2);
    if (rng() % 4 == 0) inject_bad_input(rng, st, dm, kind);
    const device_step<float> ds(st);
    std::vector<std::int32_t> want(std::size_t(B) * H, -7);
    KVTEST_CUDA(cudaMemcpy(victims.get(), want.data(), want.size() * 4, cudaMemcpyHostToDevice));
    feed<true>(ref, kind, dm, st.probs.data(), st.logits.data(), st.increments.data(), st.lse.data(), st.scale,
               st.active_set(), want.data());
    feed<true>(dev, kind, dm, ds.probs.get(), ds.logits.get(), ds.increments.get(), ds.lse.get(), st.scale,
               ds.active(st), victims.get());
    CHECK(victims.download() == want);
    const std::uint64_t word = ref.status_word();
    CHECK(dev.status_word() == word);
    refused += batch_status::unpack(word).code == batch_code::no_free_slot;
    mirror.read(dev.state());
    kvtest::check_same_state(ref.state(), mirror.view);
    kvtest::check_row_marks(mirror.view);
    if (word != batch_status_clear && rng() % 3 == 0) {  // the waiting heads catch up, on both
      clear_host_status(ref);
      dev.clear_status();
      kvtest::batch_step<float> good = kvtest::draw_step<float>(rng, dm, 0.0);
      const device_step<float> dg(good);
      const active_set retry = active_set::all().as_retry();
      feed<false>(ref, kind, dm, good.probs.data(), good.logits.data(), good.increments.data(), good.lse.data(),
                  good.scale, retry, nullptr);
      feed<false>(dev, kind, dm, dg.probs.get(), dg.logits.get(), dg.increments.get(), dg.lse.get(), good.scale,
                  retry, nullptr);
      CHECK(dev.status_word() == ref.status_word());
      clear_host_status(ref);
      dev.clear_status();
      mirror.read(dev.state());
      kvtest::check_same_state(ref.state(), mirror.view);
    }
  }
  return refused;
}

}  // namespace

TEST_CASE("cuda one-launch step equals the host's batched_step bit for bit: refusals, retries, split rows") {
  std::uint32_t seed = 5000;
  std::int64_t refused = 0;
  const int stride = kvtest::quick_stride(3);  // quick mode: one seed in `stride`, long rows among them
  for (input_kind kind : {input_kind::probs, input_kind::head_scores, input_kind::logits})
    for (int i = 0; i < 7; ++i, ++seed) {
      if (i % stride != 0 && i < 3) continue;
      const std::int32_t heads = i == 6 ? 70 : 0;
      refused += run_one_launch<h2o_policy>(seed, kind, i == 5, heads);
      refused += run_one_launch<recent_window_policy>(seed, kind, i == 4, heads);
      refused += run_one_launch<random_policy>(seed, kind, i == 3, heads);
    }
  MESSAGE("sequences refused: ", refused);
  CHECK(refused > 0);
}
