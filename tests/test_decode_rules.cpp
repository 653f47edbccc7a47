// The shared decode rules (decode_rules.hpp) that the per-sequence policies,
// the batched host backend and the CUDA kernels all run, checked against
// independent transcriptions of their specification and against references
// in higher precision; and the status word of the batched calls.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/random_reference.hpp"

namespace {

using namespace kvevict;

template <class T>
std::vector<T> random_row(std::mt19937& rng, std::int32_t n, float spread) {
  std::normal_distribution<float> d(0.0f, spread);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (T& x : v) x = from_float<T>(d(rng));
  return v;
}

// The canonical order written out the obvious way: all chunk sums, then the
// balanced tree over a power-of-two count, recursively.
float tree(const std::vector<float>& v, std::size_t lo, std::size_t n) {
  if (n == 1) return v[lo];
  return tree(v, lo, n / 2) + tree(v, lo + n / 2, n / 2);
}

// A key element's value: itself, or an fp8 code's value times the scale.
template <class K>
float element(K x, float scale) {
  if constexpr (std::is_same_v<K, fp8_e4m3>) return fp8_e4m3_to_float(x) * scale;
  else if constexpr (std::is_same_v<K, fp8_e5m2>) return fp8_e5m2_to_float(x) * scale;
  else return to_float(x);
}

template <class Q, class K>
float canonical_dot(const Q* q, std::int64_t q_stride, const K* k, std::int32_t d, float scale = 1.0f) {
  const std::int32_t chunk = static_cast<std::int32_t>(16 / sizeof(K));  // 16 fp8 codes
  std::vector<float> sums;
  for (std::int32_t c = 0; c < d; c += chunk) {
    float s = to_float(q[c * q_stride]) * element(k[c], scale);
    for (std::int32_t i = c + 1; i < std::min(d, c + chunk); ++i)
      s += to_float(q[i * q_stride]) * element(k[i], scale);
    sums.push_back(s);
  }
  std::size_t n = 1;
  while (n < sums.size()) n *= 2;
  sums.resize(n, 0.0f);
  return tree(sums, 0, n);
}

template <class K>
void check_attention_logit(std::mt19937& rng) {
  for (int trial = 0; trial < 3000; ++trial) {
    const std::int32_t d = 1 + static_cast<std::int32_t>(rng() % 300);
    const std::int64_t stride = 1 + static_cast<std::int64_t>(rng() % 3);
    const std::vector<float> q = random_row<float>(rng, std::int32_t(d * stride), 1.0f);
    const std::vector<K> k = random_row<K>(rng, d, 1.0f);
    const float scale = is_fp8_v<K> ? std::uniform_real_distribution<float>(0.01f, 3.0f)(rng) : 1.0f;
    const float got = attention_logit(q.data(), stride, k.data(), d, scale);
    CAPTURE(d);
    CAPTURE(scale);
    CHECK(got == canonical_dot(q.data(), stride, k.data(), d, scale));
    if constexpr (is_fp8_v<K>) {  // key norms: ||k||^2 in the codes' order, the scale on both sides
      std::vector<float> values(k.size());
      for (std::size_t i = 0; i < k.size(); ++i) values[i] = element(k[i], scale);
      CHECK(key_norm_score(k.data(), d, scale) == -std::sqrt(canonical_dot(values.data(), 1, k.data(), d, scale)));
    }
    long double exact = 0, size = 0;
    for (std::int32_t i = 0; i < d; ++i) {
      exact += static_cast<long double>(q[std::size_t(i * stride)]) * element(k[std::size_t(i)], scale);
      size += std::abs(static_cast<long double>(q[std::size_t(i * stride)]) * element(k[std::size_t(i)], scale));
    }
    CHECK(std::abs(got - exact) <= 2.0L * d * std::numeric_limits<float>::epsilon() * size);
  }
}

}  // namespace

TEST_CASE("attention_logit: 16-byte chunks summed in order, then a balanced tree; bitwise") {
  std::mt19937 rng(11);
  check_attention_logit<float>(rng);
  check_attention_logit<half>(rng);
  check_attention_logit<bfloat16>(rng);
  check_attention_logit<fp8_e4m3>(rng);  // 16 codes a chunk, each code x scale
  check_attention_logit<fp8_e5m2>(rng);
}

