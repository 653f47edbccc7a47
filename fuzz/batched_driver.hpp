#pragma once
// The batched half of fuzz_policy_api: batched_policy<Policy, device::host>
// (append, append with the K/V scatter, observe_evict with every input kind,
// reset, fork, check) and the free functions on its state (batched_append_tokens,
// batched_evict_to into the cache or as moves, batched_prefill with every
// input kind), over every policy, layout and dtype, with active sets of
// every mode (all, list, flags; sometimes invalid, with repeated entries,
// or marked as a retry), inputs with malformed strides (make_tensor), and
// now and then a hand-edited copy of the state view for the free functions
// (null pointers, enum values out of range, protections beyond the budget).
//
// After every call: a thrown kvevict::error must have left every byte of
// the state memory and the cache as it was. A status word that is not clear
// must name a (b, h) whose state (slot table, current scores, flags,
// recorded history, length, stream) is unchanged (the whole sequence for
// append and prefill), and check() / throw_if_error must turn it into a
// kvevict::error. A sequence the active list names twice must be left
// unchanged, whatever the word shows; in a retry, a head that was not
// waiting for its observation too; an edit of the view that must be refused
// must be. Then the slot-table invariants must hold for every
// (b, h), scores must be finite, moved K/V rows must be where the slot table
// says, and for h2o the state must match the brute-force model fed with
// what each (b, h) did.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/batch/batched_policy.hpp"
#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/multi_token.hpp"
#include "kvevict/batch/prefill.hpp"
#include "kvevict/policy/exact_greedy.hpp"
#include "kvevict/policy/h2o.hpp"
#include "kvevict/policy/policy_shape.hpp"
#include "kvevict/policy/random.hpp"
#include "kvevict/policy/recent_window.hpp"
#include "support/finding.hpp"
#include "support/fuzz_caches.hpp"
#include "support/fuzz_input.hpp"
#include "support/fuzz_tensors.hpp"
#include "support/guarded_call.hpp"
#include "support/h2o_shadow.hpp"
#include "support/slot_invariants.hpp"
#include "support/state_snapshot.hpp"

namespace kvfuzz {

constexpr int max_batched_calls = 64;
constexpr std::int32_t max_batched_length = 200;

/// An active set and the memory it points to.
struct owned_active {
  std::vector<std::int32_t> list;
  std::vector<std::uint8_t> flags;
  kvevict::active_set set;
  std::vector<std::int32_t> repeated;  ///< sequences a valid list names more than once
};

template <class Policy, class T, class Layout>
class batched_driver {
  static constexpr bool greedy = std::is_same_v<Policy, kvevict::exact_greedy_policy>;
  static constexpr bool is_h2o = std::is_same_v<Policy, kvevict::h2o_policy>;
  using view_type = kvevict::kv_view<T, Layout>;
  using batched = kvevict::batched_policy<Policy, kvevict::device::host>;

 public:
  batched_driver(fuzz_input& in, std::unique_ptr<batched> policy, kvevict::kv_cache<T, Layout> cache,
                 kvevict::group_reduce reduce, std::int32_t recent)
      : in_(in), policy_(std::move(policy)), cache_(std::move(cache)), pristine_(cache_.page_table()) {
    if constexpr (is_h2o)
      shadow_.emplace(st().num_seqs(), st().num_heads(), st().group_size(), recent, st().rule.budget, reduce,
                      st().rule.protect.sinks, st().rule.decay);
    for (std::int32_t b = 0; b < st().num_seqs(); ++b) write_rows(in_, cache_, b, 0, cache_.capacity(), 0);
  }

  void run() {
    for (int call = 0; call < max_batched_calls && !in_.exhausted(); ++call) step(in_.range(0, 14));
  }

 private:
  const kvevict::batch_state_view& st() const { return policy_->state(); }
  std::int32_t seqs() const { return st().num_seqs(); }
  std::int32_t heads() const { return st().num_heads(); }
  std::int32_t capacity() const { return st().capacity(); }
  std::int32_t head_dim() const { return cache_.head_dim(); }
  std::int32_t count(std::int32_t b, std::int32_t h) const { return st().slots.counts[st().head_index(b, h)]; }
  std::int32_t length(std::int32_t b) const { return st().slots.lengths[b]; }
  std::int32_t position(std::int32_t b, std::int32_t h, std::int32_t s) const {
    return st().slots.positions_of(b, h)[s];
  }

  snapshot take() {
    snapshot s;
    add_batch_state(s, st());
    add_cache(s, cache_);
    return s;
  }

  /// Everything the status-word check and the shadow need from before a call.
  struct before_call {
    std::vector<snapshot> heads;  // [B][H]: batch_head_state
    std::vector<std::int32_t> positions, counts, lengths;
    std::vector<std::uint8_t> appended;
    std::vector<T> k, v;
  };
  before_call remember() {
    before_call r;
    for (std::int32_t b = 0; b < seqs(); ++b) {
      r.lengths.push_back(length(b));
      for (std::int32_t h = 0; h < heads(); ++h) {
        r.heads.push_back(batch_head_state(st(), b, h));
        r.counts.push_back(count(b, h));
        r.appended.push_back(st().appended[st().head_index(b, h)]);
        r.positions.insert(r.positions.end(), st().slots.positions_of(b, h),
                           st().slots.positions_of(b, h) + capacity());
      }
    }
    r.k = cache_.k_storage();
    r.v = cache_.v_storage();
    return r;
  }
  std::int32_t before_position(const before_call& r, std::int32_t b, std::int32_t h, std::int32_t s) const {
    return r.positions[(std::size_t(b) * heads() + h) * capacity() + s];
  }

