#pragma once
// The per-sequence prefill calls (docs/semantics.md, "Prefill
// compression"): sequence b's prompt of `length` tokens (position p in
// slot p) is scored, min(length, budget) tokens per KV head are kept and
// the kept rows move in position order to slots [0, kept). Each overload
// checks its arguments as the per-sequence API has always checked them,
// then runs the batched backend's prefill of that input (detail::
// run_prefill) on sequence b alone; a refused value is named by
// sequence_errors.hpp, and a refused prompt changes nothing. Prefill is not
// the decode path: it allocates a little.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvevict/batch/prefill.hpp"
#include "kvevict/batch/prefill_key_norms.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/sequence/observe.hpp"
#include "kvevict/sequence/checks.hpp"
#include "kvevict/sequence/errors.hpp"
#include "kvevict/score_inputs.hpp"

namespace kvevict {
namespace detail {

class sequence_prefill : public sequence_observe {
 public:
  /// Scores the prompt from its causal probability matrix, keeps budget
  /// tokens per KV head and compacts them into slots [0, kept) of `view`.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const prefill_probs& in,
                         const kv_view<T, Layout>& view) {
    const site w = where("prefill");
    require_prompt(w, b, length, view);
    const std::int32_t expected[3] = {shape_.num_q_heads, length, length};
    const bool at_least[3] = {false, true, true};
    require_extents(w, "probs", in.probs, expected, at_least);
    return run_one(
        w, b, length,
        [&](const prompt_lengths& prompts, std::int32_t* pages, std::uint64_t* status) {
          run_prefill(state(), active_set::of_list(&b, 1), prompts, as_batch(in, shape_.num_seqs), view, pages, status);
        },
        [&](std::int32_t h, std::int32_t p) {
          fail_prefill_column(w, "probs", "column sums of probs", shape_.group_size(), h, p, p, length,
                              [&](std::int32_t q, std::int32_t i) { return in.probs(q, i, p); });
        });
  }

  /// Scores the prompt from column sums the engine computed.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const prefill_column_sums& in,
                         const kv_view<T, Layout>& view) {
    const site w = where("prefill");
    require_prompt(w, b, length, view);
    require_sums(w, in, length);
    return run_one(
        w, b, length,
        [&](const prompt_lengths& prompts, std::int32_t* pages, std::uint64_t* status) {
          run_prefill(state(), active_set::of_list(&b, 1), prompts, as_batch(in, shape_.num_seqs), view, pages, status);
        },
        [&](std::int32_t h, std::int32_t p) { fail_sums(w, in, h, p); });
  }

  /// Same as above for engines that compact their own buffers: updates only
  /// the slot table; afterwards slot s must hold prompt position
  /// slots().position(b, h, s), i.e. move row slots().position(b, h, s) to s.
  prefill_result prefill(std::int32_t b, std::int32_t length, const prefill_column_sums& in) {
    const site w = where("prefill");
    require_prefill(w, b, length);
    require_sums(w, in, length);
    return run_one(
        w, b, length,
        [&](const prompt_lengths& prompts, std::int32_t*, std::uint64_t* status) {
          run_prefill(state(), active_set::of_list(&b, 1), prompts, as_batch(in, shape_.num_seqs), status);
        },
        [&](std::int32_t h, std::int32_t p) { fail_sums(w, in, h, p); });
  }

