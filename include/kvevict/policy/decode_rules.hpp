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
//   - victim_order: the per-step key whose minimum is the victim, random's
//     Philox priorities included.
#include <cmath>
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

/// How a policy picks its decode victim among the unprotected occupied slots:
/// always the lowest of a 64-bit key (victim_order), so one minimum (or, for
/// evict_to, one bottom-k selection) serves every rule on every device.
enum class victim_rule : std::uint8_t {
  lowest_score,     ///< lowest eviction_key(score, position): h2o, exact_greedy
  oldest,           ///< lowest position: recent_window
  random_priority,  ///< lowest Philox priority of the step, then position: random
};

/// The victim key of one decode step of one (sequence, KV head): lower
/// evicts first, and keys are distinct because positions are.
struct victim_order {
  victim_rule victim = victim_rule::lowest_score;
  philox4x32_key step{};  ///< random_priority: random_step_key of the step

  KVEVICT_HOST_DEVICE std::uint64_t key(float score, std::int32_t position) const noexcept {
    const std::uint64_t low = static_cast<std::uint32_t>(position);
    switch (victim) {
      case victim_rule::oldest: return low;
      case victim_rule::random_priority: return std::uint64_t{random_priority(step, position)} << 32 | low;
      default: return eviction_key(score, position);
    }
  }
};

/// A policy's decode decision as plain data, passed to kernels by value.
struct decode_rule {
  victim_rule victim = victim_rule::lowest_score;
  protection protect;
  std::int32_t budget = 0;  ///< tokens kept after an eviction; capacity >= budget + 1
  group_reduce reduce = group_reduce::sum;
  float decay = 1.0f;       ///< gamma of updated_score: 1 accumulates (H2O), 0 keeps the newest increment (TOVA)
  std::uint64_t seed = 0;   ///< random_priority only
  std::int32_t first_head = 0;  ///< the layer-wide index of KV head 0 (policy_shape::first_kv_head)

  /// The layer-wide index of KV head `head`: random's draws are keyed by it,
  /// so a tensor-parallel shard draws what the unsharded layer draws.
  KVEVICT_HOST_DEVICE std::int32_t draw_head(std::int32_t head) const noexcept { return first_head + head; }

  /// The victim key of the step whose newest position is length - 1, for
  /// KV head `head` of a sequence with request stream `stream` (random's
  /// draws; the other rules ignore both).
  KVEVICT_HOST_DEVICE victim_order order(std::uint64_t stream, std::int32_t head, std::int32_t length) const noexcept {
    victim_order o;
    o.victim = victim;
    if (victim == victim_rule::random_priority) o.step = random_step_key(seed, stream, draw_head(head), length - 1);
    return o;
  }
};

/// A slot's score after a step: decay * score + increment, the product
/// rounded to float before the sum (never one FMA), so every backend gets
/// the same bits. decay = 1 is the plain sum (1 * x is x exactly): H2O's
/// accumulated attention; decay = 0 keeps the step's increment alone (+0 *
/// a finite score is a zero): TOVA; values between weigh step t - j by
/// decay^j, an exponential moving attention.
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline float updated_score(float decay, float score, float increment) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  return detail::add(detail::mul(decay, score), increment);
}

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

/// The group fold's arithmetic, one value at a time in ascending q: sum
/// and mean add from +0 (each sum rounded to float), max keeps the larger
/// from 0; mean divides by g at the end. Every form of the fold (group_fold
/// here, the host's row form in decode_pass.hpp, the kernels) runs these.
KVEVICT_HOST_DEVICE inline float fold_step(group_reduce reduce, float acc, float x) noexcept {
  return reduce == group_reduce::max ? (x > acc ? x : acc) : detail::add(acc, x);
}
KVEVICT_HOST_DEVICE inline float fold_end(group_reduce reduce, float acc, std::int32_t g) noexcept {
  return reduce == group_reduce::mean ? detail::div(acc, static_cast<float>(g)) : acc;
}

/// One slot's fold over the query heads of a group, value by value in
/// ascending q: sum, mean (the sum divided by g at the end) or max, in float
/// from +0; the first value that is not a usable input (finite; not negative
/// when `probabilities`) names the slot's problem. Kernels keep one per slot
/// and feed them a query head at a time, so every load of a head is issued
/// before any value is looked at; fold_group is the same fold for one slot.
struct group_fold {
  float acc = 0.0f;
  batch_code code = batch_code::ok;
  std::int32_t query = -1;

  KVEVICT_HOST_DEVICE void add(float x, std::int32_t q, group_reduce reduce, bool probabilities) noexcept {
    const batch_code c = classify_input(x, probabilities);
    if (code == batch_code::ok && c != batch_code::ok) {
      code = c;
      query = q;
    }
    acc = fold_step(reduce, acc, x);
  }
  KVEVICT_HOST_DEVICE slot_increment finish(group_reduce reduce, std::int32_t g) const noexcept {
    slot_increment out;
    out.code = code;
    out.query = query;
    if (code == batch_code::ok) out.value = fold_end(reduce, acc, g);
    return out;
  }
};