  /// Runs a batched call; returns its status word, or nullopt when it threw.
  /// whole_sequence: a reported problem leaves all heads of its sequence
  /// unchanged (append, prefill), not only the one named.
  template <class Call>
  std::optional<std::uint64_t> call(const char* what, const before_call& before, bool whole_sequence, bool via_policy,
                                    Call c) {
    std::uint64_t status = kvevict::batch_status_clear;
    const std::string name = std::string("batch ") + kvevict::policy_traits<Policy>::name + " " + what;
    const bool must_refuse = std::exchange(must_refuse_, false);
    if (!guarded(name, [this] { return take(); }, [&] { c(status); })) return std::nullopt;
    require(!must_refuse, name + ": a malformed state view was accepted");
    for (const std::int32_t b : repeated_)  // no entry naming it steps, whatever the word shows
      for (std::int32_t h = 0; h < heads(); ++h) {
        const std::string changed =
            before.heads[std::size_t(b) * heads() + h].first_difference(batch_head_state(st(), b, h));
        require(changed.empty(), name + ": sequence " + std::to_string(b) +
                                     " is named twice in the active list but its state changed: " + changed);
      }
    const kvevict::batch_status s = kvevict::batch_status::unpack(status);
    if (!s.ok()) {
      if (tracing()) std::fprintf(stderr, "  status: code %u sequence %d head %d index %d entry %d\n",
                                  unsigned(s.code), s.sequence, s.head, s.index, s.entry);
      require(s.code != kvevict::batch_code::bad_status_word, name + ": a call wrote a word no call writes");
      if (s.code == kvevict::batch_code::bad_sequence) {
        require(s.sequence == -1 && s.entry >= 0, name + ": bad_sequence does not name a list entry");
      } else {
        if (s.code == kvevict::batch_code::repeated_sequence) whole_sequence = true;
        require(s.sequence >= 0 && s.sequence < seqs() && s.head >= 0 && s.head < heads(),
                name + ": the status names a (sequence, head) outside the batch");
        for (std::int32_t h = whole_sequence ? 0 : s.head; h < (whole_sequence ? heads() : s.head + 1); ++h) {
          const std::string changed = before.heads[std::size_t(s.sequence) * heads() + h].first_difference(
              batch_head_state(st(), s.sequence, h));
          require(changed.empty(), name + ": status code " + std::to_string(unsigned(s.code)) + " for sequence " +
                                       std::to_string(s.sequence) + " head " + std::to_string(h) +
                                       " but its state changed: " + changed);
        }
      }
      bool threw = false;
      try {
        if (via_policy) policy_->check();
        else kvevict::throw_if_error(status, what);
      } catch (const kvevict::error&) {
        threw = true;
      }
      require(threw, name + ": a set status did not become a kvevict::error");
      if (via_policy)
        require(policy_->status_word() == kvevict::batch_status_clear, name + ": check() left the status set");
    }
    return status;
  }

  // ---- inputs ----

  owned_active pick_active() {
    owned_active a;
    repeated_.clear();
    switch (in_.range(0, 3)) {
      case 0: a.set = kvevict::active_set::all(); break;
      case 1: {
        std::vector<std::int32_t> all(static_cast<std::size_t>(seqs()));
        for (std::int32_t b = 0; b < seqs(); ++b) all[std::size_t(b)] = b;
        const std::int32_t n = in_.range(0, seqs());
        for (std::int32_t i = 0; i < n; ++i) {
          std::swap(all[std::size_t(i)], all[std::size_t(in_.range(i, seqs() - 1))]);
          a.list.push_back(all[std::size_t(i)]);
        }
        if (!a.list.empty() && in_.one_in(12)) a.list[std::size_t(in_.range(0, n - 1))] = in_.one_in(2) ? -1 : seqs();
        if (n >= 2 && in_.one_in(6)) {  // a repeated entry (refused: the sequence steps for none of them)
          const std::int32_t from = in_.range(0, n - 1), to = in_.range(0, n - 1);
          if (from != to) a.list[std::size_t(to)] = a.list[std::size_t(from)];
        }
        std::int32_t count = n;
        if (in_.one_in(24)) count = in_.one_in(2) ? -1 : seqs() + 1;
        a.list.resize(std::size_t(std::max(count, 0) + 1), 0);  // the memory covers whatever count says
        a.set = kvevict::active_set::of_list(in_.one_in(32) ? nullptr : a.list.data(), count);
        if (a.set.list && count >= 0 && count <= seqs())
          for (std::int32_t i = 0; i < count; ++i) {
            const std::int32_t b = a.list[std::size_t(i)];
            if (b >= 0 && b < seqs() && std::count(a.list.begin(), a.list.begin() + count, b) > 1 &&
                std::find(a.repeated.begin(), a.repeated.end(), b) == a.repeated.end())
              a.repeated.push_back(b);
          }
        break;
      }
      case 2: {
        for (std::int32_t b = 0; b < seqs(); ++b) a.flags.push_back(std::uint8_t(in_.range(0, 2)));
        a.set = kvevict::active_set::of_flags(in_.one_in(32) ? nullptr : a.flags.data());
        break;
      }
      default:
        a.set = kvevict::active_set::all();
        if (in_.one_in(4)) a.set.mode = static_cast<kvevict::active_set::kind>(in_.range(3, 255));
        break;
    }
    if (in_.one_in(8)) a.set = a.set.as_retry();  // observe + evict takes it; every other call refuses it
    repeated_ = a.repeated;
    return a;
  }

