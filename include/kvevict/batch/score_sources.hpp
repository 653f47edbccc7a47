#pragma once
// One adapter per batched score input (inputs.hpp) with the same calls, so a
// single observe + evict loop, on the host or in a kernel, serves them all:
//
//   std::int32_t columns()                       // slots the input has a value for
//   std::uint64_t check_head_share(b, h, t, n)   // per-(b, h) inputs (LSE, query rows):
//                                                // thread t of n checks its share (head_check keys)
//   void fold_items<N>(b, h, s[N], inc[N])       // N slots' increments, folded over the group
//   slot_increment increment(b, h, s)            // one slot's
//
// fold_items issues every load of a query head for its N slots before it
// looks at any value (group_fold), so a GPU thread keeps N loads in flight.
// All are KVEVICT_HOST_DEVICE and built from decode_rules.hpp.
#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/launch_shape.hpp"
#include "kvevict/batch/row_partial.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/config.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/key_diff_anchor.hpp"

namespace kvevict {
namespace detail {

/// Thread t of n's share of the LSE checks of group h: lse(b, q) finite.
KVEVICT_HOST_DEVICE inline std::uint64_t check_group_lse(const tensor_view<const float, 2>& lse, std::int32_t b,
                                                         std::int32_t h, std::int32_t g, std::int32_t t,
                                                         std::int32_t n) noexcept {
  std::uint64_t key = head_check::none;
  for (std::int32_t j = t; j < g; j += n)
    if (classify_input(lse(b, h * g + j), false) != batch_code::ok)
      key = lower_of(key, head_check::key(head_check::stage::lse, h * g + j));
  return key;
}

/// The head check of a source that reads keys: bad_kv_scale's key when a
/// scale of head h is bad (kv_view.hpp), else none.
template <class T, class Layout>
KVEVICT_HOST_DEVICE std::uint64_t kv_scale_check(const kv_view<T, Layout>& cache, std::int32_t h) noexcept {
  const std::int32_t bad = bad_kv_scale(cache, h);
  return bad < 0 ? head_check::none : head_check::key(head_check::stage::kv_scale, bad);
}

/// The probability of a logit (or the logit itself when it is not finite,
/// so that it is what gets reported).
KVEVICT_HOST_DEVICE inline float logit_value(float logit, float scale, float lse, lse_base base) noexcept {
  if (classify_input(logit, false) != batch_code::ok) return logit;
  return probability_from_logit(logit, scale, lse, base);
}

}  // namespace detail

template <class Input>
struct score_source;

template <>
struct score_source<batch_probs> {
  static constexpr int items = decode_tuning::items;  ///< slots a GPU thread folds at once
  static constexpr int min_blocks = decode_tuning::blocks_per_sm;  ///< its kernel's __launch_bounds__
  batch_probs in;
  std::int32_t group_size;
  group_reduce reduce;

  KVEVICT_HOST_DEVICE std::int32_t columns() const noexcept { return in.probs.extents[2]; }
  KVEVICT_HOST_DEVICE std::uint64_t check_head_share(std::int32_t, std::int32_t, std::int32_t,
                                                     std::int32_t) const noexcept {
    return head_check::none;
  }
  /// Head q + 1's loads go out before head q's values are folded.
  template <int N>
  KVEVICT_HOST_DEVICE void fold_items(std::int32_t b, std::int32_t h, const std::int32_t (&s)[N],
                                      slot_increment (&inc)[N]) const noexcept {
    group_fold fold[N];
    const std::int32_t first = h * group_size, last = first + group_size - 1;
    float x[N];
    KVEVICT_UNROLL
    for (int u = 0; u < N; ++u) x[u] = in.probs(b, first, s[u]);
    for (std::int32_t q = first; q <= last; ++q) {
      float next[N];
      const std::int32_t ahead = q < last ? q + 1 : q;  // the last head reloads itself: no branch
      KVEVICT_UNROLL
      for (int u = 0; u < N; ++u) next[u] = in.probs(b, ahead, s[u]);
      KVEVICT_UNROLL
      for (int u = 0; u < N; ++u) {
        fold[u].add(x[u], q, reduce, true);
        x[u] = next[u];
      }
    }
    KVEVICT_UNROLL
    for (int u = 0; u < N; ++u) inc[u] = fold[u].finish(reduce, group_size);
  }
  KVEVICT_HOST_DEVICE slot_increment increment(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return fold_group(h * group_size, group_size, reduce, true, [&](std::int32_t q) { return in.probs(b, q, s); });
  }
};

template <>
struct score_source<batch_head_scores> {
  static constexpr int items = decode_tuning::items;
  static constexpr int min_blocks = decode_tuning::blocks_per_sm;
  batch_head_scores in;
  std::int32_t group_size;
  group_reduce reduce;

