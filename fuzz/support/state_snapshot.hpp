#pragma once
// Byte snapshots of everything a refused call must leave alone (the strong
// guarantee, docs/reliability.md): for a per-sequence policy its whole
// observable state (lengths, protocol flags, slot table, score bits, random's
// streams, exact_greedy's history) plus the cache's K/V bytes and page
// table; for a batched state every byte of the state memory plus the cache.
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/batch/state.hpp"
#include "kvevict/kv_cache.hpp"
#include "kvevict/policy/exact_greedy.hpp"
#include "kvevict/policy/random.hpp"

namespace kvfuzz {

/// Named byte blocks; two snapshots compare block by block.
struct snapshot {
  std::vector<std::pair<std::string, std::vector<unsigned char>>> blocks;

  template <class T>
  void add(const char* name, const T* data, std::size_t count) {
    std::vector<unsigned char> bytes(count * sizeof(T));
    if (count) std::memcpy(bytes.data(), data, bytes.size());
    blocks.emplace_back(name, std::move(bytes));
  }
  template <class T>
  void add_value(const char* name, const T& value) {
    add(name, &value, 1);
  }

  /// "" when equal, else the first differing block and byte.
  std::string first_difference(const snapshot& after) const {
    if (blocks.size() != after.blocks.size()) return "the number of state blocks";
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const auto& a = blocks[i].second;
      const auto& b = after.blocks[i].second;
      if (a.size() != b.size()) return blocks[i].first + " (size " + std::to_string(a.size()) + " -> " +
                                       std::to_string(b.size()) + ")";
      for (std::size_t j = 0; j < a.size(); ++j)
        if (a[j] != b[j])
          return blocks[i].first + " byte " + std::to_string(j) + " (" + std::to_string(a[j]) + " -> " +
                 std::to_string(b[j]) + ")";
    }
    return "";
  }
};

template <class T, class Layout>
void add_cache(snapshot& s, kvevict::kv_cache<T, Layout>& cache) {
  s.add("K bytes", cache.k_storage().data(), cache.k_storage().size());
  s.add("V bytes", cache.v_storage().data(), cache.v_storage().size());
  s.add("page table", cache.page_table().data(), cache.page_table().size());
}

/// A per-sequence policy through its public accessors. history_head_dim:
/// the head_dim exact_greedy's history rows have (the cache's).
template <class Policy>
void add_policy(snapshot& s, const Policy& p, std::int32_t history_head_dim) {
  const kvevict::policy_shape& sh = p.shape();
  for (std::int32_t b = 0; b < sh.num_seqs; ++b) {
    s.add_value("length", p.length(b));
    s.add_value("awaiting_observe", p.awaiting_observe(b));
    if constexpr (std::is_same_v<Policy, kvevict::random_policy>) s.add_value("stream", p.stream(b));
    for (std::int32_t h = 0; h < sh.num_kv_heads; ++h) {
      s.add_value("count", p.slots().count(b, h));
      s.add_value("next_slot", p.next_slot(b, h));
      s.add("positions", p.slots().positions_of(b, h), std::size_t(sh.capacity));
      s.add("scores", p.scores_of(b, h), std::size_t(sh.capacity));
      if constexpr (std::is_same_v<Policy, kvevict::exact_greedy_policy>) {
        const std::int32_t rows = p.history_length(b, h);
        s.add_value("history rows", rows);
        s.add("history keys", p.history_keys(b, h), std::size_t(rows) * history_head_dim);
        s.add("history values", p.history_values(b, h), std::size_t(rows) * history_head_dim);
      }
    }
  }
}

/// Every byte of a batched state: from its first array to the end of its
/// last (the carve is one block of caller memory), padding included.
inline void add_batch_state(snapshot& s, const kvevict::batch_state_view& st) {
  const auto* first = reinterpret_cast<const unsigned char*>(st.slots.positions);
  const unsigned char* end = first;
  const auto extend = [&](const void* p, std::size_t bytes) {
    if (!p) return;
    const auto* e = static_cast<const unsigned char*>(p) + bytes;
    if (e > end) end = e;
  };
  const std::size_t heads = std::size_t(st.num_seqs()) * st.num_heads();
  const std::size_t slots = heads * st.capacity();
  extend(st.slots.positions, slots * 4);
  extend(st.slots.counts, heads * 4);
  extend(st.slots.next_slots, heads * 4);
  extend(st.slots.lengths, std::size_t(st.num_seqs()) * 4);
  extend(st.scores, 2 * slots * 4);
  extend(st.score_buffer, heads);
  extend(st.appended, heads);
  extend(st.streams, std::size_t(st.num_seqs()) * 8);
  extend(st.victim_scratch, slots * 4);
  const kvevict::history_view& hv = st.history;
  const std::size_t rows = heads * std::size_t(hv.max_tokens);
  extend(hv.keys, rows * hv.head_dim * 4);
  extend(hv.values, rows * hv.head_dim * 4);
  extend(hv.rows, heads * 4);
  extend(hv.cached, rows);
  extend(hv.work, heads * std::size_t(hv.work_doubles()) * 8);
  s.add("batch state bytes", first, std::size_t(end - first));
}

/// What a batched call must leave unchanged for a (b, h) it reported in the
/// status word: its slot-table entries, its current scores, its flags, its
/// recorded history rows and its sequence's length and stream. (The spare
/// score buffer and the scratch are not state.)
inline snapshot batch_head_state(const kvevict::batch_state_view& st, std::int32_t b, std::int32_t h) {
  snapshot s;
  const std::int64_t bh = st.head_index(b, h);
  s.add("positions", st.slots.positions_of(b, h), std::size_t(st.capacity()));
  s.add_value("count", st.slots.counts[bh]);
  s.add_value("next_slot", st.slots.next_slots[bh]);
  s.add_value("length", st.slots.lengths[b]);
  s.add_value("appended", st.appended[bh]);
  s.add("current scores", st.scores_of(b, h), std::size_t(st.capacity()));
  if (st.streams) s.add_value("stream", st.streams[b]);
  if (st.history.rows) {
    const std::int32_t rows = st.history.rows[bh];
    s.add_value("history rows", rows);
    const std::size_t at = std::size_t(bh) * st.history.max_tokens * st.history.head_dim;
    s.add("history keys", st.history.keys + at, std::size_t(rows) * st.history.head_dim);
    s.add("history values", st.history.values + at, std::size_t(rows) * st.history.head_dim);
  }
  return s;
}

}  // namespace kvfuzz
