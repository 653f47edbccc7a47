#pragma once
// A batched decoder for Llama-architecture models. Each step takes one token
// per sequence through every layer; the sequences are split into groups, and
// each (layer, group) has its own kvevict policy and cache, so one batch can
// compare several policies while the weights are read once per step.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "tinyllm/kernels.hpp"
#include "tinyllm/layer_cache.hpp"
#include "tinyllm/llama_model.hpp"
#include "tinyllm/matmul.hpp"
#include "tinyllm/numerics.hpp"

namespace tinyllm {

/// num_seqs sequences that share one policy.
struct sequence_group {
  policy_spec policy;
  std::int32_t num_seqs = 1;
};

class llama_engine {
 public:
  /// max_tokens: the most tokens any sequence will be fed.
  llama_engine(const llama_config& config, const llama_weights& weights, const std::vector<sequence_group>& groups,
               std::int32_t max_tokens, numerics arithmetic = {})
      : config_(config), weights_(weights), numerics_(arithmetic), max_tokens_(max_tokens) {
    if (groups.empty()) throw std::invalid_argument("llama_engine: groups is empty");
    for (std::size_t g = 0; g < groups.size(); ++g)
      for (std::int32_t b = 0; b < groups[g].num_seqs; ++b) members_.push_back({static_cast<std::int32_t>(g), b});
    batch_ = static_cast<std::int32_t>(members_.size());
    caches_.resize(std::size_t(config.n_layers));
    for (std::int32_t l = 0; l < config.n_layers; ++l)
      for (const sequence_group& g : groups)
        caches_[std::size_t(l)].emplace_back(g.policy, g.num_seqs, config.n_kv_heads, config.n_heads, config.head_dim,
                                             max_tokens, arithmetic.f16_attention, l);
    positions_.assign(std::size_t(batch_), 0);
    const std::size_t B = std::size_t(batch_), dim = std::size_t(config.dim);
    const std::size_t kv_dim = std::size_t(config.n_kv_heads) * std::size_t(config.head_dim);
    x_.resize(B * dim);
    xn_.resize(B * dim);
    q_.resize(B * dim);
    att_.resize(B * dim);
    proj_.resize(B * dim);
    k_.resize(B * kv_dim);
    v_.resize(B * kv_dim);
    gate_.resize(B * std::size_t(config.ffn_dim));
    up_.resize(B * std::size_t(config.ffn_dim));
    rope_cos_.resize(B * std::size_t(config.head_dim / 2));
    rope_sin_.resize(B * std::size_t(config.head_dim / 2));
  }

  std::int32_t batch() const noexcept { return batch_; }
  std::int32_t layers() const noexcept { return config_.n_layers; }
  /// Tokens sequence s has been fed.
  std::int32_t position(std::int32_t s) const { return positions_.at(std::size_t(s)); }
  /// Cache of `layer` for group g.
  const layer_cache& cache(std::int32_t layer, std::int32_t g) const { return caches_.at(std::size_t(layer)).at(std::size_t(g)); }

  /// Sequence s's first `length` tokens form a prompt that its group's
  /// prefill kind compresses (layer_cache::set_prompt); before s is fed.
  void set_prompt(std::int32_t s, std::int32_t length) {
    for_layers(s, [&](layer_cache& c, std::int32_t b) { c.set_prompt(b, length); });
  }
  /// Sequence s (a full cache) records its attention into r.
  void set_record(std::int32_t s, attention_record* r) {
    for_layers(s, [&](layer_cache& c, std::int32_t b) { c.set_record(b, r); });
  }
  /// Sequence s (a lookahead oracle) reads its future attention from r.
  void set_future(std::int32_t s, const attention_record* r) {
    for_layers(s, [&](layer_cache& c, std::int32_t b) { c.set_future(b, r); });
  }