TEST_CASE("probability_from_logit is exp(logit * scale - lse) to float rounding, in both LSE bases") {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> logit(-30.0f, 30.0f), lse(-5.0f, 20.0f), scale(0.05f, 1.0f);
  for (int i = 0; i < 200000; ++i) {
    const float l = logit(rng), s = scale(rng), e = lse(rng);
    const long double arg = static_cast<long double>(l) * s - e;
    const float nat = probability_from_logit(l, s, e, lse_base::natural);
    const float want = static_cast<float>(std::exp(arg));
    CHECK(std::abs(nat - want) <= std::abs(want) * std::numeric_limits<float>::epsilon());
    // Base 2: the same probability when the LSE is given as log2.
    const float e2 = static_cast<float>(e / std::log(2.0L));
    const long double arg2 = static_cast<long double>(l) * s - static_cast<long double>(e2) * std::log(2.0L);
    const float want2 = static_cast<float>(std::exp(arg2));
    CHECK(std::abs(probability_from_logit(l, s, e2, lse_base::base2) - want2) <=
          std::abs(want2) * std::numeric_limits<float>::epsilon());
  }
  CHECK(probability_from_logit(0.0f, 1.0f, 0.0f, lse_base::natural) == 1.0f);
  CHECK(probability_from_logit(-200.0f, 1.0f, 0.0f, lse_base::natural) == 0.0f);
  CHECK(std::isinf(probability_from_logit(100.0f, 1.0f, 0.0f, lse_base::natural)));
}

TEST_CASE("fold_group: sum, mean and max in query order; the first bad input is named") {
  const float x[4] = {0.5f, 0.25f, 0.125f, 1.0f};
  auto value = [&](std::int32_t q) { return x[q]; };
  CHECK(fold_group(0, 4, group_reduce::sum, true, value).value == 1.875f);
  CHECK(fold_group(0, 4, group_reduce::mean, true, value).value == 1.875f / 4.0f);
  CHECK(fold_group(0, 4, group_reduce::max, true, value).value == 1.0f);
  CHECK(fold_group(1, 2, group_reduce::sum, true, value).value == 0.375f);
  const float bad[3] = {0.5f, -0.25f, std::nanf("")};
  auto bad_value = [&](std::int32_t q) { return bad[q]; };
  const slot_increment neg = fold_group(0, 3, group_reduce::sum, true, bad_value);
  CHECK(neg.code == batch_code::negative_probability);
  CHECK(neg.query == 1);
  CHECK(fold_group(0, 3, group_reduce::sum, false, bad_value).code == batch_code::nan_input);  // increments may be negative
  CHECK(fold_group(0, 3, group_reduce::sum, false, bad_value).query == 2);
  const float inf[1] = {std::numeric_limits<float>::infinity()};
  CHECK(fold_group(0, 1, group_reduce::max, true, [&](std::int32_t q) { return inf[q]; }).code ==
        batch_code::infinite_input);
}

TEST_CASE("pick_victim: lowest key, oldest, or the lowest random priority; never a protected or free slot") {
  // Slots hold positions 7, -1 (free), 2, 9, 4, 5; length 10.
  const std::int32_t pos[6] = {7, -1, 2, 9, 4, 5};
  const float score[6] = {0.5f, -100.0f, 3.0f, 0.0f, 0.5f, 1.0f};
  decode_rule h2o;
  h2o.protect = {0, 2};  // positions 8, 9 protected
  // Keys among 7, 2, 4, 5: (0.5, 7), (3, 2), (0.5, 4), (1, 5): the tie at 0.5 goes to the older, 4 (slot 4).
  CHECK(pick_victim(h2o, pos, score, 6, 10, 0, 0) == 4);
  decode_rule window;
  window.victim = victim_rule::oldest;
  window.protect = {3, 0};  // positions 0..2 are sinks: the oldest other is 4
  CHECK(pick_victim(window, pos, score, 6, 10, 0, 0) == 4);
  decode_rule random;
  random.victim = victim_rule::random_priority;
  random.protect = {3, 2};  // candidates: positions 4, 5, 7 in slots 4, 5, 0
  random.seed = 42;
  const std::int32_t slot_of[8] = {-1, -1, -1, -1, 4, 5, -1, 0};
  std::int32_t seen[8] = {};
  for (std::uint64_t stream = 0; stream < 60; ++stream) {
    const std::int32_t p = kvtest::random_victims(42, stream, 1, 9, {4, 5, 7}, 1)[0];
    CHECK(pick_victim(random, pos, score, 6, 10, stream, 1) == slot_of[p]);
    ++seen[p];
  }
  CHECK((seen[4] > 0 && seen[5] > 0 && seen[7] > 0));  // each candidate is taken for some stream
  decode_rule all;
  all.protect = {10, 0};
  CHECK(pick_victim(all, pos, score, 6, 10, 0, 0) == -1);
}

