#pragma once
// What the batched calls take beside the score inputs (score_inputs.hpp,
// their batch form): new K/V rows for the fused append + scatter, and the
// set of sequences that step. Trivially copyable; on CUDA they point to
// device memory.
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/score_inputs.hpp"
#include "kvevict/status_code.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvevict {

/// One new K or V row per (sequence, KV head): rows(b, h, d), [B][Hkv][head_dim],
/// for append with scatter. The last stride must be 1.
template <class T>
struct batch_rows {
  tensor_view<const T, 3> rows;
};

/// Which sequences a batched call steps: a list of distinct indices, or one
/// flag per sequence, or (the default) all of them. On CUDA the list and the
/// flags live in device memory; the list's length is known on the host.
/// A list entry outside [0, num_seqs), and every entry naming a sequence
/// that another entry names too, steps nothing (detail::check_entry).
struct active_set {
  enum class kind : std::uint8_t { all, list, flags };
  kind mode = kind::all;
  const std::int32_t* list = nullptr;   ///< `count` distinct sequence indices (mode list)
  std::int32_t count = 0;               ///< entries of `list`; 0 steps nothing
  const std::uint8_t* flags = nullptr;  ///< [num_seqs], non-zero steps (mode flags)
  /// Observe + evict only: the retry after a refused head (docs/
  /// integration.md, "After a bad input"). A head of the set that is not
  /// waiting for its observation (it stepped in the call retried) is
  /// skipped, reports nothing and keeps its victims entry; the heads still
  /// waiting step as usual. Every other call refuses a retry set.
  bool retry = false;

  static active_set all() noexcept { return {}; }
  static active_set of_list(const std::int32_t* list, std::int32_t count) noexcept {
    return {kind::list, list, count, nullptr};
  }
  static active_set of_flags(const std::uint8_t* flags) noexcept { return {kind::flags, nullptr, 0, flags}; }
  /// The same set as a retry.
  active_set as_retry() const noexcept {
    active_set r = *this;
    r.retry = true;
    return r;
  }

  /// How many entries a call walks: the list's length, or every sequence.
  KVEVICT_HOST_DEVICE std::int32_t entries(std::int32_t num_seqs) const noexcept {
    return mode == kind::list ? count : num_seqs;
  }
  /// The sequence of entry i, or -1 when entry i is inactive; -2 when the
  /// list names an index outside [0, num_seqs). Repeats are not looked
  /// for: a batched call takes detail::check_entry.
  KVEVICT_HOST_DEVICE std::int32_t sequence(std::int32_t i, std::int32_t num_seqs) const noexcept {
    if (mode == kind::list) {
      const std::int32_t b = list[i];
      return b >= 0 && b < num_seqs ? b : -2;
    }
    return mode == kind::flags && flags[i] == 0 ? -1 : i;
  }
};

namespace detail {

/// Which other entries among list positions first, first + step, ... name
/// sequence b, as entry i does: bit 0 one before i, bit 1 one after. A
/// kernel splits the scan across its threads and ORs their bits.
KVEVICT_HOST_DEVICE inline std::uint32_t list_repeats(const active_set& active, std::int32_t i, std::int32_t b,
                                                      std::int32_t first, std::int32_t step) noexcept {
  std::uint32_t found = 0;
  for (std::int32_t j = first; j < active.count; j += step)
    if (j != i && active.list[j] == b) found |= j < i ? 1u : 2u;
  return found;
}

/// An entry of a batched call, checked: the sequence it steps (-1: none)
/// and the status word it reports (batch_status_clear: none).
struct checked_entry {
  std::int32_t sequence;
  std::uint64_t word;
};

/// Entry i, given what list_repeats found for it (0 outside list mode). An
/// index outside [0, num_seqs) reports bad_sequence; a sequence named by
/// several entries steps for none of them (two blocks would write it), and
/// each entry after the first reports repeated_sequence at its position,
/// so the status keeps the second.
KVEVICT_HOST_DEVICE inline checked_entry entry_after_scan(const active_set& active, std::int32_t i,
                                                          std::int32_t num_seqs, std::uint32_t repeats) noexcept {
  const std::int32_t b = active.sequence(i, num_seqs);
  if (b == -2) return {-1, pack_bad_entry(i, active.list[i])};
  if (b < 0 || repeats == 0) return {b, batch_status_clear};
  return {-1, repeats & 1u ? pack_status(b, 0, i, batch_code::repeated_sequence) : batch_status_clear};
}

/// Entry i checked by one thread: O(count) for a list, O(1) otherwise.
KVEVICT_HOST_DEVICE inline checked_entry check_entry(const active_set& active, std::int32_t i,
                                                     std::int32_t num_seqs) noexcept {
  const std::int32_t b = active.sequence(i, num_seqs);
  const bool scan = b >= 0 && active.mode == active_set::kind::list;
  return entry_after_scan(active, i, num_seqs, scan ? list_repeats(active, i, b, 0, 1) : 0u);
}

}  // namespace detail

static_assert(std::is_trivially_copyable_v<active_set>, "inputs go to kernels by value");

}  // namespace kvevict
