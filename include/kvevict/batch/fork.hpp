#pragma once
// fork: sequences of a batched state become copies of other sequences of
// the same state, or of a state of another batch size (docs/semantics.md,
// "Forking sequences"): parallel sampling forks a prompt into several
// sequences, beam search reorders its beams every step, and a batch grows
// or shrinks by copying its sequences into a state of the new size.
//
// Entry i of an active set names a destination, and sources[i] the
// sequence it copies: its slot table, both score buffers, KeyDiff anchors,
// exact_greedy's history, its length and flags. Every source is read as it
// was before the call, so a sequence may be both a source and a
// destination (a beam permutation), and one source may have many
// destinations. random's destination takes a new request stream:
// streams[i], else the destination index (as reset). The engine copies or
// shares the K/V pages itself.
//
// The copy of one (sequence, head) is written once here (copy_head) for
// the host and the CUDA kernels (cuda/fork.cuh). Within one state both go
// through a snapshot of the sources (a state of `entries` sequences with
// the same parts and no workspace: host memory here, the caller's
// workspace on CUDA); across two states they copy directly.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvevict/batch/copy_state.hpp"
#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/limits.hpp"

namespace kvevict {
namespace detail {

/// The snapshot of `entries` sequences of `st`: the same heads, capacity,
/// rule, history and anchor extents, no streams and no workspace.
inline batch_state_view carve_fork_snapshot(void* memory, const batch_state_view& st, std::int32_t entries,
                                            const site& w, std::size_t* bytes) {
  const policy_shape shape{entries > 0 ? entries : 1, st.num_heads(), st.num_q_heads, st.capacity()};
  state_parts parts;
  parts.history = st.history.keys != nullptr;
  parts.anchors = st.anchors.sums != nullptr;
  parts.workspace = false;
  const history_extent extent{st.history.max_tokens, parts.history ? st.history.head_dim : st.anchors.head_dim};
  return carve_state(memory, shape, st.rule, extent, parts, w, bytes);
}

template <class T>
KVEVICT_HOST_DEVICE void copy_lanes(T* to, const T* from, std::int64_t n, std::int32_t lane, std::int32_t lanes) noexcept {
  for (std::int64_t i = lane; i < n; i += lanes) to[i] = from[i];
}

/// Copies head h of sequence a of `from` into head h of sequence b of `to`
/// (states of the same heads, capacity and parts), threads [lane, lanes) of
/// a group: the slots and both score buffers (so the copy's next step reads
/// what the source's would), the counters and flags, the anchor and the
/// recorded history rows. Scratch is not copied.
KVEVICT_HOST_DEVICE inline void copy_head(const batch_state_view& from, std::int32_t a, const batch_state_view& to,
                                          std::int32_t b, std::int32_t h, std::int32_t lane,
                                          std::int32_t lanes) noexcept {
  const std::int32_t capacity = from.capacity();
  const std::int64_t fa = from.head_index(a, h), tb = to.head_index(b, h);
  copy_lanes(to.slots.positions_of(b, h), from.slots.positions_of(a, h), capacity, lane, lanes);
  copy_lanes(to.buffer_of(b, h, 0), from.buffer_of(a, h, 0), capacity, lane, lanes);
  copy_lanes(to.buffer_of(b, h, 1), from.buffer_of(a, h, 1), capacity, lane, lanes);
  if (from.anchors.sums) {
    const std::int64_t d = from.anchors.head_dim;
    copy_lanes(to.anchors.sums + tb * d, from.anchors.sums + fa * d, d, lane, lanes);
    copy_lanes(to.anchors.units + tb * d, from.anchors.units + fa * d, d, lane, lanes);
  }
  if (from.history.keys) {
    const std::int64_t d = from.history.head_dim, rows = from.history.rows[fa];
    const std::int64_t f0 = fa * from.history.max_tokens * d, t0 = tb * to.history.max_tokens * d;
    copy_lanes(to.history.keys + t0, from.history.keys + f0, rows * d, lane, lanes);
    copy_lanes(to.history.values + t0, from.history.values + f0, rows * d, lane, lanes);
  }
  if (lane == 0) {
    to.slots.counts[tb] = from.slots.counts[fa];
    set_next_slot(to, b, h, from.slots.next_slots[fa], from.slots.lengths[a]);
    to.score_buffer[tb] = from.score_buffer[fa];
    to.appended[tb] = from.appended[fa];
    if (from.history.rows) to.history.rows[tb] = from.history.rows[fa];
    if (from.anchors.upto) to.anchors.upto[tb] = from.anchors.upto[fa];
  }
}

/// The whole of sequence a of `from` into sequence b of `to`, one thread.
inline void copy_sequence(const batch_state_view& from, std::int32_t a, const batch_state_view& to, std::int32_t b) {
  for (std::int32_t h = 0; h < from.num_heads(); ++h) copy_head(from, a, to, b, h, 0, 1);
  to.slots.lengths[b] = from.slots.lengths[a];
}

/// The destination's request stream after a fork: streams[i], else its index.
KVEVICT_HOST_DEVICE inline std::uint64_t forked_stream(const std::uint64_t* streams, std::int32_t i,
                                                       std::int32_t destination) noexcept {
  return streams ? streams[i] : static_cast<std::uint64_t>(destination);
}

/// Whether `from` and `to` are one state (a fork within it needs the snapshot).
KVEVICT_HOST_DEVICE inline bool same_state(const batch_state_view& from, const batch_state_view& to) noexcept {
  return from.slots.positions == to.slots.positions;
}

/// The arrays copy_head reads and writes beside the slot table: a state
/// that keeps history or anchors must have all of their arrays.
inline void require_fork_parts(const site& w, const char* which, const batch_state_view& st) {
  const history_view& h = st.history;
  if (h.keys && (!h.values || !h.rows))
    fail<invalid_argument>(w, concat(which, ".history"), "has keys but no values or rows");
  const key_anchor_view& a = st.anchors;
  if (a.sums && (!a.units || !a.upto))
    fail<invalid_argument>(w, concat(which, ".anchors"), "has sums but no units or upto");
}

/// A fork's checks that need no entry: both states usable, and `to` able to
/// continue `from`'s sequences (the policy, heads, capacity and parts).
inline void require_fork_states(const site& w, const batch_state_view& from, const batch_state_view& to,
                                const active_set& destinations) {
  require_state(w, from);
  require_fork_parts(w, "src", from);
  require_fork_parts(w, "dst", to);
  if (!same_state(from, to)) {
    require_state(w, to);
    require_same_policy(w, from, to);
    if (from.capacity() != to.capacity())
      fail<invalid_argument>(w, "capacity", "= ", to.capacity(), " in dst, ", from.capacity(), " in src");
  }
  require_active(w, destinations, to.num_seqs());
}

}  // namespace detail

/// Forks from host state `from` into host state `to` (the same state, or
/// one of the same policy, heads and capacity with any number of
/// sequences): for every entry i of `destinations` naming sequence d of
/// `to` (a list entry, or a flag d set), d becomes a copy of sequence
/// sources[i] of `from` as every source was before the call (see the top of
/// this header). streams (optional, [entries]): random's new request
/// streams, else the destination index. Checks every entry first and
/// throws (a destination or source out of range, a repeated destination, a
/// stream above max_random_stream) with `to` unchanged.
inline void batched_fork(const batch_state_view& from, const batch_state_view& to, const active_set& destinations,
                         const std::int32_t* sources, const std::uint64_t* streams = nullptr) {
  const detail::site w{"batch", "fork"};
  detail::require_fork_states(w, from, to, destinations);
  const std::int32_t entries = destinations.entries(to.num_seqs());
  if (entries > 0) detail::require_not_null(w, "sources", sources);
  for (std::int32_t i = 0; i < entries; ++i) {  // the destinations first, as CUDA reports them
    const std::int32_t d = destinations.sequence(i, to.num_seqs());
    if (d == -2)
      detail::fail<out_of_range>(w, detail::concat("destinations.list[", i, "]"), "= ", destinations.list[i],
                                 " is outside [0, num_seqs = ", to.num_seqs(), ")");
    if (d >= 0 && detail::check_entry(destinations, i, to.num_seqs()).word != batch_status_clear)
      detail::fail<invalid_argument>(w, detail::concat("destinations.list[", i, "]"), "= ", d,
                                     " repeats an earlier entry: a sequence can be the copy of one source only");
  }
  for (std::int32_t i = 0; i < entries; ++i) {
    if (destinations.sequence(i, to.num_seqs()) < 0) continue;
    if (sources[i] < 0 || sources[i] >= from.num_seqs())
      detail::fail<out_of_range>(w, detail::concat("sources[", i, "]"), "= ", sources[i],
                                 " is outside [0, num_seqs = ", from.num_seqs(), ")");
    if (streams && streams[i] > max_random_stream)
      detail::fail<out_of_range>(w, detail::concat("streams[", i, "]"), "= ", streams[i], " exceeds max_random_stream");
  }
  if (entries == 0) return;
  // Within one state the sources are copied aside first, so none is
  // overwritten before it is read.
  std::vector<unsigned char> memory;
  batch_state_view source = from;
  const bool within = detail::same_state(from, to);
  if (within) {
    std::size_t bytes = 0;
    detail::carve_fork_snapshot(nullptr, from, entries, w, &bytes);
    memory.resize(bytes);
    source = detail::carve_fork_snapshot(memory.data(), from, entries, w, nullptr);
    for (std::int32_t i = 0; i < entries; ++i)
      if (destinations.sequence(i, to.num_seqs()) >= 0) detail::copy_sequence(from, sources[i], source, i);
  }
  for (std::int32_t i = 0; i < entries; ++i) {
    const std::int32_t d = destinations.sequence(i, to.num_seqs());
    if (d < 0) continue;
    detail::copy_sequence(source, within ? i : sources[i], to, d);
    if (to.streams) to.streams[d] = detail::forked_stream(streams, i, d);
  }
}

/// Forks within host state `st` (batched_fork(st, st, ...)): a sequence may
/// be a source and a destination of one call.
inline void batched_fork(const batch_state_view& st, const active_set& destinations, const std::int32_t* sources,
                         const std::uint64_t* streams = nullptr) {
  batched_fork(st, st, destinations, sources, streams);
}

}  // namespace kvevict
