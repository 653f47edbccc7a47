#pragma once
// The row form of the decode rules for the host's hot path (the batched host
// backend's observe + evict, which both host APIs run): loops over the
// occupied width that compilers vectorise, a row of slots at a time where
// the rules of decode_rules.hpp (fold_step, pick_victim) go a slot at a
// time. The fold's arithmetic is theirs; the victim search is the same
// minimum, for the rules whose key is the score or the position. They
// decide bit for bit as the slot form (test_decode_rules), which stays the
// definition: validation here is one reduction per row, and the caller goes
// back to the slot form, which names the problem, only when it fails.
//
// Slots hold position -1 when free; columns of free slots may hold anything
// (engines leave garbage there) and are masked, never trusted.
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kvevict/detail/reproducible_math.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/score_inputs.hpp"

namespace kvevict {
namespace detail {

/// True when v is not a probability: NaN, inf or negative.
inline std::uint32_t not_probability(float v) noexcept {
  return std::uint32_t(!(v >= 0.0f) | (v > std::numeric_limits<float>::max()));
}

/// True when v is NaN or infinite.
inline std::uint32_t outside_float_range(float v) noexcept {
  constexpr float kMax = std::numeric_limits<float>::max();
  return std::uint32_t(!(v >= -kMax) | (v > kMax));
}

/// fold_and_add_probability_rows for a group size and reduction known at
/// compile time: one pass, the G rows read side by side, no branch in the
/// loop; out[s] = decay * score[s] + the fold, as next_scores updates it.
template <std::int32_t G, group_reduce Reduce, class RowOf>
bool fold_and_add_pass(RowOf rows, float decay, const float* score, const std::int32_t* positions,
                       std::int32_t width, float* out) noexcept {
  constexpr float kMax = std::numeric_limits<float>::max();
  const float* x[G];
  for (std::int32_t j = 0; j < G; ++j) x[j] = rows(j);
  std::uint32_t bad = 0;
  for (std::int32_t s = 0; s < width; ++s) {
    float acc = 0.0f;
    std::uint32_t wrong = 0;
    for (std::int32_t j = 0; j < G; ++j) {
      const float v = x[j][s];
      wrong |= not_probability(v);
      acc = fold_step(Reduce, acc, v);  // Reduce is a constant: no branch is left
    }
    acc = fold_end(Reduce, acc, G);
    // Finite elements can sum past FLT_MAX (the slot form names the group).
    if constexpr (Reduce != group_reduce::max) wrong |= std::uint32_t(acc > kMax);
    const std::uint32_t occupied = positions[s] >= 0;
    const float v = updated_score(decay, score[s], occupied ? acc : 0.0f);  // next_scores' rule
    bad |= occupied & (wrong | outside_float_range(v));
    out[s] = v;
  }
  return bad == 0;
}

template <std::int32_t G, class RowOf>
bool fold_and_add_fixed(RowOf rows, group_reduce reduce, float decay, const float* score,
                        const std::int32_t* positions, std::int32_t width, float* out) noexcept {
  switch (reduce) {
    case group_reduce::max: return fold_and_add_pass<G, group_reduce::max>(rows, decay, score, positions, width, out);
    case group_reduce::mean: return fold_and_add_pass<G, group_reduce::mean>(rows, decay, score, positions, width, out);
    default: return fold_and_add_pass<G, group_reduce::sum>(rows, decay, score, positions, width, out);
  }
}

/// out[s] = reduce over the g rows rows(j) (unit stride) of rows(j)[s], for
/// s < width, folded in ascending j exactly as fold_group folds (sum starts
/// from 0 + x, max from 0, mean divides the sum by g), row by row for any g.
/// False when an occupied column holds a value that is not a probability
/// (NaN, inf, negative) or its fold overflows.
template <class RowOf>
bool fold_rows_any(RowOf rows, std::int32_t g, group_reduce reduce, const std::int32_t* positions,
                   std::int32_t width, float* out) noexcept {
  constexpr float kMax = std::numeric_limits<float>::max();
  std::uint32_t bad = 0;
  for (std::int32_t j = 0; j < g; ++j) {
    const float* x = rows(j);
    for (std::int32_t s = 0; s < width; ++s) {
      const float v = x[s], acc = j == 0 ? 0.0f : out[s];
      bad |= std::uint32_t(positions[s] >= 0) & not_probability(v);
      out[s] = fold_step(reduce, acc, v);
    }
  }
  if (reduce == group_reduce::mean)
    for (std::int32_t s = 0; s < width; ++s) out[s] = fold_end(reduce, out[s], g);
  for (std::int32_t s = 0; s < width; ++s) bad |= std::uint32_t(positions[s] >= 0) & std::uint32_t(out[s] > kMax);
  return bad == 0;
}

/// next[s] = updated_score(decay, score[s], inc[s]) for the occupied s <
/// width (in place: next may be inc) and score[s] for the free ones; false
/// when an occupied result leaves the float range, so also when an
/// increment is NaN or infinite (scores are finite, decay in [0, 1]): one
/// pass updates and checks a row of increments. A free slot's score is +0
/// (evict and reset clear it) and decay * +0 + +0 is +0, so adding 0 there
/// instead of branching changes no bit. Every load is unconditional: a load
/// under a condition stops the vectoriser.
inline bool next_scores(float decay, const float* score, const float* inc, const std::int32_t* positions,
                        std::int32_t width, float* next) noexcept {
  std::uint32_t bad = 0;
  for (std::int32_t s = 0; s < width; ++s) {
    const std::uint32_t occupied = positions[s] >= 0;
    const float x = inc[s];
    const float v = updated_score(decay, score[s], occupied ? x : 0.0f);
    bad |= occupied & outside_float_range(v);
    next[s] = v;
  }
  return bad == 0;
}

/// next[s] = decay * score[s] + the fold over the g rows rows(j) (unit stride) of
/// column s (fold_group's order), with next_scores' rule for free slots, in
/// one pass for the usual GQA groups. False when an occupied column holds a
/// value that is not a probability, its fold overflows or its score would
/// leave the float range; next is then garbage and the caller's scalar path
/// names the element.
template <class RowOf>
bool fold_and_add_probability_rows(RowOf rows, std::int32_t g, group_reduce reduce, float decay, const float* score,
                                   const std::int32_t* positions, std::int32_t width, float* next) noexcept {
  switch (g) {
    case 1: return fold_and_add_fixed<1>(rows, reduce, decay, score, positions, width, next);
    case 2: return fold_and_add_fixed<2>(rows, reduce, decay, score, positions, width, next);
    case 4: return fold_and_add_fixed<4>(rows, reduce, decay, score, positions, width, next);
    case 8: return fold_and_add_fixed<8>(rows, reduce, decay, score, positions, width, next);
    default:
      return fold_rows_any(rows, g, reduce, positions, width, next) &&
             next_scores(decay, score, next, positions, width, next);
  }
}

/// The victim among the occupied slots [0, width) of the scores `next` by
/// `rule` (lowest_score or oldest; not random_priority) when the newest
/// position is length - 1: the slot pick_victim returns, or -1 when every
/// occupied token is protected. With Copy, the same pass copies next into
/// `score` (staged scores committed while they are searched). Scores are
/// finite here (staged or committed scores are), so float order is the
/// eviction_key order (-0 and +0 tie there too); ties go to the lowest
/// position, which is unique.
template <bool Copy>
std::int32_t row_victim(const decode_rule& rule, const float* next, float* score, const std::int32_t* positions,
                        std::int32_t width, std::int32_t length) noexcept {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr std::int32_t kNone = std::numeric_limits<std::int32_t>::max();
  // Unprotected and occupied: sinks <= p < length - recent (p = -1 fails the first when sinks = 0 too).
  const std::int32_t lo = rule.protect.sinks > 0 ? rule.protect.sinks : 0, hi = length - rule.protect.recent;
  const bool by_score = rule.victim == victim_rule::lowest_score;
  std::int32_t s = 0;
  float lowest = kInf;
  std::int32_t oldest = kNone, victim = -1;
#if defined(__SSE2__)
  // Compilers do not vectorise a min reduction over floats without
  // -ffast-math, so the bulk goes four slots at a time here.
  const std::int32_t full = width - width % 4;
  const __m128i lo4 = _mm_set1_epi32(lo - 1), hi4 = _mm_set1_epi32(hi);
  const __m128 score_mask = _mm_castsi128_ps(_mm_set1_epi32(by_score ? -1 : 0));
  __m128 low4 = _mm_set1_ps(kInf);
  for (; s < full; s += 4) {
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(positions + s));
    const __m128 candidate = _mm_castsi128_ps(_mm_and_si128(_mm_cmpgt_epi32(p, lo4), _mm_cmplt_epi32(p, hi4)));
    const __m128 v = _mm_loadu_ps(next + s);
    if constexpr (Copy) _mm_storeu_ps(score + s, v);
    const __m128 key = _mm_and_ps(v, score_mask);  // oldest: every key 0
    low4 = _mm_min_ps(low4, _mm_or_ps(_mm_and_ps(candidate, key), _mm_andnot_ps(candidate, _mm_set1_ps(kInf))));
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, low4);
  for (const float x : lanes) lowest = x < lowest ? x : lowest;
#endif
  for (std::int32_t t = s; t < width; ++t) {
    const std::int32_t p = positions[t];
    if constexpr (Copy) score[t] = next[t];
    const float key = by_score ? next[t] : 0.0f;
    if (p >= lo && p < hi && key < lowest) lowest = key;
  }
  if (lowest == kInf) return -1;
  // The lowest position among the candidates at `lowest` (usually one).
  s = 0;
#if defined(__SSE2__)
  const __m128 lowest4 = _mm_set1_ps(lowest);
  for (; s < full; s += 4) {
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(positions + s));
    const __m128 candidate = _mm_castsi128_ps(_mm_and_si128(_mm_cmpgt_epi32(p, lo4), _mm_cmplt_epi32(p, hi4)));
    const __m128 at_lowest = _mm_or_ps(_mm_cmpeq_ps(_mm_loadu_ps(next + s), lowest4), _mm_andnot_ps(score_mask, candidate));
    for (int m = _mm_movemask_ps(_mm_and_ps(candidate, at_lowest)); m != 0; m &= m - 1) {
      const std::int32_t t = s + __builtin_ctz(static_cast<unsigned>(m));
      if (positions[t] < oldest) {
        oldest = positions[t];
        victim = t;
      }
    }
  }
#endif
  for (std::int32_t t = s; t < width; ++t) {
    const std::int32_t p = positions[t];
    if (p >= lo && p < hi && p < oldest && (!by_score || next[t] == lowest)) {
      oldest = p;
      victim = t;
    }
  }
  return victim;
}

/// The victim of row_victim over scores as they are.
inline std::int32_t find_victim(const decode_rule& rule, const float* score, const std::int32_t* positions,
                                std::int32_t width, std::int32_t length) noexcept {
  return row_victim<false>(rule, score, nullptr, positions, width, length);
}

/// score = next for [0, width) and the victim of next, in one pass.
inline std::int32_t commit_and_find_victim(const decode_rule& rule, const float* next, float* score,
                                           const std::int32_t* positions, std::int32_t width,
                                           std::int32_t length) noexcept {
  return row_victim<true>(rule, next, score, positions, width, length);
}

}  // namespace detail
}  // namespace kvevict
