#pragma once
// The per-sequence decode protocol (docs/semantics.md, "The decode cycle")
// as a facade over the batched host backend. A per-sequence policy keeps a
// batched state (sequence_state.hpp) and runs the batched backend's
// per-(sequence, head) steps on one sequence at a time, so every rule,
// fold, victim search, refill and keep plan is the backend's, written once.
// What the facade adds is the per-sequence contract (docs/integration.md,
// "Per-sequence and batched calls"):
//
//   - all or nothing across the KV heads of a sequence: every head is
//     decided before any is committed, and a refusal throws the library's
//     exception naming the element (sequence_errors.hpp) with nothing
//     changed, where a batched call commits each (sequence, head) that is
//     good and reports the others in its status word;
//   - observe and evict as two calls: observe commits the scores and keeps
//     each head's victim (found in the same pass, as the fused batched step
//     finds it); evict frees them, or after skip_observe picks them from
//     the scores as they are;
//   - the protocol per sequence: append (once or more) -> observe once (or
//     skip_observe) -> evict or evict_to; evict on stale scores or a second
//     observe throws state_error.
//
// This header holds the state and the calls that need no score input;
// observe_calls.hpp and prefill_calls.hpp add the rest. Every call checks
// its arguments first and commits after: a thrown kvevict::error leaves
// the policy and the cache unchanged. The decode path allocates nothing.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvevict/batch/evict_to.hpp"
#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/multi_token.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/compaction.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/batch/fork.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/evict_to.hpp"
#include "kvevict/policy/policy_shape.hpp"
#include "kvevict/sequence/checks.hpp"
#include "kvevict/sequence/state.hpp"
#include "kvevict/slot_table.hpp"

namespace kvevict {
namespace detail {

class sequence_protocol {
 public:
  const policy_shape& shape() const noexcept { return shape_; }
  std::int32_t budget() const noexcept { return state().rule.budget; }
  /// The decode decision as data: what the batched backends run.
  const decode_rule& rule() const noexcept { return state().rule; }
  const slot_table& slots() const noexcept { return state_.slots(); }
  /// The batched state the policy runs on, for engine code that reads it
  /// in place (slot table, counts, scores). Read only: change it through
  /// the policy's calls.
  const batch_state_view& state() const noexcept { return state_.view(); }

  /// Slot that sequence b's next token takes in KV head h (docs/semantics.md, step 1),
  /// or -1 while the sequence holds budget + 1 tokens (evict first).
  std::int32_t next_slot(std::int32_t b, std::int32_t h) const {
    require_head(where("next_slot"), shape_, b, h);
    return slots().next_slot(b, h);
  }
  /// Tokens sequence b has seen; the position its next token gets.
  std::int32_t length(std::int32_t b) const {
    require_index(where("length"), "sequence", b, shape_.num_seqs);
    return slots().length(b);
  }
  /// True between an append to sequence b and its observe (or skip_observe):
  /// evict and evict_to are refused then, observe is due.
  bool awaiting_observe(std::int32_t b) const {
    require_index(where("awaiting_observe"), "sequence", b, shape_.num_seqs);
    return awaiting(b);
  }
  /// Accumulated score of slot s of (b, h); 0 for a free slot.
  float score(std::int32_t b, std::int32_t h, std::int32_t s) const {
    require_head(where("score"), shape_, b, h);
    require_index(where("score"), "slot", s, shape_.capacity);
    return scores_of(b, h)[s];
  }
  const float* scores_of(std::int32_t b, std::int32_t h) const noexcept { return state().scores_of(b, h); }

  /// The victim slot of (b, h) by the policy's decode_rule on its current
  /// scores, or -1 when every occupied token is protected.
  std::int32_t choose_victim(std::int32_t b, std::int32_t h) const {
    const batch_state_view& st = state();
    return pick_victim(st.rule, st.slots.positions_of(b, h), st.scores_of(b, h), shape_.capacity, st.slots.lengths[b],
                       st.stream_of(b), h);
  }

