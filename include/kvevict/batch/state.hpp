#pragma once
// The state of a batched policy, as a trivially copyable view of memory the
// caller provides (docs/semantics.md, "Devices"): the slot table, the
// scores, and what a policy keeps of its own. The same view type serves the
// host and CUDA; on CUDA every pointer is device memory, and engine kernels
// may read it in place (an append kernel reads next_slots, an attention
// kernel reads counts).
//
// Memory follows CUB's two-phase pattern: batch_state_bytes<Policy>(...)
// says how much, make_batch_state<Policy>(memory, bytes, ...) carves views
// out of it (any alignment; the size includes the slack to align), and an
// init call of the device sets the initial values.
//
// Scores are double-buffered: observe + evict reads a head's scores from one
// buffer and writes the updated ones to the other, and switches that head's
// score_buffer only if every input was good. So bad input leaves (b, h)
// exactly as it was without a second pass over the inputs, on every device.
// Free slots hold 0 in both buffers; an occupied slot's other buffer is
// scratch.
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/batch/launch_shape.hpp"
#include "kvevict/batch/row_partial.hpp"
#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policy/key_diff_anchor.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/leave_one_out.hpp"
#include "kvevict/policy/policy_shape.hpp"
#include "kvevict/select/device_plan.hpp"
#include "kvevict/slot_table.hpp"

namespace kvevict {

/// exact_greedy's history: every K/V row (b, h) has seen, as float, and the
/// scratch its leave-one-out pass needs.
struct history_view {
  float* keys = nullptr;           ///< [B][H][max_tokens][head_dim]
  float* values = nullptr;         ///< [B][H][max_tokens][head_dim]
  std::int32_t* rows = nullptr;    ///< [B][H]: rows recorded so far
  std::uint8_t* cached = nullptr;  ///< [B][H][max_tokens]: 1 for cached positions (scratch)
  double* work = nullptr;          ///< [B][H][work_doubles()] (scratch)
  std::int32_t max_tokens = 0;
  std::int32_t head_dim = 0;
  std::int32_t capacity = 0;

  /// Scratch doubles per (b, h): logits and two exp terms per row, three
  /// numerators, and an error per slot.
  KVEVICT_HOST_DEVICE std::int64_t work_doubles() const noexcept {
    return 3 * std::int64_t{max_tokens} + 3 * std::int64_t{head_dim} + capacity;
  }
};

/// Sizes of what a state keeps of the K rows: exact_greedy's history
/// (max_tokens and head_dim), or h2o's KeyDiff anchors (head_dim only, see
/// key_diff_extent; recent_window and random ignore it); zero for neither.
struct history_extent {
  std::int32_t max_tokens = 0;  ///< the longest a sequence may grow (exact_greedy)
  std::int32_t head_dim = 0;
};

/// The extent of an h2o state that takes key_diff at decode time: a running
/// anchor of head_dim components per (sequence, KV head).
inline history_extent key_diff_extent(std::int32_t head_dim) noexcept { return history_extent{0, head_dim}; }

/// evict_to's plan of one (b, h) on CUDA, kept between its kernels: the row
/// as it was, how many tokens it keeps (-1: the head stays unchanged) and
/// the step's victim key. `check` gathers the blocks' failed checks (the
/// lowest evict_to_check key) and is all ones between calls.
struct evict_to_plan {
  std::uint64_t check = ~std::uint64_t{0};
  victim_order order;
  std::int32_t count = 0;
  std::int32_t next = -1;
  std::int32_t kept = -1;
};

/// What the CUDA kernels need beside the state, reserved with it so that no
/// call allocates: the host backend leaves it alone.
struct device_workspace {
  row_partial* partials = nullptr;        ///< [B][H][max_row_chunks(capacity)]: blocks of a split row (null
                                          ///< when a row fits one tile)
  std::uint32_t* arrivals = nullptr;      ///< [B][H]: blocks of a split row done; 0 between calls
  evict_to_plan* evict_plans = nullptr;   ///< [B][H]
  std::int32_t* evict_counts = nullptr;   ///< [B][H]: victims per head, the selection's counts
  unsigned char* select = nullptr;        ///< evict_to's victim selection (cuda/segmented_select.cuh)
  std::size_t select_bytes = 0;
};

/// What the one-launch decode step (gpu::batched_step) reads of a sequence's
/// other rows: a copy of lengths[b] per row, and which heads have no free
/// slot, double-buffered by the parity of the length. In one launch, row
/// (b, h) reads its own length and word [L & 1] of b (the step's append
/// verdict), and writes only its length and its bit of word [(L + 1) & 1],
/// so no row reads what another row of the launch writes. Every call that
/// sets next_slots or lengths keeps them (mark_row in step.hpp): for every
/// (b, h), lengths[b h] = lengths[b] and bit h of word [lengths[b] & 1] is
/// next_slots[b h] < 0. The other parity's word is stale.
struct row_marks {
  std::int32_t* lengths = nullptr;  ///< [B][H]
  std::uint64_t* full = nullptr;    ///< [2][B][words]
  std::int32_t words = 0;           ///< 64-bit words per sequence: words_for(H)

