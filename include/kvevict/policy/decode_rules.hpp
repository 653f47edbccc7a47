#pragma once
// The rules of one decode step, per slot and per (sequence, KV head), as
// KVEVICT_HOST_DEVICE functions: the per-sequence policies, the batched host
// backend and the CUDA kernels all call these, so the host tests cover the
// code the kernels run (docs/semantics.md, "Decode step").
//
//   - protection: which positions a policy never evicts;
//   - decode_rule: a policy's decision as data (victim order, protection,
//     budget, group reduction, seed);
//   - fold_group: one slot's increment from the query heads of a GQA group;
//   - probability_from_logit, attention_logit: the logits + LSE and
//     queries + LSE paths, with a fixed operation order so every backend
//     gets the same bits (reproducible_math.hpp);
//   - random_victim_rank: which unprotected token the random policy takes.
#include <algorithm>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/reproducible_math.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/order.hpp"
#include "kvevict/philox.hpp"
#include "kvevict/score_inputs.hpp"
#include "kvevict/status_code.hpp"

namespace kvevict {

/// Positions never evicted: the first `sinks` and the `recent` newest.
struct protection {
  std::int32_t sinks = 0;
  std::int32_t recent = 0;

  KVEVICT_HOST_DEVICE bool covers(std::int32_t position, std::int32_t length) const noexcept {
    return position < sinks || position >= length - recent;
  }
};

/// How a policy picks its decode victim among the unprotected occupied slots.
enum class victim_rule : std::uint8_t {
  lowest_score,  ///< lowest eviction_key(score, position): h2o, exact_greedy
  oldest,        ///< lowest position: recent_window
  random_rank,   ///< the k-th by position, k from Philox: random
};

/// A policy's decode decision as plain data, passed to kernels by value.
struct decode_rule {
  victim_rule victim = victim_rule::lowest_score;
  protection protect;
  std::int32_t budget = 0;  ///< tokens kept after an eviction; capacity >= budget + 1
  group_reduce reduce = group_reduce::sum;
  std::uint64_t seed = 0;   ///< random_rank only

  /// The key whose minimum is the victim (victim_rule::random_rank aside).
  KVEVICT_HOST_DEVICE std::uint64_t key(float score, std::int32_t position) const noexcept {
    return victim == victim_rule::oldest ? std::uint64_t(std::uint32_t(position)) : eviction_key(score, position);
  }
};

/// What a policy class tells the batched backends; each policy header
/// specialises it (config_type, name, rule(config) which validates).
template <class Policy>
struct policy_traits;

/// One slot's increment, or why its input is bad (`query` names the
/// offending query head).
struct slot_increment {
  float value = 0.0f;
  batch_code code = batch_code::ok;
  std::int32_t query = -1;
};

/// Why x is not a usable input: NaN, infinite, or (for a probability)
/// negative; batch_code::ok otherwise.
KVEVICT_HOST_DEVICE inline batch_code classify_input(float x, bool probability) noexcept {
  if (x != x) return batch_code::nan_input;
  if (x - x != 0.0f) return batch_code::infinite_input;  // inf - inf is NaN
  if (probability && x < 0.0f) return batch_code::negative_probability;
  return batch_code::ok;
}

/// reduce over q in [first_q, first_q + g) of value(q), folded in ascending
/// q in float: sum, mean (the sum divided by g) or max. Every value is
/// checked first (finite; non-negative when `probabilities`). value() may
/// throw: the host's checked paths validate the elements it sums.
KVEVICT_EXEC_CHECK_DISABLE
template <class Value>
KVEVICT_HOST_DEVICE inline slot_increment fold_group(std::int32_t first_q, std::int32_t g, group_reduce reduce,
                                                     bool probabilities, Value value) {
  slot_increment out;
  float acc = 0.0f;
  for (std::int32_t j = 0; j < g; ++j) {
    const float x = value(first_q + j);
    const batch_code code = classify_input(x, probabilities);
    if (code != batch_code::ok) {
      out.code = code;
      out.query = first_q + j;
      return out;
    }
    acc = reduce == group_reduce::max ? (x > acc ? x : acc) : detail::add(acc, x);
  }
  out.value = reduce == group_reduce::mean ? detail::div(acc, static_cast<float>(g)) : acc;
  return out;
}

/// exp(logit * scale - lse), with lse in natural log or base 2. logit *
/// scale is exact in double; the rest is reproducible_exp, so the result's
/// bits are the same on every backend.
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline float probability_from_logit(float logit, float scale, float lse,
                                                                             lse_base base) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  constexpr double kLn2 = 0.69314718055994530942;
  const double natural = base == lse_base::base2 ? detail::mul(double(lse), kLn2) : double(lse);
  return static_cast<float>(reproducible_exp(detail::sub(detail::mul(double(logit), double(scale)), natural)));
}

