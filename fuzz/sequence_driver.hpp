#pragma once
// The per-sequence half of fuzz_policy_api: one policy object (h2o,
// recent_window, random or exact_greedy) over one cache, driven by up to
// max_calls calls decoded from the input: append (one token or several),
// scatter, observe with every input kind, skip_observe, evict, evict_to
// (into the cache or as moves), reset, prefill with every input kind,
// compact, and the engine's own page-table edits. Indices, shapes, strides,
// pointers, enum values and data are sometimes invalid.
//
// After every call: a kvevict::error must have left the state byte for byte
// as it was; a success must leave the slot-table invariants true, every
// score finite, the K/V rows where the slot table says (prefill, evict_to,
// compact, scatter), and, for h2o, the cached positions and score bits equal
// to the brute-force model's.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/compaction.hpp"
#include "kvevict/policy/exact_greedy.hpp"
#include "kvevict/policy/h2o.hpp"
#include "kvevict/policy/random.hpp"
#include "kvevict/policy/recent_window.hpp"
#include "kvevict/scatter.hpp"
#include "support/finding.hpp"
#include "support/fuzz_caches.hpp"
#include "support/fuzz_input.hpp"
#include "support/fuzz_tensors.hpp"
#include "support/guarded_call.hpp"
#include "support/h2o_shadow.hpp"
#include "support/policy_configs.hpp"
#include "support/slot_invariants.hpp"

namespace kvfuzz {

constexpr int max_calls = 64;
/// exact_greedy keeps every row it has seen: longer sequences only cost time.
constexpr std::int32_t max_sequence_length = 200;

template <class Policy, class T, class Layout>
class sequence_driver {
  static constexpr bool greedy = std::is_same_v<Policy, kvevict::exact_greedy_policy>;
  static constexpr bool is_h2o = std::is_same_v<Policy, kvevict::h2o_policy>;
  static constexpr bool scoreless_prefill =
      std::is_same_v<Policy, kvevict::recent_window_policy> || std::is_same_v<Policy, kvevict::random_policy>;

 public:
  sequence_driver(fuzz_input& in, Policy policy, kvevict::kv_cache<T, Layout> cache)
      : in_(in), policy_(std::move(policy)), cache_(std::move(cache)), pristine_(cache_.page_table()) {
    const auto& sh = policy_.shape();
    if constexpr (is_h2o)
      shadow_.emplace(sh.num_seqs, sh.num_kv_heads, sh.group_size(), policy_.config().recent, policy_.budget(),
                      policy_.config().reduce, policy_.config().sinks, policy_.config().decay);
    write_all_rows();
  }

  void run() {
    for (int call = 0; call < max_calls && !in_.exhausted(); ++call) step(in_.range(0, 17));
  }

 private:
  using view_type = kvevict::kv_view<T, Layout>;
  const kvevict::policy_shape& shape() const { return policy_.shape(); }
  std::int32_t heads() const { return shape().num_kv_heads; }
  std::int32_t capacity() const { return shape().capacity; }
  std::int32_t head_dim() const { return cache_.head_dim(); }

  void write_all_rows() {
    for (std::int32_t b = 0; b < shape().num_seqs; ++b) write_rows(in_, cache_, b, 0, capacity(), 0);
  }

  snapshot take() {
    snapshot s;
    add_policy(s, policy_, head_dim());
    add_cache(s, cache_);
    return s;
  }
  template <class Call>
  bool call(const char* what, Call c) {
    return guarded(std::string(kvevict::policy_traits<Policy>::name) + "::" + what, [this] { return take(); }, c);
  }

  /// A sequence index: valid, or now and then one outside [0, num_seqs).
  std::int32_t pick_seq() {
    if (in_.one_in(16)) {
      const std::int32_t bad[] = {-1, shape().num_seqs, INT32_MAX, INT32_MIN};
      return bad[in_.range(0, 3)];
    }
    return in_.range(0, shape().num_seqs - 1);
  }
  bool valid_seq(std::int32_t b) const { return b >= 0 && b < shape().num_seqs; }