  /// The state view a free function gets: the policy's, or now and then a
  /// copy edited the way a caller might (must_refuse_: every call refuses
  /// that edit; the others are refused where the call uses the field).
  kvevict::batch_state_view call_view() {
    kvevict::batch_state_view v = st();
    if (!in_.one_in(16)) return v;
    bool must = true;
    switch (in_.range(0, 13)) {
      case 0: v.rule.victim = static_cast<kvevict::victim_rule>(in_.range(3, 255)); break;
      case 1: v.rule.reduce = static_cast<kvevict::group_reduce>(in_.range(3, 1000)); break;
      case 2: v.rule.protect.sinks = -in_.range(1, 5); break;
      case 3: v.rule.protect.recent = -in_.range(1, 5); break;
      case 4: v.rule.protect.sinks = v.rule.budget + 1 - v.rule.protect.recent; break;
      case 5: v.rule.budget = in_.one_in(2) ? 0 : v.capacity(); break;
      case 6: v.scores = nullptr; break;
      case 7: v.appended = nullptr; break;
      case 8: v.slots.next_slots = nullptr; break;
      case 9: v.num_q_heads = 0; break;
      case 11: v.marks.full = nullptr; break;
      case 12: v.marks.words += 1; break;
      case 10:
        v.streams = nullptr;
        must = v.rule.victim == kvevict::victim_rule::random_priority;
        break;
      default: v.victim_scratch = nullptr, must = false; break;  // refused where it is written through
    }
    if (tracing()) std::fprintf(stderr, "  (an edited state view%s)\n", must ? ", to be refused" : "");
    must_refuse_ = must;
    return v;
  }


  // ---- checks after a call that did not throw ----

  void check_all(const char* after) {
    const kvevict::protection protect = st().rule.protect;
    for (std::int32_t b = 0; b < seqs(); ++b)
      for (std::int32_t h = 0; h < heads(); ++h) {
        const std::int64_t bh = st().head_index(b, h);
        const head_slots hs{st().slots.positions_of(b, h), capacity(), count(b, h), st().slots.next_slots[bh],
                            length(b), st().rule.budget, st().appended[bh] != 0};
        check_head(after, b, h, hs, protect);
        const float* scores = st().scores_of(b, h);
        for (std::int32_t s = 0; s < capacity(); ++s) {
          const float x = scores[s];
          require(greedy ? !std::isnan(x) && x != -INFINITY : std::isfinite(x),
                  std::string(after) + ": sequence " + std::to_string(b) + " head " + std::to_string(h) + " slot " +
                      std::to_string(s) + " has score " + std::to_string(x));
          if (hs.positions[s] < 0)
            require(x == 0.0f, std::string(after) + ": a free slot has a score that is not 0");
        }
        if constexpr (is_h2o) shadow_->compare(after, b, h, hs.positions, scores, capacity(), length(b));
      }
  }

  /// Slot s of (b, h) holds the row its position had before, for every
  /// sequence whose table changed by moving rows.
  void check_rows_moved(const char* what, const before_call& before, std::int32_t b) {
    const view_type v = cache_.view();
    // The batched API does not check for page ids shared within a sequence
    // or between sequences (docs/reliability.md, "What is not checked"):
    // rows of such pages alias, so their content says nothing.
    if (shares_pages(b)) {
      if (tracing()) std::fprintf(stderr, "  (rows of sequence %d not checked: it shares a page)\n", b);
      return;
    }
    for (std::int32_t h = 0; h < heads(); ++h)
      for (std::int32_t s = 0; s < capacity(); ++s) {
        const std::int32_t p = position(b, h, s);
        if (p < 0) continue;
        std::int32_t from = -1;
        for (std::int32_t f = 0; f < capacity(); ++f)
          if (before_position(before, b, h, f) == p) from = f;
        if (from < 0 || !mapped(v, b, s) || !mapped(v, b, from)) continue;
        const std::int64_t to_off = v.layout.row_offset(b, h, s), from_off = v.layout.row_offset(b, h, from);
        require(std::memcmp(v.k + to_off, before.k.data() + from_off, sizeof(T) * head_dim()) == 0 &&
                    std::memcmp(v.v + to_off, before.v.data() + from_off, sizeof(T) * head_dim()) == 0,
                std::string(what) + ": sequence " + std::to_string(b) + " head " + std::to_string(h) + " slot " +
                    std::to_string(s) + " does not hold the rows of its position");
      }
  }

  /// Whether a page of sequence b appears twice in the page table.
  bool shares_pages(std::int32_t b) const {
    if constexpr (std::is_same_v<Layout, kvevict::paged_layout>) {
      const std::vector<std::int32_t>& table = const_cast<kvevict::kv_cache<T, Layout>&>(cache_).page_table();
      const std::size_t per_seq = table.size() / std::size_t(seqs());
      for (std::size_t i = std::size_t(b) * per_seq; i < std::size_t(b + 1) * per_seq; ++i)
        if (std::count(table.begin(), table.end(), table[i]) > 1) return true;
    }
    (void)b;
    return false;
  }

