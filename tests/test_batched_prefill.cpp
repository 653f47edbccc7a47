// Batched prefill compression on the host (batch/prefill.hpp) against a
// brute-force reference written in the test from the definitions
// (support/prefill_reference.hpp; docs/semantics.md, "Scores" and "Batched
// prefill"; docs/policies.md, "Prefill"), not against the per-sequence
// policies, which are a facade over this same backend. On seeded random
// prompts for every policy x input (probs, column sums, queries + LSE, none)
// x dtype x layout x GQA group {1, 4, 8} (h2o with sum, mean and max and
// decays 1, 0.9, 0.5 and 0), with ragged prompt lengths (L <= budget and
// L = capacity among them), random's request streams, and inactive sequences
// (fresh, or holding a token) that must stay byte for byte as they were:
// the slot table, bitwise the scores, the K/V bytes and the reclaimable
// pages must be the reference's. The reference's own code: the column sums
// in the canonical 64-row chunk order, the row weights decay^(L-1-i), the
// keep plans (sinks + recent + top by (score, position); recent_window's
// newest; random's Philox prefill priorities), the compaction and the pages.
// It calls the library only for the scalar rules of one element pinned by
// their own definitional tests: attention_logit and probability_from_logit
// (one probability of the queries input), fold_group (one column's GQA
// fold), philox4x32_10 (one draw). Then the canonical column-sum order
// itself, the status word for bad data (the sequence byte for byte
// unchanged, the rest of the batch as the reference compresses it),
// arguments that throw before anything changes, the slot-table-only form,
// and exact_greedy's refusal.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/batch/prefill.hpp"
#include "kvevict/kvevict.hpp"
#include "kvevict/policy/column_sums.hpp"
#include "support/caches.hpp"
#include "support/prefill_fixtures.hpp"
#include "support/prefill_reference.hpp"

