#pragma once
// The status word of the batched calls. A kernel cannot throw, and one bad
// (sequence, head) must not stop the rest of the batch, so a batched call
// leaves every (b, h) whose input is bad unchanged and records the offence in
// a 64-bit word in caller memory. Several offenders keep the lowest
// (sequence, head, index, code) — an atomic minimum, so the word is the same
// whatever order blocks or threads run in, on every device. The word is
// sticky: it stays set until the caller clears it, so an engine may check it
// once every few steps. throw_if_error turns it into the library's exception.
// The codes and the packing are status_code.hpp's (below the rules).
#include <cstdint>
#include <cstring>
#include <string>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/status_code.hpp"

namespace kvevict {

/// An unpacked status word. For bad_sequence there is no sequence: `entry`
/// is the active-list position and `index` the value it holds; for
/// repeated_sequence `entry` and `index` are the position of the repeat.
struct batch_status {
  batch_code code = batch_code::ok;
  std::int32_t sequence = -1, head = -1, index = -1;
  std::int32_t entry = -1;  ///< the active-list position, for the codes about a list entry

  static batch_status unpack(std::uint64_t word) noexcept {
    batch_status s;
    if (word == batch_status_clear) return s;
    s.code = static_cast<batch_code>(word & 0x3Fu);
    if (s.code == batch_code::ok || s.code > last_recorded_code) {  // no call writes such a word
      s.code = batch_code::bad_status_word;
      return s;
    }
    const std::int32_t raw = static_cast<std::int32_t>((word >> 6) & 0x3FFFFFFu);
    s.index = raw >= (1 << 25) ? raw - (1 << 26) : raw;  // 26-bit two's complement
    s.head = static_cast<std::int32_t>((word >> 32) & 0xFFFu);
    s.sequence = static_cast<std::int32_t>(word >> 44);
    if (s.code == batch_code::bad_sequence) {
      s.entry = s.sequence;
      s.sequence = s.head = -1;
    }
    if (s.code == batch_code::repeated_sequence) s.entry = s.index;
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
    case batch_code::bad_length:
      return "a prompt length is outside [1, capacity], above max_length, or shorter than SnapKV's window";
    case batch_code::over_capacity: return "appending these tokens would exceed the capacity";
    case batch_code::not_observed: return "evict_to after an append that was not observed";
    case batch_code::narrow_input:
      return "the input has fewer columns than the head holds tokens (one per occupied slot)";
    case batch_code::repeated_sequence:
      return "the active list names this sequence more than once; no entry naming it stepped";
    case batch_code::bad_fork_source: return "the sequence a fork copies is outside [0, num_seqs)";
    case batch_code::bad_kv_scale: return "an fp8 cache's K or V scale for this head is not positive and finite";
    case batch_code::bad_status_word:
      return "the word is not one a batched call writes: initialise it to batch_status_clear (all ones); a "
             "word of 0 is below every problem, so no refusal could be recorded in it";
  }
  return "unknown status code";
}

namespace detail {

/// What the index of a status word with `code` counts ("" where it is 0).
inline const char* status_index_meaning(batch_code code) noexcept {
  switch (code) {
    case batch_code::non_finite_lse:
    case batch_code::non_finite_query: return "the query head";
    case batch_code::bad_length: return "the prompt length";
    case batch_code::over_capacity: return "the tokens appended";
    case batch_code::narrow_input: return "the tokens the head holds";
    case batch_code::bad_count: return "the segment";
    case batch_code::bad_fork_source: return "the source";
    case batch_code::bad_kv_scale: return "0: the K scale, 1: the V scale";
    case batch_code::bad_stream: return "the active-list entry";
    case batch_code::nan_input:
    case batch_code::infinite_input:
    case batch_code::negative_probability:
    case batch_code::score_overflow:
    case batch_code::bad_page:
    case batch_code::non_finite_kv: return "the slot";
    default: return "";
  }
}

/// Where a status word points, in words: the list entry, or the sequence,
/// head and index (with what the index counts). `prefill`: the call leaves
/// a refused sequence whole, not only the head.
inline std::string status_place(const batch_status& s, bool prefill = false) {
  if (s.code == batch_code::bad_sequence)
    return concat("active-list entry ", s.entry, " is ", s.index, ": ", describe(s.code),
                  " (that entry stepped nothing)");
  if (s.code == batch_code::repeated_sequence)
    return concat("at sequence ", s.sequence, ", active-list entry ", s.entry, ": ", describe(s.code),
                  " (that sequence was left unchanged)");
  const char* meaning = status_index_meaning(s.code);
  // A prompt's length and emptiness are the sequence's: prefill leaves all of it unchanged; so do
  // reset and fork for a bad stream or source.
  const bool whole = prefill || s.code == batch_code::bad_length || s.code == batch_code::not_empty ||
                     s.code == batch_code::bad_stream || s.code == batch_code::bad_fork_source;
  return concat("at sequence ", s.sequence, ", head ", s.head, ", index ", s.index,
                *meaning ? concat(" (", meaning, ")") : std::string(), ": ", describe(s.code),
                whole ? " (that sequence was left unchanged)" : " (that head was left unchanged)");
}

}  // namespace detail

namespace detail {

/// Throws the library's exception for a status word that is not clear, in
/// the name of `where` (a batched call, or a per-sequence policy's call
/// that runs the batched step); `prefill`: the call leaves a refused
/// sequence whole.
inline void throw_status(const site& where, std::uint64_t word, bool prefill) {
  const batch_status s = batch_status::unpack(word);
  if (s.ok()) return;
  if (s.code == batch_code::bad_status_word)
    fail<invalid_argument>(where, "status", "= ", word, ": ", describe(s.code));
  const std::string at = status_place(s, prefill);
  switch (s.code) {
    case batch_code::nan_input:
    case batch_code::infinite_input:
    case batch_code::non_finite_lse:
    case batch_code::non_finite_query:
    case batch_code::non_finite_kv:
    case batch_code::score_overflow: fail_state<non_finite_error>(where, at);
    case batch_code::bad_sequence:
    case batch_code::bad_stream:
    case batch_code::bad_count:
    case batch_code::bad_length:
    case batch_code::bad_fork_source:
    case batch_code::bad_page: fail_state<out_of_range>(where, at);
    case batch_code::no_free_slot:
    case batch_code::not_empty:
    case batch_code::over_capacity:
    case batch_code::not_observed:
    case batch_code::history_full:
    case batch_code::history_gap:
    case batch_code::not_appended: fail_state<state_error>(where, at);
    case batch_code::repeated_sequence:
    case batch_code::bad_kv_scale:
    default: fail_state<invalid_argument>(where, at);
  }
}

}  // namespace detail

/// Throws the library's exception for a status word that is not clear:
/// non_finite_error, invalid_argument, out_of_range or state_error, naming
/// the call, the sequence, head and index (or the active-list entry). A
/// word that no call writes (0, from a word initialised to 0) throws
/// invalid_argument naming 'status': it would have hidden every refusal.
inline void throw_if_error(std::uint64_t word, const char* call = "batched call") {
  detail::throw_status(detail::site{"batch", call}, word, std::strstr(call, "prefill") != nullptr);
}

}  // namespace kvevict