  /// Records sequence b's next token (position length(b)) in next_slot(b, h)
  /// of every KV head and returns its position. The engine writes the K/V
  /// rows there (before or after this call) and runs attention over it.
  /// Decode never holds more than budget + 1 tokens (next_slot_after_append):
  /// slots beyond a larger capacity (for prompts) stay unused, so paged
  /// engines may reclaim them.
  std::int32_t append(std::int32_t b) {
    const site w = where("append");
    require_index(w, "sequence", b, shape_.num_seqs);
    const std::int32_t position = slots().length(b);
    const std::uint64_t problem =
        append_sequence(state(), b, [](std::int32_t) { return true; }, [](std::int32_t, std::int32_t) {});
    if (problem != batch_status_clear) {
      const std::int32_t h = batch_status::unpack(problem).head;
      fail_state<state_error>(w, "sequence ", b, " head ", h, " has no free slot (it holds budget + 1 = ",
                              slots().count(b, h), " tokens); call evict after observe");
    }
    forget_step(b);
    return position;
  }

  /// Multi-token append (chunked prefill, speculative decoding): records
  /// positions length(b) .. length(b) + tokens - 1 in every KV head, token j
  /// in new_token_slot(count, next_slot, j) (evict_to.hpp), and returns the
  /// first position. Needs count + tokens <= capacity in every head, beyond
  /// budget + 1 if the capacity allows; evict_to brings it back to a
  /// budget. slots (optional, [num_kv_heads][tokens]): where each token went.
  std::int32_t append(std::int32_t b, std::int32_t tokens, std::int32_t* slots) {
    const site w = where("append");
    require_index(w, "sequence", b, shape_.num_seqs);
    if (tokens < 1) fail<out_of_range>(w, "tokens", "= ", tokens, " is below 1");
    const std::int32_t first = this->slots().length(b);
    const std::uint64_t problem = append_tokens_sequence(state(), b, tokens, [&](std::int32_t h, std::int32_t j, std::int32_t s) {
      if (slots) slots[std::int64_t{h} * tokens + j] = s;
    });
    if (problem != batch_status_clear) {
      const std::int32_t h = batch_status::unpack(problem).head;
      fail<out_of_range>(w, "tokens", "= ", tokens, ": sequence ", b, " head ", h, " holds ",
                         this->slots().count(b, h), " of capacity ", shape_.capacity, " (evict_to first)");
    }
    forget_step(b);
    return first;
  }

  /// The protocol's opt-out: ends sequence b's step without adding scores,
  /// for engines that skip observation on purpose (no attention weights this
  /// step, or scoring every n-th step). The scores stay as they are, so the
  /// next evict decides on them (and a new token's score is 0). Like observe,
  /// it needs an append since the last observe.
  void skip_observe(std::int32_t b) {
    require_observable(where("skip_observe"), b);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) state().appended[state().head_index(b, h)] = 0;
  }

  /// Decode step 6: when sequence b holds more than budget tokens, frees one
  /// victim slot per KV head; no K/V bytes move. Writes the victims' slots
  /// to victim_slots[h] (-1 when nothing was evicted) if given and returns
  /// the number of slots freed. One token a step: above the budget with a
  /// slot already freed (a multi-token append, or evict_to to a target
  /// above the budget) it is refused; evict_to frees the rest.
  std::int32_t evict(std::int32_t b, std::int32_t* victim_slots = nullptr) {
    const site w = where("evict");
    require_observed(w, b);
    const std::int32_t heads = shape_.num_kv_heads;
    const batch_state_view& st = state();
    if (slots().count(b, 0) <= st.rule.budget) {
      if (victim_slots) std::fill_n(victim_slots, heads, -1);
      return 0;
    }
    // Decide every head before changing any, so a failure changes nothing.
    const bool found = victims_found_[std::size_t(b)] != 0;
    for (std::int32_t h = 0; h < heads; ++h) {
      // A free slot below count is the one hole a step may leave: a second
      // victim would make two, and append fills only one.
      const std::int32_t next = slots().next_slot(b, h), count = slots().count(b, h);
      if (next >= 0 && next < count)
        fail_state<state_error>(w, "sequence ", b, " head ", h, " holds ", count, " tokens, above the budget ",
                                st.rule.budget, ", and already has a free slot; evict frees one token a step: "
                                "call evict_to(b, budget) after a multi-token append");
      const std::int32_t s = found ? found_victims_[std::size_t(st.head_index(b, h))] : choose_victim(b, h);
      if (s < 0) fail_state<state_error>(w, "sequence ", b, " head ", h, " has no evictable token");
      victims_[std::size_t(h)] = s;
    }
    for (std::int32_t h = 0; h < heads; ++h) {
      free_victim(st, b, h, victims_[std::size_t(h)], slots().count(b, h), st.slots.lengths[b]);
      // KeyDiff's observe took its victims out of the anchors already.
      if (anchor_follows_[std::size_t(b)]) st.anchors.upto[st.head_index(b, h)] = st.slots.lengths[b];
      if (victim_slots) victim_slots[h] = victims_[std::size_t(h)];
    }
    forget_step(b);
    return heads;
  }

