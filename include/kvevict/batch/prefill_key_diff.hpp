#pragma once
// Batched prefill compression scored by KeyDiff (key_diff.hpp): position p
// of (b, h) scores -cos(k_p, anchor), the anchor the sum of the unit keys in
// slots [0, L) of that head; the rest is every batched prefill's
// (prefill.hpp): keep the sinks, the recent window and the least similar
// keys, compact, report reclaimable pages. No attention input: kvpress's
// KeyDiffPress. A prompt key whose norm is not finite refuses the sequence
// (non_finite_kv at the lowest such position of the lowest head).
#include <cstdint>
#include <vector>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/prefill.hpp"
#include "kvevict/batch/prefill_rules.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/key_diff.hpp"

namespace kvevict {
namespace detail {

/// The host scorer: key_diff_scores for (b, h).
template <class T, class Layout>
struct host_key_diff_scores {
  static constexpr bool has_scores = true;
  kv_view<T, Layout> cache;
  std::vector<std::int64_t>* sums;  // [head_dim]
  std::vector<float>* unit;         // [head_dim]

  std::uint64_t score_head(std::int32_t b, std::int32_t h, std::int32_t length, float* out) const {
    const std::int32_t bad = key_diff_scores(cache, b, h, length, sums->data(), unit->data(), out);
    return bad < 0 ? batch_status_clear : pack_status(b, h, bad, batch_code::non_finite_kv);
  }
};

template <class T, class Layout>
void run_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                 const key_diff<T, Layout>& in, std::int32_t* reclaimable_pages, std::uint64_t* status) {
  std::vector<std::int64_t> sums(static_cast<std::size_t>(in.cache.head_dim));
  std::vector<float> unit(static_cast<std::size_t>(in.cache.head_dim));
  const host_key_diff_scores<T, Layout> scorer{in.cache, &sums, &unit};
  host_prefill(st, active, prompts, scorer, prefill_key_checks<T, Layout>{in.cache}, &in.cache, reclaimable_pages,
               status);
}

}  // namespace detail

/// KeyDiff prefill compression of every active sequence from its cached
/// prompt keys (slots [0, L) of in.cache); the kept rows move to slots
/// [0, kept). reclaimable_pages: optional [B]. See the top of this header.
template <class T, class Layout>
void batched_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                     const key_diff<T, Layout>& in, std::int32_t* reclaimable_pages, std::uint64_t* status) {
  const detail::site w{"batch", "prefill"};
  detail::require_prefill_call(w, st, active, prompts, status);
  detail::require_cache(w, st, in.cache);
  detail::run_prefill(st, active, prompts, in, reclaimable_pages, status);
}

}  // namespace kvevict