  std::int32_t occupied_width(std::int32_t b) const {
    std::int32_t w = 0;
    for (std::int32_t h = 0; h < heads(); ++h)
      for (std::int32_t s = capacity() - 1; s >= w; --s)
        if (policy_.slots().position(b, h, s) >= 0) {
          w = s + 1;
          break;
        }
    return w;
  }

  /// The slot table of sequence b: positions [H][capacity].
  std::vector<std::int32_t> positions_of(std::int32_t b) const {
    std::vector<std::int32_t> out;
    for (std::int32_t h = 0; h < heads(); ++h)
      out.insert(out.end(), policy_.slots().positions_of(b, h), policy_.slots().positions_of(b, h) + capacity());
    return out;
  }


  // ---- checks after a success ----

  void check_all(const char* after) {
    const auto& sh = shape();
    const kvevict::protection protect = policy_.rule().protect;
    for (std::int32_t b = 0; b < sh.num_seqs; ++b)
      for (std::int32_t h = 0; h < sh.num_kv_heads; ++h) {
        const head_slots hs{policy_.slots().positions_of(b, h), sh.capacity,      policy_.slots().count(b, h),
                            policy_.next_slot(b, h),            policy_.length(b), policy_.budget(),
                            policy_.awaiting_observe(b)};
        check_head(after, b, h, hs, protect);
        for (std::int32_t s = 0; s < sh.capacity; ++s) {
          const float x = policy_.score(b, h, s);
          // exact_greedy's error is +inf for a token whose eviction would
          // leave nothing to attend to (leave_one_out.hpp); never NaN.
          require(greedy ? !std::isnan(x) && x != -INFINITY : std::isfinite(x), std::string(after) + ": sequence " + std::to_string(b) + " head " +
                                        std::to_string(h) + " slot " + std::to_string(s) + " has score " +
                                        std::to_string(x) + " (position " + std::to_string(hs.positions[s]) + ")");
          if (hs.positions[s] < 0)
            require(x == 0.0f, std::string(after) + ": free slot " + std::to_string(s) + " has score " +
                                   std::to_string(x));
        }
        if constexpr (is_h2o)
          shadow_->compare(after, b, h, hs.positions, policy_.scores_of(b, h), sh.capacity, policy_.length(b));
      }
  }

  /// After rows moved: slot s of (b, h) holds the bytes slot from_slot(h, s)
  /// held before, for every occupied slot s.
  template <class FromSlot>
  void check_rows_moved(const char* what, std::int32_t b, const std::vector<T>& k_before,
                        const std::vector<T>& v_before, FromSlot from_slot) {
    const view_type v = cache_.view();
    for (std::int32_t h = 0; h < heads(); ++h)
      for (std::int32_t s = 0; s < capacity(); ++s) {
        if (policy_.slots().position(b, h, s) < 0) continue;
        const std::int32_t from = from_slot(h, s);
        if (from < 0 || !mapped(v, b, s) || !mapped(v, b, from)) continue;
        const std::int64_t to_off = v.layout.row_offset(b, h, s), from_off = v.layout.row_offset(b, h, from);
        const bool same = std::memcmp(v.k + to_off, k_before.data() + from_off, sizeof(T) * head_dim()) == 0 &&
                          std::memcmp(v.v + to_off, v_before.data() + from_off, sizeof(T) * head_dim()) == 0;
        require(same, std::string(what) + ": sequence " + std::to_string(b) + " head " + std::to_string(h) +
                          " slot " + std::to_string(s) + " does not hold the rows of its position");
      }
  }

  /// Where each position of sequence b was before, from a saved table.
  static std::int32_t slot_in(const std::vector<std::int32_t>& table, std::int32_t capacity, std::int32_t h,
                              std::int32_t position) {
    for (std::int32_t s = 0; s < capacity; ++s)
      if (table[std::size_t(h) * capacity + s] == position) return s;
    return -1;
  }

  // ---- the calls ----