  KVEVICT_HOST_DEVICE static constexpr std::int32_t words_for(std::int32_t heads) noexcept { return (heads + 63) / 64; }

  KVEVICT_HOST_DEVICE std::uint64_t* word_of(std::int32_t b, std::int32_t h, std::int32_t length,
                                             std::int32_t num_seqs) const noexcept {
    return full + (std::int64_t{length & 1} * num_seqs + b) * words + h / 64;
  }
};

struct batch_state_view {
  slot_table_view slots;                 ///< positions [B][H][capacity], counts, next_slots [B][H], lengths [B]
  float* scores = nullptr;               ///< [2][B][H][capacity]: two buffers, see score_buffer
  std::uint8_t* score_buffer = nullptr;  ///< [B][H]: the buffer (0 or 1) holding (b, h)'s scores
  std::uint8_t* appended = nullptr;      ///< [B][H]: 1 after an append, 0 after observe + evict
  row_marks marks;                       ///< the one-launch step's view of other rows
  std::uint64_t* streams = nullptr;      ///< [B]: random's request streams (null for other policies)
  std::int32_t* victim_scratch = nullptr;  ///< [B][H][capacity] scratch of evict_to (its victims and holes)
  history_view history;                  ///< exact_greedy only (null pointers otherwise)
  key_anchor_view anchors;               ///< KeyDiff's running anchors: h2o sized by key_diff_extent (else null)
  device_workspace work;                 ///< the CUDA kernels' (unused on the host)
  decode_rule rule;
  std::int32_t num_q_heads = 0;

