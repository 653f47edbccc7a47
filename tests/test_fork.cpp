// fork (batch/fork.hpp): a forked sequence continues as if it had lived its
// source's life. Each case runs a layer A that forks mid-stream, with some
// sources also destinations (a beam permutation) and one source copied
// several times, and a replay R in which every destination was fed its
// source's inputs (and K/V rows) from the start: after the fork, with the
// same inputs to both, A and R must hold the same slot tables, scores,
// KeyDiff anchors, exact_greedy history, lengths, streams and victims at
// every step, bit for bit, for every policy and decode input, with list
// and flag destinations. random's copies take the source's stream here
// (so they can replay), and the destination index by default. Then a fork
// across states: the batch doubled (2k and 2k + 1 live k's life beside A)
// and shrunk. Then the refusals (state unchanged) and the per-sequence
// form, whose pending victims travel with the copy.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/batch_streams.hpp"
#include "support/decode_inputs.hpp"

namespace {

using namespace kvevict;

constexpr std::int32_t B = 5, H = 2, group = 2, Hq = H * group, D = 8;
// After the fork: 0, 3 and 4 are copies of the old 2, 2 of the old 0; 1 stays.
constexpr std::int32_t fork_destinations[] = {0, 2, 3, 4};
constexpr std::int32_t fork_sources[] = {2, 0, 2, 2};
constexpr std::int32_t lineage[B] = {2, 1, 0, 2, 2};  // whose life each sequence of R lives before the fork

using kvtest::decode_input;

/// A step of of.size() sequences, sequence j with sequence of[j]'s part of
/// `st` (rows, inputs, activity): what a copy sees when it lives the life
/// of its source.
kvtest::batch_step<float> remapped(const kvtest::batch_step<float>& st, const std::vector<std::int32_t>& of,
                                   std::int32_t width) {
  kvtest::batch_step<float> r = st;
  const std::size_t n = of.size();
  const auto rows = [&](std::vector<float>& to, const std::vector<float>& from, std::size_t per_seq) {
    to.assign(n * per_seq, 0.0f);
    for (std::size_t j = 0; j < n; ++j)
      std::copy_n(from.begin() + std::ptrdiff_t(std::size_t(of[j]) * per_seq), per_seq,
                  to.begin() + std::ptrdiff_t(j * per_seq));
  };
  rows(r.k_new, st.k_new, std::size_t(H) * D);
  rows(r.v_new, st.v_new, std::size_t(H) * D);
  rows(r.probs, st.probs, std::size_t(Hq) * width);
  rows(r.logits, st.logits, std::size_t(Hq) * width);
  rows(r.increments, st.increments, std::size_t(H) * width);
  rows(r.lse, st.lse, std::size_t(Hq));
  rows(r.q, st.q, std::size_t(Hq) * D);
  r.use_list = false;
  r.flags.assign(n, 0);
  for (std::size_t j = 0; j < n; ++j) r.flags[j] = st.active(of[j]) ? 1 : 0;
  r.list.clear();
  return r;
}

template <class Policy>
void run_stream(std::uint32_t seed, decode_input in, bool flags) {
  std::mt19937 rng(seed);
  const auto config = kvtest::draw_config<Policy>(rng, in);
  constexpr bool is_random = std::is_same_v<Policy, random_policy>;
  const std::int32_t budget = policy_traits<Policy>::rule(config).budget;
  const std::int32_t capacity = budget + 3, before = std::uniform_int_distribution<int>(1, 12)(rng), after = 14;
  const history_extent history = kvtest::history_of<Policy>(in, before + after + 7, D);  // the grown batch takes 6 more steps
  const policy_shape shape{B, H, Hq, capacity};
  batched_policy<Policy> a(shape, config, history), r(shape, config, history);
  auto cache_a = make_paged_cache<float>(B, H, capacity, D, 3, page_order::nhd);
  auto cache_r = make_paged_cache<float>(B, H, capacity, D, 3, page_order::nhd);
  std::uint64_t streams[B];
  if constexpr (is_random) {  // R's copies draw with their lineage's stream from the start
    for (std::int32_t b = 0; b < B; ++b) streams[b] = 100 + seed * 8 + std::uint64_t(b);
    a.reset(active_set::all(), streams);
    std::uint64_t lineage_streams[B];
    for (std::int32_t b = 0; b < B; ++b) lineage_streams[b] = streams[lineage[b]];
    r.reset(active_set::all(), lineage_streams);
  }
  kvtest::batch_dims dm;
  dm.seqs = B, dm.heads = H, dm.group = group, dm.head_dim = D, dm.capacity = capacity;
  const auto step = [&](const kvtest::batch_step<float>& sa, const kvtest::batch_step<float>& sr) {
    std::vector<std::int32_t> va(std::size_t(B) * H, -2), vr(va.size(), -2);  // inactive entries stay -2
    for (auto [p, s, view, victims] : {std::tuple{&a, &sa, cache_a.view(), va.data()},
                                       std::tuple{&r, &sr, cache_r.view(), vr.data()}}) {
      p->append(view, batch_rows<float>{make_tensor_view<const float>(s->k_new.data(), B, H, D)},
                batch_rows<float>{make_tensor_view<const float>(s->v_new.data(), B, H, D)}, s->active_set());
      kvtest::observe_step(*p, *s, dm, in, view, 0, victims);
      REQUIRE(p->status_word() == batch_status_clear);
    }
    return std::pair{va, vr};
  };
  for (std::int32_t t = 0; t < before; ++t) {
    const kvtest::batch_step<float> st = kvtest::draw_step<float>(rng, dm, 0.2);
    step(st, remapped(st, std::vector<std::int32_t>(lineage, lineage + B), capacity));
  }
  // The fork in A, and the engine's copy of each source's K/V rows (as
  // they were) to its destination.
  std::vector<float> old_k(std::size_t(B) * H * capacity * D), old_v(old_k.size());
  const auto row_at = [&](std::int32_t b, std::int32_t h, std::int32_t slot) {
    return std::size_t((b * H + h) * capacity + slot) * D;
  };
  for (std::int32_t b = 0; b < B; ++b)
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t slot = 0; slot < capacity; ++slot) {
        std::memcpy(&old_k[row_at(b, h, slot)], cache_a.view().k_row(b, h, slot), sizeof(float) * D);
        std::memcpy(&old_v[row_at(b, h, slot)], cache_a.view().v_row(b, h, slot), sizeof(float) * D);
      }
  std::uint64_t list_streams[4], flag_streams[B];
  for (std::int32_t i = 0; i < 4; ++i) list_streams[i] = streams[fork_sources[i]];
  const std::uint8_t destination_flags[B] = {1, 0, 1, 1, 1};
  const std::int32_t sources_by_sequence[B] = {2, 99, 0, 2, 2};  // entry 1 is not a destination: never read
  for (std::int32_t b = 0; b < B; ++b) flag_streams[b] = b == 1 ? ~std::uint64_t{0} : streams[sources_by_sequence[b]];
  if (flags)
    a.fork(active_set::of_flags(destination_flags), sources_by_sequence, is_random ? flag_streams : nullptr);
  else
    a.fork(active_set::of_list(fork_destinations, 4), fork_sources, is_random ? list_streams : nullptr);
  for (std::int32_t i = 0; i < 4; ++i)
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t slot = 0; slot < capacity; ++slot) {
        std::memcpy(cache_a.view().k_row(fork_destinations[i], h, slot), &old_k[row_at(fork_sources[i], h, slot)],
                    sizeof(float) * D);
        std::memcpy(cache_a.view().v_row(fork_destinations[i], h, slot), &old_v[row_at(fork_sources[i], h, slot)],
                    sizeof(float) * D);
      }
  for (std::int32_t b = 0; b < B; ++b) kvtest::require_same_sequence(a.state(), b, r.state(), b);

  for (std::int32_t t = 0; t < after; ++t) {
    CAPTURE(t);
    const kvtest::batch_step<float> st = kvtest::draw_step<float>(rng, dm, 0.2);
    const auto [va, vr] = step(st, st);
    REQUIRE(va == vr);
    for (std::int32_t b = 0; b < B; ++b) kvtest::require_same_sequence(a.state(), b, r.state(), b);
  }
  for (std::int32_t b = 0; b < B; ++b)
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t slot = 0; slot < capacity; ++slot) {
        kvtest::require_equal(cache_a.view().k_row(b, h, slot), cache_r.view().k_row(b, h, slot), D, "k rows");
        kvtest::require_equal(cache_a.view().v_row(b, h, slot), cache_r.view().v_row(b, h, slot), D, "v rows");
      }
  // The batch grows (transformers' batch_repeat_interleave): a state of 2B
  // sequences, 2k and 2k + 1 copies of A's k, which then live k's life.
  std::vector<std::int32_t> twice(2 * B);
  for (std::int32_t j = 0; j < 2 * B; ++j) twice[std::size_t(j)] = j / 2;
  batched_policy<Policy> grown(policy_shape{2 * B, H, Hq, capacity}, config, history);
  auto cache_g = make_paged_cache<float>(2 * B, H, capacity, D, 3, page_order::nhd);
  std::vector<std::uint64_t> grown_streams(2 * B);
  for (std::int32_t j = 0; j < 2 * B; ++j) grown_streams[std::size_t(j)] = a.state().stream_of(j / 2);
  batched_fork(a.state(), grown.state(), active_set::all(), twice.data(), is_random ? grown_streams.data() : nullptr);
  for (std::int32_t j = 0; j < 2 * B; ++j) {
    kvtest::require_same_sequence(grown.state(), j, a.state(), j / 2);
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t slot = 0; slot < capacity; ++slot) {
        std::memcpy(cache_g.view().k_row(j, h, slot), cache_a.view().k_row(j / 2, h, slot), sizeof(float) * D);
        std::memcpy(cache_g.view().v_row(j, h, slot), cache_a.view().v_row(j / 2, h, slot), sizeof(float) * D);
      }
  }
  kvtest::batch_dims grown_dims = dm;
  grown_dims.seqs = 2 * B;
  for (std::int32_t t = 0; t < 6; ++t) {
    const kvtest::batch_step<float> st = kvtest::draw_step<float>(rng, dm, 0.2), sg = remapped(st, twice, capacity);
    std::vector<std::int32_t> va(std::size_t(B) * H, -2), vg(std::size_t(2 * B) * H, -2);
    a.append(cache_a.view(), batch_rows<float>{make_tensor_view<const float>(st.k_new.data(), B, H, D)},
             batch_rows<float>{make_tensor_view<const float>(st.v_new.data(), B, H, D)}, st.active_set());
    kvtest::observe_step(a, st, dm, in, cache_a.view(), 0, va.data());
    grown.append(cache_g.view(), batch_rows<float>{make_tensor_view<const float>(sg.k_new.data(), 2 * B, H, D)},
                 batch_rows<float>{make_tensor_view<const float>(sg.v_new.data(), 2 * B, H, D)}, sg.active_set());
    kvtest::observe_step(grown, sg, grown_dims, in, cache_g.view(), 0, vg.data());
    REQUIRE(a.status_word() == batch_status_clear);
    REQUIRE(grown.status_word() == batch_status_clear);
    for (std::int32_t j = 0; j < 2 * B; ++j) {
      kvtest::require_same_sequence(grown.state(), j, a.state(), j / 2);
      for (std::int32_t h = 0; h < H; ++h) REQUIRE(vg[std::size_t(j * H + h)] == va[std::size_t(j / 2 * H + h)]);
    }
  }
  // ... and shrinks (batch_select_indices) to sequences 3 and 0 of A.
  const std::int32_t kept[] = {3, 0};
  batched_policy<Policy> small(policy_shape{2, H, Hq, capacity}, config, history);
  const std::uint64_t small_streams[] = {a.state().stream_of(3), a.state().stream_of(0)};
  batched_fork(a.state(), small.state(), active_set::all(), kept, is_random ? small_streams : nullptr);
  kvtest::require_same_sequence(small.state(), 0, a.state(), 3);
  kvtest::require_same_sequence(small.state(), 1, a.state(), 0);

  if constexpr (is_random) {  // by default a copy draws with its own index as stream
    a.fork(active_set::of_list(fork_destinations, 4), fork_sources);
    for (std::int32_t d : fork_destinations) CHECK(a.state().stream_of(d) == std::uint64_t(d));
    CHECK(a.state().stream_of(1) == streams[1]);
  }
}