  /// Forgets sequence b (a finished request); its slots become free.
  void reset(std::int32_t b) {
    require_index(where("reset"), "sequence", b, shape_.num_seqs);
    reset_sequence(b, nullptr);
  }

  /// Sequence `destination` becomes a copy of sequence `source`
  /// (batch/fork.hpp, docs/semantics.md "Forking sequences"): its slots,
  /// scores, anchors, history, length and a pending step's victims; random
  /// gives it the stream `destination` (random_policy::fork takes another).
  /// The engine copies or shares the K/V rows. source == destination
  /// changes nothing else.
  void fork(std::int32_t source, std::int32_t destination) { fork_sequence(source, destination, nullptr); }

  /// Multi-token eviction (evict_to.hpp): every KV head of sequence b that
  /// holds more than `target` tokens keeps `target` (its protected tokens
  /// plus the best of the rest) and kept rows move in `view` so the occupied
  /// slots are [0, target + 1) but one hole, the next slot (as after evict).
  /// Returns the tokens freed per head. With one token above target it is
  /// evict: the same victim, no row moved. target: in [sinks + recent,
  /// capacity].
  template <class T, class Layout>
  std::int32_t evict_to(std::int32_t b, std::int32_t target, const kv_view<T, Layout>& view) {
    return evict_to_rows(b, target, view, [this, target](std::int32_t seq, std::int32_t h) {
      return rule_victims(state(), seq, h, target);
    });
  }

  /// The same for engines that move rows themselves: moves[h * capacity +
  /// i] for i < move_counts[h] says which slot's rows go where (sources and
  /// destinations are distinct, so any order works).
  std::int32_t evict_to(std::int32_t b, std::int32_t target, slot_move* moves, std::int32_t* move_counts) {
    return evict_to_moves(b, target, moves, move_counts, [this, target](std::int32_t seq, std::int32_t h) {
      return rule_victims(state(), seq, h, target);
    });
  }

 protected:
  sequence_protocol(const char* name, const policy_shape& shape, const decode_rule& rule, const state_parts& parts)
      : name_(name), shape_(shape) {
    const site w = where("constructor");
    validate_shape(w, shape, rule.budget);
    // The status word packs (sequence, head, slot) into 20, 12 and 26 bits.
    if (shape.num_seqs > batch_status_limits::max_seqs)
      fail<out_of_range>(w, "shape.num_seqs", "= ", shape.num_seqs, " exceeds ", batch_status_limits::max_seqs);
    if (shape.num_q_heads > batch_status_limits::max_heads)
      fail<out_of_range>(w, "shape.num_q_heads", "= ", shape.num_q_heads, " exceeds ", batch_status_limits::max_heads);
    if (shape.capacity > batch_status_limits::max_index)
      fail<out_of_range>(w, "shape.capacity", "= ", shape.capacity, " exceeds ", batch_status_limits::max_index);
    state_ = sequence_state(shape, rule, parts, w);
    init_batch_state(state());
    const std::size_t heads = std::size_t(shape.num_seqs) * std::size_t(shape.num_kv_heads);
    found_victims_.assign(heads, -1);
    victims_found_.assign(std::size_t(shape.num_seqs), 0);
    anchor_follows_.assign(std::size_t(shape.num_seqs), 0);
    victims_.assign(std::size_t(shape.num_kv_heads), -1);
    staged_.assign(std::size_t(shape.num_kv_heads) * std::size_t(shape.capacity), 0.0f);
    results_.assign(std::size_t(shape.num_kv_heads), evict_to_result{});
  }

