#pragma once
// The batched state a per-sequence policy runs on (protocol.hpp): the state
// of batch/state.hpp in host memory it owns, plus the two parts whose size
// the per-sequence API learns late and grows into, so its constructors keep
// their arguments:
//   - KeyDiff's anchors (h2o), sized by the head_dim of the first key_diff
//     observe (a later head_dim starts them again, stale);
//   - exact_greedy's history, sized by the first observe's or prefill's
//     head_dim and grown (doubling its rows) as sequences grow: the oracle
//     allocates as it goes, as it always has.
// Copies hold the same state in memory of their own; moves keep the memory.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvevict/batch/host_state.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/error.hpp"
#include "kvevict/limits.hpp"
#include "kvevict/slot_table.hpp"

namespace kvevict {
namespace detail {

class sequence_state {
 public:
  sequence_state() = default;
  /// The state of a policy with these parts (anchors and history start
  /// absent), initialised: every sequence empty.
  sequence_state(const policy_shape& shape, const decode_rule& rule, state_parts parts, const site& w)
      : keeps_history_(parts.history) {
    parts.history = parts.anchors = false;  // grown here, outside the carve
    memory_ = host_state(shape, rule, history_extent{}, parts, w);
    refresh();
  }
  sequence_state(const sequence_state& o)
      : memory_(o.memory_), anchors_(o.anchors_), history_(o.history_), keeps_history_(o.keeps_history_) {
    refresh();
  }
  sequence_state& operator=(const sequence_state& o) {
    if (this != &o) {
      memory_ = o.memory_;
      anchors_ = o.anchors_;
      history_ = o.history_;
      keeps_history_ = o.keeps_history_;
      refresh();
    }
    return *this;
  }
  sequence_state(sequence_state&&) noexcept = default;  // vectors keep their memory: the view stays valid
  sequence_state& operator=(sequence_state&&) noexcept = default;

  const batch_state_view& view() const noexcept { return view_; }
  const slot_table& slots() const noexcept { return slots_; }

  /// KeyDiff's anchors for keys of `head_dim` (allocated, every anchor
  /// stale, on the first call or a new head_dim).
  void require_anchors(std::int32_t head_dim) {
    if (anchors_.head_dim == head_dim) return;
    const std::size_t heads = heads_of(), n = heads * std::size_t(head_dim);
    anchors_.sums.assign(n, 0);
    anchors_.units.assign(n, 0.0f);
    anchors_.upto.assign(heads, -1);
    anchors_.head_dim = head_dim;
    refresh();
  }

  /// exact_greedy's history for rows of `head_dim` and at least `tokens`
  /// positions per (sequence, head). The first call fixes head_dim (the
  /// caller checks later ones); growing doubles the rows, keeping those
  /// recorded.
  void require_history(const site& w, std::int32_t head_dim, std::int32_t tokens) {
    history_memory& hm = history_;
    if (hm.head_dim == head_dim && tokens <= hm.max_tokens) return;
    const std::int64_t capacity = view_.capacity();
    std::int64_t rows = std::max<std::int64_t>({tokens, capacity, 2 * std::int64_t{hm.max_tokens}});
    rows = std::min<std::int64_t>(rows, 0x7FFFFFFF);
    const std::size_t heads = heads_of();
    require_allocation(w, "the history (heads x tokens x head_dim)", 8.0L * heads * rows * head_dim);
    history_memory grown;
    grown.max_tokens = static_cast<std::int32_t>(rows);
    grown.head_dim = head_dim;
    grown.keys.assign(heads * std::size_t(rows) * head_dim, 0.0f);
    grown.values.assign(grown.keys.size(), 0.0f);
    grown.rows.assign(heads, 0);
    grown.cached.assign(heads * std::size_t(rows), 0);
    history_view shape_of;
    shape_of.max_tokens = grown.max_tokens;
    shape_of.head_dim = head_dim;
    shape_of.capacity = static_cast<std::int32_t>(capacity);
    grown.work.assign(heads * std::size_t(shape_of.work_doubles()), 0.0);
    if (hm.head_dim == head_dim)  // keep the rows recorded so far
      for (std::size_t bh = 0; bh < heads; ++bh) {
        grown.rows[bh] = hm.rows[bh];
        const std::size_t n = std::size_t(hm.rows[bh]) * head_dim;
        std::copy_n(hm.keys.data() + bh * hm.max_tokens * head_dim, n, grown.keys.data() + bh * rows * head_dim);
        std::copy_n(hm.values.data() + bh * hm.max_tokens * head_dim, n, grown.values.data() + bh * rows * head_dim);
      }
    history_ = std::move(grown);
    refresh();
  }

 private:
  struct anchor_memory {
    std::vector<std::int64_t> sums;
    std::vector<float> units;
    std::vector<std::int32_t> upto;
    std::int32_t head_dim = 0;
  };
  struct history_memory {
    std::vector<float> keys, values;
    std::vector<std::int32_t> rows;
    std::vector<std::uint8_t> cached;
    std::vector<double> work;
    std::int32_t max_tokens = 0, head_dim = 0;
  };

  std::size_t heads_of() const noexcept { return std::size_t(view_.num_seqs()) * std::size_t(view_.num_heads()); }

  /// The view: the carve, with the grown parts where they are now.
  void refresh() noexcept {
    view_ = memory_.view();
    if (anchors_.head_dim > 0)
      view_.anchors = key_anchor_view{anchors_.sums.data(), anchors_.units.data(), anchors_.upto.data(),
                                      view_.num_heads(), anchors_.head_dim};
    if (keeps_history_ && history_.head_dim > 0) {
      history_view& hv = view_.history;
      hv.keys = history_.keys.data();
      hv.values = history_.values.data();
      hv.rows = history_.rows.data();
      hv.cached = history_.cached.data();
      hv.work = history_.work.data();
      hv.max_tokens = history_.max_tokens;
      hv.head_dim = history_.head_dim;
      hv.capacity = view_.capacity();
    }
    slots_ = slot_table(view_.slots);
  }

  host_state memory_;
  anchor_memory anchors_;
  history_memory history_;
  bool keeps_history_ = false;
  batch_state_view view_;
  slot_table slots_;
};

}  // namespace detail
}  // namespace kvevict