  KVEVICT_HOST_DEVICE std::int32_t columns() const noexcept { return in.scores.extents[2]; }
  KVEVICT_HOST_DEVICE std::uint64_t check_head_share(std::int32_t, std::int32_t, std::int32_t,
                                                     std::int32_t) const noexcept {
    return head_check::none;
  }
  /// Increments are added as given: finite, of any sign.
  template <int N>
  KVEVICT_HOST_DEVICE void fold_items(std::int32_t b, std::int32_t h, const std::int32_t (&s)[N],
                                      slot_increment (&inc)[N]) const noexcept {
    float x[N];
    KVEVICT_UNROLL
    for (int u = 0; u < N; ++u) x[u] = in.scores(b, h, s[u]);
    KVEVICT_UNROLL
    for (int u = 0; u < N; ++u) {
      group_fold fold;
      fold.add(x[u], h, group_reduce::sum, false);
      inc[u] = fold.finish(group_reduce::sum, 1);
    }
  }
  KVEVICT_HOST_DEVICE slot_increment increment(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return fold_group(h, 1, group_reduce::sum, false, [&](std::int32_t) { return in.scores(b, h, s); });
  }
};

template <>
struct score_source<batch_logits> {
  /// Half the slots of the other inputs: the exponentials' registers and the
  /// next head's loads fit 80 registers then (at 8, ptxas spills).
  static constexpr int items = decode_tuning::items / 2;
  static constexpr int min_blocks = decode_tuning::blocks_per_sm;
  batch_logits in;
  std::int32_t group_size;
  group_reduce reduce;

  KVEVICT_HOST_DEVICE std::int32_t columns() const noexcept { return in.logits.extents[2]; }
  KVEVICT_HOST_DEVICE std::uint64_t check_head_share(std::int32_t b, std::int32_t h, std::int32_t t,
                                                     std::int32_t n) const noexcept {
    return detail::check_group_lse(in.lse, b, h, group_size, t, n);
  }
  /// A NaN logit gives a NaN probability and an infinite one an infinite or
  /// zero probability; the logit itself is reported.
  template <int N>
  KVEVICT_HOST_DEVICE void fold_items(std::int32_t b, std::int32_t h, const std::int32_t (&s)[N],
                                      slot_increment (&inc)[N]) const noexcept {
    group_fold fold[N];
    const std::int32_t first = h * group_size, last = first + group_size - 1;
    float x[N], lse = in.lse(b, first);
    KVEVICT_UNROLL
    for (int u = 0; u < N; ++u) x[u] = in.logits(b, first, s[u]);
    for (std::int32_t q = first; q <= last; ++q) {  // head q + 1's loads before head q's exponentials
      float next[N];
      const std::int32_t ahead = q < last ? q + 1 : q;
      const float next_lse = in.lse(b, ahead);
      KVEVICT_UNROLL
      for (int u = 0; u < N; ++u) next[u] = in.logits(b, ahead, s[u]);
      KVEVICT_UNROLL
      for (int u = 0; u < N; ++u) {
        fold[u].add(detail::logit_value(x[u], in.scale, lse, in.base), q, reduce, true);
        x[u] = next[u];
      }
      lse = next_lse;
    }
    KVEVICT_UNROLL
    for (int u = 0; u < N; ++u) inc[u] = fold[u].finish(reduce, group_size);
  }
  KVEVICT_HOST_DEVICE slot_increment increment(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return fold_group(h * group_size, group_size, reduce, true, [&](std::int32_t q) {
      return detail::logit_value(in.logits(b, q, s), in.scale, in.lse(b, q), in.base);
    });
  }
};

/// Queries + LSE: logits recomputed from the cached keys of `cache`.
template <class Q, class T, class Layout>
struct query_source {
  /// One slot at a time: its key row's vector loads are already many.
  static constexpr int items = 1;
  static constexpr int min_blocks = 2;
  batch_queries<Q> in;
  kv_view<T, Layout> cache;
  std::int32_t group_size;
  group_reduce reduce;

