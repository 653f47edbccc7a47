#pragma once
// Shapes and results shared by every policy.
#include <cstdint>

#include "kvevict/error.hpp"
#include "kvevict/limits.hpp"
#include "kvevict/score_inputs.hpp"

namespace kvevict {

/// The batch a policy manages (one layer): sequences, KV and query heads, and
/// the physical slots per (sequence, KV head). capacity must be at least
/// budget + 1 (the spare slot of the decode cycle), and at least the longest
/// prompt that is compressed by prefill.
struct policy_shape {
  std::int32_t num_seqs = 1;
  std::int32_t num_kv_heads = 1;
  std::int32_t num_q_heads = 1;  ///< a multiple of num_kv_heads (GQA group size)
  std::int32_t capacity = 0;
  /// Tensor parallelism: the layer-wide index of this shard's KV head 0.
  /// A shard of a layer's KV heads (each with its whole query group) is an
  /// independent policy; only random's draws depend on the head, and they
  /// are keyed by the layer-wide index, so shards make the decisions of the
  /// unsharded layer (docs/integration.md, "Tensor parallelism").
  std::int32_t first_kv_head = 0;

  std::int32_t group_size() const noexcept { return num_q_heads / num_kv_heads; }
};

/// What prefill compression did to one sequence.
struct prefill_result {
  std::int32_t kept = 0;  ///< tokens kept per KV head, now in slots [0, kept)
  /// For a paged cache: trailing pages of the prompt the sequence no longer
  /// needs (the spare slot included); the engine may return them to its pool.
  std::int32_t reclaimable_pages = 0;
};

namespace detail {

/// The sum of two budget parts, rejected unless it leaves room for the spare
/// slot in an int32 (parts are checked non-negative first).
template <class Where>
std::int32_t budget_sum(const Where& where, const char* parts, std::int32_t a, std::int32_t b) {
  const std::int64_t sum = std::int64_t{a} + b;
  if (sum >= std::int64_t{INT32_MAX})
    fail<budget_error>(where, parts, "= ", sum, " is too large (the capacity budget + 1 must fit in int32)");
  return static_cast<std::int32_t>(sum);
}

/// A score decay: a float in [0, 1] (NaN fails both comparisons).
template <class Where>
void require_decay(const Where& where, const char* arg, float decay) {
  if (!(decay >= 0.0f && decay <= 1.0f)) fail<out_of_range>(where, arg, "= ", decay, " is outside [0, 1]");
}

/// key_norms and key_diff replace a slot's score every step
/// (score_inputs.hpp): a rule that evicts by score takes them only with
/// decay 0, else the old scores would accumulate into the new.
template <class Where>
void require_replacing_decay(const Where& where, const char* input, bool evicts_by_score, float decay) {
  if (evicts_by_score && decay != 0.0f)
    fail<invalid_argument>(where, "in", "is ", input, ", whose score replaces the old one each step: the rule's decay "
                           "must be 0 (key_norm_config), it is ", decay);
}

template <class Where>
void require_group_reduce(const Where& where, const char* arg, group_reduce r) {
  if (r != group_reduce::sum && r != group_reduce::mean && r != group_reduce::max)
    fail<invalid_argument>(where, arg, "= ", static_cast<int>(r), " is not a group_reduce (sum, mean or max)");
}

template <class Where>
void require_lse_base(const Where& where, const char* arg, lse_base base) {
  if (base != lse_base::natural && base != lse_base::base2)
    fail<invalid_argument>(where, arg, "= ", static_cast<int>(base), " is not an lse_base (natural or base2)");
}

template <class Where>
void validate_shape(const Where& where, const policy_shape& s, std::int32_t budget) {
  require_positive(where, "shape.num_seqs", s.num_seqs);
  require_positive(where, "shape.num_kv_heads", s.num_kv_heads);
  require_positive(where, "shape.num_q_heads", s.num_q_heads);
  if (s.first_kv_head < 0 || std::int64_t{s.first_kv_head} + s.num_kv_heads > std::int64_t{INT32_MAX})
    fail<out_of_range>(where, "shape.first_kv_head", "= ", s.first_kv_head,
                       " is negative or puts the shard's last head beyond 2^31 - 1");
  if (s.num_q_heads % s.num_kv_heads != 0)
    fail<invalid_argument>(where, "shape.num_q_heads", "= ", s.num_q_heads,
                           " is not a multiple of shape.num_kv_heads = ", s.num_kv_heads);
  if (budget < 1) fail<budget_error>(where, "budget", "= ", budget, " must be at least 1");
  if (s.capacity < std::int64_t{budget} + 1)
    fail<budget_error>(where, "shape.capacity", "= ", s.capacity, " cannot hold budget = ", budget,
                       " plus the spare slot (needs ", std::int64_t{budget} + 1, ")");
  // A position and a score per (b, h, slot), and about 24 bytes of scratch per (h, slot).
  const long double slots = static_cast<long double>(s.num_seqs) * s.num_kv_heads * s.capacity;
  require_allocation(where, "shape.num_seqs * shape.num_kv_heads * shape.capacity",
                     8.0L * slots + 24.0L * s.num_kv_heads * s.capacity);
}

}  // namespace detail
}  // namespace kvevict