/// reduce over q in [first_q, first_q + g) of value(q), folded by
/// group_fold; stops at the first bad value. value() may throw: the host's
/// checked paths validate the elements it sums.
KVEVICT_EXEC_CHECK_DISABLE
template <class Value>
KVEVICT_HOST_DEVICE inline slot_increment fold_group(std::int32_t first_q, std::int32_t g, group_reduce reduce,
                                                     bool probabilities, Value value) {
  group_fold fold;
  for (std::int32_t j = 0; j < g && fold.code == batch_code::ok; ++j) fold.add(value(first_q + j), first_q + j, reduce, probabilities);
  return fold.finish(reduce, g);
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

namespace detail {

/// One chunk of q . k: q[d] * k[d] for d in [0, n), summed left to right,
/// products and sums unfused; fp8 elements are their codes times q_scale /
/// k_scale (kv_value). `k` may be a copy of the chunk in registers (a GPU's
/// 16-byte load): the arithmetic is the same.
template <class Q, class K>
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline float chunk_dot(const Q* q, std::int64_t q_stride, const K* k,
                                                                std::int32_t n, float q_scale, float k_scale) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  float v = mul(kv_value(q[0], q_scale), kv_value(k[0], k_scale));
  for (std::int32_t d = 1; d < n; ++d) v = add(v, mul(kv_value(q[d * q_stride], q_scale), kv_value(k[d], k_scale)));
  return v;
}

/// The balanced tree over chunk_sum(c), c in [0, chunks), padded with +0 to
/// a power of two, built as a binary counter (level i: a finished subtree of
/// 2^i chunks) whose levels are indexed only by unrolled constants, so a GPU
/// keeps them in registers. Room for 2^(Levels - 1) chunks.
KVEVICT_EXEC_CHECK_DISABLE
template <int Levels, class ChunkSum>
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline float chunk_tree(std::int32_t chunks, ChunkSum chunk_sum) {
  KVEVICT_FP_CONTRACT_OFF
  float level[Levels] = {};  // every level is written before it is read; zeroed for the compilers' sake
  std::uint32_t pushed = 0;  // chunks pushed so far; bit i set when level[i] holds a subtree
  for (std::int32_t c = 0; c < chunks || (pushed & (pushed - 1u)); ++c) {
    float v = c < chunks ? chunk_sum(c) : 0.0f;  // past the last chunk: +0 pads the count to a power of two
    bool placed = false;  // push v: merge it with the finished subtrees of its size
    KVEVICT_UNROLL
    for (int i = 0; i < Levels; ++i) {
      if (placed) continue;
      if ((pushed >> i) & 1u) {
        v = add(level[i], v);  // the earlier (left) subtree first
      } else {
        level[i] = v;
        placed = true;
      }
    }
    ++pushed;
  }
  float root = 0.0f;
  KVEVICT_UNROLL
  for (int i = 0; i < Levels; ++i)
    if (pushed == (1u << i)) root = level[i];  // pushed is a power of two: the one full level
  return root;
}

template <int Levels, class Q, class K>
KVEVICT_HOST_DEVICE inline float chunk_tree_logit(const Q* q, std::int64_t q_stride, const K* k, std::int32_t head_dim,
                                                  float q_scale, float k_scale) noexcept {
  constexpr std::int32_t chunk = static_cast<std::int32_t>(16 / sizeof(K));
  return chunk_tree<Levels>((head_dim + chunk - 1) / chunk, [&](std::int32_t c) {
    const std::int32_t first = c * chunk;
    return chunk_dot(q + first * q_stride, q_stride, k + first, head_dim - first < chunk ? head_dim - first : chunk,
                     q_scale, k_scale);
  });
}

/// Any int32 head_dim, out of line: rare, and its 32 levels would size the
/// registers of every caller.
template <class Q, class K>
KVEVICT_HOST_DEVICE KVEVICT_NOINLINE float wide_tree_logit(const Q* q, std::int64_t q_stride, const K* k,
                                                           std::int32_t head_dim, float q_scale,
                                                           float k_scale) noexcept {
  return chunk_tree_logit<32>(q, q_stride, k, head_dim, q_scale, k_scale);
}

/// The element-wise path of attention_logit_rows, out of line: rows that
/// are not 16-byte aligned are rare, and its registers would size the
/// caller's.
template <class Q, class K>
KVEVICT_HOST_DEVICE KVEVICT_NOINLINE float unaligned_logit(const Q* q, std::int64_t q_stride, const K* k,
                                                           std::int32_t head_dim, float q_scale,
                                                           float k_scale) noexcept;

}  // namespace detail