  void step(int op) {
    switch (op) {
      case 0: return append_one();
      case 1: return append_many();
      case 2: return scatter_rows();
      case 3:
      case 4:
      case 5:
      case 6: return observe(op - 3, pick_seq());
      case 7: return skip_observe();
      case 8: return evict();
      case 9: return evict_to_view();
      case 10: return evict_to_moves();
      case 11: return reset();
      case 12:
      case 13: return prefill();
      case 14: return compact_rows();
      case 15: return mutate_page_table(in_, cache_, pristine_);
      default: return decode_step();
    }
  }

  void append_one() {
    const std::int32_t b = pick_seq();
    if (valid_seq(b) && policy_.length(b) >= max_sequence_length) return;
    if (call("append", [&] { policy_.append(b); })) {
      if constexpr (is_h2o) shadow_->append(b, 1);
      check_all("append");
    }
  }

  void append_many() {
    const std::int32_t b = pick_seq();
    std::int32_t tokens = in_.range(1, 6);
    if (in_.one_in(16)) tokens = in_.one_in(2) ? in_.range(-2, 0) : capacity() + 1;
    if (valid_seq(b) && policy_.length(b) + std::max(tokens, 0) > max_sequence_length) return;
    std::vector<std::int32_t> slots(std::size_t(heads()) * std::size_t(std::max(tokens, 1)), -7);
    const bool with_slots = !in_.one_in(4);
    if (call("append(tokens)", [&] { policy_.append(b, tokens, with_slots ? slots.data() : nullptr); })) {
      if (with_slots)
        for (std::int32_t h = 0; h < heads(); ++h)
          for (std::int32_t j = 0; j < tokens; ++j) {
            const std::int32_t s = slots[std::size_t(h) * tokens + j];
            require(s >= 0 && s < capacity() && policy_.slots().position(b, h, s) == policy_.length(b) - tokens + j,
                    "append(tokens): reported slot does not hold the token");
          }
      if constexpr (is_h2o) shadow_->append(b, tokens);
      check_all("append(tokens)");
    }
  }

  /// The engine's scatter of one new row per head, to the next slots or to
  /// slots the input picks (sometimes outside the cache).
  void scatter_rows() {
    const std::int32_t b = pick_seq();
    std::vector<std::int32_t> slots(static_cast<std::size_t>(heads()));
    const bool own = in_.one_in(4);
    for (std::int32_t h = 0; h < heads(); ++h) {
      std::int32_t s = own || !valid_seq(b) ? in_.range(0, capacity() - 1) : policy_.next_slot(b, h);
      if (s < 0) s = valid_seq(b) ? policy_.slots().count(b, h) - 1 : 0;  // the newest token's slot when full
      if (in_.one_in(24)) s = in_.one_in(2) ? -1 : capacity() + in_.range(0, 2);
      slots[std::size_t(h)] = s;
    }
    const auto k_new = make_tensor<T, 2>(in_, {heads(), head_dim()}, {false, false}, value_kind::kv_row, 24, 16);
    const auto v_new = make_tensor<T, 2>(in_, {heads(), head_dim()}, {false, false}, value_kind::kv_row, 24, 16);
    const view_type view = pick_view(in_, cache_);
    const bool null_slots = in_.one_in(32);
    if (call("scatter", [&] { kvevict::scatter(view, b, null_slots ? nullptr : slots.data(), k_new.view, v_new.view); })) {
      const view_type v = cache_.view();
      for (std::int32_t h = 0; h < heads(); ++h) {
        const std::int64_t off = v.layout.row_offset(b, h, slots[std::size_t(h)]);
        require(std::memcmp(v.k + off, &k_new.view(h, 0), sizeof(T) * head_dim()) == 0 &&
                    std::memcmp(v.v + off, &v_new.view(h, 0), sizeof(T) * head_dim()) == 0,
                "scatter: the row was not written where asked");
      }
      check_all("scatter");
    }
  }