  /// Shadow: sequences whose length grew by `tokens` appended them.
  void shadow_appends(const before_call& before) {
    if constexpr (is_h2o)
      for (std::int32_t b = 0; b < seqs(); ++b)
        if (length(b) > before.lengths[std::size_t(b)]) shadow_->append(b, length(b) - before.lengths[std::size_t(b)]);
  }

  // ---- the calls ----

  void step(int op) {
    must_refuse_ = false;  // an edited view that no call took
    switch (op) {
      case 0: return append(false);
      case 1: return append(true);
      case 2: return append_tokens();
      case 3:
      case 4:
      case 5:
      case 6: return observe_evict(greedy && !in_.one_in(8) ? 3 : op - 3, pick_active());
      case 7:
      case 8: return evict_to();
      case 9: return reset();
      case 10:
      case 11: return prefill();
      case 12: return mutate_page_table(in_, cache_, pristine_);
      case 13: return fork();
      default: return valid_step();
    }
  }

  bool too_long() const {
    for (std::int32_t b = 0; b < seqs(); ++b)
      if (length(b) >= max_batched_length) return true;
    return false;
  }

  /// The engine writes a generated row to (b, h, s), where mapped.
  void write_row(std::int32_t b, std::int32_t h, std::int32_t s, int poison_odds) {
    const view_type v = cache_.view();
    if (!mapped(v, b, s)) return;
    const std::vector<T> k = in_.elements<T>(std::size_t(head_dim()), value_kind::kv_row, poison_odds);
    const std::vector<T> val = in_.elements<T>(std::size_t(head_dim()), value_kind::kv_row, poison_odds);
    std::copy(k.begin(), k.end(), v.k_row(b, h, s));
    std::copy(val.begin(), val.end(), v.v_row(b, h, s));
  }

  /// The slot of position p in (b, h), or -1.
  std::int32_t slot_of(std::int32_t b, std::int32_t h, std::int32_t p) const {
    for (std::int32_t s = 0; s < capacity(); ++s)
      if (position(b, h, s) == p) return s;
    return -1;
  }

  void append(bool with_rows) {
    if (too_long()) return;
    const owned_active active = pick_active();
    const before_call before = remember();
    if (with_rows) {
      const auto k_new = make_tensor<T, 3>(in_, {seqs(), heads(), head_dim()}, {false, false, false},
                                           value_kind::kv_row, 24, greedy ? 32 : 0);
      const auto v_new = make_tensor<T, 3>(in_, {seqs(), heads(), head_dim()}, {false, false, false},
                                           value_kind::kv_row, 24, greedy ? 32 : 0);
      const view_type view = pick_view(in_, cache_);
      if (!call("append(rows)", before, true, true, [&](std::uint64_t& s) {
            policy_->append(view, kvevict::batch_rows<T>{k_new.view}, kvevict::batch_rows<T>{v_new.view}, active.set);
            s = policy_->status_word();
          }))
        return;
      const view_type v = cache_.view();
      for (std::int32_t b = 0; b < seqs(); ++b)
        if (length(b) > before.lengths[std::size_t(b)] && !shares_pages(b))  // shared pages alias (unchecked)
          for (std::int32_t h = 0; h < heads(); ++h) {
            const std::int32_t s = slot_of(b, h, length(b) - 1);
            require(s >= 0, "batched append(rows): the new position is not cached");
            require(std::memcmp(v.k_row(b, h, s), &k_new.view(b, h, 0), sizeof(T) * head_dim()) == 0 &&
                        std::memcmp(v.v_row(b, h, s), &v_new.view(b, h, 0), sizeof(T) * head_dim()) == 0,
                    "batched append(rows): the new rows are not in the new token's slot");
          }
    } else if (in_.one_in(4)) {
      const kvevict::batch_state_view view = call_view();
      if (!call("append(free function)", before, true, false,
                [&](std::uint64_t& s) { kvevict::batched_append(view, active.set, &s); }))
        return;
    } else if (!call("append", before, true, true, [&](std::uint64_t& s) {
                 policy_->append(active.set);
                 s = policy_->status_word();
               })) {
      return;
    }
    for (std::int32_t b = 0; b < seqs(); ++b)
      require(length(b) - before.lengths[std::size_t(b)] <= 1, "batched append: a length grew by more than 1");
    shadow_appends(before);
    check_all("batched append");
  }

  void append_tokens() {
    if (too_long()) return;
    const owned_active active = pick_active();
    std::int32_t tokens = in_.range(1, 4);
    if (in_.one_in(16)) tokens = in_.one_in(2) ? 0 : capacity() + 1;
    const before_call before = remember();
    const kvevict::batch_state_view view = call_view();
    if (!call("append_tokens", before, true, false,
              [&](std::uint64_t& s) { kvevict::batched_append_tokens(view, active.set, tokens, &s); }))
      return;
    for (std::int32_t b = 0; b < seqs(); ++b) {
      const std::int32_t grew = length(b) - before.lengths[std::size_t(b)];
      require(grew == 0 || grew == tokens, "batched append_tokens: a length grew by another count");
      if (grew == 0) continue;
      for (std::int32_t h = 0; h < heads(); ++h)  // the engine writes the new tokens' rows
        for (std::int32_t s = 0; s < capacity(); ++s)
          if (position(b, h, s) >= before.lengths[std::size_t(b)]) write_row(b, h, s, greedy ? 48 : 0);
    }
    shadow_appends(before);
    check_all("batched append_tokens");
  }