  /// "policy::function", for messages.
  site where(const char* function) const noexcept { return {name_, function}; }

  bool awaiting(std::int32_t b) const noexcept { return state().appended[state().head_index(b, 0)] != 0; }

  /// observe (and skip_observe) needs an append since the last observe.
  void require_observable(const site& w, std::int32_t b) const {
    require_index(w, "sequence", b, shape_.num_seqs);
    if (slots().length(b) == 0) fail_state<state_error>(w, "sequence ", b, " holds no token; call append first");
    if (!awaiting(b))
      fail_state<state_error>(w, "sequence ", b, " was already observed since its last append; ",
                              "observe once per step (append, observe, evict)");
  }

  /// evict and evict_to need this step's scores: no append since the last observe.
  void require_observed(const site& w, std::int32_t b) const {
    require_index(w, "sequence", b, shape_.num_seqs);
    if (awaiting(b))
      fail_state<state_error>(w, "sequence ", b, " was appended but not observed; ",
                              "call observe (or skip_observe) before evicting");
  }

  /// Every slot of (b, h) below `width`, checked as require_row does.
  template <class T, class Layout, class Wanted>
  void require_rows(const site& w, const kv_view<T, Layout>& view, std::int32_t b, std::int32_t width,
                    Wanted wanted) const {
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      for (std::int32_t s = 0; s < width; ++s)
        if (wanted(h, s)) require_row(w, view, b, h, s);
  }
  auto occupied(std::int32_t b) const noexcept {
    return [this, b](std::int32_t h, std::int32_t s) { return slots().position(b, h, s) >= 0; };
  }
  static auto all_columns() noexcept {
    return [](std::int32_t, std::int32_t) { return true; };
  }

