#pragma once
// One adapter per batched score input (inputs.hpp) with the same three
// calls, so a single observe + evict loop, on the host or in a kernel, serves
// them all:
//
//   std::int32_t columns()              // slots the input has a value for
//   batch_code check_head(b, h, index)  // per-(b, h) inputs: LSE, query rows
//   slot_increment increment(b, h, s)   // slot s's increment, folded over the group
//
// All are KVEVICT_HOST_DEVICE and built from decode_rules.hpp;
// check_observe_head runs the checks of a (b, h) in the order both devices use.
#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/config.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_rules.hpp"

namespace kvevict {
namespace detail {

/// Checks lse(b, q) for the query heads of group h.
KVEVICT_HOST_DEVICE inline batch_code check_group_lse(const tensor_view<const float, 2>& lse, std::int32_t b,
                                                      std::int32_t h, std::int32_t g, std::int32_t& index) noexcept {
  for (std::int32_t q = h * g; q < (h + 1) * g; ++q)
    if (classify_input(lse(b, q), false) != batch_code::ok) {
      index = q;
      return batch_code::non_finite_lse;
    }
  return batch_code::ok;
}

}  // namespace detail

template <class Input>
struct score_source;

template <>
struct score_source<batch_probs> {
  batch_probs in;
  std::int32_t group_size;
  group_reduce reduce;

  KVEVICT_HOST_DEVICE std::int32_t columns() const noexcept { return in.probs.extents[2]; }
  KVEVICT_HOST_DEVICE batch_code check_head(std::int32_t, std::int32_t, std::int32_t&) const noexcept {
    return batch_code::ok;
  }
  KVEVICT_HOST_DEVICE slot_increment increment(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return fold_group(h * group_size, group_size, reduce, true, [&](std::int32_t q) { return in.probs(b, q, s); });
  }
};

template <>
struct score_source<batch_head_scores> {
  batch_head_scores in;
  std::int32_t group_size;
  group_reduce reduce;

  KVEVICT_HOST_DEVICE std::int32_t columns() const noexcept { return in.scores.extents[2]; }
  KVEVICT_HOST_DEVICE batch_code check_head(std::int32_t, std::int32_t, std::int32_t&) const noexcept {
    return batch_code::ok;
  }
  /// Increments are added as given: finite, of any sign.
  KVEVICT_HOST_DEVICE slot_increment increment(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return fold_group(h, 1, group_reduce::sum, false, [&](std::int32_t) { return in.scores(b, h, s); });
  }
};

template <>
struct score_source<batch_logits> {
  batch_logits in;
  std::int32_t group_size;
  group_reduce reduce;

  KVEVICT_HOST_DEVICE std::int32_t columns() const noexcept { return in.logits.extents[2]; }
  KVEVICT_HOST_DEVICE batch_code check_head(std::int32_t b, std::int32_t h, std::int32_t& index) const noexcept {
    return detail::check_group_lse(in.lse, b, h, group_size, index);
  }
  KVEVICT_HOST_DEVICE slot_increment increment(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return fold_group(h * group_size, group_size, reduce, true, [&](std::int32_t q) {
      const float logit = in.logits(b, q, s);
      // A NaN logit gives a NaN probability and an infinite one an infinite
      // or zero probability; report the logit itself.
      if (classify_input(logit, false) != batch_code::ok) return logit;
      return probability_from_logit(logit, in.scale, in.lse(b, q), in.base);
    });
  }
};

/// Queries + LSE: logits recomputed from the cached keys of `cache`.
template <class Q, class T, class Layout>
struct query_source {
  batch_queries<Q> in;
  kv_view<T, Layout> cache;
  std::int32_t group_size;
  group_reduce reduce;

  /// Every slot of the cache has a key.
  KVEVICT_HOST_DEVICE std::int32_t columns() const noexcept { return cache.capacity; }
  KVEVICT_HOST_DEVICE batch_code check_head(std::int32_t b, std::int32_t h, std::int32_t& index) const noexcept {
    const batch_code lse = detail::check_group_lse(in.lse, b, h, group_size, index);
    if (lse != batch_code::ok) return lse;
    for (std::int32_t q = h * group_size; q < (h + 1) * group_size; ++q)
      for (std::int32_t d = 0; d < cache.head_dim; ++d)
        if (classify_input(to_float(in.q(b, q, d)), false) != batch_code::ok) {
          index = q;
          return batch_code::non_finite_query;
        }
    return batch_code::ok;
  }
  KVEVICT_HOST_DEVICE slot_increment increment(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    if (!row_is_mapped(cache, b, s)) {
      slot_increment bad;
      bad.code = batch_code::bad_page;
      return bad;
    }
    const T* key = cache.k_row(b, h, s);
    return fold_group(h * group_size, group_size, reduce, true, [&](std::int32_t q) {
      const float logit = attention_logit(&in.q(b, q, 0), in.q.strides[2], key, cache.head_dim);
      if (classify_input(logit, false) != batch_code::ok) return logit;  // a non-finite key
      return probability_from_logit(logit, in.scale, in.lse(b, q), in.base);
    });
  }
};

namespace detail {

/// The checks of (b, h) before observe + evict reads its slots, in the order
/// both devices make them: an append since the last observe; a value in the
/// input for every occupied slot (the argument check asks for budget + 1
/// columns, and a multi-token append takes a head beyond that: index = the
/// slots held); then the source's per-head inputs.
template <class Source>
KVEVICT_HOST_DEVICE batch_code check_observe_head(const batch_state_view& st, const Source& source, std::int32_t b,
                                                  std::int32_t h, std::int32_t& index) noexcept {
  const std::int64_t bh = st.head_index(b, h);
  if (!st.appended[bh]) return batch_code::not_appended;
  if (st.slots.counts[bh] > source.columns()) {
    index = st.slots.counts[bh];
    return batch_code::narrow_input;
  }
  return source.check_head(b, h, index);
}

}  // namespace detail
}  // namespace kvevict