TEST_CASE("status word: packs (sequence, head, index, code) so the lowest offender wins, and throws by kind") {
  const std::uint64_t a = pack_status(3, 2, 17, batch_code::nan_input);
  const batch_status s = batch_status::unpack(a);
  CHECK(s.sequence == 3);
  CHECK(s.head == 2);
  CHECK(s.index == 17);
  CHECK(s.code == batch_code::nan_input);
  CHECK(pack_status(2, 4000, 1 << 27, batch_code::history_gap) < pack_status(3, 0, 0, batch_code::nan_input));
  CHECK(pack_status(3, 1, 99, batch_code::score_overflow) < pack_status(3, 2, 0, batch_code::nan_input));
  CHECK(pack_status(1048575, 4095, (1 << 28) - 1, batch_code::history_gap) < batch_status_clear);
  CHECK(batch_status::unpack(batch_status_clear).ok());
  CHECK_NOTHROW(throw_if_error(batch_status_clear));
  CHECK_THROWS_AS(throw_if_error(a), non_finite_error);
  CHECK_THROWS_AS(throw_if_error(pack_status(0, 0, 5, batch_code::bad_page)), out_of_range);
  CHECK_THROWS_AS(throw_if_error(pack_status(0, 0, 0, batch_code::no_free_slot)), state_error);
  try {
    throw_if_error(a, "observe_evict");
  } catch (const error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("kvevict::batch::observe_evict") == 0);
    CHECK(msg.find("sequence 3, head 2, index 17") != std::string::npos);
  }
}

TEST_CASE("per-sequence observe with logits + LSE equals observe with queries + LSE bit for bit") {
  // The queries path computes each logit with attention_logit; feeding the
  // canonical dot written out here as logits must give the same scores.
  std::mt19937 rng(8);
  const std::int32_t heads = 2, group = 3, d = 24, cap = 9;
  const policy_shape shape{1, heads, heads * group, cap};
  auto cache = make_bhsd_cache<half>(1, heads, cap, d);
  h2o_policy by_queries(shape, h2o_config{4, 4}), by_logits(shape, h2o_config{4, 4});
  const float scale = 0.2f;
  for (int step = 0; step < 30; ++step) {
    std::int32_t slots[heads];
    for (std::int32_t h = 0; h < heads; ++h) slots[h] = by_queries.next_slot(0, h);
    const std::vector<half> k = random_row<half>(rng, heads * d, 1.0f), v = random_row<half>(rng, heads * d, 1.0f);
    scatter(cache.view(), 0, slots, make_tensor_view<const half>(k.data(), heads, d),
            make_tensor_view<const half>(v.data(), heads, d));
    by_queries.append(0);
    by_logits.append(0);
    const std::vector<float> q = random_row<float>(rng, heads * group * d, 1.0f);
    std::vector<float> lse(std::size_t(heads * group)), logits(std::size_t(heads * group * cap), std::nanf(""));
    for (std::int32_t qh = 0; qh < heads * group; ++qh) {
      lse[std::size_t(qh)] = std::uniform_real_distribution<float>(1.0f, 3.0f)(rng);
      for (std::int32_t s = 0; s < cap; ++s)
        if (by_queries.slots().position(0, qh / group, s) >= 0)
          logits[std::size_t(qh * cap + s)] = canonical_dot(&q[std::size_t(qh * d)], 1, cache.view().k_row(0, qh / group, s), d);
    }
    const auto lse_view = make_tensor_view<const float>(lse.data(), heads * group);
    by_queries.observe(0, decode_queries<float>{make_tensor_view<const float>(q.data(), heads * group, d), lse_view, scale},
                       cache.view());
    by_logits.observe(0, decode_logits{make_tensor_view<const float>(logits.data(), heads * group, cap), lse_view, scale});
    for (std::int32_t h = 0; h < heads; ++h)
      for (std::int32_t s = 0; s < cap; ++s) CHECK(std::memcmp(&by_queries.scores_of(0, h)[s], &by_logits.scores_of(0, h)[s], 4) == 0);
    by_queries.evict(0);
    by_logits.evict(0);
    for (std::int32_t h = 0; h < heads; ++h)
      for (std::int32_t s = 0; s < cap; ++s)
        CHECK(by_queries.slots().position(0, h, s) == by_logits.slots().position(0, h, s));
  }
}