template <class Policy>
void run_all(std::initializer_list<decode_input> inputs) {
  std::uint32_t seed = 1;
  for (decode_input in : inputs)
    for (int round = 0; round < 4; ++round, ++seed) {
      CAPTURE(int(in));
      CAPTURE(seed);
      run_stream<Policy>(seed, in, round % 2 == 1);
    }
}

/// The state's bytes, to show a refused call changed nothing.
std::vector<unsigned char> bytes_of(const batch_state_view& st, std::size_t bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(st.slots.positions);
  return std::vector<unsigned char>(p, p + bytes);
}

}  // namespace

TEST_CASE("fork: h2o's copies replay their source's life, for every decode input") {
  run_all<h2o_policy>({decode_input::probs, decode_input::head_scores, decode_input::logits, decode_input::queries,
                       decode_input::key_norms, decode_input::key_diff});
}

TEST_CASE("fork: recent window's and random's copies replay their source's life") {
  run_all<recent_window_policy>({decode_input::probs});
  run_all<random_policy>({decode_input::probs, decode_input::logits});
}

TEST_CASE("fork: exact greedy's copies replay their source's life (history included)") {
  run_all<exact_greedy_policy>({decode_input::queries});
}

TEST_CASE("fork: bad entries are refused by name and change nothing") {
  random_config c{4, 0, 1, 9};
  batched_policy<random_policy> p(policy_shape{3, 2, 2, 8}, c);
  std::uint64_t status = batch_status_clear;
  batched_append_tokens(p.state(), active_set::all(), 3, &status);
  REQUIRE(status == batch_status_clear);
  // The carve's used bytes: its size query less the slack for aligning the base.
  const std::size_t bytes =
      batch_state_bytes<random_policy>(policy_shape{3, 2, 2, 8}, c) - (detail::state_carver::alignment - 1);
  const std::vector<unsigned char> before = bytes_of(p.state(), bytes);
  const std::int32_t two[] = {0, 2}, repeat[] = {1, 1}, outside[] = {0, 3}, sources[] = {1, 0}, bad_source[] = {1, -1};
  const std::uint64_t too_large[] = {1, max_random_stream + 1};
  CHECK_THROWS_WITH_AS(p.fork(active_set::of_list(outside, 2), sources), doctest::Contains("argument 'destinations.list[1]' = 3"), out_of_range);
  CHECK_THROWS_WITH_AS(p.fork(active_set::of_list(repeat, 2), sources), doctest::Contains("argument 'destinations.list[1]' = 1 repeats"), invalid_argument);
  CHECK_THROWS_WITH_AS(p.fork(active_set::of_list(two, 2), bad_source), doctest::Contains("argument 'sources[1]' = -1"), out_of_range);
  CHECK_THROWS_WITH_AS(p.fork(active_set::of_list(two, 2), sources, too_large), doctest::Contains("argument 'streams[1]'"), out_of_range);
  CHECK_THROWS_WITH_AS(p.fork(active_set::of_list(two, 2), nullptr), doctest::Contains("argument 'sources'"), invalid_argument);
  // Destinations are checked before sources, as CUDA reports them.
  const std::int32_t twice_two[] = {2, 2}, far_source[] = {99, 0};
  CHECK_THROWS_WITH_AS(p.fork(active_set::of_list(twice_two, 2), far_source),
                       doctest::Contains("argument 'destinations.list[1]' = 2 repeats"), invalid_argument);
  CHECK(bytes_of(p.state(), bytes) == before);

  // A hand-edited view without the arrays its parts need is refused, not read.
  batched_policy<exact_greedy_policy> greedy(policy_shape{3, 2, 2, 8}, exact_greedy_config{4, 0, 0}, history_extent{16, 4});
  batch_state_view no_rows = greedy.state();
  no_rows.history.rows = nullptr;
  CHECK_THROWS_WITH_AS(batched_fork(no_rows, active_set::of_list(two, 2), sources), doctest::Contains("argument 'src.history'"),
                       invalid_argument);
  batched_policy<h2o_policy> anchored(policy_shape{3, 2, 2, 8}, key_norm_config(4), key_diff_extent(4));
  batch_state_view no_units = anchored.state();
  no_units.anchors.units = nullptr;
  CHECK_THROWS_WITH_AS(batched_fork(anchored.state(), no_units, active_set::of_list(two, 2), sources),
                       doctest::Contains("argument 'dst.anchors'"), invalid_argument);

  // Across states: the policy, heads and capacity must match, any batch size.
  batched_policy<random_policy> wider(policy_shape{3, 2, 2, 9}, c), other(policy_shape{3, 2, 2, 8}, random_config{4, 0, 1, 10});
  CHECK_THROWS_WITH_AS(batched_fork(p.state(), wider.state(), active_set::of_list(two, 2), sources),
                       doctest::Contains("argument 'capacity' = 9 in dst, 8 in src"), invalid_argument);
  CHECK_THROWS_WITH_AS(batched_fork(p.state(), other.state(), active_set::of_list(two, 2), sources),
                       doctest::Contains("argument 'dst.rule'"), invalid_argument);
  batched_policy<random_policy> one(policy_shape{1, 2, 2, 8}, c);
  const std::int32_t zero = 0, three = 3;
  CHECK_THROWS_WITH_AS(batched_fork(p.state(), one.state(), active_set::of_list(&two[1], 1), &zero),
                       doctest::Contains("argument 'destinations.list[0]' = 2 is outside [0, num_seqs = 1)"), out_of_range);
  CHECK_THROWS_WITH_AS(batched_fork(p.state(), one.state(), active_set::all(), &three),
                       doctest::Contains("argument 'sources[0]' = 3 is outside [0, num_seqs = 3)"), out_of_range);
  batched_fork(p.state(), one.state(), active_set::all(), &two[1]);
  CHECK(one.state().slots.lengths[0] == 3);
  CHECK(bytes_of(p.state(), bytes) == before);
}