/// q . k in float for a cached key row k (contiguous) and a query row q
/// (stride q_stride), in the order every backend uses: products summed left
/// to right within chunks of 16 bytes of K (16 / sizeof(K) elements; a GPU
/// lane's vector load), then the chunk sums combined pairwise, as a balanced
/// tree over a power-of-two count with +0 for the missing chunks. Head dims
/// up to 256 chunks (2048 bf16 elements) keep the tree in 9 levels. An fp8
/// row's elements are its codes times k_scale (q_scale: when q is an fp8
/// row too, as in ||k||^2); a float row's are themselves.
template <class Q, class K>
KVEVICT_HOST_DEVICE inline float attention_logit(const Q* q, std::int64_t q_stride, const K* k, std::int32_t head_dim,
                                                 float k_scale = 1.0f, float q_scale = 1.0f) noexcept {
  constexpr std::int32_t chunk = static_cast<std::int32_t>(16 / sizeof(K));
  if (head_dim <= 256 * chunk) return detail::chunk_tree_logit<9>(q, q_stride, k, head_dim, q_scale, k_scale);
  return detail::wide_tree_logit(q, q_stride, k, head_dim, q_scale, k_scale);
}

namespace detail {
template <class Q, class K>
KVEVICT_HOST_DEVICE KVEVICT_NOINLINE float unaligned_logit(const Q* q, std::int64_t q_stride, const K* k,
                                                           std::int32_t head_dim, float q_scale,
                                                           float k_scale) noexcept {
  return attention_logit(q, q_stride, k, head_dim, k_scale, q_scale);
}
}  // namespace detail

/// attention_logit, with the key row read as 16-byte vectors on a GPU when
/// its chunks are whole and aligned (a thread's loads are then a few
/// LDG.128 instead of one per element): the same chunks, the same bits.
template <class Q, class K>
KVEVICT_HOST_DEVICE inline float attention_logit_rows(const Q* q, std::int64_t q_stride, const K* k,
                                                      std::int32_t head_dim, float k_scale = 1.0f,
                                                      float q_scale = 1.0f) noexcept {
#if defined(__CUDA_ARCH__)
  constexpr std::int32_t chunk = static_cast<std::int32_t>(16 / sizeof(K));
  struct alignas(16) chunk_of {
    K v[chunk];
  };
  if (head_dim % chunk == 0 && head_dim <= 256 * chunk && reinterpret_cast<std::uintptr_t>(k) % 16 == 0)
    return detail::chunk_tree<9>(head_dim / chunk, [&](std::int32_t c) {
      const chunk_of loaded = reinterpret_cast<const chunk_of*>(k)[c];
      return detail::chunk_dot(q + std::int64_t{c} * chunk * q_stride, q_stride, loaded.v, chunk, q_scale, k_scale);
    });
  return detail::unaligned_logit(q, q_stride, k, head_dim, q_scale, k_scale);
#else
  return attention_logit(q, q_stride, k, head_dim, k_scale, q_scale);
#endif
}

/// Key-norm's score of a cached key row k (contiguous, head_dim elements):
/// -||k||_2 in float, the squares summed as attention_logit_rows sums k . k
/// (one order on every backend; bf16 keys tie often in their own precision,
/// rarely in float), then a correctly rounded square root. A NaN or an
/// infinite element, or a sum of squares that overflows float, gives a
/// value that is not finite: the callers report it (non_finite_kv). `scale`:
/// the row's kv_value scale (the view's k_scale(h); 1 for a float cache).
template <class K>
KVEVICT_HOST_DEVICE inline float key_norm_score(const K* k, std::int32_t head_dim, float scale) noexcept {
  const float squares = attention_logit_rows(k, 1, k, head_dim, scale, scale);
#if defined(__CUDA_ARCH__)
  return -__fsqrt_rn(squares);
#else
  return -std::sqrt(squares);
#endif
}

/// The victim among the occupied slots [0, width) of one (sequence, head)
/// when the newest position is length - 1: the lowest victim key (stream and
/// head key random's draws) among the unprotected (positions -1 for free
/// slots), or -1 when every occupied token is protected. The host's form;
/// the CUDA kernels reduce the same keys in parallel.
inline std::int32_t pick_victim(const decode_rule& rule, const std::int32_t* positions, const float* scores,
                                std::int32_t width, std::int32_t length, std::uint64_t stream, std::int32_t head) {
  const victim_order order = rule.order(stream, head, length);
  std::int32_t victim = -1;
  std::uint64_t best = 0;
  for (std::int32_t s = 0; s < width; ++s) {
    const std::int32_t p = positions[s];
    if (p < 0 || rule.protect.covers(p, length)) continue;
    const std::uint64_t key = order.key(scores[s], p);
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