  /// The increment observe adds to slot s of (b, h), brute force.
  template <class Value>
  float folded(std::int32_t h, Value value_of_query) const {
    std::vector<float> vals(static_cast<std::size_t>(st().group_size()));
    for (std::int32_t j = 0; j < st().group_size(); ++j)
      vals[std::size_t(j)] = value_of_query(h * st().group_size() + j);
    if constexpr (is_h2o) return shadow_->fold(vals.data());
    return 0.0f;
  }

  /// observe_evict with input kind 0 probs, 1 head scores, 2 logits + LSE,
  /// 3 queries + LSE with the cache.
  void observe_evict(int kind, const owned_active& active, bool valid = false) {
    const before_call before = remember();
    const std::int32_t width = st().rule.budget + 1, hq = st().num_q_heads, g = st().group_size();
    const int bad = valid ? 0 : 24;
    const int poison = valid ? 0 : 8;
    std::vector<std::int32_t> victims(std::size_t(seqs()) * heads(), -7);
    const bool with_victims = !in_.one_in(3);
    std::int32_t* victims_out = with_victims ? victims.data() : nullptr;
    // Through the policy, or the free function on a view that may be edited.
    const bool free_function = !valid && in_.one_in(4);
    const auto run = [&](const char* what, auto via_policy, auto via_free_function, auto increment) {
      const kvevict::batch_state_view view = free_function ? call_view() : st();
      if (!call(what, before, false, !free_function, [&](std::uint64_t& s) {
            if (free_function) {
              via_free_function(view, s);
            } else {
              via_policy();
              s = policy_->status_word();
            }
          }))
        return;
      if (active.set.retry)  // a head that was not waiting for its observation is skipped
        for (std::int32_t b = 0; b < seqs(); ++b)
          for (std::int32_t h = 0; h < heads(); ++h) {
            const std::size_t bh = std::size_t(b) * heads() + h;
            if (before.appended[bh]) continue;
            const std::string changed = before.heads[bh].first_difference(batch_head_state(st(), b, h));
            require(changed.empty(), std::string(what) + ": a retry changed a head that had stepped: " + changed);
            require(!with_victims || victims[bh] == -7, std::string(what) + ": a retry wrote a skipped head's victim");
          }
      for (std::int32_t b = 0; b < seqs(); ++b)
        for (std::int32_t h = 0; h < heads(); ++h) {
          const std::size_t bh = std::size_t(b) * heads() + h;
          const bool stepped = before.appended[bh] && !st().appended[st().head_index(b, h)];
          const std::int32_t count_before = before.counts[bh];
          if (stepped && with_victims) {
            const std::int32_t v = victims[bh];
            if (count_before > st().rule.budget)
              require(v >= 0 && v < capacity() && before_position(before, b, h, v) >= 0 && position(b, h, v) == -1,
                      std::string(what) + ": the reported victim was not freed");
            else
              require(v == -1, std::string(what) + ": a victim reported below the budget");
          }
          if constexpr (is_h2o) {
            if (!stepped) continue;
            for (std::int32_t s = 0; s < capacity(); ++s) {
              const std::int32_t p = before_position(before, b, h, s);
              if (p >= 0) shadow_->add(b, h, p, increment(b, h, s), what);
            }
            require(shadow_->evict_one(b, h), std::string(what) + ": the brute force has no victim");
          }
        }
      check_all(what);
    };
    if (kind == 0) {
      const auto probs = make_tensor<float, 3>(in_, {seqs(), hq, width}, {false, false, true},
                                               value_kind::probability, bad, poison);
      const kvevict::batch_probs input{probs.view};
      run("observe_evict(probs)", [&] { policy_->observe_evict(input, active.set, victims_out); },
          [&](const kvevict::batch_state_view& v, std::uint64_t& s) {
            kvevict::batched_observe_evict(v, active.set, input, victims_out, &s);
          },
          [&](std::int32_t b, std::int32_t h, std::int32_t s) {
            return folded(h, [&](std::int32_t q) { return probs.view(b, q, s); });
          });
    } else if (kind == 1) {
      const auto sc = make_tensor<float, 3>(in_, {seqs(), heads(), width}, {false, false, true},
                                            value_kind::signed_score, bad, poison);
      const kvevict::batch_head_scores input{sc.view};
      run("observe_evict(head_scores)", [&] { policy_->observe_evict(input, active.set, victims_out); },
          [&](const kvevict::batch_state_view& v, std::uint64_t& s) {
            kvevict::batched_observe_evict(v, active.set, input, victims_out, &s);
          },
          [&](std::int32_t b, std::int32_t h, std::int32_t s) { return sc.view(b, h, s); });
    } else if (kind == 2) {
      const auto logits = make_tensor<float, 3>(in_, {seqs(), hq, width}, {false, false, true}, value_kind::logit,
                                                bad, poison);
      const auto lse = make_tensor<float, 2>(in_, {seqs(), hq}, {false, false}, value_kind::logit, bad, poison * 3);
      const kvevict::batch_logits input{logits.view, lse.view, valid ? 1.0f : scale_value(in_),
                                        valid ? kvevict::lse_base::natural : base_value(in_)};
      run("observe_evict(logits)", [&] { policy_->observe_evict(input, active.set, victims_out); },
          [&](const kvevict::batch_state_view& v, std::uint64_t& s) {
            kvevict::batched_observe_evict(v, active.set, input, victims_out, &s);
          },
          [&](std::int32_t b, std::int32_t h, std::int32_t s) {
            return folded(h, [&](std::int32_t q) {
              return kvevict::probability_from_logit(logits.view(b, q, s), input.scale, lse.view(b, q), input.base);
            });
          });
    } else {
      const auto q = make_tensor<T, 3>(in_, {seqs(), hq, head_dim()}, {false, false, false}, value_kind::query, bad,
                                       poison * 3);
      const auto lse = make_tensor<float, 2>(in_, {seqs(), hq}, {false, false}, value_kind::logit, bad, poison * 3);
      const kvevict::batch_queries<T> input{q.view, lse.view, valid ? 1.0f : scale_value(in_),
                                            valid ? kvevict::lse_base::natural : base_value(in_)};
      const view_type view = valid ? cache_.view() : pick_view(in_, cache_);
      run("observe_evict(queries)", [&] { policy_->observe_evict(input, view, active.set, victims_out); },
          [&](const kvevict::batch_state_view& v, std::uint64_t& s) {
            kvevict::batched_observe_evict(v, active.set, input, view, victims_out, &s);
          },
          [&](std::int32_t b, std::int32_t h, std::int32_t s) {
            const view_type v = cache_.view();
            return folded(h, [&](std::int32_t qh) {
              const float logit =
                  kvevict::attention_logit(&q.view(b, qh, 0), q.view.strides[2], v.k_row(b, h, s), head_dim());
              return kvevict::probability_from_logit(logit, input.scale, lse.view(b, qh), input.base);
            });
          });
      (void)g;
    }
  }