namespace {

using namespace kvevict;
using kvtest::layout_kind;

// ---------------------------------------------------------------------------
// The canonical order.

bool same_float(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

/// Column 0 of a 66-row prompt with 64 ones and two values of 2^-18 after
/// a per-sequence prefill: the plain order loses them (64 + 2^-18 rounds to
/// 64, twice), the canonical order keeps them (64 + 2^-17).
float per_sequence_prefill_column_zero() {
  const std::int32_t L = 66;
  h2o_policy p(policy_shape{1, 1, 1, L + 1}, h2o_config{1, 1});
  std::vector<float> probs(std::size_t(L) * L, 0.0f);
  for (std::int32_t i = 0; i < L; ++i) probs[std::size_t(i) * L] = i < 64 ? 1.0f : std::ldexp(1.0f, -18);
  auto cache = make_bhsd_cache<float>(1, 1, L + 1, 4);
  p.prefill(0, L, prefill_probs{make_tensor_view<const float>(probs.data(), 1, L, L)}, cache.view());
  REQUIRE(p.slots().position(0, 0, 0) == 0);
  return p.scores_of(0, 0)[0];
}

}  // namespace

TEST_CASE("prefill column sums: chunks of 64 rows, partials in ascending chunk order") {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (std::int32_t length : {1, 2, 63, 64, 65, 127, 128, 129, 200, 333}) {
    std::vector<float> column(static_cast<std::size_t>(length));
    for (float& x : column) x = u(rng) * u(rng);
    for (std::int32_t p = 0; p < length; p += std::max(1, length / 17)) {
      const float got = prefill_column_sum(p, length, [&](std::int32_t i) { return column[std::size_t(i)]; });
      CHECK(same_float(got, kvtest::reference_column_sum(p, length, [&](std::int32_t i) { return column[std::size_t(i)]; })));
      if (length <= 64) {  // the plain left-to-right sum
        float plain = 0.0f;
        for (std::int32_t i = p; i < length; ++i) plain += column[std::size_t(i)];
        CHECK(same_float(got, plain));
      }
      // The pieces a kernel uses give the same bits.
      const float pieces = prefill_combine_chunks(p, length, [&](std::int32_t c) {
        return prefill_chunk_partial(p, c, length, [&](std::int32_t i) { return column[std::size_t(i)]; });
      });
      CHECK(same_float(pieces, got));
    }
  }
  // The order matters beyond 64 rows: 64 ones, then 2^-18 twice.
  std::vector<float> column(66, 1.0f);
  column[64] = column[65] = std::ldexp(1.0f, -18);
  CHECK(prefill_column_sum(0, 66, [&](std::int32_t i) { return column[std::size_t(i)]; }) ==
        64.0f + std::ldexp(1.0f, -17));
  // Rows are visited in ascending order (validation meets elements as a loop would).
  std::vector<std::int32_t> seen;
  prefill_column_sum(3, 150, [&](std::int32_t i) {
    seen.push_back(i);
    return 1.0f;
  });
  REQUIRE(seen.size() == 147);
  CHECK(std::is_sorted(seen.begin(), seen.end()));
  CHECK(seen.front() == 3);
  CHECK(prefill_chunks(1) == 1);
  CHECK(prefill_chunks(64) == 1);
  CHECK(prefill_chunks(65) == 2);
  CHECK(prefill_chunk_range(70, 0, 100).empty());
  CHECK(prefill_chunk_range(70, 1, 100).begin == 70);
  CHECK(prefill_chunk_range(70, 1, 100).end == 100);
  // The per-sequence policies sum in this order too.
  CHECK(per_sequence_prefill_column_zero() == 64.0f + std::ldexp(1.0f, -17));
}

namespace {

// ---------------------------------------------------------------------------
// Random prompts.

using kvtest::converted;
using kvtest::draw_prefill_config;
using kvtest::draw_prompts;
using kvtest::prefill_input;
using kvtest::prefill_reference_rule;
using kvtest::reference_prefill;
using kvtest::reference_reclaimable;
using kvtest::reference_sequence;
using kvtest::prompt_batch;
using kvtest::prompt_options;
using kvtest::sequence_bytes;

/// Writes the same random rows into every (b, h, slot) of two caches.
template <class V>
void fill_caches(std::mt19937& rng, const V& a, const V& b) {
  using T = typename V::element_type;
  for (std::int32_t s = 0; s < a.num_seqs; ++s)
    for (std::int32_t h = 0; h < a.num_heads; ++h)
      for (std::int32_t slot = 0; slot < a.capacity; ++slot)
        for (std::int32_t e = 0; e < a.head_dim; ++e) {
          const T k = kvtest::random_value<T>(rng), v = kvtest::random_value<T>(rng);
          a.k_row(s, h, slot)[e] = b.k_row(s, h, slot)[e] = k;
          a.v_row(s, h, slot)[e] = b.v_row(s, h, slot)[e] = v;
        }
}

/// Elements from a view's k (or v) pointer to the end of its last row.
template <class T, class Layout>
std::size_t span_elements(const kv_view<T, Layout>& v) {
  const auto& l = v.layout;
  if constexpr (std::is_same_v<Layout, paged_layout>) {
    return std::size_t((l.num_pages - 1) * l.stride_page + (v.num_heads - 1) * l.stride_head +
                       (l.page_size - 1) * l.stride_slot + v.head_dim);
  } else {
    return std::size_t((v.num_seqs - 1) * l.stride_seq + (v.num_heads - 1) * l.stride_head +
                       (v.capacity - 1) * l.stride_slot + v.head_dim);
  }
}

template <class T, class Layout>
bool same_kv_bytes(const kv_view<T, Layout>& a, const kv_view<T, Layout>& b) {
  const std::size_t n = span_elements(a) * sizeof(T);
  return std::memcmp(a.k, b.k, n) == 0 && std::memcmp(a.v, b.v, n) == 0;
}

template <class T, class Layout>
std::vector<unsigned char> kv_bytes(const kv_view<T, Layout>& a) {
  const std::size_t n = span_elements(a) * sizeof(T);
  std::vector<unsigned char> out(2 * n);
  std::memcpy(out.data(), a.k, n);
  std::memcpy(out.data() + n, a.v, n);
  return out;
}

// ---------------------------------------------------------------------------
// The library's call and the reference's expectation.

/// A batched state in memory of its own, so that its bytes can be compared.
template <class Policy>
struct raw_state {
  std::vector<unsigned char> memory;
  batch_state_view view;
  raw_state(const policy_shape& shape, const typename policy_traits<Policy>::config_type& c,
            const history_extent& history = {})
      : memory(batch_state_bytes<Policy>(shape, c, history)),
        view(make_batch_state<Policy>(memory.data(), memory.size(), shape, c, history)) {
    init_batch_state(view);
  }
};

/// The batched prefill of the batch's inputs.
template <class Q, class V>
void prefill_batched(const batch_state_view& st, const prompt_batch& d, prefill_input kind, const V& view,
                     std::int32_t* reclaimable, std::uint64_t* status) {
  const std::int32_t B = d.B, Hq = d.Hq(), M = d.M, D = d.D;
  const active_set active = d.active_set_of();
  switch (kind) {
    case prefill_input::probs:
      batched_prefill(st, active, d.prompts(),
                      batch_prefill_probs{make_tensor_view<const float>(d.probs.data(), B, Hq, M, M)}, view,
                      reclaimable, status);
      return;
    case prefill_input::sums:
      batched_prefill(st, active, d.prompts(), batch_prefill_sums{make_tensor_view<const float>(d.sums.data(), B, Hq, M)},
                      view, reclaimable, status);
      return;
    case prefill_input::queries: {
      const std::vector<Q> qv = converted<Q>(d.q);
      batched_prefill(st, active, d.prompts(),
                      batch_prefill_queries<Q>{make_tensor_view<const Q>(qv.data(), B, Hq, M, D),
                                               make_tensor_view<const float>(d.lse.data(), B, Hq, M), d.scale, d.base},
                      view, reclaimable, status);
      return;
    }
    case prefill_input::none: batched_prefill(st, active, d.prompts(), view, reclaimable, status); return;
  }
}

/// Sequence b of the state after a prefill the reference computed: length
/// L; per head slot s < kept holds keep[s] with its reference score bit for
/// bit in the current buffer, every other slot is free with score 0, the
/// spare buffer is 0, count = next slot = kept, not appended; the stream is
/// the one the sequence had.
void check_prefilled(const batch_state_view& st, std::int32_t b, const reference_sequence& want,
                     std::uint64_t stream) {
  CAPTURE(b);
  REQUIRE(st.slots.lengths[b] == want.length);
  if (st.streams) CHECK(st.streams[b] == stream);
  for (std::int32_t h = 0; h < st.num_heads(); ++h) {
    CAPTURE(h);
    const std::int64_t bh = st.head_index(b, h);
    const std::vector<std::int32_t>& keep = want.keep[std::size_t(h)];
    const std::int32_t kept = std::int32_t(keep.size());
    REQUIRE(st.slots.counts[bh] == kept);
    CHECK(st.slots.next_slots[bh] == kept);
    CHECK(st.appended[bh] == 0);
    for (std::int32_t s = 0; s < st.capacity(); ++s) {
      CAPTURE(s);
      REQUIRE(st.slots.positions_of(b, h)[s] == (s < kept ? keep[std::size_t(s)] : -1));
      CHECK(same_float(st.scores_of(b, h)[s], s < kept ? want.scores[std::size_t(h)][std::size_t(s)] : 0.0f));
      CHECK(same_float(st.spare_scores_of(b, h)[s], 0.0f));
    }
  }
}

template <class V>
constexpr bool is_paged() {
  return std::is_same_v<typename V::layout_type, paged_layout>;
}

struct totals {
  std::int64_t calls = 0, compressed = 0, whole = 0, long_prompts = 0, dropped = 0, untouched = 0;
};

/// One seeded batch: the library's batched prefill (cache view_b) against
/// the reference (cache view_a, the same rows on entry): slot tables,
/// scores bit for bit, K/V bytes and reclaimable pages of every active
/// sequence; the inactive ones (fresh, or holding one appended token) byte
/// for byte as they were.
template <class Policy, class T, class Q>
void run_case(std::uint32_t seed, layout_kind layout, std::int32_t group, prefill_input kind, totals& tot) {
  std::mt19937 rng(seed);
  std::int32_t budget = 0;
  const auto config = draw_prefill_config<Policy>(rng, budget);
  const prefill_reference_rule rule = kvtest::reference_rule(config);
  REQUIRE(rule.budget == budget);
  const std::int32_t B = std::uniform_int_distribution<int>(1, 4)(rng);
  const std::int32_t H = std::uniform_int_distribution<int>(1, 2)(rng);
  const std::int32_t D = std::uniform_int_distribution<int>(0, 1)(rng) ? 8 : 12;
  const std::int32_t page = std::uniform_int_distribution<int>(1, 7)(rng);
  const std::int32_t longest = seed % 2 == 0 ? 200 : 64;  // beyond 64 rows: several chunks per column
  const std::int32_t cap = std::uniform_int_distribution<int>(budget + 1, std::max(budget + 1, longest))(rng);
  prompt_batch d = draw_prompts(rng, B, H, group, D, budget, cap);
  const policy_shape shape{B, H, H * group, cap};
  raw_state<Policy> batched(shape, config);
  std::vector<std::uint64_t> streams(static_cast<std::size_t>(B));
  for (std::int32_t b = 0; b < B; ++b) streams[std::size_t(b)] = std::uint64_t(b);  // the default stream
  if constexpr (std::is_same_v<Policy, random_policy>) {  // request streams of their own on some sequences
    for (std::int32_t b = 0; b < B; ++b)
      streams[std::size_t(b)] = rng() % 2 ? std::uint64_t(b) : 1000 + 7 * std::uint64_t(b) + seed;
    reset_batch_sequences(batched.view, active_set::all(), streams.data());
  }
  const std::vector<Q> qv = kind == prefill_input::queries ? converted<Q>(d.q) : std::vector<Q>();
  auto run_both = [&](const auto& view_a, const auto& view_b) {
    fill_caches(rng, view_a, view_b);
    // Inactive sequences may already hold a token: they must stay as they are.
    std::uint64_t status = batch_status_clear;
    for (std::int32_t b = 0; b < B; ++b)
      if (!d.active[std::size_t(b)] && rng() % 2) batched_append(batched.view, active_set::of_list(&b, 1), &status);
    REQUIRE(status == batch_status_clear);
    std::vector<std::vector<unsigned char>> before;
    for (std::int32_t b = 0; b < B; ++b) before.push_back(sequence_bytes(batched.view, b));
    std::vector<reference_sequence> want(static_cast<std::size_t>(B));
    std::vector<std::int32_t> want_pages(std::size_t(B), -7), got(std::size_t(B), -7);
    for (std::int32_t b = 0; b < B; ++b)
      if (d.active[std::size_t(b)]) {
        const std::int32_t L = d.lengths[std::size_t(b)];
        want[std::size_t(b)] = reference_prefill<Q>(d, kind, rule, b, streams[std::size_t(b)], qv, &view_a);
        want_pages[std::size_t(b)] =
            is_paged<std::decay_t<decltype(view_a)>>() ? reference_reclaimable(L, budget, cap, page) : 0;
        const bool compressed = L > budget;
        tot.compressed += compressed;
        tot.whole += !compressed;
        tot.long_prompts += L > 64;
        if (compressed) tot.dropped += std::int64_t(H) * (L - budget);
      }
    prefill_batched<Q>(batched.view, d, kind, view_b, got.data(), &status);
    REQUIRE(status == batch_status_clear);
    for (std::int32_t b = 0; b < B; ++b) {
      if (d.active[std::size_t(b)]) {
        check_prefilled(batched.view, b, want[std::size_t(b)], streams[std::size_t(b)]);
      } else {
        CHECK(sequence_bytes(batched.view, b) == before[std::size_t(b)]);
        ++tot.untouched;
      }
    }
    CHECK(got == want_pages);
    CHECK(same_kv_bytes(view_a, view_b));
  };
  kvtest::with_cache<T>(layout, B, H, cap, D, page, [&](const auto& view_a) {
    kvtest::with_cache<T>(layout, B, H, cap, D, page, [&](const auto& view_b) {
      // Both caches have the same layout; other instantiations never run.
      if constexpr (std::is_same_v<decltype(view_a), decltype(view_b)>) run_both(view_a, view_b);
    });
  });
  ++tot.calls;
}

template <class Policy>
void run_policy(const char* policy_name, std::initializer_list<prefill_input> kinds, int seeds) {
  totals tot;
  std::uint32_t seed = 1;
  const layout_kind layouts[] = {layout_kind::bhsd, layout_kind::bshd, layout_kind::bshd_padded,
                                 layout_kind::paged_nhd, layout_kind::paged_hnd};
  for (prefill_input kind : kinds)
    for (layout_kind layout : layouts)
      for (std::int32_t group : {1, 4, 8})
        for (int dtype = 0; dtype < 3; ++dtype)
          for (int i = 0; i < seeds; ++i, ++seed) {
            CAPTURE(seed);
            CAPTURE(std::string(name(kind)));
            CAPTURE(std::string(kvtest::name(layout)));
            CAPTURE(group);
            CAPTURE(dtype);
            const bool float_queries = seed % 2 == 0;  // otherwise queries in the cache's dtype
            switch (dtype) {
              case 0: run_case<Policy, float, float>(seed, layout, group, kind, tot); break;
              case 1:
                if (float_queries) run_case<Policy, half, float>(seed, layout, group, kind, tot);
                else run_case<Policy, half, half>(seed, layout, group, kind, tot);
                break;
              default:
                if (float_queries) run_case<Policy, bfloat16, float>(seed, layout, group, kind, tot);
                else run_case<Policy, bfloat16, bfloat16>(seed, layout, group, kind, tot);
                break;
            }
          }
  MESSAGE(std::string(policy_name), ": ", tot.calls, " batched calls against the reference, ", tot.compressed,
          " prompts compressed (", tot.dropped, " (head, position) pairs dropped), ", tot.whole, " kept whole, ",
          tot.long_prompts, " longer than 64 rows, ", tot.untouched, " inactive sequences unchanged");
  CHECK(tot.compressed > 100 * seeds);
  CHECK(tot.whole > 10 * seeds);
  CHECK(tot.long_prompts > 10 * seeds);
  CHECK(tot.untouched > 10 * seeds);
}

}  // namespace

TEST_CASE("batched prefill h2o equals the reference prefill, every input x dtype x layout x GQA x decay") {
  run_policy<h2o_policy>("h2o", {prefill_input::probs, prefill_input::sums, prefill_input::queries}, 2);
}
TEST_CASE("batched prefill recent_window keeps the reference's sinks + window, every input x dtype x layout") {
  run_policy<recent_window_policy>(
      "recent_window", {prefill_input::none, prefill_input::probs, prefill_input::sums, prefill_input::queries}, 1);
}
TEST_CASE("batched prefill random keeps the reference's Philox prefill priorities, request streams included") {
  run_policy<random_policy>("random",
                            {prefill_input::none, prefill_input::probs, prefill_input::sums, prefill_input::queries}, 2);
}

namespace {

// ---------------------------------------------------------------------------
// Bad data: the sequence stays byte for byte as it was, the rest compresses.

/// An h2o batch of 4 sequences (2 KV heads, group 2), every one active and
/// longer than the budget (cap, cap - 1, ...); `spoil` damages the inputs of
/// sequence `bad` (and may set up the state or both caches), `want` is the
/// expected status word. Every other sequence must match the reference
/// prefill (slot table, scores, rows, reclaimable pages); the bad one must
/// keep its state and rows byte for byte.
template <class Spoil>
void run_bad(const char* what, prefill_input kind, std::int32_t cap, std::int32_t bad, Spoil spoil,
             std::uint64_t want, std::int32_t also_bad = -1) {
  CAPTURE(std::string(what));
  std::mt19937 rng(11);
  const std::int32_t B = 4, H = 2, g = 2, D = 8, budget = 6, page = 8;
  const h2o_config config{3, 3, group_reduce::sum};
  const prefill_reference_rule rule = kvtest::reference_rule(config);
  const std::vector<std::int32_t> lengths = {cap, cap - 1, cap - 2, cap - 3};
  prompt_batch d = draw_prompts(rng, B, H, g, D, budget, cap, prompt_options{true, true, &lengths});
  d.use_list = true;
  d.list = {3, 1, 0, 2};
  const policy_shape shape{B, H, H * g, cap};
  raw_state<h2o_policy> batched(shape, config);
  auto run = [&](const auto& view_a, const auto& view_b) {
    fill_caches(rng, view_a, view_b);
    std::vector<std::uint8_t> appended(std::size_t(B), 0);
    spoil(d, batched.view, view_a, view_b, appended);
    const std::vector<unsigned char> before = sequence_bytes(batched.view, bad);
    const std::vector<unsigned char> also_before = also_bad >= 0 ? sequence_bytes(batched.view, also_bad) : before;
    const std::vector<float> qv = kind == prefill_input::queries ? d.q : std::vector<float>();
    std::vector<reference_sequence> good(static_cast<std::size_t>(B));
    for (std::int32_t b = 0; b < B; ++b)
      if (b != bad && b != also_bad) good[std::size_t(b)] = reference_prefill<float>(d, kind, rule, b, b, qv, &view_a);
    std::vector<std::int32_t> reclaimable(std::size_t(B), -7);
    std::uint64_t status = batch_status_clear;
    prefill_batched<float>(batched.view, d, kind, view_b, reclaimable.data(), &status);
    const batch_status got = batch_status::unpack(status), expected = batch_status::unpack(want);
    CHECK(got.code == expected.code);
    CHECK(got.sequence == expected.sequence);
    CHECK(got.head == expected.head);
    CHECK(got.index == expected.index);
    CHECK(status == want);
    CHECK(reclaimable[std::size_t(bad)] == 0);
    if (also_bad >= 0) CHECK(reclaimable[std::size_t(also_bad)] == 0);
    CHECK(sequence_bytes(batched.view, bad) == before);
    if (also_bad >= 0) CHECK(sequence_bytes(batched.view, also_bad) == also_before);
    for (std::int32_t b = 0; b < B; ++b) {
      if (b == bad || b == also_bad) continue;
      check_prefilled(batched.view, b, good[std::size_t(b)], std::uint64_t(b));
      CHECK(reclaimable[std::size_t(b)] == (is_paged<std::decay_t<decltype(view_a)>>()
                                                 ? reference_reclaimable(lengths[std::size_t(b)], budget, cap, page)
                                                 : 0));
    }
    CHECK(same_kv_bytes(view_a, view_b));  // the bad sequence's rows did not move, the others as the reference's
  };
  if (kind == prefill_input::queries) {  // paged: the bad-page case needs pages
    auto a = make_paged_cache<float>(B, H, cap, D, page, page_order::hnd);
    auto b = make_paged_cache<float>(B, H, cap, D, page, page_order::hnd);
    run(a.view(), b.view());
  } else {
    auto a = make_bshd_cache<float>(B, H, cap, D);
    auto b = make_bshd_cache<float>(B, H, cap, D);
    run(a.view(), b.view());
  }
}

}  // namespace

TEST_CASE("batched prefill: bad data leaves its sequence unchanged and reports the lowest offender") {
  const std::int32_t g = 2, Hq = 4;
  SUBCASE("probabilities: NaN, infinity, negative; the lowest column, then the lowest code") {
    const float values[3] = {std::nanf(""), INFINITY, -0.25f};
    const batch_code codes[3] = {batch_code::nan_input, batch_code::infinite_input, batch_code::negative_probability};
    for (int k = 0; k < 3; ++k)
      run_bad("probs element", prefill_input::probs, 90, 1,
              [&](prompt_batch& d, auto&, auto&, auto&, auto&) { d.probs[d.at(1, 3, 40, 17)] = values[k]; },
              pack_status(1, 3 / g, 17, codes[k]));
    run_bad("two codes in one column, in two chunks; a later column; a higher head", prefill_input::probs, 90, 2,
            [&](prompt_batch& d, auto&, auto&, auto&, auto&) {
              d.probs[d.at(2, 1, 30, 9)] = -1.0f;           // (h 0, column 9): negative
              d.probs[d.at(2, 0, 70, 9)] = std::nanf("");   // (h 0, column 9): NaN, in the second chunk
              d.probs[d.at(2, 2, 50, 3)] = INFINITY;        // (h 1, column 3)
              d.probs[d.at(2, 1, 60, 12)] = std::nanf("");  // (h 0, column 12)
            },
            pack_status(2, 0, 9, batch_code::nan_input));
    run_bad("a column total that overflows", prefill_input::probs, 90, 3,
            [&](prompt_batch& d, auto&, auto&, auto&, auto&) {
              for (std::int32_t i = 5; i < 8; ++i) d.probs[d.at(3, 2, i, 5)] = 3e38f;
            },
            pack_status(3, 1, 5, batch_code::score_overflow));
  }
  SUBCASE("column sums: NaN, and a group sum that overflows") {
    run_bad("sums NaN", prefill_input::sums, 90, 0,
            [&](prompt_batch& d, auto&, auto&, auto&, auto&) {
              d.sums[(std::size_t(0) * Hq + 1) * std::size_t(d.M) + 20] = std::nanf("");
            },
            pack_status(0, 0, 20, batch_code::nan_input));
    run_bad("sums overflow in the fold", prefill_input::sums, 90, 1,
            [&](prompt_batch& d, auto&, auto&, auto&, auto&) {
              d.sums[(std::size_t(1) * Hq + 2) * std::size_t(d.M) + 4] = 3e38f;
              d.sums[(std::size_t(1) * Hq + 3) * std::size_t(d.M) + 4] = 3e38f;
            },
            pack_status(1, 1, 4, batch_code::score_overflow));
  }
  SUBCASE("queries: a non-finite LSE or query row, a NaN key") {
    const std::int32_t cap = 60;  // within one chunk: the per-sequence reference's plain order
    run_bad("lse and query rows of one head: the lowest query head", prefill_input::queries, cap, 2,
            [&](prompt_batch& d, auto&, auto&, auto&, auto&) {
              d.lse[(std::size_t(2) * Hq + 3) * std::size_t(d.M) + 33] = INFINITY;
              d.q[((std::size_t(2) * Hq + 2) * std::size_t(d.M) + 40) * std::size_t(d.D) + 1] = std::nanf("");
            },
            pack_status(2, 1, 2, batch_code::non_finite_query));
    run_bad("query", prefill_input::queries, cap, 1,
            [&](prompt_batch& d, auto&, auto&, auto&, auto&) {
              d.q[((std::size_t(1) * Hq + 1) * std::size_t(d.M) + 7) * std::size_t(d.D) + 3] = -INFINITY;
            },
            pack_status(1, 0, 1, batch_code::non_finite_query));
    run_bad("a NaN key", prefill_input::queries, cap, 3,
            [&](prompt_batch&, auto&, auto& view_a, auto& view_b, auto&) {
              view_a.k_row(3, 1, 25)[2] = view_b.k_row(3, 1, 25)[2] = std::nanf("");
            },
            pack_status(3, 1, 25, batch_code::nan_input));
    run_bad("a page outside the pool", prefill_input::queries, cap, 2,
            [&](prompt_batch&, auto&, auto& view_a, auto& view_b, auto&) {
              using layout = typename std::decay_t<decltype(view_a)>::layout_type;
              if constexpr (std::is_same_v<layout, paged_layout>) {  // queries run on a paged cache
                const_cast<std::int32_t*>(view_a.layout.page_table)[2 * view_a.layout.page_table_stride + 5] = -3;
                const_cast<std::int32_t*>(view_b.layout.page_table)[2 * view_b.layout.page_table_stride + 5] = -3;
              }
            },
            pack_status(2, 0, 40, batch_code::bad_page));
  }
  SUBCASE("the sequence: its length, tokens it already holds") {
    run_bad("length 0", prefill_input::probs, 90, 2,
            [&](prompt_batch& d, auto&, auto&, auto&, auto&) { d.lengths[2] = 0; },
            pack_status(2, 0, 0, batch_code::bad_length));
    run_bad("length above max_length", prefill_input::sums, 90, 0,
            [&](prompt_batch& d, auto&, auto&, auto&, auto&) { d.lengths[0] = d.M + 1; },
            pack_status(0, 0, 91, batch_code::bad_length));
    run_bad("not empty", prefill_input::sums, 90, 1,
            [&](prompt_batch&, auto& st, auto&, auto&, auto& appended) {
              std::uint64_t status = batch_status_clear;
              const std::int32_t one = 1;
              batched_append(st, active_set::of_list(&one, 1), &status);
              appended[1] = 1;
            },
            pack_status(1, 0, 0, batch_code::not_empty));
  }
  SUBCASE("several bad sequences: the lowest sequence's word") {
    run_bad("two", prefill_input::probs, 90, 1,
            [&](prompt_batch& d, auto&, auto&, auto&, auto&) {
              d.probs[d.at(1, 3, 40, 17)] = -2.0f;
              d.lengths[3] = 200;  // sequence 3 is refused too
            },
            pack_status(1, 1, 17, batch_code::negative_probability), 3);
  }
}

TEST_CASE("batched prefill: arguments are checked before anything changes") {
  const std::int32_t B = 2, H = 2, cap = 12;
  const policy_shape shape{B, H, 4, cap};
  raw_state<h2o_policy> st(shape, h2o_config{2, 3});
  auto cache = make_bhsd_cache<float>(B, H, cap, 4);
  std::mt19937 rng(3);
  for (float& x : cache.k_storage()) x = float(rng() % 9);
  const std::vector<unsigned char> state_before = st.memory;
  const std::vector<float> k_before = cache.k_storage();
  const std::vector<std::int32_t> lengths = {10, 12};
  const prompt_lengths prompts{lengths.data(), cap};
  std::vector<float> probs(std::size_t(B) * 4 * cap * cap, 0.01f), sums(std::size_t(B) * 4 * cap, 0.5f);
  std::vector<float> q(std::size_t(B) * 4 * cap * 4, 0.5f), lse(std::size_t(B) * 4 * cap, 1.0f);
  const batch_prefill_probs good{make_tensor_view<const float>(probs.data(), B, 4, cap, cap)};
  std::uint64_t status = batch_status_clear;
  const active_set all = active_set::all();

  CHECK_THROWS_AS(batched_prefill(st.view, all, prompts, good, cache.view(), nullptr, nullptr), invalid_argument);
  CHECK_THROWS_AS(batched_prefill(st.view, all, prompt_lengths{nullptr, cap}, good, cache.view(), nullptr, &status),
                  invalid_argument);
  CHECK_THROWS_AS(batched_prefill(st.view, all, prompt_lengths{lengths.data(), 0}, good, cache.view(), nullptr, &status),
                  out_of_range);
  CHECK_THROWS_AS(batched_prefill(st.view, all, prompt_lengths{lengths.data(), cap + 1}, good, cache.view(), nullptr,
                                  &status),
                  out_of_range);
  CHECK_THROWS_AS(batched_prefill(st.view, all, prompts,
                                  batch_prefill_probs{make_tensor_view<const float>(probs.data(), B, 4, cap, cap - 1)},
                                  cache.view(), nullptr, &status),
                  invalid_argument);
  CHECK_THROWS_AS(batched_prefill(st.view, all, prompts,
                                  batch_prefill_probs{make_tensor_view<const float>(probs.data(), B, 2, cap, cap)},
                                  cache.view(), nullptr, &status),
                  invalid_argument);
  CHECK_THROWS_AS(batched_prefill(st.view, all, prompts,
                                  batch_prefill_sums{make_tensor_view<const float>(sums.data(), B, 4, cap - 2)},
                                  cache.view(), nullptr, &status),
                  invalid_argument);
  CHECK_THROWS_AS(batched_prefill(st.view, all, prompts,
                                  batch_prefill_queries<float>{make_tensor_view<const float>(q.data(), B, 4, cap, 3),
                                                               make_tensor_view<const float>(lse.data(), B, 4, cap)},
                                  cache.view(), nullptr, &status),
                  invalid_argument);
  CHECK_THROWS_AS(batched_prefill(st.view, all, prompts,
                                  batch_prefill_queries<float>{make_tensor_view<const float>(q.data(), B, 4, cap, 4),
                                                               make_tensor_view<const float>(lse.data(), B, 4, cap),
                                                               0.0f},
                                  cache.view(), nullptr, &status),
                  invalid_argument);
  auto other = make_bhsd_cache<float>(B, 1, cap, 4);
  CHECK_THROWS_AS(batched_prefill(st.view, all, prompts, good, other.view(), nullptr, &status), invalid_argument);
  CHECK_THROWS_AS(batched_prefill(st.view, active_set::of_list(nullptr, 1), prompts, good, cache.view(), nullptr,
                                  &status),
                  invalid_argument);
  // h2o cannot keep without scores.
  CHECK_THROWS_AS(batched_prefill(st.view, all, prompts, cache.view(), nullptr, &status), invalid_argument);
  CHECK(st.memory == state_before);
  CHECK(cache.k_storage() == k_before);
  CHECK(status == batch_status_clear);

  // A good call changes both.
  batched_prefill(st.view, all, prompts, good, cache.view(), nullptr, &status);
  CHECK(status == batch_status_clear);
  CHECK(st.view.slots.lengths[1] == 12);
  CHECK(st.view.slots.counts[0] == 5);
}

TEST_CASE("batched prefill of exact_greedy refuses attention inputs, naming the one it takes") {
  exact_greedy_config c;
  c.budget = 3;
  const policy_shape shape{1, 1, 1, 6};
  raw_state<exact_greedy_policy> st(shape, c, history_extent{6, 4});
  auto cache = make_bhsd_cache<float>(1, 1, 6, 4);
  const std::vector<std::int32_t> lengths = {5};
  std::vector<float> sums(6, 0.5f);
  std::uint64_t status = batch_status_clear;
  const std::vector<unsigned char> before = st.memory;
  try {
    batched_prefill(st.view, active_set::all(), prompt_lengths{lengths.data(), 6},
                    batch_prefill_sums{make_tensor_view<const float>(sums.data(), 1, 1, 6)}, cache.view(), nullptr,
                    &status);
    FAIL("exact_greedy was not refused");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("exact_greedy") != std::string::npos);
    CHECK(std::string(e.what()).find("last prompt row's queries") != std::string::npos);
  }
  CHECK(st.memory == before);
}

