#pragma once
// The codes of the batched status word and their packing into it: what a
// decode rule returns when an input is bad, below every API. The batched
// API (batch/status.hpp) adds the decoding and the exception; the rules of
// policy/ use the codes alone, so no rule knows a batch.
//
// A word packs (sequence, head, index, code) so that a smaller word is a
// lower (sequence, head, index, code): calls keep the minimum of all their
// offenders, the same on every device whatever order blocks run in. The
// clear value is all ones, so that any recorded problem is below it.
#include <cstdint>

#include "kvevict/config.hpp"

namespace kvevict {

/// What went wrong in a batched call. `index` in the status is the slot for
/// per-slot inputs, the query head for LSE and query rows, and the head
/// dimension element's slot for K/V rows.
enum class batch_code : std::uint32_t {
  ok = 0,
  nan_input = 1,             ///< NaN in probabilities, increments or logits
  infinite_input = 2,        ///< +-inf in probabilities, increments or logits
  negative_probability = 3,  ///< a probability (or one computed from logits) below 0
  non_finite_lse = 4,        ///< NaN or inf LSE of query head `index`
  non_finite_query = 5,      ///< NaN or inf in query head `index`
  score_overflow = 6,        ///< the score of slot `index` would become non-finite
  no_free_slot = 7,          ///< append with a head at budget + 1 tokens (evict first)
  bad_sequence = 8,          ///< an active-list entry outside [0, num_seqs) (pack_bad_entry)
  bad_page = 9,              ///< a page id outside [0, num_pages) for slot `index`
  non_finite_kv = 10,        ///< exact_greedy, key_norms: NaN or inf in the K/V row of slot `index` (key_norms: or a norm that overflows)
  history_full = 11,         ///< exact_greedy: the sequence outgrew max_tokens
  history_gap = 12,          ///< exact_greedy: a step was appended but never observed
  not_appended = 13,         ///< observe + evict with no append since the last one
  bad_stream = 14,           ///< CUDA reset and fork: a random stream above max_random_stream
  bad_count = 15,            ///< a selection's k, or evict_to's target, outside what segment `index` allows
  not_empty = 16,            ///< prefill of a sequence that already holds tokens (reset it first)
  bad_length = 17,           ///< a prompt length outside [1, capacity] (index: the length, signed)
  over_capacity = 18,        ///< appending `index` tokens would exceed the capacity
  not_observed = 19,         ///< evict_to after an append with no observe + evict since
  narrow_input = 20,         ///< the input has fewer columns than the head holds tokens (`index`)
  repeated_sequence = 21,    ///< active-list entry `index` names a sequence an earlier entry names
  bad_fork_source = 22,      ///< CUDA fork: the source `index` of this destination is not a sequence index
  bad_kv_scale = 23,         ///< an fp8 cache's K (`index` 0) or V (1) scale of this head is not positive and finite
  /// Never recorded by a call: batch_status::unpack's reading of a word
  /// that is neither clear nor a recorded problem, such as 0 (a word set to
  /// 0 instead of batch_status_clear keeps every refusal out: it is the
  /// minimum already).
  bad_status_word = 63,
};

/// The highest code a call records.
inline constexpr batch_code last_recorded_code = batch_code::bad_kv_scale;

/// The value of a clear status word.
inline constexpr std::uint64_t batch_status_clear = ~std::uint64_t{0};

/// Field widths of the packed word, most significant first: sequence 20
/// bits, head 12, index 26 (two's complement, so that a negative prompt
/// length reads as itself), code 6.
struct batch_status_limits {
  static constexpr std::int64_t max_seqs = std::int64_t{1} << 20;
  static constexpr std::int64_t max_heads = std::int64_t{1} << 12;
  /// The index range a word holds as it is; pack_status saturates an index
  /// outside it (only a bad prompt length can be), so it never reads as a
  /// small one. A capacity above max_index is refused.
  static constexpr std::int64_t max_index = (std::int64_t{1} << 25) - 1;
  static constexpr std::int64_t min_index = -(std::int64_t{1} << 25);
};

KVEVICT_HOST_DEVICE inline std::uint64_t pack_status(std::int32_t b, std::int32_t h, std::int32_t index,
                                                     batch_code code) noexcept {
  constexpr std::int32_t lo = std::int32_t(batch_status_limits::min_index);
  constexpr std::int32_t hi = std::int32_t(batch_status_limits::max_index);
  const std::int32_t i = index < lo ? lo : index > hi ? hi : index;
  return (std::uint64_t(std::uint32_t(b)) << 44) | (std::uint64_t(std::uint32_t(h) & 0xFFFu) << 32) |
         (std::uint64_t(std::uint32_t(i) & 0x3FFFFFFu) << 6) | std::uint64_t(code);
}

/// The word of active-list entry `position` holding `value`, which is not a
/// sequence index: there is no sequence to name, so the position takes the
/// sequence field and the value the index (batch_status::unpack reads them
/// back as entry and index).
KVEVICT_HOST_DEVICE inline std::uint64_t pack_bad_entry(std::int32_t position, std::int32_t value) noexcept {
  return pack_status(position, 0, value, batch_code::bad_sequence);
}

}  // namespace kvevict
