#pragma once
// One transformer layer's KV cache under one kvevict policy: this is where
// the engine embeds the library. Each decode step of a sequence runs the
// cycle of docs/semantics.md: next slot, write K/V, attention that yields
// probabilities, observe, evict.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <kvevict/kvevict.hpp>

#include "tinyllm/attention_record.hpp"
#include "tinyllm/kernels.hpp"
#include "tinyllm/numerics.hpp"

namespace tinyllm {

/// h2o covers the decayed rules too (decay 0: TOVA); key_norm and key_diff
/// are h2o observed through key norms and KeyDiff's cosines; lookahead and
/// topk are the evaluation's oracles (attention_record.hpp,
/// docs/fidelity.md), not library policies. h2o, key_norm and key_diff keep
/// H2O's split: the newest budget / 2 tokens, the rest by score.
enum class policy_kind { full, h2o, recent_window, random, exact_greedy, key_norm, key_diff, lookahead, topk };

/// Prompt compression (prefill): the first prompt_length tokens of a
/// sequence (set_prompt) are processed with every prompt key in the cache,
/// then the library's prefill call scores them and keeps the budget.
enum class prefill_kind { none, attention, snapkv, key_diff, key_norm, recent };

/// How attention scores reach the policy: the probabilities the attention
/// computed, or (as a FlashAttention-style kernel would) the queries and the
/// log-sum-exp, from which kvevict recomputes them. exact_greedy always uses
/// the queries.
enum class score_source { probs, lse };

/// A policy and its budget. `full` keeps every token (budget ignored).
struct policy_spec {
  policy_kind kind = policy_kind::full;
  std::int32_t budget = 0;  ///< tokens kept between steps
  std::int32_t sinks = 0;   ///< first positions always kept (not by full, lookahead, topk)
  std::uint64_t seed = 0;   ///< random
  std::int32_t recent = 0;  ///< random, exact_greedy: newest positions always kept
  score_source source = score_source::probs;
  float decay = 1.0f;       ///< h2o: 1 accumulates (H2O), 0 is TOVA, between a moving attention
  prefill_kind prefill = prefill_kind::none;
  std::int32_t snap_window = 32;  ///< prefill snapkv: observation rows (max pooling of width 7)
  std::int32_t horizon = 0;       ///< lookahead: future queries summed (0: every recorded one)
};

/// The library's configuration of a spec, one function per policy class, so
/// that another engine embedding the same specs (integrations/llama.cpp)
/// makes the same decisions. h2o, key_norm and key_diff keep H2O's split (the
/// newest budget / 2, the rest by score); lookahead has no protection.
inline kvevict::h2o_config h2o_config_of(const policy_spec& spec) {
  const std::int32_t recent = spec.budget / 2;
  switch (spec.kind) {
    case policy_kind::key_norm:
    case policy_kind::key_diff:  // both replace the score each step (decay 0)
      return kvevict::key_norm_config(spec.budget - recent - spec.sinks, recent, spec.sinks);
    case policy_kind::lookahead:  // the future decides alone
      return kvevict::tova_config(spec.budget, 0, 0, kvevict::group_reduce::sum);
    default: {
      kvevict::h2o_config c;
      c.heavy = spec.budget - recent - spec.sinks;
      c.recent = recent;
      c.sinks = spec.sinks;
      c.decay = spec.decay;
      return c;
    }
  }
}
inline kvevict::recent_window_config recent_window_config_of(const policy_spec& spec) {
  return {spec.sinks, spec.budget - spec.sinks};
}
inline kvevict::random_config random_config_of(const policy_spec& spec) {
  return {spec.budget, spec.sinks, spec.recent, spec.seed};
}
inline kvevict::exact_greedy_config exact_greedy_config_of(const policy_spec& spec) {
  kvevict::exact_greedy_config c;
  c.budget = spec.budget;
  c.recent = spec.recent;
  c.sinks = spec.sinks;
  return c;
}

/// The cache of one layer for a group of sequences that share a policy.
class layer_cache {
 public:
  using policy_variant = std::variant<kvevict::h2o_policy, kvevict::recent_window_policy, kvevict::random_policy,
                                      kvevict::exact_greedy_policy>;