  /// observe with input kind 0 probs, 1 head scores, 2 logits + LSE,
  /// 3 queries + LSE (exact_greedy: always queries).
  void observe(int kind, std::int32_t b) {
    const std::int32_t width = valid_seq(b) ? std::max(occupied_width(b), 1) : capacity();
    const std::int32_t q_heads = shape().num_q_heads;
    const std::int32_t g = shape().group_size();
    const std::vector<std::int32_t> before = valid_seq(b) ? positions_of(b) : std::vector<std::int32_t>{};
    // inc(h, s, values): the increment of slot s of head h from the group's values
    const auto apply = [&](auto value_of, const char* what) {
      if constexpr (is_h2o) {
        std::vector<float> vals(static_cast<std::size_t>(g));
        for (std::int32_t h = 0; h < heads(); ++h)
          for (std::int32_t s = 0; s < capacity(); ++s) {
            const std::int32_t p = before[std::size_t(h) * capacity() + s];
            if (p < 0) continue;
            for (std::int32_t j = 0; j < g; ++j) vals[std::size_t(j)] = value_of(h * g + j, s);
            shadow_->add(b, h, p, shadow_->fold(vals.data()), what);
          }
      }
      check_all(what);
    };
    if (greedy || kind == 3) {
      const auto q = make_tensor<T, 2>(in_, {q_heads, head_dim()}, {false, false}, value_kind::query, 24, 24);
      const auto lse = make_tensor<float, 1>(in_, {q_heads}, {false}, value_kind::logit, 24, 24);
      const float scale = scale_value(in_);
      const kvevict::lse_base base = base_value(in_);
      const view_type view = pick_view(in_, cache_);
      const kvevict::decode_queries<T> input{q.view, lse.view, scale, base};
      if (call("observe(queries)", [&] { policy_.observe(b, input, view); })) {
        if constexpr (is_h2o) {
          const view_type v = cache_.view();
          apply(
              [&](std::int32_t qh, std::int32_t s) {
                const float logit =
                    kvevict::attention_logit(&q.view(qh, 0), q.view.strides[1], v.k_row(b, qh / g, s), head_dim());
                return kvevict::probability_from_logit(logit, scale, lse.view(qh), base);
              },
              "observe(queries)");
        } else {
          apply([](std::int32_t, std::int32_t) { return 0.0f; }, "observe(queries)");
        }
      }
      return;
    }
    if constexpr (!greedy) {
      if (kind == 0) {
        const auto probs = make_tensor<float, 2>(in_, {q_heads, width}, {false, true}, value_kind::probability);
        if (call("observe(probs)", [&] { policy_.observe(b, kvevict::decode_probs{probs.view}); }))
          apply([&](std::int32_t qh, std::int32_t s) { return probs.view(qh, s); }, "observe(probs)");
      } else if (kind == 1) {
        const auto sc = make_tensor<float, 2>(in_, {heads(), width}, {false, true}, value_kind::signed_score);
        if (call("observe(head_scores)", [&] { policy_.observe(b, kvevict::head_scores{sc.view}); })) {
          if constexpr (is_h2o) {
            for (std::int32_t h = 0; h < heads(); ++h)
              for (std::int32_t s = 0; s < capacity(); ++s) {
                const std::int32_t p = before[std::size_t(h) * capacity() + s];
                if (p >= 0) shadow_->add(b, h, p, sc.view(h, s), "observe(head_scores)");
              }
          }
          check_all("observe(head_scores)");
        }
      } else {
        const auto logits = make_tensor<float, 2>(in_, {q_heads, width}, {false, true}, value_kind::logit);
        const auto lse = make_tensor<float, 1>(in_, {q_heads}, {false}, value_kind::logit, 24, 24);
        const kvevict::decode_logits input{logits.view, lse.view, scale_value(in_), base_value(in_)};
        if (call("observe(logits)", [&] { policy_.observe(b, input); }))
          apply(
              [&](std::int32_t qh, std::int32_t s) {
                return kvevict::probability_from_logit(logits.view(qh, s), input.scale, lse.view(qh), input.base);
              },
              "observe(logits)");
      }
    }
  }