  /// Feeds tokens[s] to every sequence s; writes next-token logits, [batch][vocab].
  /// Bad input is rejected before anything changes; any other exception
  /// (a bug) leaves the batch half-stepped and unusable.
  void step(const std::int32_t* tokens, float* logits) {
    const llama_config& c = config_;
    const std::size_t dim = std::size_t(c.dim), hd = std::size_t(c.head_dim);
    const std::size_t kv_dim = std::size_t(c.n_kv_heads) * hd;
    for (std::int32_t s = 0; s < batch_; ++s)
      if (tokens[s] < 0 || tokens[s] >= c.vocab)
        throw std::out_of_range("llama_engine::step: tokens[" + std::to_string(s) + "] = " + std::to_string(tokens[s]) +
                                " is outside the vocabulary [0, " + std::to_string(c.vocab) + ")");
    if (positions_.front() >= max_tokens_)  // the full cache would start evicting
      throw std::length_error("llama_engine::step: every sequence already holds max_tokens = " +
                              std::to_string(max_tokens_) + " tokens");
    for (std::int32_t s = 0; s < batch_; ++s) weights_.token_embd.dequantize(tokens[s], &x_[s * dim]);
    const std::size_t pairs = hd / 2;
    for (std::int32_t s = 0; s < batch_; ++s)
      rope_angles(positions_[std::size_t(s)], c.head_dim, c.rope_base, &rope_cos_[s * pairs], &rope_sin_[s * pairs]);

    for (std::int32_t l = 0; l < c.n_layers; ++l) {
      const llama_layer_weights& w = weights_.layers[std::size_t(l)];
      for (std::int32_t s = 0; s < batch_; ++s) rms_norm(&x_[s * dim], w.attn_norm.data(), c.rms_eps, &xn_[s * dim], c.dim);
      multiply(w.wq, xn_, q_.data());
      multiply(w.wk, xn_, k_.data());
      multiply(w.wv, xn_, v_.data());
      for (std::int32_t s = 0; s < batch_; ++s) {
        const float* cos = &rope_cos_[s * pairs];
        const float* sin = &rope_sin_[s * pairs];
        for (std::int32_t h = 0; h < c.n_heads; ++h) rope_adjacent_pairs(&q_[s * dim + h * hd], c.head_dim, cos, sin);
        for (std::int32_t h = 0; h < c.n_kv_heads; ++h) rope_adjacent_pairs(&k_[s * kv_dim + h * hd], c.head_dim, cos, sin);
      }
      attend(l, dim, kv_dim);
      multiply(w.wo, att_, proj_.data());
      for (std::size_t i = 0; i < x_.size(); ++i) x_[i] += proj_[i];

      for (std::int32_t s = 0; s < batch_; ++s) rms_norm(&x_[s * dim], w.ffn_norm.data(), c.rms_eps, &xn_[s * dim], c.dim);
      multiply(w.gate, xn_, gate_.data());
      multiply(w.up, xn_, up_.data());
      swiglu(gate_.data(), up_.data(), static_cast<std::int64_t>(gate_.size()));
      multiply(w.down, gate_, proj_.data());
      for (std::size_t i = 0; i < x_.size(); ++i) x_[i] += proj_[i];
    }
    for (std::int32_t s = 0; s < batch_; ++s)
      rms_norm(&x_[s * dim], weights_.output_norm.data(), c.rms_eps, &xn_[s * dim], c.dim);
    multiply(weights_.output, xn_, logits);
    for (std::int32_t& p : positions_) ++p;
  }

 private:
  struct member {
    std::int32_t group, index;
  };

  template <class F>
  void for_layers(std::int32_t s, F&& f) {
    const member m = members_.at(std::size_t(s));
    for (auto& layer : caches_) f(layer[std::size_t(m.group)], m.index);
  }

  // y = w x for the batch, in float, or as llama.cpp computes it.
  void multiply(const weight_matrix& w, const std::vector<float>& x, float* y) {
    if (!numerics_.q8_activations || !rounds_activations(w.type)) return matmul(w, x.data(), batch_, y);
    const std::int64_t blocks = w.cols / 32;
    quantized_.resize(std::size_t(batch_ * blocks));
    for (std::int32_t s = 0; s < batch_; ++s) quantize_q8(&x[std::size_t(s * w.cols)], w.cols, &quantized_[std::size_t(s * blocks)]);
    matmul_q8(w, quantized_.data(), batch_, y);
  }

  // Groups are independent policy objects, so they run in parallel; the
  // sequences of one group share their policy's scratch and run in order.
  void attend(std::int32_t layer, std::size_t dim, std::size_t kv_dim) {
    std::vector<layer_cache>& groups = caches_[std::size_t(layer)];
    const std::int32_t n = static_cast<std::int32_t>(groups.size());
    std::exception_ptr failure;
#pragma omp parallel for schedule(dynamic) if (n > 1)
    for (std::int32_t g = 0; g < n; ++g) {
      try {
        for (std::int32_t s = 0; s < batch_; ++s) {
          const member m = members_[std::size_t(s)];
          if (m.group != g) continue;
          groups[std::size_t(g)].decode(m.index, &q_[s * dim], &k_[s * kv_dim], &v_[s * kv_dim], &att_[s * dim]);
        }
      } catch (...) {
#pragma omp critical
        failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
  }

  llama_config config_;
  const llama_weights& weights_;
  numerics numerics_;
  std::int32_t max_tokens_;
  std::vector<member> members_;
  std::int32_t batch_ = 0;
  std::vector<std::vector<layer_cache>> caches_;  // [layer][group]
  std::vector<std::int32_t> positions_;
  std::vector<float> x_, xn_, q_, k_, v_, att_, proj_, gate_, up_;
  std::vector<float> rope_cos_, rope_sin_;  // [batch][head_dim / 2], this step's angles
  std::vector<q8_activations> quantized_;
};

}  // namespace tinyllm
