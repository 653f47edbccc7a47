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

#include "tinyllm/kernels.hpp"
#include "tinyllm/numerics.hpp"

namespace tinyllm {

enum class policy_kind { full, h2o, recent_window, random, exact_greedy };

/// How attention scores reach the policy: the probabilities the attention
/// computed, or (as a FlashAttention-style kernel would) the queries and the
/// log-sum-exp, from which kvevict recomputes them. exact_greedy always uses
/// the queries.
enum class score_source { probs, lse };

/// A policy and its budget. `full` keeps every token (budget ignored).
struct policy_spec {
  policy_kind kind = policy_kind::full;
  std::int32_t budget = 0;  ///< tokens kept between steps
  std::int32_t sinks = 0;   ///< recent_window, random, exact_greedy: first positions always kept
  std::uint64_t seed = 0;   ///< random
  std::int32_t recent = 0;  ///< random, exact_greedy: newest positions always kept
  score_source source = score_source::probs;
};

/// The cache of one layer for a group of sequences that share a policy.
class layer_cache {
 public:
  using policy_variant = std::variant<kvevict::h2o_policy, kvevict::recent_window_policy, kvevict::random_policy,
                                      kvevict::exact_greedy_policy>;

  /// max_tokens: the longest sequence the full cache must hold. f16: round
  /// K/V, queries and attention weights to half precision (numerics.hpp).
  layer_cache(const policy_spec& spec, std::int32_t num_seqs, std::int32_t num_kv_heads, std::int32_t num_q_heads,
              std::int32_t head_dim, std::int32_t max_tokens, bool f16 = false)
      : source_(spec.source),
        f16_(f16),
        policy_(make_policy(spec, {num_seqs, num_kv_heads, num_q_heads, capacity_for(spec, max_tokens)})),
        cache_(kvevict::make_bhsd_cache<float>(num_seqs, num_kv_heads, capacity_for(spec, max_tokens), head_dim)),
        probs_(std::size_t(num_q_heads) * std::size_t(cache_.capacity())),
        lse_(std::size_t(num_q_heads)),
        logits_(std::size_t(cache_.capacity())),
        rounded_(std::size_t(num_q_heads + 2 * num_kv_heads) * std::size_t(head_dim)),
        occupied_(std::size_t(cache_.capacity())) {
    if (num_kv_heads > max_kv_heads)
      throw kvevict::invalid_argument("layer_cache: num_kv_heads = " + std::to_string(num_kv_heads) + " exceeds " +
                                      std::to_string(max_kv_heads));
  }

  const policy_variant& policy() const noexcept { return policy_; }

  /// One decode step of sequence b. k, v: the new token's rows [kv_heads][head_dim]
  /// with RoPE applied to k; q: [q_heads][head_dim] with RoPE applied.
  /// Writes the attention output [q_heads][head_dim] to out.
  void decode(std::int32_t b, const float* q, const float* k, const float* v, float* out) {
    std::visit([&](auto& policy) { decode(policy, b, q, k, v, out); }, policy_);
  }

 private:
  static std::int32_t capacity_for(const policy_spec& spec, std::int32_t max_tokens) {
    return spec.kind == policy_kind::full ? max_tokens + 1 : spec.budget + 1;  // + the decode cycle's spare slot
  }

  static policy_variant make_policy(const policy_spec& spec, const kvevict::policy_shape& shape) {
    switch (spec.kind) {
      case policy_kind::full:  // a window that never fills: nothing is ever evicted
        return kvevict::recent_window_policy(shape, {0, shape.capacity - 1});
      case policy_kind::h2o:  // H2O's split: half heavy hitters, half recent
        return kvevict::h2o_policy(shape, {spec.budget - spec.budget / 2, spec.budget / 2});
      case policy_kind::recent_window:
        return kvevict::recent_window_policy(shape, {spec.sinks, spec.budget - spec.sinks});
      case policy_kind::random:
        return kvevict::random_policy(shape, {spec.budget, spec.sinks, spec.recent, spec.seed});
      case policy_kind::exact_greedy: {
        kvevict::exact_greedy_config c;
        c.budget = spec.budget;
        c.recent = spec.recent;
        c.sinks = spec.sinks;
        return kvevict::exact_greedy_policy(shape, c);
      }
    }
    throw kvevict::invalid_argument("layer_cache: unknown policy kind");
  }

  template <class Policy>
  void decode(Policy& policy, std::int32_t b, const float* q, const float* k, const float* v, float* out) {
    using kvevict::make_tensor_view;
    const auto view = cache_.view();
    const kvevict::policy_shape& shape = policy.shape();
    const std::int32_t heads = shape.num_kv_heads, q_heads = shape.num_q_heads, d = view.head_dim;
    const std::int32_t group = shape.group_size(), cap = view.capacity;

    std::int32_t slots[max_kv_heads];
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

    // 1-2. the new token's slot, then its K/V rows
    for (std::int32_t h = 0; h < heads; ++h) slots[h] = policy.next_slot(b, h);
    kvevict::scatter(view, b, slots, make_tensor_view<const float>(k, heads, d),
                     make_tensor_view<const float>(v, heads, d));
    policy.append(b);

    // 3. attention over the occupied slots, keeping the probabilities
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (std::int32_t h = 0; h < heads; ++h) {
      const std::int32_t* pos = policy.slots().positions_of(b, h);
      std::int32_t n = 0;
      for (std::int32_t s = 0; s < cap; ++s)
        if (pos[s] >= 0) occupied_[std::size_t(n++)] = s;
      for (std::int32_t j = 0; j < group; ++j) {
        const std::int32_t qh = h * group + j;
        const float* qrow = q + std::size_t(qh) * d;
        float* p = probs_.data() + std::size_t(qh) * cap;
        std::fill_n(p, cap, 0.0f);
        float* logits = logits_.data();
        for (std::int32_t i = 0; i < n; ++i) logits[i] = dot(qrow, view.k_row(b, h, occupied_[std::size_t(i)]), d) * scale;
        lse_[std::size_t(qh)] = softmax(logits, n);
        float* o = out + std::size_t(qh) * d;
        std::fill_n(o, d, 0.0f);
        for (std::int32_t i = 0; i < n; ++i) {
          const std::int32_t s = occupied_[std::size_t(i)];
          p[s] = logits[i];
          axpy(f16_ ? round_to_half(p[s]) : p[s], view.v_row(b, h, s), o, d);
        }
      }
    }

    // 4. scores
    const kvevict::decode_queries<float> queries{make_tensor_view<const float>(q, q_heads, d),
                                                 make_tensor_view<const float>(lse_.data(), q_heads), scale};
    constexpr bool needs_queries = std::is_same_v<Policy, kvevict::exact_greedy_policy>;
    if (needs_queries || source_ == score_source::lse) {
      policy.observe(b, queries, view);
    } else if constexpr (!needs_queries) {  // exact_greedy has no probability overload
      policy.observe(b, kvevict::decode_probs{make_tensor_view<const float>(probs_.data(), q_heads, cap)});
    }
    // 5. back to the budget
    policy.evict(b);
  }

  static constexpr std::int32_t max_kv_heads = 64;

  score_source source_;
  bool f16_;
  policy_variant policy_;
  kvevict::kv_cache<float, kvevict::strided_layout> cache_;
  std::vector<float> probs_, lse_, logits_, rounded_;
  std::vector<std::int32_t> occupied_;
};

}  // namespace tinyllm
