#pragma once
// Batched prefill compression scored by key norms (key_norms,
// score_inputs.hpp): position p of (b, h) scores -||k|| of the key in slot p
// of the cache, the decode source's rule (score_source<key_norms>), and the
// rest is every batched prefill's (prefill.hpp): keep the sinks, the recent
// window and the best of the others, compact, report reclaimable pages.
// No attention input: what KV compression at prefill needs when the
// attention kernel returns nothing (kvpress's KnormPress).
#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/prefill.hpp"
#include "kvevict/batch/score_sources.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/score_inputs.hpp"

namespace kvevict {
namespace detail {

/// The host scorer: -||k_p|| for p in [0, L) of (b, h); the first position
/// whose norm is not finite gives the head's word (non_finite_kv at p).
template <class T, class Layout>
struct host_key_norm_scores {
  static constexpr bool has_scores = true;
  score_source<key_norms<T, Layout>> source;

  std::uint64_t score_head(std::int32_t b, std::int32_t h, std::int32_t length, float* out) const {
    for (std::int32_t p = 0; p < length; ++p) {
      const slot_increment inc = source.increment(b, h, p);  // position p sits in slot p
      out[p] = inc.value;
      if (inc.code != batch_code::ok) return pack_status(b, h, p, inc.code);
    }
    return batch_status_clear;
  }
};

template <class T, class Layout>
void run_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                 const key_norms<T, Layout>& in, std::int32_t* reclaimable_pages, std::uint64_t* status) {
  const host_key_norm_scores<T, Layout> scorer{{in, st.group_size(), st.rule.reduce}};
  host_prefill(st, active, prompts, scorer, prefill_key_checks<T, Layout>{in.cache}, &in.cache, reclaimable_pages,
               status);
}

}  // namespace detail

/// Prefill compression of every active sequence by the norms of its cached
/// prompt keys (slots [0, L) of in.cache); the kept rows move to slots
/// [0, kept). A rule that keeps by score needs decay 0 (key_norm_config).
/// reclaimable_pages: optional [B].
template <class T, class Layout>
void batched_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                     const key_norms<T, Layout>& in, std::int32_t* reclaimable_pages, std::uint64_t* status) {
  const detail::site w{"batch", "prefill"};
  detail::require_prefill_call(w, st, active, prompts, status);
  detail::require_input(w, st, in);
  detail::run_prefill(st, active, prompts, in, reclaimable_pages, status);
}

}  // namespace kvevict