TEST_CASE("observe rejects a score that would overflow, and bad logits, leaving every score as it was") {
  h2o_policy pol(policy_shape{1, 1, 2, 4}, h2o_config{1, 2});
  pol.append(0);
  pol.append(0);
  const float big[2 * 4] = {3e38f, 3e38f, 0, 0, 3e38f, 3e38f, 0, 0};
  const std::vector<float> before(pol.scores_of(0, 0), pol.scores_of(0, 0) + 4);
  // Each probability is finite, but 3e38 + 3e38 is not: rejected.
  CHECK_THROWS_AS(pol.observe(0, decode_probs{make_tensor_view<const float>(big, 2, 4)}), non_finite_error);
  CHECK(std::vector<float>(pol.scores_of(0, 0), pol.scores_of(0, 0) + 4) == before);
  const float inc[4] = {3e38f, 1.0f, 0, 0};
  pol.observe(0, head_scores{make_tensor_view<const float>(inc, 1, 4)});
  pol.evict(0);  // 2 tokens: within the budget
  pol.append(0);
  CHECK_THROWS_AS(pol.observe(0, head_scores{make_tensor_view<const float>(inc, 1, 4)}), non_finite_error);
  CHECK(pol.score(0, 0, 0) == 3e38f);
  const float logits[2 * 4] = {0.0f, std::nanf(""), 0, 0, 0, 0, 0, 0}, lse[2] = {0, 0};
  CHECK_THROWS_AS(pol.observe(0, decode_logits{make_tensor_view<const float>(logits, 2, 4),
                                                make_tensor_view<const float>(lse, 2), 1.0f}),
                  non_finite_error);
  CHECK(pol.score(0, 0, 1) == 1.0f);
}

TEST_CASE("out-of-range enum values are rejected, naming the argument") {
  h2o_config c{2, 2};
  c.reduce = static_cast<group_reduce>(9);
  try {
    h2o_policy pol(policy_shape{1, 1, 1, 5}, c);
    FAIL("accepted group_reduce(9)");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("'config.reduce' = 9") != std::string::npos);
  }
}

TEST_CASE("h2o's decay and sinks: a decay outside [0, 1] or NaN and negative sinks are refused, naming the field") {
  for (const float decay : {-0.5f, 1.0001f, std::nanf(""), std::numeric_limits<float>::infinity()}) {
    h2o_config c{2, 2};
    c.decay = decay;
    CAPTURE(decay);
    CHECK_THROWS_WITH_AS(h2o_policy(policy_shape{1, 1, 1, 5}, c), doctest::Contains("'config.decay'"), out_of_range);
    CHECK_THROWS_AS(batch_state_bytes<h2o_policy>(policy_shape{1, 1, 1, 5}, c), out_of_range);
  }
  h2o_config c{2, 2};
  c.sinks = -1;
  CHECK_THROWS_WITH_AS(h2o_policy(policy_shape{1, 1, 1, 5}, c), doctest::Contains("'config.sinks'"), budget_error);
  c.sinks = 1;  // budget 5: capacity 5 no longer holds the spare slot
  CHECK_THROWS_AS(h2o_policy(policy_shape{1, 1, 1, 5}, c), budget_error);
  CHECK(h2o_policy(policy_shape{1, 1, 1, 6}, c).rule().budget == 5);
  c.decay = 0.0f;
  c.sinks = 0;
  CHECK(h2o_policy(policy_shape{1, 1, 1, 5}, c).rule().decay == 0.0f);
}