  void skip_observe() {
    if constexpr (!greedy) {
      const std::int32_t b = pick_seq();
      if (call("skip_observe", [&] { policy_.skip_observe(b); })) {
        check_all("skip_observe");
      }
    }
  }

  void evict() {
    const std::int32_t b = pick_seq();
    std::vector<std::int32_t> victims(std::size_t(heads()), -7);
    const bool with_victims = !in_.one_in(3);
    const std::vector<std::int32_t> before = valid_seq(b) ? positions_of(b) : std::vector<std::int32_t>{};
    const std::int32_t count_before = valid_seq(b) ? policy_.slots().count(b, 0) : 0;
    std::int32_t freed = 0;
    if (call("evict", [&] { freed = policy_.evict(b, with_victims ? victims.data() : nullptr); })) {
      require(freed == (count_before > policy_.budget() ? heads() : 0), "evict: unexpected number of slots freed");
      if (with_victims)
        for (std::int32_t h = 0; h < heads(); ++h) {
          const std::int32_t s = victims[std::size_t(h)];
          if (freed == 0) {
            require(s == -1, "evict: a victim reported with nothing evicted");
            continue;
          }
          require(s >= 0 && s < capacity() && before[std::size_t(h) * capacity() + s] >= 0 &&
                      policy_.slots().position(b, h, s) == -1,
                  "evict: the reported victim slot was not freed");
        }
      if constexpr (is_h2o)
        for (std::int32_t h = 0; h < heads(); ++h)
          require(shadow_->evict_one(b, h), "evict: the library evicted where the brute force has no victim");
      check_all("evict");
    }
  }

  std::int32_t pick_target() {
    const kvevict::protection p = policy_.rule().protect;
    if (in_.one_in(16)) {
      const std::int32_t bad[] = {p.sinks + p.recent - 1, capacity() + 1, -1, INT32_MAX};
      return bad[in_.range(0, 3)];
    }
    return in_.range(p.sinks + p.recent, capacity());
  }

  void after_evict_to(std::int32_t b, std::int32_t target, const char* what) {
    if constexpr (is_h2o)
      for (std::int32_t h = 0; h < heads(); ++h) shadow_->evict_to(b, h, target);
    for (std::int32_t h = 0; h < heads(); ++h)
      require(policy_.slots().count(b, h) <= target, std::string(what) + ": a head holds more than the target");
    check_all(what);
  }

  void evict_to_view() {
    const std::int32_t b = pick_seq();
    const std::int32_t target = pick_target();
    const view_type view = pick_view(in_, cache_);
    const std::vector<std::int32_t> before = valid_seq(b) ? positions_of(b) : std::vector<std::int32_t>{};
    const std::vector<T> k_before = cache_.k_storage(), v_before = cache_.v_storage();
    if (call("evict_to(view)", [&] { policy_.evict_to(b, target, view); })) {
      check_rows_moved("evict_to(view)", b, k_before, v_before, [&](std::int32_t h, std::int32_t s) {
        return slot_in(before, capacity(), h, policy_.slots().position(b, h, s));
      });
      after_evict_to(b, target, "evict_to(view)");
    }
  }

  void evict_to_moves() {
    const std::int32_t b = pick_seq();
    const std::int32_t target = pick_target();
    std::vector<kvevict::slot_move> moves(std::size_t(heads()) * capacity());
    std::vector<std::int32_t> counts(std::size_t(heads()), -7);
    const bool null_moves = in_.one_in(32), null_counts = in_.one_in(32);
    const std::vector<std::int32_t> before = valid_seq(b) ? positions_of(b) : std::vector<std::int32_t>{};
    if (call("evict_to(moves)", [&] {
          policy_.evict_to(b, target, null_moves ? nullptr : moves.data(), null_counts ? nullptr : counts.data());
        })) {
      for (std::int32_t h = 0; h < heads(); ++h) {
        const std::int32_t n = counts[std::size_t(h)];
        require(n >= 0 && n <= capacity(), "evict_to(moves): move count outside [0, capacity]");
        for (std::int32_t i = 0; i < n; ++i) {
          const kvevict::slot_move m = moves[std::size_t(h) * capacity() + i];
          require(m.from >= 0 && m.from < capacity() && m.to >= 0 && m.to < capacity() && m.from != m.to,
                  "evict_to(moves): a move outside the slots");
          require(policy_.slots().position(b, h, m.to) == before[std::size_t(h) * capacity() + m.from],
                  "evict_to(moves): a moved slot does not hold the moved token");
        }
      }
      after_evict_to(b, target, "evict_to(moves)");
    }
  }