  /// max_tokens: the longest sequence the full cache must hold. f16: round
  /// K/V, queries and attention weights to half precision (numerics.hpp).
  /// layer: this cache's layer, for the attention records.
  layer_cache(const policy_spec& spec, std::int32_t num_seqs, std::int32_t num_kv_heads, std::int32_t num_q_heads,
              std::int32_t head_dim, std::int32_t max_tokens, bool f16 = false, std::int32_t layer = 0)
      : spec_(spec),
        f16_(f16),
        layer_(layer),
        policy_(make_policy(spec, {num_seqs, num_kv_heads, num_q_heads, capacity_for(spec, max_tokens)})),
        cache_(kvevict::make_bhsd_cache<float>(num_seqs, num_kv_heads, capacity_for(spec, max_tokens), head_dim)),
        probs_(std::size_t(num_q_heads) * std::size_t(cache_.capacity())),
        lse_(std::size_t(num_q_heads)),
        logits_(std::size_t(cache_.capacity())),
        rounded_(std::size_t(num_q_heads + 2 * num_kv_heads) * std::size_t(head_dim)),
        mass_(std::size_t(num_kv_heads) * std::size_t(cache_.capacity())),
        occupied_(std::size_t(cache_.capacity())),
        prompt_(std::size_t(num_seqs)),
        records_(std::size_t(num_seqs), nullptr),
        futures_(std::size_t(num_seqs), nullptr) {
    if (num_kv_heads > max_kv_heads)
      throw kvevict::invalid_argument("layer_cache: num_kv_heads = " + std::to_string(num_kv_heads) + " exceeds " +
                                      std::to_string(max_kv_heads));
  }

  const policy_variant& policy() const noexcept { return policy_; }

  /// Sequence b's first `length` tokens are a prompt to compress with the
  /// spec's prefill kind (before b is fed anything).
  void set_prompt(std::int32_t b, std::int32_t length) {
    if (spec_.prefill == prefill_kind::none) throw kvevict::invalid_argument("layer_cache: the spec has no prefill");
    if (length < 1 || length > cache_.capacity())
      throw kvevict::invalid_argument("layer_cache: a prompt of " + std::to_string(length) +
                                      " tokens does not fit the capacity " + std::to_string(cache_.capacity()));
    prompt_state& ps = prompt_[std::size_t(b)];
    ps.length = length;
    const std::size_t row = std::size_t(cache_.capacity()), q_heads = lse_.size();
    if (spec_.prefill == prefill_kind::attention) ps.sums.assign(q_heads * row, 0.0f);
    if (spec_.prefill == prefill_kind::snapkv) ps.window.assign(q_heads * std::size_t(spec_.snap_window) * row, 0.0f);
  }
  /// The full cache records sequence b's attention into `r` (layer `layer`).
  void set_record(std::int32_t b, attention_record* r) { records_.at(std::size_t(b)) = r; }
  /// The look-ahead oracle reads sequence b's future attention from `r`.
  void set_future(std::int32_t b, const attention_record* r) { futures_.at(std::size_t(b)) = r; }

  /// One decode step of sequence b. k, v: the new token's rows [kv_heads][head_dim]
  /// with RoPE applied to k; q: [q_heads][head_dim] with RoPE applied.
  /// Writes the attention output [q_heads][head_dim] to out.
  void decode(std::int32_t b, const float* q, const float* k, const float* v, float* out) {
    std::visit([&](auto& policy) { decode(policy, b, q, k, v, out); }, policy_);
  }

 private:
  struct prompt_state {
    std::int32_t length = 0, fed = 0;
    std::vector<float> sums;    // attention: decayed column sums [Hq][capacity]
    std::vector<float> window;  // snapkv: the last rows' probabilities [Hq][window][capacity]
  };

  static std::int32_t capacity_for(const policy_spec& spec, std::int32_t max_tokens) {
    // the full cache, the revocable top-k and a prompt to compress need room
    // for every token; a decode-time policy only its budget + the spare slot
    const bool all = spec.kind == policy_kind::full || spec.kind == policy_kind::topk || spec.prefill != prefill_kind::none;
    return all ? std::max(max_tokens, spec.budget) + 1 : spec.budget + 1;
  }