TEST_CASE("updated_score and the prefill row weights follow their definitions") {
  // decay * score rounded to float, then the increment: never one fused operation.
  const float score = 1.0f + 0x1p-23f, decay = 1.0f - 0x1p-24f;
  const volatile float product = decay * score;
  CHECK(updated_score(decay, score, -1.0f) == product - 1.0f);
  CHECK(updated_score(1.0f, -0.0f, 0.0f) == 0.0f);
  CHECK(updated_score(0.0f, 3e38f, 0.25f) == 0.25f);  // TOVA: the old score is gone
  // decay^n: exact where the powers are exact, within a few ulps of the real power otherwise.
  for (std::int32_t n = 0; n < 200; ++n) {
    CHECK(decay_power(1.0f, n) == 1.0f);
    CHECK(decay_power(0.0f, n) == (n == 0 ? 1.0f : 0.0f));
    CHECK(decay_power(0.5f, n) == static_cast<float>(std::ldexp(1.0, -n)));
    const double real = std::pow(double(0.9f), double(n));  // of the float nearest 0.9
    CHECK(std::fabs(decay_power(0.9f, n) - real) <= 1e-6 * real * (1 + n / 8));
  }
  // Row i of a prompt of L weighs decay^(L - 1 - i): the last row fully.
  CHECK(decayed_row(0.0f, 10, 9, 0.75f) == 0.75f);
  CHECK(decayed_row(0.0f, 10, 8, 0.75f) == 0.0f);
  CHECK(decayed_row(0.5f, 10, 7, 0.75f) == 0.1875f);
  CHECK(decayed_row(1.0f, 10, 0, 0.75f) == 0.75f);
}

// ---- the host hot path (decode_pass.hpp) against the scalar rules it replaces ----

TEST_CASE("decode_pass: the vectorised fold, decayed add and victim search decide as fold_group and pick_victim") {
  std::mt19937 rng(20261123u);
  const float specials[] = {0.0f, -0.0f, 1.0f, 0.5f, 0.25f, 1e-40f, 3e38f};
  const float decays[] = {1.0f, 0.0f, 0.5f, 0.9f, 0.999f};  // H2O, TOVA, and moving averages between
  std::int32_t trials = 0, ties = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const std::int32_t width = 1 + std::int32_t(rng() % 37);  // not a multiple of 4 most of the time
    const std::int32_t g = 1 + std::int32_t(rng() % 5);
    const group_reduce reduce = static_cast<group_reduce>(rng() % 3);
    const float decay = decays[rng() % 5];
    // Positions: a permutation of a window ending at length - 1, some slots free.
    const std::int32_t length = width + std::int32_t(rng() % 50);
    std::vector<std::int32_t> pos(static_cast<std::size_t>(width));
    for (std::int32_t s = 0; s < width; ++s) pos[std::size_t(s)] = length - 1 - s;
    std::shuffle(pos.begin(), pos.end(), rng);
    for (std::int32_t s = 0; s < width; ++s)
      if (rng() % 5 == 0) pos[std::size_t(s)] = -1;
    // Probabilities on a coarse grid (many exact ties), garbage in free columns.
    std::vector<float> probs(std::size_t(g) * width);
    for (std::int32_t j = 0; j < g; ++j)
      for (std::int32_t s = 0; s < width; ++s)
        probs[std::size_t(j) * width + s] = pos[std::size_t(s)] < 0 ? std::nanf("") : float(rng() % 4) / 4.0f;
    std::vector<float> score(std::size_t(width), 0.0f), reference(std::size_t(width), 0.0f);
    std::vector<float> incs(static_cast<std::size_t>(width), 0.0f);
    for (std::int32_t s = 0; s < width; ++s) {
      if (pos[std::size_t(s)] < 0) continue;
      const slot_increment inc =
          fold_group(0, g, reduce, true, [&](std::int32_t q) { return probs[std::size_t(q) * width + s]; });
      REQUIRE(inc.code == batch_code::ok);
      incs[std::size_t(s)] = inc.value;
      // Scores of any sign, signed zeros included; free slots hold +0.
      score[std::size_t(s)] = specials[rng() % 6] * (rng() % 2 ? 1.0f : -1.0f);
      // The definition: the decayed score rounded to float, then the increment added.
      const volatile float decayed = decay * score[std::size_t(s)];
      reference[std::size_t(s)] = decayed + inc.value;
    }
    // One pass: fold and add (g = 1, 2, 4, 8 in one pass, the others row by row).
    std::vector<float> next(static_cast<std::size_t>(width));
    REQUIRE(detail::fold_and_add_probability_rows([&](std::int32_t j) { return probs.data() + std::size_t(j) * width; },
                                                  g, reduce, decay, score.data(), pos.data(), width, next.data()));
    CHECK(std::memcmp(next.data(), reference.data(), sizeof(float) * std::size_t(width)) == 0);
    // A row of increments (the head_scores path).
    std::vector<float> added(static_cast<std::size_t>(width));
    REQUIRE(detail::next_scores(decay, score.data(), incs.data(), pos.data(), width, added.data()));
    CHECK(std::memcmp(added.data(), reference.data(), sizeof(float) * std::size_t(width)) == 0);
    for (const victim_rule victim : {victim_rule::lowest_score, victim_rule::oldest}) {
      decode_rule rule;
      rule.victim = victim;
      rule.protect = {std::int32_t(rng() % 3), std::int32_t(rng() % 4)};
      const std::int32_t expected = pick_victim(rule, pos.data(), next.data(), width, length, 0, 0);
      CHECK(detail::find_victim(rule, next.data(), pos.data(), width, length) == expected);
      std::vector<float> committed = score;
      CHECK(detail::commit_and_find_victim(rule, next.data(), committed.data(), pos.data(), width, length) == expected);
      CHECK(std::memcmp(committed.data(), next.data(), sizeof(float) * std::size_t(width)) == 0);
      ++trials;
    }
    score = next;
    ties += std::int32_t(std::count(score.begin(), score.end(), 0.0f)) > 1;
  }
  CHECK(trials == 8000);
  CHECK(ties > 1000);  // the grid makes ties common, so the position tie-break is exercised
}