/// q . k in float for a cached key row k (contiguous) and a query row q
/// (stride q_stride), in the order every backend uses: products summed left
/// to right within chunks of 16 bytes of K (16 / sizeof(K) elements; a GPU
/// lane's vector load), then the chunk sums combined pairwise, as a balanced
/// tree over a power-of-two count with +0 for the missing chunks.
template <class Q, class K>
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline float attention_logit(const Q* q, std::int64_t q_stride, const K* k,
                                                                      std::int32_t head_dim) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  constexpr std::int32_t chunk = static_cast<std::int32_t>(16 / sizeof(K));
  float level[32];          // level[i]: a finished subtree of 2^i chunks
  std::uint32_t pushed = 0;  // chunks pushed so far; bit i set when level[i] is in use
  auto push = [&](float v) {
    std::int32_t i = 0;
    for (; (pushed >> i) & 1u; ++i) v = detail::add(level[i], v);
    level[i] = v;
    ++pushed;
  };
  for (std::int32_t c = 0; c < head_dim; c += chunk) {
    const std::int32_t end = c + chunk < head_dim ? c + chunk : head_dim;
    float sum = detail::mul(to_float(q[c * q_stride]), to_float(k[c]));
    for (std::int32_t d = c + 1; d < end; ++d) sum = detail::add(sum, detail::mul(to_float(q[d * q_stride]), to_float(k[d])));
    push(sum);
  }
  while (pushed & (pushed - 1u)) push(0.0f);
  std::int32_t top = 0;
  while ((1u << top) < pushed) ++top;
  return level[top];
}

/// The rank, in position order among the `candidates` unprotected tokens,
/// of the random policy's victim for KV head h when the newest token of the
/// request `stream` has position length - 1; `round` numbers the victims of
/// one evict_to call (round 0 is evict's victim).
KVEVICT_HOST_DEVICE inline std::int32_t random_victim_rank(std::uint64_t seed, std::uint64_t stream, std::int32_t h,
                                                           std::int32_t length, std::int32_t candidates,
                                                           std::int32_t round = 0) noexcept {
  const std::uint32_t draw = random_draw(seed, random_use::decode_victim, stream, h, length - 1, round);
  return static_cast<std::int32_t>(uniform_index(draw, static_cast<std::uint32_t>(candidates)));
}

/// The victim among the occupied slots [0, width) of one (sequence, head) by
/// `rule` (positions -1 for free slots), or -1 when every occupied token is
/// protected; stream and head key random's draw. `scratch` holds width ints.
/// The host's form; the CUDA kernels reduce the same keys in parallel.
inline std::int32_t pick_victim(const decode_rule& rule, const std::int32_t* positions, const float* scores,
                                std::int32_t width, std::int32_t length, std::uint64_t stream, std::int32_t head,
                                std::int32_t* scratch) {
  if (rule.victim == victim_rule::random_rank) {
    std::int32_t n = 0;
    for (std::int32_t s = 0; s < width; ++s)
      if (positions[s] >= 0 && !rule.protect.covers(positions[s], length)) scratch[n++] = s;
    if (n == 0) return -1;
    const std::int32_t k = random_victim_rank(rule.seed, stream, head, length, n);
    std::nth_element(scratch, scratch + k, scratch + n,
                     [positions](std::int32_t x, std::int32_t y) { return positions[x] < positions[y]; });
    return scratch[k];
  }
  std::int32_t victim = -1;
  std::uint64_t best = 0;
  for (std::int32_t s = 0; s < width; ++s) {
    const std::int32_t p = positions[s];
    if (p < 0 || rule.protect.covers(p, length)) continue;
    const std::uint64_t key = rule.key(scores[s], p);
    if (victim < 0 || key < best) {
      best = key;
      victim = s;
    }
  }
  return victim;
}

/// The next slot after an append brought (b, h) to `count` tokens: the next
/// unused one while the cache fills, none (-1) at budget + 1 (evict first).
KVEVICT_HOST_DEVICE inline std::int32_t next_slot_after_append(std::int32_t count, std::int32_t budget) noexcept {
  return count <= budget ? count : -1;
}

}  // namespace kvevict
