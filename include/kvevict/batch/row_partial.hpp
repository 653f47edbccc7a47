#pragma once
// Observe + evict of one (sequence, KV head) in parts: any split of its
// slots into chunks, each folded into a row_partial (the lowest victim key
// and its slot, the lowest problem, the first failing head check) and the
// partials merged in any order, gives the decision and status word of the
// whole row, because every field is an exact minimum. The CUDA kernel splits
// long rows over several blocks this way; the host backend runs the same
// per-slot rule (observe_slot) over the whole row.
#include <cstdint>

#include "kvevict/batch/status.hpp"
#include "kvevict/config.hpp"
#include "kvevict/detail/reproducible_math.hpp"
#include "kvevict/policy/decode_rules.hpp"

namespace kvevict {

/// The checks of a (b, h) before observe + evict uses its slots, as keys
/// whose minimum is the first check that fails in the order both devices
/// make them: an append since the last observe; an input column for every
/// occupied slot; the LSE of each query head of the group, lowest first;
/// then its query rows. Threads can each make a share and reduce.
struct head_check {
  enum class stage : std::uint32_t { not_appended = 0, narrow_input = 1, lse = 2, query = 3, kv_scale = 4 };
  static constexpr std::uint64_t none = ~std::uint64_t{0};

  KVEVICT_HOST_DEVICE static std::uint64_t key(stage s, std::int32_t index) noexcept {
    return std::uint64_t(s) << 32 | std::uint32_t(index);
  }
  /// The status word of a reduced key (batch_status_clear for none).
  KVEVICT_HOST_DEVICE static std::uint64_t word(std::uint64_t key, std::int32_t b, std::int32_t h) noexcept {
    if (key == none) return batch_status_clear;
    const std::int32_t index = static_cast<std::int32_t>(key & 0xFFFFFFFFu);
    switch (static_cast<stage>(key >> 32)) {
      case stage::not_appended: return pack_status(b, h, index, batch_code::not_appended);
      case stage::narrow_input: return pack_status(b, h, index, batch_code::narrow_input);
      case stage::lse: return pack_status(b, h, index, batch_code::non_finite_lse);
      case stage::kv_scale: return pack_status(b, h, index, batch_code::bad_kv_scale);
      default: return pack_status(b, h, index, batch_code::non_finite_query);
    }
  }
};

KVEVICT_HOST_DEVICE inline std::uint64_t lower_of(std::uint64_t a, std::uint64_t b) noexcept { return a < b ? a : b; }

/// What part of a row contributes to its observe + evict (32 bytes, loaded
/// as two 16-byte vectors by the CUDA kernel that merges them).
struct alignas(16) row_partial {
  std::uint64_t key = ~std::uint64_t{0};       ///< the lowest victim key among the unprotected
  std::uint64_t problem = batch_status_clear;  ///< the lowest per-slot status word
  std::uint64_t head = head_check::none;       ///< the lowest head check key
  std::int32_t slot = -1;                      ///< the slot of `key`, -1 when none bid
  std::int32_t unused = 0;                     ///< written with the rest, so a 32-byte copy reads no undefined byte

  KVEVICT_HOST_DEVICE void bid(std::uint64_t k, std::int32_t s) noexcept {
    if (k < key) {
      key = k;
      slot = s;
    }
  }
  /// Both parts in one; associative and commutative (keys are distinct).
  KVEVICT_HOST_DEVICE static row_partial merge(const row_partial& a, const row_partial& b) noexcept {
    row_partial m = a.key <= b.key ? a : b;
    m.problem = lower_of(a.problem, b.problem);
    m.head = lower_of(a.head, b.head);
    return m;
  }
  /// The row's status word: a failed head check first, else the lowest slot
  /// problem, else batch_status_clear.
  KVEVICT_HOST_DEVICE std::uint64_t status_word(std::int32_t b, std::int32_t h) const noexcept {
    return head != head_check::none ? head_check::word(head, b, h) : problem;
  }
};

/// One occupied slot s of (b, h) in observe + evict: its updated score
/// (updated_score with the rule's decay) goes to `updated` and, unprotected,
/// bids for the victim with order.key; a bad increment or a score that
/// would overflow is reported instead.
KVEVICT_HOST_DEVICE inline void observe_slot(const decode_rule& rule, const victim_order& order, std::int32_t b,
                                             std::int32_t h, std::int32_t s, std::int32_t position,
                                             std::int32_t length, float current, const slot_increment& inc,
                                             float* updated, row_partial& part) noexcept {
  if (inc.code != batch_code::ok) {
    part.problem = lower_of(part.problem, pack_status(b, h, s, inc.code));
    return;
  }
  const float score = updated_score(rule.decay, current, inc.value);
  if (classify_input(score, false) != batch_code::ok) {
    part.problem = lower_of(part.problem, pack_status(b, h, s, batch_code::score_overflow));
    return;
  }
  updated[s] = score;
  if (!rule.protect.covers(position, length)) part.bid(order.key(score, position), s);
}

}  // namespace kvevict