  std::int32_t pick_target() {
    const kvevict::protection p = st().rule.protect;
    if (in_.one_in(16)) {
      const std::int32_t bad[] = {p.sinks + p.recent - 1, capacity() + 1, -1, INT32_MAX};
      return bad[in_.range(0, 3)];
    }
    return in_.range(p.sinks + p.recent, capacity());
  }

  void evict_to() {
    const owned_active active = pick_active();
    const std::int32_t target = pick_target();
    const bool with_cache = !in_.one_in(3);
    const before_call before = remember();
    std::vector<std::int32_t> freed(std::size_t(seqs()) * heads(), -7);
    std::int32_t* freed_out = in_.one_in(3) ? nullptr : freed.data();
    std::vector<kvevict::slot_move> moves(std::size_t(seqs()) * heads() * capacity());
    std::vector<std::int32_t> move_counts(std::size_t(seqs()) * heads(), 0);
    kvevict::slot_move* moves_out = in_.one_in(32) ? nullptr : moves.data();
    std::int32_t* counts_out = in_.one_in(32) ? nullptr : move_counts.data();
    const view_type view = pick_view(in_, cache_);
    // exact_greedy's overloads take the step's queries; the others must refuse a state of exact_greedy's
    const bool queries = greedy ? !in_.one_in(16) : in_.one_in(16);
    const std::int32_t qd = greedy ? st().history.head_dim : head_dim();
    const auto q = make_tensor<T, 3>(in_, {seqs(), st().num_q_heads, std::max(qd, 1)}, {false, false, false},
                                     value_kind::query, 24, 24);
    const auto lse = make_tensor<float, 2>(in_, {seqs(), st().num_q_heads}, {false, false}, value_kind::logit, 24, 24);
    const kvevict::batch_queries<T> input{q.view, lse.view, scale_value(in_), base_value(in_)};
    const kvevict::batch_state_view sv = call_view();
    if (!call("evict_to", before, false, false, [&](std::uint64_t& s) {
          if (queries && with_cache) kvevict::batched_evict_to(sv, active.set, target, input, view, freed_out, &s);
          else if (queries) kvevict::batched_evict_to(sv, active.set, target, input, moves_out, counts_out, &s);
          else if (with_cache) kvevict::batched_evict_to(sv, active.set, target, view, freed_out, &s);
          else kvevict::batched_evict_to(sv, active.set, target, moves_out, counts_out, &s);
        }))
      return;
    for (std::int32_t b = 0; b < seqs(); ++b) {
      for (std::int32_t h = 0; h < heads(); ++h) {
        const std::size_t bh = std::size_t(b) * heads() + h;
        if (count(b, h) != before.counts[bh]) {
          require(count(b, h) == target, "batched evict_to: a head changed its count to other than the target");
          if constexpr (is_h2o) shadow_->evict_to(b, h, target);
        }
        if (!with_cache && counts_out && moves_out && count(b, h) != before.counts[bh])
          for (std::int32_t i = 0; i < move_counts[bh]; ++i) {
            const kvevict::slot_move m = moves[bh * capacity() + i];
            require(m.from >= 0 && m.from < capacity() && m.to >= 0 && m.to < capacity() &&
                        position(b, h, m.to) == before_position(before, b, h, m.from),
                    "batched evict_to(moves): a move does not match the slot table");
          }
      }
      if (with_cache) check_rows_moved("batched evict_to", before, b);
    }
    check_all("batched evict_to");
  }

  void reset() {
    const owned_active active = pick_active();
    const std::int32_t entries = std::max(active.set.entries(seqs()), 0);
    std::vector<std::uint64_t> streams(std::size_t(std::max(entries, seqs())) + 1);
    for (auto& s : streams) s = in_.one_in(16) ? kvevict::max_random_stream + 1 : in_.u64() >> 1;
    const bool with_streams = in_.one_in(2);
    const before_call before = remember();
    if (!call("reset", before, true, true, [&](std::uint64_t& s) {
          policy_->reset(active.set, with_streams ? streams.data() : nullptr);
          s = policy_->status_word();
        }))
      return;
    if constexpr (is_h2o)
      for (std::int32_t b = 0; b < seqs(); ++b)
        if (length(b) == 0) shadow_->reset(b);
    check_all("batched reset");
  }