TEST_CASE("decode_pass: a bad element anywhere in an occupied column fails the row check; free columns are ignored") {
  const std::int32_t width = 11;
  std::vector<std::int32_t> pos(width);
  for (std::int32_t s = 0; s < width; ++s) pos[std::size_t(s)] = s == 6 ? -1 : s;
  std::vector<float> row(width, 0.5f), out(width);
  const std::vector<float> zero(width, 0.0f);
  const auto fold_and_add = [&](const std::vector<float>& score, std::int32_t g,
                                group_reduce reduce = group_reduce::sum) {
    return detail::fold_and_add_probability_rows([&](std::int32_t) { return row.data(); }, g, reduce, 1.0f, score.data(),
                                                 pos.data(), width, out.data());
  };
  CHECK(fold_and_add(zero, 2));
  for (const float bad : {std::nanf(""), std::numeric_limits<float>::infinity(), -0.25f})
    for (std::int32_t s = 0; s < width; ++s) {
      row.assign(width, 0.5f);
      row[std::size_t(s)] = bad;
      CHECK(fold_and_add(zero, 2) == (s == 6));  // slot 6 is free: its column is ignored
      CHECK(fold_and_add(zero, 3) == (s == 6));  // the row-by-row path of other group sizes
      CHECK(detail::next_scores(1.0f, zero.data(), row.data(), pos.data(), width, out.data()) ==
            (s == 6 || bad == -0.25f));  // increments may be negative: next_scores checks them through the sum
    }
  row.assign(width, 3e38f);  // each element valid, the sum over the two rows is not
  CHECK_FALSE(fold_and_add(zero, 2));
  CHECK_FALSE(fold_and_add(zero, 3));
  std::vector<float> big(width, 3e38f), next(width);
  CHECK_FALSE(detail::next_scores(1.0f, big.data(), big.data(), pos.data(), width, next.data()));
  // A valid fold (3e38), an overflowing score, in the one-pass and row-by-row paths.
  CHECK(fold_and_add(zero, 1));
  CHECK_FALSE(fold_and_add(big, 1));
  CHECK(fold_and_add(zero, 5, group_reduce::max));
  CHECK_FALSE(fold_and_add(big, 5, group_reduce::max));
  big[6] = 0.0f;  // only the free slot: ignored
  for (std::int32_t s = 0; s < width; ++s) row[std::size_t(s)] = s == 6 ? 3e38f : 0.0f;
  CHECK(detail::next_scores(1.0f, big.data(), row.data(), pos.data(), width, next.data()));
}
