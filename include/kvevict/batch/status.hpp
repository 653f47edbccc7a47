#pragma once
// The status word of the batched calls. A kernel cannot throw, and one bad
// (sequence, head) must not stop the rest of the batch, so a batched call
// leaves every (b, h) whose input is bad unchanged and records the offence in
// a 64-bit word in caller memory. Several offenders keep the lowest
// (sequence, head, index, code) — an atomic minimum, so the word is the same
// whatever order blocks or threads run in, on every device. The word is
// sticky: it stays set until the caller clears it, so an engine may check it
// once every few steps. throw_if_error turns it into the library's exception.
#include <cstdint>
#include <string>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"

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
  bad_sequence = 8,          ///< an active-list entry outside [0, num_seqs)
  bad_page = 9,              ///< a page id outside [0, num_pages) for slot `index`
  non_finite_kv = 10,        ///< exact_greedy: NaN or inf in the K/V row of slot `index`
  history_full = 11,         ///< exact_greedy: the sequence outgrew max_tokens
  history_gap = 12,          ///< exact_greedy: a step was appended but never observed
  not_appended = 13,         ///< observe + evict with no append since the last one
  bad_stream = 14,           ///< CUDA reset: a random stream above max_random_stream
  bad_count = 15,            ///< a selection's k, or evict_to's target, outside what segment `index` allows
  not_empty = 16,            ///< prefill of a sequence that already holds tokens (reset it first)
  bad_length = 17,           ///< a prompt length outside [1, capacity] (index: the length)
  over_capacity = 18,        ///< appending `index` tokens would exceed the capacity
  not_observed = 19,         ///< evict_to after an append with no observe + evict since
  narrow_input = 20,         ///< the input has fewer columns than the head holds tokens (`index`)
};

/// The value of a clear status word.
inline constexpr std::uint64_t batch_status_clear = ~std::uint64_t{0};

/// Field widths of the packed word, most significant first:
/// sequence 20 bits, head 12, index 26, code 6.
struct batch_status_limits {
  static constexpr std::int64_t max_seqs = std::int64_t{1} << 20;
  static constexpr std::int64_t max_heads = std::int64_t{1} << 12;
  static constexpr std::int64_t max_index = std::int64_t{1} << 26;
};

KVEVICT_HOST_DEVICE inline std::uint64_t pack_status(std::int32_t b, std::int32_t h, std::int32_t index,
                                                     batch_code code) noexcept {
  return (std::uint64_t(std::uint32_t(b)) << 44) | (std::uint64_t(std::uint32_t(h) & 0xFFFu) << 32) |
         (std::uint64_t(std::uint32_t(index) & 0x3FFFFFFu) << 6) | std::uint64_t(code);
}

/// An unpacked status word.
struct batch_status {
  batch_code code = batch_code::ok;
  std::int32_t sequence = -1, head = -1, index = -1;

  static batch_status unpack(std::uint64_t word) noexcept {
    batch_status s;
    if (word == batch_status_clear) return s;
    s.code = static_cast<batch_code>(word & 0x3Fu);
    s.index = static_cast<std::int32_t>((word >> 6) & 0x3FFFFFFu);
    s.head = static_cast<std::int32_t>((word >> 32) & 0xFFFu);
    s.sequence = static_cast<std::int32_t>(word >> 44);
    return s;
  }
  bool ok() const noexcept { return code == batch_code::ok; }
};

inline const char* describe(batch_code code) noexcept {
  switch (code) {
    case batch_code::ok: return "no error";
    case batch_code::nan_input: return "an input is NaN";
    case batch_code::infinite_input: return "an input is infinite";
    case batch_code::negative_probability: return "a probability is negative";
    case batch_code::non_finite_lse: return "the LSE of a query head is not finite";
    case batch_code::non_finite_query: return "a query row is not finite";
    case batch_code::score_overflow: return "a score would overflow to a non-finite value";
    case batch_code::no_free_slot: return "a head has no free slot (it holds budget + 1 tokens; evict first)";
    case batch_code::bad_sequence: return "an active-list entry is not a sequence index";
    case batch_code::bad_page: return "a page id is outside [0, num_pages)";
    case batch_code::non_finite_kv: return "a K/V row is not finite";
    case batch_code::history_full: return "the sequence outgrew the history's max_tokens";
    case batch_code::history_gap: return "a step was appended but never observed";
    case batch_code::not_appended: return "observe + evict without an append since the last one";
    case batch_code::bad_stream: return "a random stream exceeds max_random_stream";
    case batch_code::bad_count: return "a selection count or evict_to target does not fit the segment";
    case batch_code::not_empty: return "prefill of a sequence that already holds tokens (reset it first)";
    case batch_code::bad_length: return "a prompt length is outside [1, capacity]";
    case batch_code::over_capacity: return "appending these tokens would exceed the capacity";
    case batch_code::not_observed: return "evict_to after an append that was not observed";
    case batch_code::narrow_input:
      return "the input has fewer columns than the head holds tokens (after a multi-token append)";
  }
  return "unknown status code";
}

/// Throws the library's exception for a status word that is not clear:
/// non_finite_error, invalid_argument, out_of_range or state_error, naming
/// the call, the sequence, head and index.
inline void throw_if_error(std::uint64_t word, const char* call = "batched call") {
  const batch_status s = batch_status::unpack(word);
  if (s.ok()) return;
  const detail::site where{"batch", call};
  const std::string at =
      detail::concat("at sequence ", s.sequence, ", head ", s.head, ", index ", s.index, ": ", describe(s.code),
                     " (that head was left unchanged)");
  switch (s.code) {
    case batch_code::nan_input:
    case batch_code::infinite_input:
    case batch_code::non_finite_lse:
    case batch_code::non_finite_query:
    case batch_code::non_finite_kv:
    case batch_code::score_overflow: detail::fail_state<non_finite_error>(where, at);
    case batch_code::bad_sequence:
    case batch_code::bad_stream:
    case batch_code::bad_count:
    case batch_code::bad_length:
    case batch_code::bad_page: detail::fail_state<out_of_range>(where, at);
    case batch_code::no_free_slot:
    case batch_code::not_empty:
    case batch_code::over_capacity:
    case batch_code::not_observed:
    case batch_code::history_full:
    case batch_code::history_gap:
    case batch_code::not_appended: detail::fail_state<state_error>(where, at);
    default: detail::fail_state<invalid_argument>(where, at);
  }
}

}  // namespace kvevict
