#pragma once
// A brute-force batched prefill, written in the tests from the definitions
// (docs/semantics.md, "Scores" (prefill) and "Batched prefill";
// docs/policies.md, "Prefill", "random" and "Prefill compression"), so the
// library's prefill is checked against it rather than against itself (the
// per-sequence policies are a facade over the batched host backend).
//
// What is the reference's own code: the column sums (rows in chunks of 64
// aligned at multiples of 64, each chunk summed left to right from its first
// row, the partials added in ascending chunks), the row weights
// decay^(L-1-i) (binary exponentiation, low bits first, every product
// rounded to float), each element's weighting, the keep plans (the first
// `sinks`, the last `recent` or `window`, and the top of the rest by
// (score, position) for h2o, by the Philox prefill priority
// (draw << 32 | position) for random), the compaction of the kept rows to
// slots [0, kept) and the reclaimable pages. Every float operation is one
// statement of its own (no contraction into an FMA).
//
// What it borrows from the library, one element at a time, because those
// scalar rules are pinned by their own definitional tests
// (test_decode_rules.cpp, test_order.cpp):
//   - kvevict::attention_logit (q . k in its fixed order) and
//     kvevict::probability_from_logit (exp(logit * scale - lse)) for one
//     probability of the queries + LSE input;
//   - kvevict::fold_group for the GQA fold (sum, mean, max in ascending query
//     head) of one column;
//   - kvevict::philox4x32_10 for one draw (Random123's known answers).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvevict/philox.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "support/prefill_fixtures.hpp"