  static policy_variant make_policy(const policy_spec& spec, const kvevict::policy_shape& shape) {
    switch (spec.kind) {
      case policy_kind::full:  // a window that never fills: nothing is ever evicted
      case policy_kind::topk:  // keeps everything; attention picks its keys each step
        return kvevict::recent_window_policy(shape, {0, shape.capacity - 1});
      case policy_kind::h2o:
      case policy_kind::key_norm:
      case policy_kind::key_diff:
      case policy_kind::lookahead:
        return kvevict::h2o_policy(shape, h2o_config_of(spec));
      case policy_kind::recent_window:
        return kvevict::recent_window_policy(shape, recent_window_config_of(spec));
      case policy_kind::random:
        return kvevict::random_policy(shape, random_config_of(spec));
      case policy_kind::exact_greedy:
        return kvevict::exact_greedy_policy(shape, exact_greedy_config_of(spec));
    }
    throw kvevict::invalid_argument("layer_cache: unknown policy kind");
  }

  // Softmax of query head qh over the n slots in occupied_; probabilities
  // into probs_ (zero elsewhere), log-sum-exp into lse_.
  void attend_head(const float* qrow, std::int32_t qh, std::int32_t b, std::int32_t h, std::int32_t n, float scale,
                   std::int32_t d) {
    const auto view = cache_.view();
    const std::int32_t cap = view.capacity;
    float* p = probs_.data() + std::size_t(qh) * cap;
    std::fill_n(p, cap, 0.0f);
    float* logits = logits_.data();
    for (std::int32_t i = 0; i < n; ++i) logits[i] = dot(qrow, view.k_row(b, h, occupied_[std::size_t(i)]), d) * scale;
    lse_[std::size_t(qh)] = softmax(logits, n);
    for (std::int32_t i = 0; i < n; ++i) p[occupied_[std::size_t(i)]] = logits[i];
  }

  // The revocable top-k oracle: KV head h keeps, for this step only, the
  // budget + 1 slots of the highest attention summed over its group (as
  // many keys as a policy attends to), and its queries renormalise over them.
  void keep_top(std::int32_t h, std::int32_t group, std::int32_t n, std::int32_t cap) {
    const std::int32_t keep = spec_.budget + 1;
    if (n <= keep) return;
    float* sum = mass_.data();
    for (std::int32_t i = 0; i < n; ++i) {
      const std::int32_t s = occupied_[std::size_t(i)];
      sum[s] = 0.0f;
      for (std::int32_t j = 0; j < group; ++j) sum[s] += probs_[std::size_t(h * group + j) * cap + s];
    }
    std::vector<std::int32_t>& order = order_;
    order.assign(occupied_.begin(), occupied_.begin() + n);
    std::nth_element(order.begin(), order.begin() + keep, order.end(), [sum](std::int32_t x, std::int32_t y) {
      return sum[x] > sum[y] || (sum[x] == sum[y] && x > y);  // ties keep the newer slot
    });
    for (std::int32_t j = 0; j < group; ++j) {
      float* p = probs_.data() + std::size_t(h * group + j) * cap;
      for (auto it = order.begin() + keep; it != order.end(); ++it) p[*it] = 0.0f;
      double total = 0.0;
      for (std::int32_t i = 0; i < n; ++i) total += p[occupied_[std::size_t(i)]];
      const float inv = static_cast<float>(1.0 / total);
      for (std::int32_t i = 0; i < n; ++i) p[occupied_[std::size_t(i)]] *= inv;
    }
  }

  // Group-summed probabilities of KV head h by position, into the record.
  void record_row(attention_record& r, const std::int32_t* pos, std::int32_t h, std::int32_t group, std::int32_t n,
                  std::int32_t t, std::int32_t cap) {
    row_.assign(std::size_t(t) + 1, 0.0f);
    for (std::int32_t i = 0; i < n; ++i) {
      const std::int32_t s = occupied_[std::size_t(i)];
      for (std::int32_t j = 0; j < group; ++j) row_[std::size_t(pos[s])] += probs_[std::size_t(h * group + j) * cap + s];
    }
    r.write_row(layer_, h, t, row_.data());
  }