  KVEVICT_HOST_DEVICE std::int32_t num_seqs() const noexcept { return slots.num_seqs; }
  KVEVICT_HOST_DEVICE std::int32_t num_heads() const noexcept { return slots.num_heads; }
  KVEVICT_HOST_DEVICE std::int32_t capacity() const noexcept { return slots.capacity; }
  KVEVICT_HOST_DEVICE std::int32_t group_size() const noexcept { return num_q_heads / slots.num_heads; }
  KVEVICT_HOST_DEVICE std::int64_t head_index(std::int32_t b, std::int32_t h) const noexcept {
    return slots.head_index(b, h);
  }
  /// The current scores of (b, h).
  KVEVICT_HOST_DEVICE float* scores_of(std::int32_t b, std::int32_t h) const noexcept {
    return buffer_of(b, h, score_buffer[head_index(b, h)]);
  }
  /// The other buffer, where observe + evict writes the updated scores.
  KVEVICT_HOST_DEVICE float* spare_scores_of(std::int32_t b, std::int32_t h) const noexcept {
    return buffer_of(b, h, 1 - score_buffer[head_index(b, h)]);
  }
  /// random's request stream of sequence b (the sequence index without streams).
  KVEVICT_HOST_DEVICE std::uint64_t stream_of(std::int32_t b) const noexcept {
    return streams ? streams[b] : static_cast<std::uint64_t>(b);
  }
  /// The victim key of (b, h)'s current step (its newest position is length(b) - 1).
  KVEVICT_HOST_DEVICE victim_order order_of(std::int32_t b, std::int32_t h) const noexcept {
    return rule.order(stream_of(b), h, slots.lengths[b]);
  }
  KVEVICT_HOST_DEVICE float* buffer_of(std::int32_t b, std::int32_t h, std::int32_t which) const noexcept {
    const std::int64_t heads = std::int64_t{slots.num_seqs} * slots.num_heads;
    return scores + (which * heads + head_index(b, h)) * slots.capacity;
  }
};

static_assert(std::is_trivially_copyable_v<batch_state_view>, "the state view goes to kernels by value");

namespace detail {

/// The bytes of evict_to's victim selection over every (b, h) row of
/// `capacity` slots: the plan the CUDA launcher makes for the most rows.
inline std::size_t evict_select_bytes(const site& w, std::int64_t heads, std::int32_t capacity) {
  struct row_keys {  // the shapes of the selection; ascending slot order is all evict_to needs
    std::int32_t num_segments, max_length;
    bool ordered_by_index() const noexcept { return true; }
  };
  if (heads > 0x7FFFFFFF) fail<invalid_argument>(w, "shape", "has ", heads, " (sequence, head) rows, above 2^31 - 1");
  std::int32_t stand_in = 0;
  selection_output out;
  out.indices = &stand_in;
  out.index_stride = capacity;
  const auto plan = gpu::detail::plan_selection<gpu::detail::segmented_select_tuning>(
      w, row_keys{static_cast<std::int32_t>(heads), capacity}, selection_count{0, &stand_in}, out, nullptr);
  return gpu::detail::workspace_bytes_of(plan);
}

// Carves aligned sub-buffers out of [memory, memory + bytes); with a null
// memory it only counts, which is how the size query and the carve share
// one description of the layout.
class state_carver {
 public:
  static constexpr std::size_t alignment = 256;  // what cudaMalloc returns; enough for any vector access

  explicit state_carver(void* memory) noexcept
      : base_(memory ? align_up(reinterpret_cast<std::uintptr_t>(memory)) : 0), offset_(0) {}

  template <class T>
  T* take(std::int64_t count) noexcept {
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ = align_up(offset_ + static_cast<std::size_t>(count) * sizeof(T));
    return p;
  }
  /// Bytes used, plus the slack that aligning an arbitrary base may cost.
  std::size_t bytes() const noexcept { return offset_ + alignment - 1; }
  static std::size_t align_up(std::size_t x) noexcept { return (x + alignment - 1) / alignment * alignment; }

