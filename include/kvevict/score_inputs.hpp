#pragma once
// What an engine can hand a policy to score its tokens (docs/semantics.md,
// "Scores"): one small struct of views per input, so a call site states
// what it passes. Each input is written once, in two forms:
//
//   - input_form::sequence, for the per-sequence policies (h2o_policy, ...):
//     the views of one sequence (decode_probs, prefill_probs, ...);
//   - input_form::batch, for the batched calls and the CUDA launchers: the
//     same views with a leading [num_seqs] dimension (batch_probs, ...).
//
// as_batch turns a per-sequence input into the batched one without a copy
// (a sequence dimension of stride 0), which is how the per-sequence
// policies run the batched backend.
//
// Query heads map to KV heads in groups: query head q belongs to KV head
// q / (num_q_heads / num_kv_heads), as in every GQA implementation. All
// structs are trivially copyable; on CUDA the views point to device memory.
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvevict {

/// How the query heads of one GQA group combine into one KV head's score.
enum class group_reduce { sum, mean, max };

/// Base of a log-sum-exp: FlashAttention returns natural-log LSE, FlashInfer
/// returns it in base 2.
enum class lse_base { natural, base2 };

/// Whether an input holds one sequence or the batch ([num_seqs] first).
enum class input_form : int { sequence = 0, batch = 1 };

/// A read-only view of Rank dimensions per sequence, in the given form.
template <class T, int Rank, input_form Form>
using input_view = tensor_view<const T, Rank + static_cast<int>(Form)>;

// ---- decode: one step's attention ----
// Slot dimensions may be wider than needed: a call reads the occupied slots
// [0, count) of each (sequence, KV head) only, and refuses a head whose
// count exceeds the input's slot dimension. Columns of free slots are
// ignored.

/// Materialised attention: probs(q, s) is query head q's softmax weight on
/// slot s of its KV head, [num_q_heads][slots].
template <input_form Form>
struct basic_probs {
  input_view<float, 2, Form> probs;
};

/// Per-KV-head increments the engine reduced itself, [num_kv_heads][slots].
template <input_form Form>
struct basic_head_scores {
  input_view<float, 2, Form> scores;
};

/// A fused attention kernel that also writes its logits (one float per
/// slot, the cheapest input after probabilities): prob = exp(logits(q, s) *
/// scale - lse(q)), no K re-read. logits [num_q_heads][slots], lse [num_q_heads].
template <input_form Form>
struct basic_logits {
  input_view<float, 2, Form> logits;
  input_view<float, 1, Form> lse;
  float scale = 1.0f;
  lse_base base = lse_base::natural;
};

/// Fused attention: the query rows and the LSE the kernel returned; kvevict
/// recomputes prob = exp(q . k_s * scale - lse) from the cached keys.
/// q [num_q_heads][head_dim], lse [num_q_heads].
template <class Q, input_form Form>
struct basic_queries {
  input_view<Q, 2, Form> q;
  input_view<float, 1, Form> lse;
  float scale = 1.0f;
  lse_base base = lse_base::natural;
};

/// Key-norm scores (no attention input): each occupied slot's score becomes
/// -||k||_2 of its cached key row in `cache` (key_norm_score,
/// decode_rules.hpp), so the lowest-score victim is the key of the largest
/// norm and the policy keeps the smallest. The score replaces the old one
/// every step: a rule that evicts by score takes it only with decay 0
/// (key_norm_config). At prefill, position p scores the key in slot p. One
/// form: a kv_view has the sequence dimension.
template <class T, class Layout>
struct key_norms {
  kv_view<T, Layout> cache;
};

/// KeyDiff's input (key_diff.hpp): the cached keys themselves. One form, as
/// key_norms.
template <class T, class Layout>
struct key_diff {
  kv_view<T, Layout> cache;
};

// ---- prefill: a prompt's attention (position p sits in slot p) ----
// Batched, the row and column dimensions are at least prompts.max_length.

/// Materialised causal attention: probs(q, i, p) for query row i and key
/// position p <= i, [num_q_heads][>= L][>= L]. Entries above the diagonal
/// are ignored. The score of position p is the sum over i >= p.
template <input_form Form>
struct basic_prefill_probs {
  input_view<float, 3, Form> probs;
};

/// Column sums the engine computed: sums(q, p) = sum over i >= p of
/// probs(q, i, p), [num_q_heads][>= L].
template <input_form Form>
struct basic_prefill_sums {
  input_view<float, 2, Form> sums;
};

/// Fused attention: every prompt row's query and LSE; the probabilities are
/// recomputed from the cached keys. q [num_q_heads][>= L][head_dim], lse
/// [num_q_heads][>= L].
template <class Q, input_form Form>
struct basic_prefill_queries {
  input_view<Q, 3, Form> q;
  input_view<float, 2, Form> lse;
  float scale = 1.0f;
  lse_base base = lse_base::natural;
};

// ---- SnapKV's observation window (policy/snapkv.hpp) ----

/// How SnapKV pools the window sums along positions.
enum class snap_pooling : std::uint8_t {
  max = 0,   ///< the SnapKV paper's
  mean = 1,  ///< kvpress's SnapKVPress
};

/// SnapKV's parameters. The presets are the published defaults.
struct snap_window {
  std::int32_t window = 32;      ///< observation rows: the last `window` prompt rows; always kept
  std::int32_t pool_width = 7;   ///< odd: a position pools over pool_width / 2 neighbours on each side
  snap_pooling pooling = snap_pooling::max;

  /// The SnapKV paper's defaults: w = 32, max pooling of width 7.
  static constexpr snap_window paper() noexcept { return {32, 7, snap_pooling::max}; }
  /// kvpress's SnapKVPress defaults: w = 64, mean pooling of width 5.
  static constexpr snap_window kvpress() noexcept { return {64, 5, snap_pooling::mean}; }
};

// Window row r is prompt row L - window + r; its columns above the row
// (p > L - window + r, not yet written when it attended) are ignored.

/// The window rows' probabilities: probs(q, r, p), [num_q_heads][window][>= L].
template <input_form Form>
struct basic_window_probs {
  input_view<float, 3, Form> probs;
  snap_window snap;
};

/// The window rows' logits: prob = exp(logits(q, r, p) * scale - lse(q, r))
/// (probability_from_logit). logits [num_q_heads][window][>= L], lse
/// [num_q_heads][window].
template <input_form Form>
struct basic_window_logits {
  input_view<float, 3, Form> logits;
  input_view<float, 2, Form> lse;
  float scale = 1.0f;
  lse_base base = lse_base::natural;
  snap_window snap;
};

/// The window rows' queries and LSE, the probabilities recomputed from the
/// cached keys. q [num_q_heads][window][head_dim], lse [num_q_heads][window].
template <class Q, input_form Form>
struct basic_window_queries {
  input_view<Q, 3, Form> q;
  input_view<float, 2, Form> lse;
  float scale = 1.0f;
  lse_base base = lse_base::natural;
  snap_window snap;
};

// ---- the names of the two forms ----

using decode_probs = basic_probs<input_form::sequence>;
using batch_probs = basic_probs<input_form::batch>;
using head_scores = basic_head_scores<input_form::sequence>;
using batch_head_scores = basic_head_scores<input_form::batch>;
using decode_logits = basic_logits<input_form::sequence>;
using batch_logits = basic_logits<input_form::batch>;
template <class Q>
using decode_queries = basic_queries<Q, input_form::sequence>;
template <class Q>
using batch_queries = basic_queries<Q, input_form::batch>;
using prefill_probs = basic_prefill_probs<input_form::sequence>;
using batch_prefill_probs = basic_prefill_probs<input_form::batch>;
using prefill_column_sums = basic_prefill_sums<input_form::sequence>;
using batch_prefill_sums = basic_prefill_sums<input_form::batch>;
template <class Q>
using prefill_queries = basic_prefill_queries<Q, input_form::sequence>;
template <class Q>
using batch_prefill_queries = basic_prefill_queries<Q, input_form::batch>;
using window_probs = basic_window_probs<input_form::sequence>;
using batch_window_probs = basic_window_probs<input_form::batch>;
using window_logits = basic_window_logits<input_form::sequence>;
using batch_window_logits = basic_window_logits<input_form::batch>;
template <class Q>
using window_queries = basic_window_queries<Q, input_form::sequence>;
template <class Q>
using batch_window_queries = basic_window_queries<Q, input_form::batch>;

static_assert(std::is_trivially_copyable_v<batch_logits>, "inputs go to kernels by value");
static_assert(std::is_trivially_copyable_v<batch_queries<float>>, "inputs go to kernels by value");
static_assert(std::is_trivially_copyable_v<batch_prefill_queries<float>>, "inputs go to kernels by value");
static_assert(std::is_trivially_copyable_v<batch_window_logits>, "inputs go to kernels by value");

// ---- one sequence as the batch ----

namespace detail {

/// `v` with a leading dimension of `num_seqs` and stride 0: every sequence
/// reads v. Only the per-sequence calls make these, after checking v, and
/// only for calls that step one sequence.
template <class T, int Rank>
tensor_view<T, Rank + 1> broadcast_sequences(const tensor_view<T, Rank>& v, std::int32_t num_seqs) noexcept {
  tensor_view<T, Rank + 1> out;
  out.data = v.data;
  out.extents[0] = num_seqs;
  out.strides[0] = 0;
  for (int d = 0; d < Rank; ++d) {
    out.extents[d + 1] = v.extents[d];
    out.strides[d + 1] = v.strides[d];
  }
  return out;
}

}  // namespace detail

/// The batched input whose every sequence reads the per-sequence input
/// `in` (no copy): for a call that steps one sequence of a batched state.
inline batch_probs as_batch(const decode_probs& in, std::int32_t num_seqs) noexcept {
  return {detail::broadcast_sequences(in.probs, num_seqs)};
}
inline batch_head_scores as_batch(const head_scores& in, std::int32_t num_seqs) noexcept {
  return {detail::broadcast_sequences(in.scores, num_seqs)};
}
inline batch_logits as_batch(const decode_logits& in, std::int32_t num_seqs) noexcept {
  return {detail::broadcast_sequences(in.logits, num_seqs), detail::broadcast_sequences(in.lse, num_seqs), in.scale,
          in.base};
}
template <class Q>
batch_queries<Q> as_batch(const decode_queries<Q>& in, std::int32_t num_seqs) noexcept {
  return {detail::broadcast_sequences(in.q, num_seqs), detail::broadcast_sequences(in.lse, num_seqs), in.scale,
          in.base};
}
inline batch_prefill_probs as_batch(const prefill_probs& in, std::int32_t num_seqs) noexcept {
  return {detail::broadcast_sequences(in.probs, num_seqs)};
}
inline batch_prefill_sums as_batch(const prefill_column_sums& in, std::int32_t num_seqs) noexcept {
  return {detail::broadcast_sequences(in.sums, num_seqs)};
}
template <class Q>
batch_prefill_queries<Q> as_batch(const prefill_queries<Q>& in, std::int32_t num_seqs) noexcept {
  return {detail::broadcast_sequences(in.q, num_seqs), detail::broadcast_sequences(in.lse, num_seqs), in.scale,
          in.base};
}
inline batch_window_probs as_batch(const window_probs& in, std::int32_t num_seqs) noexcept {
  return {detail::broadcast_sequences(in.probs, num_seqs), in.snap};
}
inline batch_window_logits as_batch(const window_logits& in, std::int32_t num_seqs) noexcept {
  return {detail::broadcast_sequences(in.logits, num_seqs), detail::broadcast_sequences(in.lse, num_seqs), in.scale,
          in.base, in.snap};
}
template <class Q>
batch_window_queries<Q> as_batch(const window_queries<Q>& in, std::int32_t num_seqs) noexcept {
  return {detail::broadcast_sequences(in.q, num_seqs), detail::broadcast_sequences(in.lse, num_seqs), in.scale,
          in.base, in.snap};
}

}  // namespace kvevict