  void reset() {
    const std::int32_t b = pick_seq();
    bool ok = false;
    if constexpr (std::is_same_v<Policy, kvevict::random_policy>) {
      if (in_.one_in(2)) {
        const std::uint64_t stream = in_.one_in(4) ? kvevict::max_random_stream + in_.range(0, 2) : in_.u64() >> 1;
        ok = call("reset(stream)", [&] { policy_.reset(b, stream); });
        if (ok) require(policy_.stream(b) == stream, "reset(stream): stream not set");
      } else {
        ok = call("reset", [&] { policy_.reset(b); });
      }
    } else {
      ok = call("reset", [&] { policy_.reset(b); });
    }
    if (ok) {
      if constexpr (is_h2o) shadow_->reset(b);
      check_all("reset");
    }
  }

  /// Column total of one query head in the canonical order (the first
  /// element starts it); prompts here are at most 64 long: one chunk.
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
  /// Per-head prefill scores from per-query-head column totals.
  template <class Total>
  std::vector<std::vector<float>> head_scores_from(std::int32_t length, Total total) const {
    const std::int32_t g = shape().group_size();
    std::vector<std::vector<float>> scores(static_cast<std::size_t>(heads()), std::vector<float>(static_cast<std::size_t>(length)));
    std::vector<float> vals(static_cast<std::size_t>(g));
    for (std::int32_t h = 0; h < heads(); ++h)
      for (std::int32_t p = 0; p < length; ++p) {
        for (std::int32_t j = 0; j < g; ++j) vals[std::size_t(j)] = total(h * g + j, p);
        scores[std::size_t(h)][std::size_t(p)] = shadow_fold(vals);
      }
    return scores;
  }
  float shadow_fold(const std::vector<float>& vals) const {
    if constexpr (is_h2o) return shadow_->fold(vals.data());
    return 0.0f;
  }