TEST_CASE("batched prefill, slot table only: the reference's slot table, and the engine's own compaction gives the "
          "same bytes") {
  std::mt19937 rng(21);
  const std::int32_t B = 3, H = 2, g = 4, D = 8, cap = 150, budget = 10;
  const h2o_config config{6, 4, group_reduce::mean};
  const prefill_reference_rule rule = kvtest::reference_rule(config);
  std::int64_t compressed = 0;
  for (int round = 0; round < 4; ++round) {
    prompt_batch d = draw_prompts(rng, B, H, g, D, budget, cap);
    const policy_shape shape{B, H, H * g, cap};
    raw_state<h2o_policy> table_only(shape, config), with_cache(shape, config);
    const std::vector<unsigned char> fresh = sequence_bytes(table_only.view, 0);
    auto a = make_paged_cache<bfloat16>(B, H, cap, D, 16, page_order::nhd);
    auto b = make_paged_cache<bfloat16>(B, H, cap, D, 16, page_order::nhd);
    auto c = make_paged_cache<bfloat16>(B, H, cap, D, 16, page_order::nhd);  // the reference's compaction
    fill_caches(rng, a.view(), b.view());
    c.k_storage() = a.k_storage();
    c.v_storage() = a.v_storage();
    const batch_prefill_sums sums{make_tensor_view<const float>(d.sums.data(), B, H * g, d.M)};
    std::uint64_t status = batch_status_clear;
    batched_prefill(table_only.view, d.active_set_of(), d.prompts(), sums, &status);
    batched_prefill(with_cache.view, d.active_set_of(), d.prompts(), sums, b.view(), nullptr, &status);
    REQUIRE(status == batch_status_clear);
    for (std::int32_t s = 0; s < B; ++s) CHECK(sequence_bytes(table_only.view, s) == sequence_bytes(with_cache.view, s));
    const auto reference_view = c.view();
    for (std::int32_t s = 0; s < B; ++s) {
      if (!d.active[std::size_t(s)]) {
        CHECK(sequence_bytes(table_only.view, s) == fresh);
        continue;
      }
      const std::int32_t L = d.lengths[std::size_t(s)];
      const reference_sequence want =
          reference_prefill<float>(d, prefill_input::sums, rule, s, std::uint64_t(s), {}, &reference_view);
      check_prefilled(table_only.view, s, want, std::uint64_t(s));
      compressed += L > budget;
      // The engine's compaction: slot s' receives row positions[s'], ascending.
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t slot = 0; slot < cap; ++slot) {
          const std::int32_t p = table_only.view.slots.positions_of(s, h)[slot];
          if (p < 0 || p == slot) continue;
          std::memcpy(a.view().k_row(s, h, slot), a.view().k_row(s, h, p), sizeof(bfloat16) * D);
          std::memcpy(a.view().v_row(s, h, slot), a.view().v_row(s, h, p), sizeof(bfloat16) * D);
        }
    }
    CHECK(same_kv_bytes(a.view(), b.view()));
    CHECK(same_kv_bytes(a.view(), c.view()));
  }
  CHECK(compressed > 4);
}