  template <class Policy>
  void decode(Policy& policy, std::int32_t b, const float* q, const float* k, const float* v, float* out) {
    using kvevict::make_tensor_view;
    const auto view = cache_.view();
    const kvevict::policy_shape& shape = policy.shape();
    const std::int32_t heads = shape.num_kv_heads, q_heads = shape.num_q_heads, d = view.head_dim;
    const std::int32_t group = shape.group_size(), cap = view.capacity;

    if (f16_) {  // what an f16 KV cache stores and what its matmuls read
      float* r = rounded_.data();
      std::copy_n(q, std::size_t(q_heads) * d, r);
      std::copy_n(k, std::size_t(heads) * d, r + std::size_t(q_heads) * d);
      std::copy_n(v, std::size_t(heads) * d, r + std::size_t(q_heads + heads) * d);
      round_to_half(r, std::int64_t(q_heads + 2 * heads) * d);
      q = r;
      k = r + std::size_t(q_heads) * d;
      v = r + std::size_t(q_heads + heads) * d;
    }
    prompt_state& ps = prompt_[std::size_t(b)];
    const bool in_prompt = ps.fed < ps.length;

    // 1-2. the new token's slot, then its K/V rows; a prompt to compress
    // puts position p in slot p and leaves the policy untouched until prefill
    std::int32_t slots[max_kv_heads] = {};
    for (std::int32_t h = 0; h < heads; ++h) slots[h] = in_prompt ? ps.fed : policy.next_slot(b, h);
    kvevict::scatter(view, b, slots, make_tensor_view<const float>(k, heads, d),
                     make_tensor_view<const float>(v, heads, d));
    if (!in_prompt) policy.append(b);
    const std::int32_t t = in_prompt ? ps.fed : policy.slots().length(b) - 1;  // the new token's position

    // 3. attention over the occupied slots, keeping the probabilities
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (std::int32_t h = 0; h < heads; ++h) {
      const std::int32_t* pos = in_prompt ? nullptr : policy.slots().positions_of(b, h);
      std::int32_t n = 0;
      for (std::int32_t s = 0; s < cap; ++s)
        if (in_prompt ? s <= t : pos[s] >= 0) occupied_[std::size_t(n++)] = s;
      for (std::int32_t j = 0; j < group; ++j) attend_head(q + std::size_t(h * group + j) * d, h * group + j, b, h, n, scale, d);
      if (spec_.kind == policy_kind::topk) keep_top(h, group, n, cap);
      if (attention_record* r = records_[std::size_t(b)]) record_row(*r, in_prompt ? identity(cap) : pos, h, group, n, t, cap);
      for (std::int32_t j = 0; j < group; ++j) {
        const std::int32_t qh = h * group + j;
        const float* p = probs_.data() + std::size_t(qh) * cap;
        float* o = out + std::size_t(qh) * d;
        std::fill_n(o, d, 0.0f);
        for (std::int32_t i = 0; i < n; ++i) {
          const std::int32_t s = occupied_[std::size_t(i)];
          if (p[s] != 0.0f || spec_.kind != policy_kind::topk) axpy(f16_ ? round_to_half(p[s]) : p[s], view.v_row(b, h, s), o, d);
        }
      }
    }
    if (in_prompt) return prompt_step(policy, b, ps);

    // 4. scores
    const kvevict::decode_queries<float> queries{make_tensor_view<const float>(q, q_heads, d),
                                                 make_tensor_view<const float>(lse_.data(), q_heads), scale};
    constexpr bool needs_queries = std::is_same_v<Policy, kvevict::exact_greedy_policy>;
    if constexpr (std::is_same_v<Policy, kvevict::h2o_policy>) {
      if (spec_.kind == policy_kind::key_norm) return observe_evict(policy, b, kvevict::key_norms<float, kvevict::strided_layout>{view});
      if (spec_.kind == policy_kind::key_diff) return observe_evict(policy, b, kvevict::key_diff<float, kvevict::strided_layout>{view});
      if (spec_.kind == policy_kind::lookahead) {
        const attention_record* future = futures_[std::size_t(b)];
        if (!future) throw kvevict::invalid_argument("layer_cache: lookahead needs set_future");
        std::fill(mass_.begin(), mass_.end(), 0.0f);
        for (std::int32_t h = 0; h < heads; ++h) {
          const std::int32_t* pos = policy.slots().positions_of(b, h);
          for (std::int32_t s = 0; s < cap; ++s)
            if (pos[s] >= 0) mass_[std::size_t(h) * cap + s] = future->future_mass(layer_, h, pos[s], t, spec_.horizon);
        }
        return observe_evict(policy, b, kvevict::head_scores{make_tensor_view<const float>(mass_.data(), heads, cap)});
      }
    }
    if (needs_queries || spec_.source == score_source::lse) {
      policy.observe(b, queries, view);
    } else if constexpr (!needs_queries) {  // exact_greedy has no probability overload
      policy.observe(b, kvevict::decode_probs{make_tensor_view<const float>(probs_.data(), q_heads, cap)});
    }
    // 5. back to the budget
    policy.evict(b);
  }