  void prefill() {
    const std::int32_t b = pick_seq();
    std::int32_t length = in_.range(1, capacity());
    if (in_.one_in(24)) length = in_.one_in(2) ? 0 : capacity() + 1;
    // The engine writes the prompt's rows to slots [0, length) first.
    if (valid_seq(b) && policy_.length(b) == 0 && length > 0 && length <= capacity())
      write_rows(in_, cache_, b, 0, length, greedy ? 24 : 0);
    const std::int32_t q_heads = shape().num_q_heads;
    const std::int32_t g = shape().group_size();
    const view_type view = pick_view(in_, cache_);
    const std::vector<T> k_before = cache_.k_storage(), v_before = cache_.v_storage();
    std::optional<std::vector<std::vector<float>>> scores;  // h2o: the brute-force prefill scores
    bool moved_rows = true;
    bool ok = false;
    const std::int32_t m = std::max(length, 1);
    if constexpr (greedy) {
      const auto q = make_tensor<T, 2>(in_, {q_heads, head_dim()}, {false, false}, value_kind::query, 24, 24);
      const auto lse = make_tensor<float, 1>(in_, {q_heads}, {false}, value_kind::logit, 24, 24);
      const kvevict::decode_queries<T> input{q.view, lse.view, scale_value(in_), base_value(in_)};
      ok = call("prefill(queries)", [&] { policy_.prefill(b, length, input, view); });
    } else {
      const int kind = in_.range(0, scoreless_prefill ? 4 : 3);
      if (kind == 0) {
        const auto probs =
            make_tensor<float, 3>(in_, {q_heads, m, m}, {false, true, true}, value_kind::probability, 24, 48);
        ok = call("prefill(probs)", [&] { policy_.prefill(b, length, kvevict::prefill_probs{probs.view}, view); });
        if (ok && is_h2o)
          scores = head_scores_from(length, [&](std::int32_t qh, std::int32_t p) {
            return column_total(p, length, [&](std::int32_t i) { return weigh_row(probs.view(qh, i, p), length, i); });
          });
      } else if (kind == 1 || kind == 2) {
        const auto sums = make_tensor<float, 2>(in_, {q_heads, m}, {false, true}, value_kind::probability, 24, 48);
        if (kind == 1) {
          ok = call("prefill(sums)",
                    [&] { policy_.prefill(b, length, kvevict::prefill_column_sums{sums.view}, view); });
        } else {
          moved_rows = false;
          ok = call("prefill(sums, no view)",
                    [&] { policy_.prefill(b, length, kvevict::prefill_column_sums{sums.view}); });
        }
        if (ok && is_h2o)
          scores = head_scores_from(length, [&](std::int32_t qh, std::int32_t p) { return sums.view(qh, p); });
      } else if (kind == 3) {
        const auto q = make_tensor<T, 3>(in_, {q_heads, m, head_dim()}, {false, true, false}, value_kind::query, 24,
                                         48);
        const auto lse = make_tensor<float, 2>(in_, {q_heads, m}, {false, true}, value_kind::logit, 24, 48);
        const kvevict::prefill_queries<T> input{q.view, lse.view, scale_value(in_), base_value(in_)};
        ok = call("prefill(queries)", [&] { policy_.prefill(b, length, input, view); });
        if (ok && is_h2o) {
          const view_type v = cache_.view();
          scores = head_scores_from(length, [&](std::int32_t qh, std::int32_t p) {
            const T* key = k_before.data() + v.layout.row_offset(b, qh / g, p);
            return column_total(p, length, [&](std::int32_t i) {
              const float logit = kvevict::attention_logit(&q.view(qh, i, 0), q.view.strides[2], key, head_dim());
              return weigh_row(kvevict::probability_from_logit(logit, input.scale, lse.view(qh, i), input.base), length,
                               i);
            });
          });
        }
      } else {
        if constexpr (scoreless_prefill) ok = call("prefill(no scores)", [&] { policy_.prefill(b, length, view); });
      }
    }
    if (!ok) return;
    for (std::int32_t h = 0; h < heads(); ++h)
      require(policy_.slots().count(b, h) == std::min(length, policy_.budget()),
              "prefill: kept count is not min(length, budget)");
    if (moved_rows)
      check_rows_moved("prefill", b, k_before, v_before,
                       [&](std::int32_t h, std::int32_t s) { return policy_.slots().position(b, h, s); });
    if constexpr (is_h2o) {
      if (scores) shadow_->prefill(b, length, *scores);
      else finding("prefill: h2o accepted a prefill the harness has no scores for");
    }
    check_all("prefill");
  }