namespace kvtest {

/// Which keep rule a reference prefill follows.
enum class prefill_keep { by_score, newest, by_priority };

/// The policy as the reference sees it.
struct prefill_reference_rule {
  prefill_keep keep = prefill_keep::by_score;
  std::int32_t budget = 0;
  std::int32_t sinks = 0;
  std::int32_t recent = 0;  ///< h2o's and random's recent; recent_window's window
  kvevict::group_reduce reduce = kvevict::group_reduce::sum;
  float decay = 1.0f;
  std::uint64_t seed = 0;
};

inline prefill_reference_rule reference_rule(const kvevict::h2o_config& c) {
  return {prefill_keep::by_score, std::int32_t(c.budget()), c.sinks, c.recent, c.reduce, c.decay, 0};
}
inline prefill_reference_rule reference_rule(const kvevict::recent_window_config& c) {
  return {prefill_keep::newest, std::int32_t(c.budget()), c.sinks, c.window, kvevict::group_reduce::sum, 1.0f, 0};
}
inline prefill_reference_rule reference_rule(const kvevict::random_config& c) {
  return {prefill_keep::by_priority, c.budget, c.sinks, c.recent, kvevict::group_reduce::sum, 1.0f, c.seed};
}

namespace ref_detail {
inline float mul(float a, float b) {
  const float r = a * b;
  return r;
}
inline float add(float a, float b) {
  const float r = a + b;
  return r;
}
}  // namespace ref_detail

/// decay^n: square the base, multiply the result at each set bit of n, low
/// bits first, every product rounded to float; 1 for n = 0.
inline float reference_decay_power(float decay, std::int32_t n) {
  float result = 1.0f, base = decay;
  for (std::int32_t e = n; e > 0; e /= 2) {
    if (e % 2 == 1) result = ref_detail::mul(result, base);
    if (e > 1) base = ref_detail::mul(base, base);
  }
  return result;
}

/// Column p of a prompt of `length` rows, value(i) for rows i in [p, length),
/// in chunks of 64 aligned at multiples of 64, each from its first row, the
/// partials in ascending chunks.
template <class Value>
float reference_column_sum(std::int32_t p, std::int32_t length, Value value) {
  float total = 0.0f;
  bool started = false;
  for (std::int32_t first = (p / 64) * 64; first < length; first += 64) {
    float part = 0.0f;
    bool any = false;
    for (std::int32_t i = std::max(first, p); i < std::min(first + 64, length); ++i) {
      const float x = value(i);
      part = any ? ref_detail::add(part, x) : x;
      any = true;
    }
    total = started ? ref_detail::add(total, part) : part;
    started = true;
  }
  return total;
}

/// Row i's element as it enters its column: weighted by decay^(L-1-i), the
/// product rounded.
inline float reference_weighted(float decay, std::int32_t length, std::int32_t i, float x) {
  return ref_detail::mul(reference_decay_power(decay, length - 1 - i), x);
}

/// The prefill scores [0, L) of KV head h of sequence b from the batch's
/// input `kind` (none: zeros). `qv` are the queries in the dtype the call
/// takes, `key(p)` the cached key row of position p (slot p).
template <class Q, class KeyRow>
std::vector<float> reference_prefill_scores(const prompt_batch& d, prefill_input kind, const prefill_reference_rule& r,
                                            std::int32_t b, std::int32_t h, const std::vector<Q>& qv, KeyRow key) {
  const std::int32_t L = d.lengths[std::size_t(b)], g = d.g;
  std::vector<float> out(static_cast<std::size_t>(L), 0.0f);
  if (kind == prefill_input::none) return out;
  std::vector<float> column(static_cast<std::size_t>(g));
  for (std::int32_t p = 0; p < L; ++p) {
    for (std::int32_t j = 0; j < g; ++j) {
      const std::int32_t q = h * g + j;
      switch (kind) {
        case prefill_input::probs:
          column[std::size_t(j)] = reference_column_sum(
              p, L, [&](std::int32_t i) { return reference_weighted(r.decay, L, i, d.probs[d.at(b, q, i, p)]); });
          break;
        case prefill_input::sums: column[std::size_t(j)] = d.sums[d.row(b, q, p)]; break;  // taken as given
        case prefill_input::queries:
          column[std::size_t(j)] = reference_column_sum(p, L, [&](std::int32_t i) {
            const float logit = kvevict::attention_logit(qv.data() + d.row(b, q, i) * std::size_t(d.D), 1, key(p), d.D);
            const float x = kvevict::probability_from_logit(logit, d.scale, d.lse[d.row(b, q, i)], d.base);
            return reference_weighted(r.decay, L, i, x);
          });
          break;
        case prefill_input::none: break;
      }
    }
    out[std::size_t(p)] =
        kvevict::fold_group(h * g, g, r.reduce, true, [&](std::int32_t q) { return column[std::size_t(q - h * g)]; })
            .value;
  }
  return out;
}

/// random's prefill priority of candidate p of KV head h: the first word of
/// Philox4x32-10 of {p, stream bits 0-31, h, 1 | stream bits 32-62 << 1}
/// under {seed low, seed high}, above the position.
inline std::uint64_t reference_prefill_priority(std::uint64_t seed, std::uint64_t stream, std::int32_t h,
                                                std::int32_t p) {
  const kvevict::philox4x32_counter draw = kvevict::philox4x32_10(
      {{std::uint32_t(p), std::uint32_t(stream), std::uint32_t(h), (std::uint32_t(stream >> 32) << 1) | 1u}},
      {{std::uint32_t(seed), std::uint32_t(seed >> 32)}});
  return std::uint64_t{draw.v[0]} << 32 | std::uint32_t(p);
}

/// The positions a head keeps, ascending: every one when L <= budget; else
/// the first `sinks`, the last `recent` (recent_window: `window`) and the
/// best budget - sinks - recent of the others (h2o: highest score, then the
/// newer position; random: highest priority; recent_window: none left).
inline std::vector<std::int32_t> reference_keep(const prefill_reference_rule& r, std::int32_t L,
                                                const std::vector<float>& scores, std::uint64_t stream,
                                                std::int32_t h) {
  std::vector<std::int32_t> keep;
  if (L <= r.budget) {
    for (std::int32_t p = 0; p < L; ++p) keep.push_back(p);
    return keep;
  }
  for (std::int32_t p = 0; p < r.sinks; ++p) keep.push_back(p);
  for (std::int32_t p = L - r.recent; p < L; ++p) keep.push_back(p);
  std::vector<std::int32_t> others;
  for (std::int32_t p = r.sinks; p < L - r.recent; ++p) others.push_back(p);
  const auto better = [&](std::int32_t x, std::int32_t y) {  // x before y: x is kept first
    switch (r.keep) {
      case prefill_keep::by_score: {
        const float sx = scores[std::size_t(x)], sy = scores[std::size_t(y)];
        return sx != sy ? sx > sy : x > y;
      }
      case prefill_keep::by_priority:
        return reference_prefill_priority(r.seed, stream, h, x) > reference_prefill_priority(r.seed, stream, h, y);
      case prefill_keep::newest: return x > y;
    }
    return false;
  };
  std::sort(others.begin(), others.end(), better);
  const std::size_t take = static_cast<std::size_t>(r.budget - std::int32_t(keep.size()));
  for (std::size_t i = 0; i < take && i < others.size(); ++i) keep.push_back(others[i]);
  std::sort(keep.begin(), keep.end());
  return keep;
}

/// What one prefilled sequence must hold: per KV head the kept positions
/// (slot s holds keep[s]) and their scores.
struct reference_sequence {
  std::int32_t length = 0;
  std::vector<std::vector<std::int32_t>> keep;  // [H][kept]
  std::vector<std::vector<float>> scores;       // [H][kept]
};

/// The reference prefill of sequence b: scores from the input, the keep
/// set, and the compaction written into `expected` (the cache as the call
/// must leave it; it must hold the prompt's rows at slots [0, L) on entry):
/// slot s receives the rows of position keep[s], ascending, the other
/// slots stay as they were. Returns the kept positions and scores.
template <class Q, class V>
reference_sequence reference_prefill(const prompt_batch& d, prefill_input kind, const prefill_reference_rule& r,
                                     std::int32_t b, std::uint64_t stream, const std::vector<Q>& qv,
                                     const V* expected) {
  using T = typename V::element_type;
  reference_sequence out;
  out.length = d.lengths[std::size_t(b)];
  const std::int32_t L = out.length;
  for (std::int32_t h = 0; h < d.H; ++h) {
    std::vector<float> scores;
    if (kind == prefill_input::queries) {
      scores = reference_prefill_scores<Q>(d, kind, r, b, h, qv, [&](std::int32_t p) { return expected->k_row(b, h, p); });
    } else {
      scores = reference_prefill_scores<Q>(d, kind, r, b, h, qv, [](std::int32_t) { return static_cast<const T*>(nullptr); });
    }
    std::vector<std::int32_t> keep = reference_keep(r, L, scores, stream, h);
    std::vector<float> kept_scores;
    for (std::int32_t p : keep) kept_scores.push_back(scores[std::size_t(p)]);
    if (expected) {
      const std::size_t row = std::size_t(d.D);
      std::vector<T> k(keep.size() * row), v(keep.size() * row);
      for (std::size_t s = 0; s < keep.size(); ++s) {
        std::memcpy(k.data() + s * row, expected->k_row(b, h, keep[s]), sizeof(T) * row);
        std::memcpy(v.data() + s * row, expected->v_row(b, h, keep[s]), sizeof(T) * row);
      }
      for (std::size_t s = 0; s < keep.size(); ++s) {
        std::memcpy(expected->k_row(b, h, std::int32_t(s)), k.data() + s * row, sizeof(T) * row);
        std::memcpy(expected->v_row(b, h, std::int32_t(s)), v.data() + s * row, sizeof(T) * row);
      }
    }
    out.keep.push_back(std::move(keep));
    out.scores.push_back(std::move(kept_scores));
  }
  return out;
}

/// Pages of P slots a paged prompt of L tokens no longer needs once min(L,
/// budget) tokens and the spare slot remain: ceil(L / P) - ceil(min(budget
/// + 1, capacity) / P), at least 0.
inline std::int32_t reference_reclaimable(std::int32_t L, std::int32_t budget, std::int32_t capacity,
                                          std::int32_t page_size) {
  const std::int32_t used = (L + page_size - 1) / page_size;
  const std::int32_t keep = (std::min(budget + 1, capacity) + page_size - 1) / page_size;
  return std::max(0, used - keep);
}

}  // namespace kvtest