  /// The observation of sequence b's step, once head_step(h, victim,
  /// staged) has decided every head (its new scores into the row `staged`
  /// of a scratch the policy keeps hot, nothing committed) and none was
  /// refused: the scores are copied back into the current buffer (a row
  /// the step just read, still in cache: staging in the spare buffer would
  /// cost a cold row's read-for-ownership per head), the row's victim found
  /// in the same pass where the step left it to the commit, and the
  /// victims wait for evict. A refused head's status word goes to
  /// fail(word), which throws. Observe runs after an append: the occupied
  /// slots are [0, count).
  template <class HeadStep, class Fail>
  void observe_heads(std::int32_t b, HeadStep head_step, Fail fail) {
    const batch_state_view& st = state();
    const std::size_t cap = std::size_t(shape_.capacity);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      std::int32_t victim = -1;
      const std::uint64_t word = head_step(h, victim, staged_.data() + std::size_t(h) * cap);
      if (word != batch_status_clear) fail(word);
      victims_[std::size_t(h)] = victim;
    }
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      const std::int64_t bh = st.head_index(b, h);
      const float* staged = staged_.data() + std::size_t(h) * cap;
      std::int32_t victim = victims_[std::size_t(h)];
      if (victim == victim_at_commit)
        victim = commit_and_find_victim(st.rule, staged, st.scores_of(b, h), st.slots.positions_of(b, h),
                                        st.slots.counts[bh], st.slots.lengths[b]);
      else
        std::copy_n(staged, st.slots.counts[bh], st.scores_of(b, h));
      st.appended[bh] = 0;
      found_victims_[std::size_t(bh)] = victim;
    }
    victims_found_[std::size_t(b)] = 1;
  }

  /// A call that changes b's cached set other than by its step's evict:
  /// the victims observe found are void.
  void forget_step(std::int32_t b) noexcept {
    victims_found_[std::size_t(b)] = 0;
    anchor_follows_[std::size_t(b)] = 0;
  }

  /// fork, with random's new stream (or the default when null).
  void fork_sequence(std::int32_t source, std::int32_t destination, const std::uint64_t* stream) {
    const site w = where("fork");
    require_index(w, "source", source, shape_.num_seqs);
    require_index(w, "destination", destination, shape_.num_seqs);
    batched_fork(state(), active_set::of_list(&destination, 1), &source, stream);
    const auto s = std::size_t(source), d = std::size_t(destination), heads = std::size_t(shape_.num_kv_heads);
    victims_found_[d] = victims_found_[s];
    anchor_follows_[d] = anchor_follows_[s];
    std::copy_n(found_victims_.begin() + std::ptrdiff_t(s * heads), heads,
                found_victims_.begin() + std::ptrdiff_t(d * heads));
  }

  /// reset, with random's new stream (or the default when null).
  void reset_sequence(std::int32_t b, const std::uint64_t* stream) {
    reset_batch_sequences(state(), active_set::of_list(&b, 1), stream);
    forget_step(b);
  }

  /// evict_to's checks: observed, and a target in [sinks + recent, capacity].
  void require_evict_to(const site& w, std::int32_t b, std::int32_t target) const {
    require_observed(w, b);
    const std::int64_t protected_max = std::int64_t{rule().protect.sinks} + rule().protect.recent;
    if (target < protected_max || target > shape_.capacity)
      fail<budget_error>(w, "target", "= ", target, " is outside [sinks + recent = ", protected_max,
                         ", capacity = ", shape_.capacity, "]");
  }

  /// evict_to with the rows moved in `view`, victims by victims_of(b, h).
  template <class T, class Layout, class Victims>
  std::int32_t evict_to_rows(std::int32_t b, std::int32_t target, const kv_view<T, Layout>& view, Victims victims_of) {
    const site w = where("evict_to");
    require_evict_to(w, b, target);
    require_policy_view(w, shape_, view);
    const std::int32_t span = std::max(target, slots().occupied_width(b));
    require_rows(w, view, b, span, all_columns());
    require_distinct_pages(w, view, b, span);
    return evict_to_heads(b, target, victims_of, [&](std::int32_t h, std::int32_t, std::int32_t from, std::int32_t to) {
      move_rows(view, b, h, from, to);
    });
  }

  /// evict_to with the moves reported.
  template <class Victims>
  std::int32_t evict_to_moves(std::int32_t b, std::int32_t target, slot_move* moves, std::int32_t* move_counts,
                              Victims victims_of) {
    const site w = where("evict_to");
    require_evict_to(w, b, target);
    require_not_null(w, "moves", moves);
    require_not_null(w, "move_counts", move_counts);
    const std::int32_t freed = evict_to_heads(b, target, victims_of,
                                              [&](std::int32_t h, std::int32_t i, std::int32_t from, std::int32_t to) {
                                                moves[std::int64_t{h} * shape_.capacity + i] = slot_move{from, to};
                                              });
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) move_counts[h] = results_[std::size_t(h)].moves;
    return freed;
  }

  /// The backend's evict_to of sequence b, every check made: nothing can
  /// refuse a head now. Returns the tokens freed per head.
  template <class Victims, class OnMove>
  std::int32_t evict_to_heads(std::int32_t b, std::int32_t target, Victims victims_of, OnMove on_move) {
    std::uint64_t status = batch_status_clear;
    std::fill(results_.begin(), results_.end(), evict_to_result{});
    evict_to_sequence(
        state(), b, &status, [](std::int32_t) { return true; },
        [&](std::int32_t seq, std::int32_t h, auto mapped) { return evict_to_problem(state(), seq, h, target, mapped); },
        victims_of, on_move, [&](std::int32_t h, const evict_to_result& r) { results_[std::size_t(h)] = r; });
    throw_status(where("evict_to"), status, false);  // not reached: every refusal was checked above
    forget_step(b);
    return results_.back().freed;
  }

  const char* name_;
  policy_shape shape_;
  sequence_state state_;
  std::vector<std::int32_t> found_victims_;   // [B][Hkv]: the victims observe found
  std::vector<std::uint8_t> victims_found_;   // [B]: 1 while found_victims_ of b is current
  std::vector<std::uint8_t> anchor_follows_;  // [B]: KeyDiff's observe took b's victims out of the anchors
  std::vector<std::int32_t> victims_;         // [Hkv]: scratch of one call
  std::vector<float> staged_;                 // [Hkv][capacity]: observe's new scores until committed
  std::vector<evict_to_result> results_;      // [Hkv]: evict_to's per head
};

}  // namespace detail
}  // namespace kvevict