  /// Every slot of the cache has a key.
  KVEVICT_HOST_DEVICE std::int32_t columns() const noexcept { return cache.capacity; }
  /// The LSE checks, then every element of the group's query rows.
  KVEVICT_HOST_DEVICE std::uint64_t check_head_share(std::int32_t b, std::int32_t h, std::int32_t t,
                                                     std::int32_t n) const noexcept {
    std::uint64_t key =
        lower_of(detail::check_group_lse(in.lse, b, h, group_size, t, n), detail::kv_scale_check(cache, h));
    const std::int32_t d = cache.head_dim;
    for (std::int64_t i = t; i < std::int64_t{group_size} * d; i += n) {
      const std::int32_t q = h * group_size + static_cast<std::int32_t>(i / d);
      if (classify_input(to_float(in.q(b, q, static_cast<std::int32_t>(i % d))), false) != batch_code::ok)
        key = lower_of(key, head_check::key(head_check::stage::query, q));
    }
    return key;
  }
  /// Slot by slot: each reads its key row once per query head (the first
  /// time from memory, then from cache).
  template <int N>
  KVEVICT_HOST_DEVICE void fold_items(std::int32_t b, std::int32_t h, const std::int32_t (&s)[N],
                                      slot_increment (&inc)[N]) const noexcept {
    KVEVICT_UNROLL
    for (int u = 0; u < N; ++u) inc[u] = increment(b, h, s[u]);
  }
  KVEVICT_HOST_DEVICE slot_increment increment(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    if (!row_is_mapped(cache, b, s)) {
      slot_increment bad;
      bad.code = batch_code::bad_page;
      return bad;
    }
    const T* key = cache.k_row(b, h, s);
    const float key_scale = cache.k_scale(h);
    return fold_group(h * group_size, group_size, reduce, true, [&](std::int32_t q) {
      const float logit = attention_logit_rows(&in.q(b, q, 0), in.q.strides[2], key, cache.head_dim, key_scale);
      return detail::logit_value(logit, in.scale, in.lse(b, q), in.base);
    });
  }
};

/// Key norms: each slot's score is -||k|| of its cached key row
/// (key_norm_score); per KV head, so the group and its reduction play no
/// part. A key whose norm is not finite is reported as non_finite_kv.
template <class T, class Layout>
struct score_source<key_norms<T, Layout>> {
  static constexpr int items = 1;  ///< one key row per slot: its vector loads are many
  static constexpr int min_blocks = 2;
  key_norms<T, Layout> in;
  std::int32_t group_size;
  group_reduce reduce;

  KVEVICT_HOST_DEVICE std::int32_t columns() const noexcept { return in.cache.capacity; }
  KVEVICT_HOST_DEVICE std::uint64_t check_head_share(std::int32_t, std::int32_t h, std::int32_t,
                                                     std::int32_t) const noexcept {
    return detail::kv_scale_check(in.cache, h);
  }
  template <int N>
  KVEVICT_HOST_DEVICE void fold_items(std::int32_t b, std::int32_t h, const std::int32_t (&s)[N],
                                      slot_increment (&inc)[N]) const noexcept {
    KVEVICT_UNROLL
    for (int u = 0; u < N; ++u) inc[u] = increment(b, h, s[u]);
  }
  KVEVICT_HOST_DEVICE slot_increment increment(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    slot_increment out;
    if (!row_is_mapped(in.cache, b, s)) {
      out.code = batch_code::bad_page;
      return out;
    }
    out.value = key_norm_score(in.cache.k_row(b, h, s), in.cache.head_dim, in.cache.k_scale(h));
    if (classify_input(out.value, false) != batch_code::ok) out.code = batch_code::non_finite_kv;
    return out;
  }
};

/// KeyDiff: each slot's score is -cos(k, anchor) against the unit anchor
/// of (b, h) that refresh_key_anchor wrote for this step
/// (key_diff_anchor.hpp); per KV head, like key norms. A key whose norm is
/// not finite is reported as non_finite_kv.
template <class T, class Layout>
struct score_source<key_diff<T, Layout>> {
  static constexpr int items = 1;  ///< one key row per slot, as key norms
  static constexpr int min_blocks = 2;
  key_diff<T, Layout> in;
  key_anchor_view anchors;