  template <class Policy, class Input>
  static void observe_evict(Policy& policy, std::int32_t b, const Input& in) {
    policy.observe(b, in);
    policy.evict(b);
  }

  // A prompt token's scores: the decayed column sums or SnapKV's window rows;
  // after the last one, the library's prefill scores and compacts the prompt.
  template <class Policy>
  void prompt_step(Policy& policy, std::int32_t b, prompt_state& ps) {
    using kvevict::make_tensor_view;
    const auto view = cache_.view();
    const std::int32_t q_heads = policy.shape().num_q_heads, cap = view.capacity, t = ps.fed, L = ps.length;
    if (spec_.prefill == prefill_kind::attention)
      for (std::int32_t qh = 0; qh < q_heads; ++qh) {
        float* c = ps.sums.data() + std::size_t(qh) * cap;
        const float* p = probs_.data() + std::size_t(qh) * cap;
        for (std::int32_t s = 0; s <= t; ++s) c[s] = spec_.decay == 1.0f ? c[s] + p[s] : spec_.decay * c[s] + p[s];
      }
    const std::int32_t w = spec_.snap_window, row = t - (L - w);
    if (spec_.prefill == prefill_kind::snapkv && row >= 0)
      for (std::int32_t qh = 0; qh < q_heads; ++qh)
        std::copy_n(probs_.data() + std::size_t(qh) * cap, t + 1,
                    ps.window.data() + (std::size_t(qh) * w + std::size_t(row)) * cap);
    if (++ps.fed < L) return;
    if constexpr (std::is_same_v<Policy, kvevict::h2o_policy>) {
      switch (spec_.prefill) {
        case prefill_kind::attention:
          policy.prefill(b, L, kvevict::prefill_column_sums{make_tensor_view<const float>(ps.sums.data(), q_heads, cap)}, view);
          return;
        case prefill_kind::snapkv:
          policy.prefill(b, L,
                         kvevict::window_probs{make_tensor_view<const float>(ps.window.data(), q_heads, w, cap),
                                               kvevict::snap_window{w, 7, kvevict::snap_pooling::max}},
                         view);
          return;
        case prefill_kind::key_diff:
          policy.prefill(b, L, kvevict::key_diff<float, kvevict::strided_layout>{view});
          return;
        case prefill_kind::key_norm:
          policy.prefill(b, L, kvevict::key_norms<float, kvevict::strided_layout>{view});
          return;
        default:
          break;
      }
    }
    if constexpr (std::is_same_v<Policy, kvevict::recent_window_policy>) {
      if (spec_.prefill == prefill_kind::recent) {
        policy.prefill(b, L, view);
        return;
      }
    }
    throw kvevict::invalid_argument("layer_cache: this prefill kind does not fit the policy kind");
  }

  const std::int32_t* identity(std::int32_t n) {
    if (std::int32_t(identity_.size()) < n) {
      identity_.resize(std::size_t(n));
      for (std::int32_t i = 0; i < n; ++i) identity_[std::size_t(i)] = i;
    }
    return identity_.data();
  }

  static constexpr std::int32_t max_kv_heads = 64;

  policy_spec spec_;
  bool f16_;
  std::int32_t layer_;
  policy_variant policy_;
  kvevict::kv_cache<float, kvevict::strided_layout> cache_;
  std::vector<float> probs_, lse_, logits_, rounded_, mass_, row_;
  std::vector<std::int32_t> occupied_, order_, identity_;
  std::vector<prompt_state> prompt_;
  std::vector<attention_record*> records_;
  std::vector<const attention_record*> futures_;
};

}  // namespace tinyllm