 private:
  std::uintptr_t base_;
  std::size_t offset_;
};

/// Which optional parts a state carries, from its policy's traits.
struct state_parts {
  bool streams = false;  ///< random's request streams
  bool history = false;  ///< exact_greedy's history (max_tokens x head_dim)
  bool anchors = false;  ///< KeyDiff's anchors (head_dim)
  bool workspace = true; ///< scratch and the CUDA kernels' workspace (a fork's snapshot has none)
};

/// Whether a state keeps KeyDiff anchors: a policy that evicts by score
/// (h2o) given a head_dim; the others ignore it, as they ignore the scores.
template <class Policy>
bool keeps_anchors(const decode_rule& rule, const history_extent& history) noexcept {
  return !policy_traits<Policy>::has_history && history.head_dim > 0 && rule.victim == victim_rule::lowest_score;
}

template <class Policy>
state_parts parts_of(const decode_rule& rule, const history_extent& history) noexcept {
  return {policy_traits<Policy>::has_streams, policy_traits<Policy>::has_history,
          keeps_anchors<Policy>(rule, history)};
}

inline batch_state_view carve_state(void* memory, const policy_shape& shape, const decode_rule& rule,
                                    const history_extent& history, const state_parts& parts, const site& w,
                                    std::size_t* bytes) {
  state_carver c(memory);
  const std::int64_t heads = std::int64_t{shape.num_seqs} * shape.num_kv_heads;
  const std::int64_t slots = heads * shape.capacity;
  batch_state_view v;
  v.slots.positions = c.take<std::int32_t>(slots);
  v.slots.counts = c.take<std::int32_t>(heads);
  v.slots.next_slots = c.take<std::int32_t>(heads);
  v.slots.lengths = c.take<std::int32_t>(shape.num_seqs);
  v.slots.num_seqs = shape.num_seqs;
  v.slots.num_heads = shape.num_kv_heads;
  v.slots.capacity = shape.capacity;
  v.scores = c.take<float>(2 * slots);
  v.score_buffer = c.take<std::uint8_t>(heads);
  v.appended = c.take<std::uint8_t>(heads);
  v.marks.words = row_marks::words_for(shape.num_kv_heads);
  v.marks.lengths = c.take<std::int32_t>(heads);
  v.marks.full = c.take<std::uint64_t>(2 * std::int64_t{shape.num_seqs} * v.marks.words);
  if (parts.streams) v.streams = c.take<std::uint64_t>(shape.num_seqs);
  if (parts.workspace) v.victim_scratch = c.take<std::int32_t>(slots);
  if (parts.history) {
    history_view& hv = v.history;
    hv.max_tokens = history.max_tokens;
    hv.head_dim = history.head_dim;
    hv.capacity = shape.capacity;
    const std::int64_t rows = heads * history.max_tokens;
    hv.keys = c.take<float>(rows * history.head_dim);
    hv.values = c.take<float>(rows * history.head_dim);
    hv.rows = c.take<std::int32_t>(heads);
    if (parts.workspace) {
      hv.cached = c.take<std::uint8_t>(rows);
      hv.work = c.take<double>(heads * hv.work_doubles());
    }
  }
  if (parts.anchors) {
    key_anchor_view& a = v.anchors;
    a.num_heads = shape.num_kv_heads;
    a.head_dim = history.head_dim;
    a.sums = c.take<std::int64_t>(heads * history.head_dim);
    a.units = c.take<float>(heads * history.head_dim);
    a.upto = c.take<std::int32_t>(heads);
  }
  if (parts.workspace) {
    device_workspace& dw = v.work;
    if (max_row_chunks(shape.capacity) > 1) dw.partials = c.take<row_partial>(heads * max_row_chunks(shape.capacity));
    dw.arrivals = c.take<std::uint32_t>(heads);
    dw.evict_plans = c.take<evict_to_plan>(heads);
    dw.evict_counts = c.take<std::int32_t>(heads);
    dw.select_bytes = evict_select_bytes(w, heads, shape.capacity);
    dw.select = c.take<unsigned char>(static_cast<std::int64_t>(dw.select_bytes));
  }
  v.rule = rule;
  v.rule.first_head = shape.first_kv_head;  // a shard's place in its layer, for random's draws
  v.num_q_heads = shape.num_q_heads;
  if (bytes) *bytes = c.bytes();
  return v;
}

template <class Policy>
batch_state_view carve_state(void* memory, const policy_shape& shape, const decode_rule& rule,
                             const history_extent& history, std::size_t* bytes) {
  return carve_state(memory, shape, rule, history, parts_of<Policy>(rule, history),
                     site{policy_traits<Policy>::name, "batch_state_bytes"}, bytes);
}

/// The state `v` moved by `delta` bytes: every pointer shifted, for a copy
/// of its memory at another address (the offsets of a carve depend on the
/// base's alignment only, so a copy from aligned base to aligned base keeps
/// them). Null pointers stay null.
inline batch_state_view rebase_state(batch_state_view v, std::ptrdiff_t delta) noexcept {
  static_assert(sizeof(batch_state_view) == 296 && sizeof(history_view) == 56 && sizeof(device_workspace) == 48 &&
                    sizeof(key_anchor_view) == 32,
                "batch_state_view changed: shift its new pointers here too");
  const auto shift = [delta](auto*& p) {
    using T = std::remove_reference_t<decltype(*p)>;
    if (p) p = reinterpret_cast<T*>(reinterpret_cast<std::uintptr_t>(p) + static_cast<std::uintptr_t>(delta));
  };
  shift(v.slots.positions);
  shift(v.slots.counts);
  shift(v.slots.next_slots);
  shift(v.slots.lengths);
  shift(v.scores);
  shift(v.score_buffer);
  shift(v.appended);
  shift(v.marks.lengths);
  shift(v.marks.full);
  shift(v.streams);
  shift(v.victim_scratch);
  shift(v.history.keys);
  shift(v.history.values);
  shift(v.history.rows);
  shift(v.history.cached);
  shift(v.history.work);
  shift(v.anchors.sums);
  shift(v.anchors.units);
  shift(v.anchors.upto);
  shift(v.work.partials);
  shift(v.work.arrivals);
  shift(v.work.evict_plans);
  shift(v.work.evict_counts);
  shift(v.work.select);
  return v;
}

template <class Policy>
void require_history_extent(const site& w, const policy_shape& shape, const decode_rule& rule,
                            const history_extent& history) {
  if (!policy_traits<Policy>::has_history) {  // KeyDiff's anchors, or nothing
    if (history.head_dim < 0) fail<invalid_argument>(w, "history.head_dim", "= ", history.head_dim, " is negative");
    if (keeps_anchors<Policy>(rule, history))
      require_allocation(w, "history.head_dim", 12.0L * shape.num_seqs * shape.num_kv_heads * history.head_dim);
    return;
  }
  require_positive(w, "history.head_dim", history.head_dim);
  if (history.max_tokens < shape.capacity)
    fail<invalid_argument>(w, "history.max_tokens", "= ", history.max_tokens, " is below the capacity ",
                           shape.capacity);
  // K and V as float per (b, h, token), before carve_state sums it in size_t.
  require_allocation(w, "history.max_tokens * history.head_dim",
                     8.0L * shape.num_seqs * shape.num_kv_heads * history.max_tokens * history.head_dim);
}

}  // namespace detail

/// Bytes of caller memory a batched Policy needs for `shape` (any alignment
/// of the memory is fine). exact_greedy also needs `history`.
template <class Policy>
std::size_t batch_state_bytes(const policy_shape& shape, const typename policy_traits<Policy>::config_type& config,
                              const history_extent& history = {}) {
  const detail::site w{policy_traits<Policy>::name, "batch_state_bytes"};
  const decode_rule rule = policy_traits<Policy>::rule(config, "batch_state_bytes");
  detail::validate_shape(w, shape, rule.budget);
  // The status word packs (sequence, head, slot) into 20, 12 and 26 bits.
  if (shape.num_seqs > batch_status_limits::max_seqs)
    detail::fail<out_of_range>(w, "shape.num_seqs", "= ", shape.num_seqs, " exceeds ", batch_status_limits::max_seqs);
  if (shape.num_kv_heads > batch_status_limits::max_heads || shape.num_q_heads > batch_status_limits::max_heads)
    detail::fail<out_of_range>(w, "shape.num_q_heads", "= ", shape.num_q_heads, " exceeds ",
                               batch_status_limits::max_heads);
  if (shape.capacity > batch_status_limits::max_index)
    detail::fail<out_of_range>(w, "shape.capacity", "= ", shape.capacity, " exceeds ", batch_status_limits::max_index);
  detail::require_history_extent<Policy>(w, shape, rule, history);
  std::size_t bytes = 0;
  detail::carve_state<Policy>(nullptr, shape, rule, history, &bytes);
  return bytes;
}

/// Views of a batched Policy's state in `memory` (at least
/// batch_state_bytes). The values are not initialised: call the device's
/// init (host: init_batch_state; CUDA: cuda::init_batch_state).
template <class Policy>
batch_state_view make_batch_state(void* memory, std::size_t bytes, const policy_shape& shape,
                                  const typename policy_traits<Policy>::config_type& config,
                                  const history_extent& history = {}) {
  const detail::site w{policy_traits<Policy>::name, "make_batch_state"};
  detail::require_not_null(w, "memory", memory);
  const std::size_t needed = batch_state_bytes<Policy>(shape, config, history);
  if (bytes < needed)
    detail::fail<invalid_argument>(w, "bytes", "= ", bytes, " is below batch_state_bytes = ", needed);
  return detail::carve_state<Policy>(memory, shape, policy_traits<Policy>::rule(config, "make_batch_state"), history,
                                     nullptr);
}

}  // namespace kvevict