  KVEVICT_HOST_DEVICE std::int32_t columns() const noexcept { return in.cache.capacity; }
  KVEVICT_HOST_DEVICE std::uint64_t check_head_share(std::int32_t, std::int32_t h, std::int32_t,
                                                     std::int32_t) const noexcept {
    return detail::kv_scale_check(in.cache, h);
  }
  template <int N>
  KVEVICT_HOST_DEVICE void fold_items(std::int32_t b, std::int32_t h, const std::int32_t (&s)[N],
                                      slot_increment (&inc)[N]) const noexcept {
    KVEVICT_UNROLL
    for (int u = 0; u < N; ++u) inc[u] = increment(b, h, s[u]);
  }
  KVEVICT_HOST_DEVICE slot_increment increment(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    slot_increment out;
    if (!row_is_mapped(in.cache, b, s)) {
      out.code = batch_code::bad_page;
      return out;
    }
    const T* k = in.cache.k_row(b, h, s);
    const float scale = in.cache.k_scale(h);
    const float norm = key_length(k, in.cache.head_dim, scale);
    if (classify_input(norm, false) != batch_code::ok) {
      out.value = norm;
      out.code = batch_code::non_finite_kv;
      return out;
    }
    out.value = key_diff_score(k, anchors.units_of(b, h), in.cache.head_dim, scale, norm);
    return out;
  }
};

namespace detail {

/// What a source keeps beside the scores follows the commit of (b, h)'s
/// step (commit_observe_evict, which left a KeyDiff anchor stale if it
/// evicted): nothing for most sources.
template <class Source>
KVEVICT_HOST_DEVICE void after_commit(const Source&, const batch_state_view&, std::int32_t, std::int32_t,
                                      std::int32_t) noexcept {}

/// KeyDiff: the victim's key leaves the anchor, which is current again.
KVEVICT_EXEC_CHECK_DISABLE
template <class T, class Layout>
KVEVICT_HOST_DEVICE void after_commit(const score_source<key_diff<T, Layout>>& source, const batch_state_view& st,
                                      std::int32_t b, std::int32_t h, std::int32_t victim) noexcept {
  if (victim < 0) return;
  remove_from_key_anchor(source.anchors, source.in.cache, b, h, victim);
  source.anchors.upto[st.head_index(b, h)] = st.slots.lengths[b];
}

/// Thread t of n's share of the checks of (b, h) before observe + evict
/// reads its slots (head_check; reduce the shares by their minimum): an
/// append since the last observe; a value in the input for every occupied
/// slot (the argument check asks for budget + 1 columns, and a multi-token
/// append takes a head beyond that: index = the slots held); then the
/// source's per-head inputs.
/// `appended` and `count` are the head's flag and token count (a kernel has
/// them already).
template <class Source>
KVEVICT_HOST_DEVICE std::uint64_t head_check_share(const Source& source, std::int32_t b, std::int32_t h,
                                                   std::int32_t t, std::int32_t n, bool appended,
                                                   std::int32_t count) noexcept {
  std::uint64_t key = source.check_head_share(b, h, t, n);
  if (t == 0 && count > source.columns()) key = lower_of(key, head_check::key(head_check::stage::narrow_input, count));
  if (t == 0 && !appended) key = head_check::key(head_check::stage::not_appended, 0);
  return key;
}

/// The status word of the checks of (b, h), made by one thread.
template <class Source>
KVEVICT_HOST_DEVICE std::uint64_t check_observe_head(const batch_state_view& st, const Source& source, std::int32_t b,
                                                     std::int32_t h) noexcept {
  const std::int64_t bh = st.head_index(b, h);
  return head_check::word(head_check_share(source, b, h, 0, 1, st.appended[bh] != 0, st.slots.counts[bh]), b, h);
}

}  // namespace detail
}  // namespace kvevict