  void compact_rows() {
    const std::int32_t b = pick_seq();
    std::int32_t h = in_.range(0, heads() - 1);
    if (in_.one_in(24)) h = in_.one_in(2) ? -1 : heads();
    std::int32_t n = in_.range(0, capacity());
    if (in_.one_in(24)) n = in_.one_in(2) ? -1 : capacity() + 1;
    std::vector<std::int32_t> src;
    std::vector<std::int32_t> pool(static_cast<std::size_t>(capacity()));
    for (std::int32_t s = 0; s < capacity(); ++s) pool[std::size_t(s)] = s;
    const bool ascending = in_.one_in(2);
    for (std::int32_t i = 0; i < n && i < capacity(); ++i) {  // distinct slots, in ascending or input order
      const std::size_t j = std::size_t(in_.range(i, capacity() - 1));
      std::swap(pool[std::size_t(i)], pool[j]);
      src.push_back(pool[std::size_t(i)]);
    }
    if (ascending) std::sort(src.begin(), src.end());
    if (!src.empty() && in_.one_in(16)) src[std::size_t(in_.range(0, int(src.size()) - 1))] = in_.one_in(2) ? -1 : src[0];
    if (!src.empty() && in_.one_in(24)) src.back() = capacity();
    while (std::int32_t(src.size()) < std::max(n, 0)) src.push_back(0);  // n > capacity: the count is refused
    std::vector<T> workspace(kvevict::compaction_workspace_elements(std::max(n, 0), head_dim()) + 1);
    const bool null_workspace = in_.one_in(8);
    const bool null_src = in_.one_in(32);
    const view_type view = pick_view(in_, cache_);
    const std::vector<T> k_before = cache_.k_storage(), v_before = cache_.v_storage();
    if (call("compact", [&] {
          kvevict::compact(view, b, h, null_src ? nullptr : src.data(), n, null_workspace ? nullptr : workspace.data());
        })) {
      const view_type v = cache_.view();
      for (std::int32_t i = 0; i < n; ++i) {
        const std::int64_t to = v.layout.row_offset(b, h, i), from = v.layout.row_offset(b, h, src[std::size_t(i)]);
        require(std::memcmp(v.k + to, k_before.data() + from, sizeof(T) * head_dim()) == 0 &&
                    std::memcmp(v.v + to, v_before.data() + from, sizeof(T) * head_dim()) == 0,
                "compact: row " + std::to_string(i) + " does not hold the row of slot " +
                    std::to_string(src[std::size_t(i)]));
      }
      check_all("compact");
    }
  }

  /// A whole valid decode step on one sequence, so short inputs reach deep
  /// states: evict if needed, append, write the rows, observe, evict.
  void decode_step() {
    const std::int32_t b = in_.range(0, shape().num_seqs - 1);
    if (policy_.length(b) >= max_sequence_length) return;
    if (policy_.awaiting_observe(b)) {
      if constexpr (greedy) return;
      else call("skip_observe", [&] { policy_.skip_observe(b); });
    }
    if (policy_.next_slot(b, 0) < 0) {
      if (!call("evict", [&] { policy_.evict(b); })) return;
      if constexpr (is_h2o)
        for (std::int32_t h = 0; h < heads(); ++h) shadow_->evict_one(b, h);
      check_all("evict");
      for (std::int32_t h = 0; h < heads(); ++h)
        if (policy_.next_slot(b, h) < 0) return;
    }
    std::vector<std::int32_t> slots(static_cast<std::size_t>(heads()));
    for (std::int32_t h = 0; h < heads(); ++h) slots[std::size_t(h)] = policy_.next_slot(b, h);
    if (!call("append", [&] { policy_.append(b); })) return;
    if constexpr (is_h2o) shadow_->append(b, 1);
    check_all("append");
    const auto k_new = make_tensor<T, 2>(in_, {heads(), head_dim()}, {false, false}, value_kind::kv_row, 0, 64);
    const auto v_new = make_tensor<T, 2>(in_, {heads(), head_dim()}, {false, false}, value_kind::kv_row, 0, 64);
    call("scatter", [&] { kvevict::scatter(cache_.view(), b, slots.data(), k_new.view, v_new.view); });
    observe(in_.range(0, 3), b);
    if (!policy_.awaiting_observe(b)) evict_seq(b);
  }

  void evict_seq(std::int32_t b) {
    if (call("evict", [&] { policy_.evict(b); })) {
      if constexpr (is_h2o)
        for (std::int32_t h = 0; h < heads(); ++h)
          require(shadow_->evict_one(b, h), "evict: the library evicted where the brute force has no victim");
      check_all("evict");
    }
  }

  fuzz_input& in_;
  Policy policy_;
  kvevict::kv_cache<T, Layout> cache_;
  std::vector<std::int32_t> pristine_;
  std::optional<h2o_shadow> shadow_;
};

}  // namespace kvfuzz