  /// fork: destinations (any active set) become copies of sources (now
  /// and then outside the batch), random's with streams (now and then too
  /// large); then the engine's part, each destination's K/V rows its
  /// source's as they were.
  void fork() {
    const owned_active active = pick_active();
    const std::int32_t entries = std::max(active.set.entries(seqs()), 0);
    std::vector<std::int32_t> sources(std::size_t(std::max(entries, seqs())) + 1);
    for (auto& s : sources) s = in_.one_in(16) ? (in_.one_in(2) ? -1 : seqs()) : in_.range(0, seqs() - 1);
    std::vector<std::uint64_t> streams(sources.size());
    for (auto& s : streams) s = in_.one_in(16) ? kvevict::max_random_stream + 1 : in_.u64() >> 1;
    const bool with_streams = in_.one_in(2);
    const before_call before = remember();
    if (!call("fork", before, true, true, [&](std::uint64_t& s) {
          policy_->fork(active.set, sources.data(), with_streams ? streams.data() : nullptr);
          s = policy_->status_word();
        }))
      return;
    std::optional<h2o_shadow> old;
    if constexpr (is_h2o) old = *shadow_;
    const view_type v = cache_.view();
    for (std::int32_t i = 0; i < entries; ++i) {
      const std::int32_t d = active.set.sequence(i, seqs()), src = sources[std::size_t(i)];
      if (d < 0) continue;
      require(length(d) == before.lengths[std::size_t(src)], "batched fork: a destination's length is not its source's");
      for (std::int32_t h = 0; h < heads(); ++h) {
        require(count(d, h) == before.counts[std::size_t(src) * heads() + h],
                "batched fork: a destination's count is not its source's");
        for (std::int32_t slot = 0; slot < capacity(); ++slot) {
          require(position(d, h, slot) == before_position(before, src, h, slot),
                  "batched fork: a destination's slot table is not its source's");
          if (shares_pages(d) || !mapped(v, d, slot) || !mapped(v, src, slot)) continue;
          const std::int64_t to = v.layout.row_offset(d, h, slot), from = v.layout.row_offset(src, h, slot);
          std::memcpy(v.k + to, before.k.data() + from, sizeof(T) * head_dim());
          std::memcpy(v.v + to, before.v.data() + from, sizeof(T) * head_dim());
        }
      }
      if constexpr (is_h2o) shadow_->copy_sequence(*old, src, d);
    }
    check_all("batched fork");
  }

  /// Prompt row i's element as the brute force sums it (the h2o decay).
  float weigh_row(float x, std::int32_t length, std::int32_t i) const {
    if constexpr (is_h2o) return shadow_->weigh_row(x, length, i);
    return x;
  }

  template <class Value>
  static float column_total(std::int32_t p, std::int32_t length, Value value) {
    float acc = value(p);
    for (std::int32_t i = p + 1; i < length; ++i) acc = acc + value(i);
    return acc;
  }