  /// Fused-attention prefill: column sums recomputed from every prompt row's
  /// query and LSE and the cached keys (O(L^2 * head_dim) per query head).
  template <class Q, class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const prefill_queries<Q>& in,
                         const kv_view<T, Layout>& view) {
    const site w = where("prefill");
    require_prompt(w, b, length, view);
    require_prefill_queries(w, shape_, in, length, view.head_dim);
    return run_one(
        w, b, length,
        [&](const prompt_lengths& prompts, std::int32_t* pages, std::uint64_t* status) {
          run_prefill(state(), active_set::of_list(&b, 1), prompts, as_batch(in, shape_.num_seqs), view, pages, status);
        },
        [&](std::int32_t h, std::int32_t p) {
          fail_prefill_column(w, "probs from (q, lse)", "column sums from (q, lse)", shape_.group_size(), h, p, p,
                              length, [&](std::int32_t q, std::int32_t i) {
                                return prefill_query_value(&in.q(q, i, 0), in.q.strides[2], view.k_row(b, h, p),
                                                           view.k_scale(h), view.head_dim, in.scale, in.lse(q, i),
                                                           in.base);
                              });
        });
  }

  /// Key-norm prefill (key_norms): position p scores -||k|| of its key in slot p.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const key_norms<T, Layout>& in) {
    const site w = where("prefill");
    require_prompt(w, b, length, in.cache);
    require_replacing_decay(w, "key_norms", rule().victim == victim_rule::lowest_score, rule().decay);
    return run_one(
        w, b, length,
        [&](const prompt_lengths& prompts, std::int32_t* pages, std::uint64_t* status) {
          run_prefill(state(), active_set::of_list(&b, 1), prompts, in, pages, status);
        },
        [&](std::int32_t h, std::int32_t p) {
          const float score = key_norm_score(in.cache.k_row(b, h, p), in.cache.head_dim, in.cache.k_scale(h));
          require_finite(w, "-||cache.k||", score, h, p);
        });
  }

 protected:
  using sequence_observe::sequence_observe;

  /// A prefill starts a sequence: b in range, length in [1, capacity], b empty.
  void require_prefill(const site& w, std::int32_t b, std::int32_t length) const {
    require_index(w, "sequence", b, shape_.num_seqs);
    if (length < 1 || length > shape_.capacity)
      fail<out_of_range>(w, "length", "= ", length, " is outside [1, capacity = ", shape_.capacity, "]");
    if (slots().length(b) != 0)
      fail_state<state_error>(w, "sequence ", b, " already holds ", slots().length(b),
                              " tokens; prefill starts a sequence (reset it first)");
  }

  /// require_prefill, a usable view, and the prompt's rows in it: every row
  /// inside the view and, paged, pages in the pool and distinct (rows move).
  template <class T, class Layout>
  void require_prompt(const site& w, std::int32_t b, std::int32_t length, const kv_view<T, Layout>& view) const {
    require_prefill(w, b, length);
    require_policy_view(w, shape_, view);
    require_rows(w, view, b, length, all_columns());
    require_distinct_pages(w, view, b, length);
  }

  void require_sums(const site& w, const prefill_column_sums& in, std::int32_t length) const {
    const std::int32_t expected[2] = {shape_.num_q_heads, length};
    const bool at_least[2] = {false, true};
    require_extents(w, "sums", in.sums, expected, at_least);
  }

  /// Names the refused column p of KV head h of column sums.
  [[noreturn]] void fail_sums(const site& w, const prefill_column_sums& in, std::int32_t h, std::int32_t p) const {
    const std::int32_t g = shape_.group_size();
    for (std::int32_t q = h * g; q < (h + 1) * g; ++q) require_probability(w, "sums", in.sums(q, p), q, p);
    fail<non_finite_error>(w, concat("sums[", h * g, "..", (h + 1) * g - 1, "][", p, "]"),
                           "overflows when reduced over the query heads of KV head ", h);
  }

  /// run(prompts, reclaimable_pages, status), the batched prefill of
  /// sequence b alone; a refusal goes to fail_prefill with `column`.
  template <class Run, class Column>
  prefill_result run_one(const site& w, std::int32_t b, std::int32_t length, Run run, Column column) {
    std::vector<std::int32_t> lengths(std::size_t(shape_.num_seqs), 0), pages(lengths.size(), 0);
    lengths[std::size_t(b)] = length;
    std::uint64_t status = batch_status_clear;
    run(prompt_lengths{lengths.data(), length}, pages.data(), &status);
    if (status != batch_status_clear) fail_prefill(w, status, column);
    forget_step(b);
    prefill_result result;
    result.kept = std::min(length, rule().budget);
    result.reclaimable_pages = pages[std::size_t(b)];
    return result;
  }
};

}  // namespace detail
}  // namespace kvevict
