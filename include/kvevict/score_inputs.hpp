#pragma once
// What an engine can hand a policy to update its scores (docs/semantics.md,
// "Scores"). Each is a small tagged struct of views, so one `observe` /
// `prefill` overload per source keeps call sites explicit about what they
// pass.
//
// Query heads map to KV heads in groups: query head q belongs to KV head
// q / (num_q_heads / num_kv_heads), as in every GQA implementation.
#include <cstdint>

#include "kvevict/kv_view.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvevict {

/// How the query heads of one GQA group combine into one KV head's score.
enum class group_reduce { sum, mean, max };

/// Base of a log-sum-exp: FlashAttention returns natural-log LSE, FlashInfer
/// returns it in base 2.
enum class lse_base { natural, base2 };

/// Decode step, materialised attention: probs(q, s) is query head q's softmax
/// weight on slot s of its KV head, [num_q_heads][>= highest occupied slot + 1].
/// Columns of free slots are ignored.
struct decode_probs {
  tensor_view<const float, 2> probs;
};

/// Decode step, per-KV-head increments already reduced by the engine,
/// [num_kv_heads][>= highest occupied slot + 1].
struct head_scores {
  tensor_view<const float, 2> scores;
};

/// Decode step, fused attention that also writes its logits (one float per
/// slot, the cheapest input after probabilities): prob = exp(logits(q, s) *
/// scale - lse(q)), no K re-read. logits: [num_q_heads][>= highest occupied
/// slot + 1], lse: [num_q_heads]. Columns of free slots are ignored.
struct decode_logits {
  tensor_view<const float, 2> logits;
  tensor_view<const float, 1> lse;
  float scale = 1.0f;
  lse_base base = lse_base::natural;
};

/// Decode step, fused attention: the query rows and the LSE the kernel
/// returned; kvevict recomputes prob = exp(q . k_s * scale - lse) from the
/// cached keys. q: [num_q_heads][head_dim], lse: [num_q_heads].
template <class Q>
struct decode_queries {
  tensor_view<const Q, 2> q;
  tensor_view<const float, 1> lse;
  float scale = 1.0f;
  lse_base base = lse_base::natural;
};

/// Decode step, key-norm scores (no attention input): each occupied slot's
/// score becomes -||k||_2 of its cached key row in `cache` (key_norm_score,
/// decode_rules.hpp), so the lowest-score victim is the key of the largest
/// norm and the policy keeps the smallest. The score is recomputed every
/// step and replaces the old one: a rule that evicts by score takes it only
/// with decay 0 (key_norm_config). The per-sequence observe and the
/// batched calls take the same struct (a kv_view has the sequence
/// dimension).
template <class T, class Layout>
struct key_norms {
  kv_view<T, Layout> cache;
};

/// Prefill, materialised causal attention: probs(q, i, p) for query row i and
/// key position p <= i, [num_q_heads][L][L]. Entries above the diagonal are
/// ignored. The score of position p is sum over i >= p of probs(q, i, p).
struct prefill_probs {
  tensor_view<const float, 3> probs;
};

/// Prefill, column sums the engine computed: sums(q, p) = sum over i >= p of
/// probs(q, i, p), [num_q_heads][L].
struct prefill_column_sums {
  tensor_view<const float, 2> sums;
};

/// Prefill, fused attention: every prompt row's query and LSE.
/// q: [num_q_heads][L][head_dim], lse: [num_q_heads][L].
template <class Q>
struct prefill_queries {
  tensor_view<const Q, 3> q;
  tensor_view<const float, 2> lse;
  float scale = 1.0f;
  lse_base base = lse_base::natural;
};

}  // namespace kvevict
