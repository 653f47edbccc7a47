// The CUDA kernels' algorithms, run on the host from the same pieces the
// kernels call, against the host backend (which test_batched_host and
// test_evict_to hold to the per-sequence policies and brute force):
//
//   - launch shapes: a split of a row covers every slot with whole tiles,
//     never needs more chunks than the state's workspace holds, and fills
//     the device when rows are few;
//   - observe + evict in chunks: per-chunk row_partials (head checks made by
//     256 "threads", slots folded 8 at a time as a GPU thread does), merged
//     in a random order, give the host's status word, victim and scores for
//     every (b, h), bad inputs in any chunk included;
//   - evict_to as the kernels run it: the lowest count - target victim keys
//     (one selection), the free slots as victims merged with the old hole,
//     and every piece of refill work in a random order (as parallel threads
//     may), equal batched_evict_to's slot table, both score buffers, next
//     slots and moves.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kvevict/batch/multi_token.hpp"
#include "kvevict/kvevict.hpp"
#include "support/state_invariants.hpp"

namespace {

using namespace kvevict;

TEST_CASE("launch shapes: whole tiles cover every slot, chunks fit the workspace, the cheapest split is taken") {
  const std::int32_t tile = decode_tuning::tile;
  // The cost model, written out: waves of resident blocks x tiles per block.
  const auto cost = [&](std::int64_t rows, std::int32_t cap, std::int64_t resident, std::int32_t per_chunk) {
    const std::int64_t tiles = (cap + tile - 1) / tile, chunks = (tiles + per_chunk - 1) / per_chunk;
    return (rows * chunks + resident - 1) / resident * per_chunk;
  };
  for (const std::int64_t rows : {1, 2, 8, 64, 128, 512, 768, 1024, 6000})
    for (const std::int32_t cap : {2, 100, tile, tile + 1, 2 * tile, 16384, 32768, 100003, 131072})
      for (const std::int32_t sms : {1, 108, 132})
        for (const std::int32_t per_sm : {2, 3}) {
          CAPTURE(rows);
          CAPTURE(cap);
          CAPTURE(sms);
          CAPTURE(per_sm);
          const row_split s = split_rows(rows, cap, sms, per_sm);
          CHECK(s.chunk_slots % tile == 0);
          CHECK(std::int64_t{s.chunks} * s.chunk_slots >= cap);     // every slot has a chunk
          CHECK(std::int64_t{s.chunks - 1} * s.chunk_slots < cap);  // no chunk is empty
          CHECK(s.chunks <= max_row_chunks(cap));                   // the partials fit the state
          const std::int32_t tiles = (cap + tile - 1) / tile, chosen = s.chunk_slots / tile;
          for (std::int32_t per_chunk = 1; per_chunk <= tiles; ++per_chunk) {
            const std::int64_t other = cost(rows, cap, std::int64_t{sms} * per_sm, per_chunk);
            const std::int64_t mine = cost(rows, cap, std::int64_t{sms} * per_sm, chosen);
            CHECK(mine <= other);                                   // the cheapest
            if (per_chunk > chosen) CHECK(mine < other);            // the longest chunks among equals
          }
        }
  // The benchmark scenarios on an H100 (132 SMs, 3 blocks each): chunks per row.
  const auto chunks = [&](std::int64_t rows, std::int32_t cap) { return split_rows(rows, cap, 132, 3).chunks; };
  CHECK(chunks(24 * 32, 820) == 1);     // S0
  CHECK(chunks(64 * 8, 4096) == 2);     // S1: 1024 blocks even out the waves
  CHECK(chunks(16 * 8, 32768) == 3);    // S2: 384 blocks of 6 tiles, one wave
  CHECK(chunks(8, 131072) == 32);       // S3: 256 blocks of 2 tiles
  CHECK(chunks(32 * 32, 8192) == 4);    // S4
  CHECK(chunks(8, 1025) == 1);          // S5
  CHECK(chunks(64 * 8, 16384) == 8);    // L8: no 16K-slot row on one block
  for (const std::int32_t tiles : {-1, 0, 1, 2, 3, 1000}) {
    const row_split s = split_by_tiles(5 * tile + 7, tiles);
    CHECK(s.chunk_slots == std::clamp(tiles, 1, 6) * tile);
    CHECK(s.chunks == (6 + std::clamp(tiles, 1, 6) - 1) / std::clamp(tiles, 1, 6));
  }
}

// ---- observe + evict in chunks ----

/// A full host state of `cap` slots per (b, h): budget + 1 shuffled
/// positions, scores on a grid with ties, every head appended (some not).
batch_state_view full_state(std::vector<unsigned char>& memory, const policy_shape& shape, const h2o_config& config,
                            std::mt19937& rng) {
  memory.assign(batch_state_bytes<h2o_policy>(shape, config), 0);
  const batch_state_view st = make_batch_state<h2o_policy>(memory.data(), memory.size(), shape, config);
  init_batch_state(st);
  const std::int32_t length = shape.capacity + 9, count = config.heavy + config.recent + 1;
  for (std::int32_t b = 0; b < shape.num_seqs; ++b) {
    st.slots.lengths[b] = length;
    for (std::int32_t h = 0; h < shape.num_kv_heads; ++h) {
      std::vector<std::int32_t> pos(static_cast<std::size_t>(length));
      std::iota(pos.begin(), pos.end(), 0);
      std::shuffle(pos.begin(), pos.end() - 1, rng);
      std::swap(pos[0], pos.back());  // the newest is cached
      const std::int64_t bh = st.head_index(b, h);
      for (std::int32_t s = 0; s < count; ++s) {
        st.slots.positions_of(b, h)[s] = pos[std::size_t(s)];
        st.scores_of(b, h)[s] = float(rng() % 32) / 4.0f;
      }
      st.slots.counts[bh] = count;
      st.slots.next_slots[bh] = -1;
      st.appended[bh] = rng() % 10 != 0;
    }
  }
  return st;
}

/// The kernel's row, chunk by chunk: chunk 0 also makes the head checks,
/// each chunk folds its slots `Source::items` at a time over 256 threads.
template <class Source>
row_partial chunk_partial(const batch_state_view& st, const Source& source, std::int32_t b, std::int32_t h,
                          const row_split& split, std::int32_t chunk, float* updated) {
  constexpr int kThreads = decode_tuning::threads, kItems = Source::items;
  const std::int64_t bh = st.head_index(b, h);
  const std::int32_t count = st.slots.counts[bh], length = st.slots.lengths[b];
  const std::int32_t width = std::min(count, source.columns());
  const std::int32_t first = chunk * split.chunk_slots, end = std::min(first + split.chunk_slots, width);
  const victim_order order = st.order_of(b, h);
  const float* current = st.scores_of(b, h);
  row_partial part;
  if (chunk == 0)
    for (std::int32_t t = 0; t < kThreads; ++t)
      part.head = std::min(part.head, detail::head_check_share(source, b, h, t, kThreads, st.appended[bh] != 0, count));
  for (std::int32_t base = first; base < end; base += kThreads * kItems)
    for (std::int32_t t = 0; t < kThreads; ++t) {
      std::int32_t s[kItems];
      slot_increment inc[kItems];
      for (int u = 0; u < kItems; ++u) s[u] = std::min(base + u * kThreads + t, end - 1);
      source.template fold_items<kItems>(b, h, s, inc);
      for (int u = 0; u < kItems; ++u)
        if (base + u * kThreads + t < end && st.slots.positions_of(b, h)[s[u]] >= 0)
          observe_slot(st.rule, order, b, h, s[u], st.slots.positions_of(b, h)[s[u]], length, current[s[u]], inc[u],
                       updated, part);
    }
  return part;
}

template <class Source>
void check_chunks_equal_host(const batch_state_view& st, const Source& source, std::mt19937& rng,
                             std::int64_t& heads_checked, std::int64_t& refused) {
  for (std::int32_t b = 0; b < st.num_seqs(); ++b)
    for (std::int32_t h = 0; h < st.num_heads(); ++h) {
      CAPTURE(b);
      CAPTURE(h);
      std::int32_t victim = -1;
      const std::uint64_t want = detail::observe_evict_head(st, b, h, source, victim);
      const std::vector<float> host_updated(st.spare_scores_of(b, h), st.spare_scores_of(b, h) + st.capacity());
      for (const std::int32_t tiles : {1, 2}) {
        const row_split split = split_by_tiles(st.capacity(), tiles);
        const std::int32_t count = st.slots.counts[st.head_index(b, h)];
        const std::int32_t chunks = count > split.chunk_slots ? (count + split.chunk_slots - 1) / split.chunk_slots : 1;
        std::vector<std::int32_t> order(static_cast<std::size_t>(chunks));
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<float> updated(std::size_t(st.capacity()), -1.0f);
        row_partial total;
        for (const std::int32_t c : order)
          total = row_partial::merge(total, chunk_partial(st, source, b, h, split, c, updated.data()));
        CHECK(total.status_word(b, h) == want);
        if (want == batch_status_clear) {
          CHECK((count > st.rule.budget ? total.slot : -1) == victim);
          CHECK(std::memcmp(updated.data(), host_updated.data(), sizeof(float) * std::size_t(count)) == 0);
        }
      }
      ++heads_checked;
      refused += want != batch_status_clear;
    }
}

TEST_CASE("observe + evict in chunks: partials merged in any order decide as the host, bad inputs in any chunk") {
  std::mt19937 rng(11);
  std::int64_t heads = 0, refused = 0;
  for (int trial = 0; trial < 24; ++trial) {
    CAPTURE(trial);
    const std::int32_t cap = 2 * decode_tuning::tile + 1 + std::int32_t(rng() % 3000);
    const std::int32_t group = 1 + std::int32_t(rng() % 3);
    const policy_shape shape{2, 2, 2 * group, cap};
    h2o_config config{cap / 2, cap - 1 - cap / 2, static_cast<group_reduce>(trial % 3)};
    config.decay = std::array<float, 4>{1.0f, 0.0f, 0.5f, 0.9f}[trial % 4];  // H2O, TOVA, moving averages
    std::vector<unsigned char> memory;
    const batch_state_view st = full_state(memory, shape, config, rng);
    const std::int32_t columns = trial % 6 == 5 ? cap - 7 : cap;  // a narrow input now and then
    std::vector<float> probs(std::size_t(2) * shape.num_q_heads * columns), lse(std::size_t(2) * shape.num_q_heads);
    for (float& x : probs) x = float(rng() % 64) / 256.0f;
    for (float& x : lse) x = 1.0f + float(rng() % 8) / 4.0f;
    for (int bad = int(rng() % 3); bad > 0; --bad)  // NaN, inf or a negative probability anywhere
      probs[rng() % probs.size()] = std::array<float, 3>{std::nanf(""), INFINITY, -0.5f}[rng() % 3];
    if (trial % 4 == 3) lse[rng() % lse.size()] = std::nanf("");
    const auto p = make_tensor_view<const float>(probs.data(), 2, shape.num_q_heads, columns);
    switch (trial % 3) {
      case 0: check_chunks_equal_host(st, score_source<batch_probs>{{p}, group, config.reduce}, rng, heads, refused); break;
      case 1:
        check_chunks_equal_host(
            st,
            score_source<batch_logits>{{p, make_tensor_view<const float>(lse.data(), 2, shape.num_q_heads), 0.5f},
                                       group,
                                       config.reduce},
            rng, heads, refused);
        break;
      default: {
        const auto inc = make_tensor_view<const float>(probs.data(), 2, shape.num_kv_heads, columns);
        check_chunks_equal_host(st, score_source<batch_head_scores>{{inc}, group, config.reduce}, rng, heads, refused);
      }
    }
  }
  MESSAGE(heads, " (sequence, head) rows compared, ", refused, " refused");
  CHECK(refused > 5);
  CHECK(heads - refused > 20);
}

// ---- evict_to as the kernels run it ----

/// One (b, h)'s evict_to the CUDA way, on copies of its rows; returns the
/// moves in order of their index.
std::vector<slot_move> kernel_evict_to(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                       std::int32_t target, std::mt19937& rng, std::vector<std::int32_t>& positions,
                                       std::vector<float>& current, std::vector<float>& spare,
                                       std::int32_t& next_slot) {
  const std::int64_t bh = st.head_index(b, h);
  const std::int32_t count = st.slots.counts[bh], next = st.slots.next_slots[bh];
  const std::int32_t end = detail::occupied_end(count, next), k = count - target;
  // 1. One selection: the k lowest keys of slots [0, end), in ascending slot order.
  const victim_order order = st.order_of(b, h);
  std::vector<std::int32_t> slots(static_cast<std::size_t>(end));
  std::iota(slots.begin(), slots.end(), 0);
  std::stable_sort(slots.begin(), slots.end(), [&](std::int32_t x, std::int32_t y) {
    return detail::evict_to_key(st, b, h, order, x) < detail::evict_to_key(st, b, h, order, y);
  });
  std::vector<std::int32_t> victims(slots.begin(), slots.begin() + k);
  std::sort(victims.begin(), victims.end());
  // 2. The refill: every piece of work in a random order.
  const detail::victims_and_hole freed(victims.data(), k, detail::hole_of(count, next));
  const auto plan = detail::make_refill_plan(freed, freed.size(), target, st.rule.budget, end);
  std::vector<std::int32_t> work(static_cast<std::size_t>(plan.work()));
  std::iota(work.begin(), work.end(), 0);
  std::shuffle(work.begin(), work.end(), rng);
  std::vector<slot_move> moves(std::size_t(plan.moves));
  for (const std::int32_t i : work)
    detail::refill_work(plan, i, positions.data(), current.data(), spare.data(),
                        [&](std::int32_t m, std::int32_t from, std::int32_t to) { moves[std::size_t(m)] = {from, to}; });
  next_slot = plan.next_slot();
  return moves;
}

template <class Policy>
void run_evict_to(const typename policy_traits<Policy>::config_type& config, std::uint32_t seed,
                  std::int64_t& victims_compared) {
  std::mt19937 rng(seed);
  const std::int32_t cap = 300;
  const policy_shape shape{3, 2, 2, cap};
  const std::int32_t budget = policy_traits<Policy>::rule(config).budget;
  const protection protect = policy_traits<Policy>::rule(config).protect;
  batched_policy<Policy> ref(shape, config);
  const batch_state_view& st = ref.state();
  std::vector<float> inc(std::size_t(3) * 2 * cap);
  std::vector<slot_move> moves(std::size_t(3) * 2 * cap);
  std::vector<std::int32_t> move_counts(std::size_t(3) * 2);
  for (int step = 0; step < 30; ++step) {
    CAPTURE(step);
    std::uint64_t status = batch_status_clear;
    const std::int32_t tokens = 1 + std::int32_t(rng() % 60);
    batched_append_tokens(st, active_set::all(), tokens, &status);
    for (float& x : inc) x = float(rng() % 16) / 8.0f;
    batched_observe_evict(st, active_set::all(), batch_head_scores{make_tensor_view<const float>(inc.data(), 3, 2, cap)},
                          nullptr, &status);
    REQUIRE(status == batch_status_clear);
    const std::int32_t lowest = protect.sinks + protect.recent;
    const std::int32_t target = lowest + std::int32_t(rng() % std::uint32_t(budget - lowest + 1));
    // The kernels' way, on copies, before the host changes the state.
    struct head_result {
      std::vector<std::int32_t> positions;
      std::vector<float> current, spare;
      std::int32_t next = -1;
      std::vector<slot_move> moves;
      bool touched = false;
    };
    std::vector<head_result> want(std::size_t(6));
    for (std::int32_t b = 0; b < 3; ++b)
      for (std::int32_t h = 0; h < 2; ++h) {
        head_result& r = want[std::size_t(st.head_index(b, h))];
        if (st.slots.counts[st.head_index(b, h)] <= target) continue;
        r.touched = true;
        r.positions.assign(st.slots.positions_of(b, h), st.slots.positions_of(b, h) + cap);
        r.current.assign(st.scores_of(b, h), st.scores_of(b, h) + cap);
        r.spare.assign(st.spare_scores_of(b, h), st.spare_scores_of(b, h) + cap);
        r.moves = kernel_evict_to(st, b, h, target, rng, r.positions, r.current, r.spare, r.next);
        victims_compared += st.slots.counts[st.head_index(b, h)] - target;
      }
    batched_evict_to(st, active_set::all(), target, moves.data(), move_counts.data(), &status);
    REQUIRE(status == batch_status_clear);
    kvtest::check_slot_invariants(st);
    for (std::int32_t b = 0; b < 3; ++b)
      for (std::int32_t h = 0; h < 2; ++h) {
        const std::int64_t bh = st.head_index(b, h);
        const head_result& r = want[std::size_t(bh)];
        if (!r.touched) continue;
        CAPTURE(b);
        CAPTURE(h);
        CHECK(st.slots.counts[bh] == target);
        CHECK(st.slots.next_slots[bh] == r.next);
        CHECK(std::equal(r.positions.begin(), r.positions.end(), st.slots.positions_of(b, h)));
        CHECK(std::memcmp(r.current.data(), st.scores_of(b, h), sizeof(float) * cap) == 0);
        CHECK(std::memcmp(r.spare.data(), st.spare_scores_of(b, h), sizeof(float) * cap) == 0);
        REQUIRE(move_counts[std::size_t(bh)] == std::int32_t(r.moves.size()));
        for (std::size_t i = 0; i < r.moves.size(); ++i) {
          CHECK(moves[std::size_t(bh) * cap + i].from == r.moves[i].from);
          CHECK(moves[std::size_t(bh) * cap + i].to == r.moves[i].to);
        }
      }
  }
}

TEST_CASE("evict_to as the kernels run it: one selection, refill work in any order, equals batched_evict_to") {
  std::int64_t victims = 0;
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    run_evict_to<h2o_policy>(h2o_config{150, 50}, seed, victims);
    run_evict_to<recent_window_policy>(recent_window_config{4, 196}, seed, victims);
    run_evict_to<random_policy>(random_config{200, 2, 20, seed}, seed, victims);
  }
  MESSAGE(victims, " victims chosen the kernels' way");
  CHECK(victims > 10000);
}

}  // namespace