TEST_CASE("fork: the per-sequence form copies a pending step's victims, and random's takes a stream") {
  h2o_config c;
  c.heavy = 2, c.recent = 1;
  h2o_policy p(policy_shape{2, 1, 1, 4}, c);
  std::vector<float> probs = {0.5f, 0.1f, 0.3f, 0.1f};
  for (std::int32_t t = 0; t < 4; ++t) {
    p.append(0);
    p.observe(0, decode_probs{make_tensor_view<const float>(probs.data(), 1, 4)});
    if (t == 3) break;  // the fourth token makes budget + 1: its victim is pending
    p.evict(0);
  }
  p.fork(0, 1);
  CHECK(p.length(1) == 4);
  CHECK_FALSE(p.awaiting_observe(1));
  std::int32_t v0 = -1, v1 = -2;
  CHECK(p.evict(1, &v1) == 1);
  CHECK(p.evict(0, &v0) == 1);
  CHECK(v0 == v1);
  for (std::int32_t s = 0; s < 4; ++s) CHECK(p.slots().position(0, 0, s) == p.slots().position(1, 0, s));
  CHECK_THROWS_WITH_AS(p.fork(0, 2), doctest::Contains("argument 'destination' = 2"), out_of_range);
  p.append(0);  // a copy made between append and observe awaits its observe too
  p.fork(0, 1);
  CHECK(p.awaiting_observe(1));
  CHECK(p.next_slot(1, 0) == p.next_slot(0, 0));

  random_policy r(policy_shape{2, 1, 1, 4}, random_config{3, 0, 1, 5});
  r.fork(0, 1, 77);
  CHECK(r.stream(1) == 77);
  r.fork(1, 0);
  CHECK(r.stream(0) == 0);
  CHECK_THROWS_WITH_AS(r.fork(0, 1, max_random_stream + 1), doctest::Contains("argument 'stream'"), out_of_range);
  CHECK(r.stream(1) == 77);
}