  void prefill() {
    const owned_active active = pick_active();
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(seqs()));
    std::int32_t longest = 1;
    for (auto& l : lengths) {
      l = in_.one_in(16) ? (in_.one_in(2) ? 0 : capacity() + 1) : in_.range(1, capacity());
      longest = std::max(longest, std::min(l, capacity()));
    }
    std::int32_t m = longest;
    if (in_.one_in(24)) m = in_.one_in(2) ? std::max(longest - 1, 0) : capacity() + 1;
    const std::int32_t me = std::max(m, 1);
    // The engine writes the prompts' rows (exact_greedy is refused anyway).
    for (std::int32_t b = 0; b < seqs(); ++b)
      if (length(b) == 0 && lengths[std::size_t(b)] >= 1 && lengths[std::size_t(b)] <= capacity())
        for (std::int32_t h = 0; h < heads(); ++h)
          for (std::int32_t s = 0; s < lengths[std::size_t(b)]; ++s) write_row(b, h, s, 0);
    const kvevict::prompt_lengths prompts{in_.one_in(32) ? nullptr : lengths.data(), m};
    std::vector<std::int32_t> reclaimable(static_cast<std::size_t>(seqs()), -7);
    std::int32_t* reclaim_out = in_.one_in(3) ? nullptr : reclaimable.data();
    const view_type view = pick_view(in_, cache_);
    const std::int32_t hq = st().num_q_heads;
    const before_call before = remember();
    const int kind = in_.range(0, 4);
    const kvevict::batch_state_view sv = call_view();
    // h2o: the brute-force column total of (b, query head, p) for a prompt of len, read
    // only for sequences the call prefilled (the others' rows may be unmapped)
    std::function<float(std::int32_t, std::int32_t, std::int32_t, std::int32_t)> total;
    bool ok = false, moved = true;
    if (kind == 0) {
      const auto probs = make_tensor<float, 4>(in_, {seqs(), hq, me, me}, {false, false, true, true},
                                               value_kind::probability, 24, 64);
      const kvevict::batch_prefill_probs input{probs.view};
      ok = call("prefill(probs)", before, true, false, [&](std::uint64_t& s) {
             kvevict::batched_prefill(sv, active.set, prompts, input, view, reclaim_out, &s);
           }).has_value();
      total = [&](std::int32_t b, std::int32_t q, std::int32_t p, std::int32_t len) {
        return column_total(p, len, [&](std::int32_t i) { return weigh_row(probs.view(b, q, i, p), len, i); });
      };
      if (ok) after_prefill(before, lengths, moved, total);
      return;
    } else if (kind == 1 || kind == 4) {
      const auto sums = make_tensor<float, 3>(in_, {seqs(), hq, me}, {false, false, true}, value_kind::probability,
                                              24, 64);
      const kvevict::batch_prefill_sums input{sums.view};
      moved = kind == 1;
      ok = call(kind == 1 ? "prefill(sums)" : "prefill(sums, no cache)", before, true, false, [&](std::uint64_t& s) {
             if (kind == 1) kvevict::batched_prefill(sv, active.set, prompts, input, view, reclaim_out, &s);
             else kvevict::batched_prefill(sv, active.set, prompts, input, &s);
           }).has_value();
      total = [&](std::int32_t b, std::int32_t q, std::int32_t p, std::int32_t) { return sums.view(b, q, p); };
      if (ok) after_prefill(before, lengths, moved, total);
      return;
    } else if (kind == 2) {
      const auto q = make_tensor<T, 4>(in_, {seqs(), hq, me, head_dim()}, {false, false, true, false},
                                       value_kind::query, 24, 64);
      const auto lse = make_tensor<float, 3>(in_, {seqs(), hq, me}, {false, false, true}, value_kind::logit, 24, 64);
      const kvevict::batch_prefill_queries<T> input{q.view, lse.view, scale_value(in_), base_value(in_)};
      ok = call("prefill(queries)", before, true, false, [&](std::uint64_t& s) {
             kvevict::batched_prefill(sv, active.set, prompts, input, view, reclaim_out, &s);
           }).has_value();
      const view_type v = cache_.view();
      const std::int32_t g = st().group_size();
      total = [&, v, g](std::int32_t b, std::int32_t qh, std::int32_t p, std::int32_t len) {
        const T* key = before.k.data() + v.layout.row_offset(b, qh / g, p);
        return column_total(p, len, [&](std::int32_t i) {
          const float logit = kvevict::attention_logit(&q.view(b, qh, i, 0), q.view.strides[3], key, head_dim());
          return weigh_row(kvevict::probability_from_logit(logit, input.scale, lse.view(b, qh, i), input.base), len, i);
        });
      };
      if (ok) after_prefill(before, lengths, moved, total);
      return;
    } else {
      ok = call("prefill(no scores)", before, true, false, [&](std::uint64_t& s) {
             kvevict::batched_prefill(sv, active.set, prompts, view, reclaim_out, &s);
           }).has_value();
    }
    if (ok) after_prefill(before, lengths, moved, total);
  }

  template <class Total>
  void after_prefill(const before_call& before, const std::vector<std::int32_t>& lengths, bool moved,
                     const Total& total) {
    for (std::int32_t b = 0; b < seqs(); ++b) {
      if (before.lengths[std::size_t(b)] != 0 || length(b) == 0) continue;  // not prefilled by this call
      const std::int32_t len = lengths[std::size_t(b)];
      require(length(b) == len, "batched prefill: the length is not the prompt's");
      for (std::int32_t h = 0; h < heads(); ++h)
        require(count(b, h) == std::min(len, st().rule.budget), "batched prefill: kept count is not min(L, budget)");
      if (moved) check_rows_moved("batched prefill", before, b);
      if constexpr (is_h2o) {
        require(bool(total), "batched prefill: h2o prefilled without scores");
        std::vector<std::vector<float>> scores(static_cast<std::size_t>(heads()),
                                               std::vector<float>(static_cast<std::size_t>(len)));
        for (std::int32_t h = 0; h < heads(); ++h)
          for (std::int32_t p = 0; p < len; ++p)
            scores[std::size_t(h)][std::size_t(p)] = folded(h, [&](std::int32_t q) { return total(b, q, p, len); });
        shadow_->prefill(b, len, scores);
      }
    }
    check_all("batched prefill");
  }

  /// A valid decode step of every sequence, so short inputs reach deep states.
  void valid_step() {
    repeated_.clear();
    if (too_long()) return;
    owned_active all;
    all.set = kvevict::active_set::all();
    const before_call before = remember();
    const auto k_new = make_tensor<T, 3>(in_, {seqs(), heads(), head_dim()}, {false, false, false},
                                         value_kind::kv_row, 0, 0);
    const auto v_new = make_tensor<T, 3>(in_, {seqs(), heads(), head_dim()}, {false, false, false},
                                         value_kind::kv_row, 0, 0);
    if (!call("append(rows)", before, true, true, [&](std::uint64_t& s) {
          policy_->append(cache_.view(), kvevict::batch_rows<T>{k_new.view}, kvevict::batch_rows<T>{v_new.view});
          s = policy_->status_word();
        }))
      return;
    shadow_appends(before);
    check_all("batched append(rows)");
    observe_evict(greedy ? 3 : in_.range(0, 3), all, true);
  }

  fuzz_input& in_;
  std::unique_ptr<batched> policy_;
  kvevict::kv_cache<T, Layout> cache_;
  std::vector<std::int32_t> pristine_;
  std::optional<h2o_shadow> shadow_;
  std::vector<std::int32_t> repeated_;  // the sequences the last active list named more than once
  bool must_refuse_ = false;            // the next call's state view is edited in a way every call refuses
};

}  // namespace kvfuzz

