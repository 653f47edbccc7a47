#pragma once
// kvevict inside llama.cpp: what an engine developer writes to let kvevict's
// batched host API own the KV cells of every (layer, KV head) of a
// llama.cpp context. The patch (llama-head-cells.patch) lets the caller
// name, before each llama_decode, the cell each (layer, KV head) writes the
// new token's K/V into; everything else is llama.cpp's own decode loop:
//
//   head_cells_cache cache(model, spec);                  // validates spec against the model
//   llama_context* ctx = llama_init_from_model(model, cache.context_params(p));
//   cache.bind(ctx);                                      // the layers' K/V tensors
//   for each token:
//     cache.before_decode();    // append in every layer: the new token's cell per (layer, head)
//     llama_decode(ctx, one token);  // writes K/V there; attention over the budget + 1 cells;
//                                    // cb_eval hands over each layer's probabilities
//     cache.after_decode();     // observe + evict in every layer: one free cell per head
//
// The cache has exactly budget + 1 cells per layer (the context is created
// with n_ctx = budget + 1, unpadded): the memory is freed, not masked.
// Scores come from llama.cpp's attention probabilities (its non-flash path,
// the tensor "kq_soft_max-<layer>") for h2o and the decayed rules, from the
// cached keys for key_norm and key_diff; recent_window and random need none.
//
// Prompt compression (a spec with a prefill kind) replaces the prompt's
// token-by-token cycle with prefill(): llama.cpp's batched prompt pass in a
// context of the prompt's length, kvevict's batched prefill per layer, and
// the kept rows and the state moved into the budget + 1 cells.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include <ggml.h>
#include <llama-head-cells.h>
#include <llama.h>

#include <kvevict/kvevict.hpp>

#include "prompt_attention.hpp"
#include "tinyllm/layer_cache.hpp"  // policy_spec and its configs: the same decisions as tinyllm

namespace kvevict_llama {

using tinyllm::policy_kind;
using tinyllm::policy_spec;

/// An error of the integration (bad input, a model or context it cannot serve).
struct error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class head_cells_cache {
 public:
  /// Checks that the spec is a decode-time rule this integration serves and
  /// that its budget fits the model; no llama.cpp call fails after this for
  /// a reason the spec could have told.
  head_cells_cache(const llama_model* model, const policy_spec& spec) : model_(model), spec_(spec) {
    if (!model) throw error("head_cells_cache: model is null");
    switch (spec.kind) {
      case policy_kind::h2o:
      case policy_kind::key_norm:
      case policy_kind::key_diff:
      case policy_kind::recent_window:
      case policy_kind::random:
        break;
      default:
        throw error("head_cells_cache: the policy must be h2o (decay 0: TOVA), key_norm, key_diff, recent_window or "
                    "random; the full cache is stock llama.cpp");
    }
    if (spec.budget < 1) throw error("head_cells_cache: budget = " + std::to_string(spec.budget) + " must be at least 1");
    if (spec.prefill == tinyllm::prefill_kind::snapkv && spec.snap_window > spec.budget)
      throw error("head_cells_cache: SnapKV's window of " + std::to_string(spec.snap_window) + " rows exceeds the budget " +
                  std::to_string(spec.budget));
    layers_ = llama_model_n_layer(model);
    heads_ = llama_model_n_head_kv(model);
    q_heads_ = llama_model_n_head(model);
    if (heads_ < 1 || q_heads_ % heads_ != 0)
      throw error("head_cells_cache: the model has " + std::to_string(q_heads_) + " query heads over " +
                  std::to_string(heads_) + " KV heads; kvevict needs whole query groups");
    head_dim_ = llama_model_n_embd(model) / q_heads_;
    // built here, on a throwaway state, so that a budget below the protected
    // tokens is refused (by the library, naming the argument) before any context exists
    make_layer(capacity());
  }

  head_cells_cache(const head_cells_cache&) = delete;
  head_cells_cache& operator=(const head_cells_cache&) = delete;

  /// `base` with what this cache needs: budget + 1 cells, unpadded, placed
  /// per head; attention that materialises its probabilities; the callback
  /// that reads them.
  llama_context_params context_params(llama_context_params base) {
    base.n_ctx = static_cast<std::uint32_t>(capacity());
    base.n_seq_max = 1;
    base.kv_head_cells = true;
    base.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    if (needs_probs()) {
      base.cb_eval = &head_cells_cache::on_tensor;
      base.cb_eval_user_data = this;
    }
    return base;
  }

  /// Binds the context made from context_params: checks its cells and K
  /// type, builds one batched policy per layer.
  void bind(llama_context* ctx) {
    if (!ctx) throw error("head_cells_cache::bind: the context is null (llama_init_from_model failed)");
    if (static_cast<std::int32_t>(llama_n_ctx(ctx)) != capacity())
      throw error("head_cells_cache::bind: the context has " + std::to_string(llama_n_ctx(ctx)) + " cells, the policy " +
                  std::to_string(capacity()) + " (create it with context_params)");
    keys_.clear();
    values_.clear();
    for (std::int32_t il = 0; il < layers_; ++il) {
      ggml_tensor *k = nullptr, *v = nullptr;
      bool v_trans = false;
      if (llama_kv_head_cells_layer(ctx, il, &k, &v, &v_trans) != 0)
        throw error("head_cells_cache::bind: layer " + std::to_string(il) +
                    " has no head-cells KV cache (context not made with kv_head_cells, or a layer without KV)");
      if (k->type != GGML_TYPE_F32 && k->type != GGML_TYPE_F16 && k->type != GGML_TYPE_BF16)
        throw error(std::string("head_cells_cache::bind: the K cache type is ") + ggml_type_name(k->type) +
                    "; kvevict reads f32, f16 and bf16 keys");
      if (k->ne[0] != std::int64_t{heads_} * head_dim_ || k->ne[1] != capacity() || v->type != k->type ||
          ggml_nbytes(v) != ggml_nbytes(k))
        throw error("head_cells_cache::bind: layer " + std::to_string(il) +
                    "'s K and V tensors are not [heads x head_dim, cells] of one type");
      keys_.push_back(k);
      values_.push_back(v);
    }
    ctx_ = ctx;
    policies_.clear();
    for (std::int32_t il = 0; il < layers_; ++il) policies_.push_back(make_layer(capacity()));
    probs_.assign(std::size_t(layers_) * q_heads_ * capacity(), 0.0f);
    zeros_.assign(std::size_t(q_heads_) * capacity(), 0.0f);
    seen_.assign(std::size_t(layers_), 0);
    cells_.assign(std::size_t(layers_) * heads_, 0);
  }

  /// A new sequence: every layer's state and llama.cpp's cells.
  void reset() {
    require_bound("reset");
    for (auto& p : policies_) std::visit([](auto& policy) { policy.reset(kvevict::active_set::all()); }, p);
    llama_memory_clear(llama_get_memory(ctx_), true);
  }

  /// Before llama_decode of the sequence's next token: its cell in every
  /// (layer, KV head) is that head's free one (append).
  void before_decode() {
    require_bound("before_decode");
    const timer t(seconds_);
    for (std::int32_t il = 0; il < layers_; ++il)
      std::visit(
          [&](auto& policy) {
            const kvevict::batch_state_view& st = policy.state();
            for (std::int32_t h = 0; h < heads_; ++h)
              cells_[std::size_t(il) * heads_ + h] = st.slots.next_slots[st.head_index(0, h)];
            policy.append();
            policy.check();
          },
          policies_[std::size_t(il)]);
    if (llama_kv_head_cells_set(ctx_, cells_.data(), 1) != 0)
      throw error("head_cells_cache::before_decode: llama_kv_head_cells_set refused the cells");
    std::fill(seen_.begin(), seen_.end(), 0);
  }

  /// After llama_decode: observe + evict in every layer, back to the budget.
  void after_decode() {
    require_bound("after_decode");
    const timer t(seconds_);
    for (std::int32_t il = 0; il < layers_; ++il) {
      if (needs_probs() && !seen_[std::size_t(il)])
        throw error("head_cells_cache::after_decode: llama.cpp computed no attention probabilities for layer " +
                    std::to_string(il) + " (flash attention on, or the decode failed)");
      std::visit([&](auto& policy) { observe_evict(policy, il); }, policies_[std::size_t(il)]);
    }
  }

  /// Prompt compression (the spec's prefill kind): `prompt` runs through a
  /// stock llama.cpp context of as many cells (llama.cpp's batched prompt
  /// pass, `base`'s threads and K/V types, ubatches of 512), whose attention
  /// (prompt_attention) or keys feed kvevict's batched prefill per layer in
  /// a state sized for the prompt; the kept K/V rows move into this
  /// context's budget + 1 cells, the state to budget + 1 slots (copy_state),
  /// and the prompt's context is freed. Returns the logits of the prompt's
  /// last token; decode steps follow as usual. Call on a fresh sequence.
  std::vector<float> prefill(const std::vector<llama_token>& prompt, llama_context_params base) {
    require_bound("prefill");
    if (spec_.prefill == tinyllm::prefill_kind::none) throw error("head_cells_cache::prefill: the spec has no prefill kind");
    const std::int32_t length = static_cast<std::int32_t>(prompt.size());
    if (length < 1) throw error("head_cells_cache::prefill: the prompt is empty");
    if (spec_.prefill == tinyllm::prefill_kind::snapkv && length < spec_.snap_window)
      throw error("head_cells_cache::prefill: a prompt of " + std::to_string(length) + " tokens is shorter than SnapKV's window");
    // 1. llama.cpp's prompt pass with every key cached
    base.n_ctx = base.n_batch = static_cast<std::uint32_t>(length);
    base.n_ubatch = std::min<std::uint32_t>(base.n_batch, 512);
    base.n_seq_max = 1;
    base.kv_head_cells = false;
    base.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    base.type_k = keys_[0]->type;
    base.type_v = values_[0]->type;
    const bool sums = spec_.prefill == tinyllm::prefill_kind::attention;
    prompt_attention attention(sums ? prompt_attention::fold::column_sums : prompt_attention::fold::window_rows, layers_,
                               q_heads_, length, spec_.decay,
                               spec_.prefill == tinyllm::prefill_kind::snapkv ? spec_.snap_window : 0);
    const bool reads_attention = sums || spec_.prefill == tinyllm::prefill_kind::snapkv;
    base.cb_eval = reads_attention ? &prompt_attention::on_tensor : nullptr;
    base.cb_eval_user_data = reads_attention ? &attention : nullptr;
    std::unique_ptr<llama_context, void (*)(llama_context*)> pass(llama_init_from_model(const_cast<llama_model*>(model_), base),
                                                                  llama_free);
    if (!pass) throw error("head_cells_cache::prefill: llama_init_from_model failed for the prompt's context");
    std::vector<llama_token> tokens = prompt;
    if (llama_decode(pass.get(), llama_batch_get_one(tokens.data(), length)) != 0)
      throw error("head_cells_cache::prefill: llama_decode failed on the prompt");
    if (reads_attention && !attention.complete())
      throw error("head_cells_cache::prefill: llama.cpp did not hand over every layer's prompt attention");
    const float* last = llama_get_logits_ith(pass.get(), -1);
    std::vector<float> logits(last, last + llama_vocab_n_tokens(llama_model_get_vocab(model_)));
    const timer t(seconds_);  // kvevict's part: the prefill and the moves
    // 2. per layer: kvevict's prefill, then the kept rows and the state move
    for (std::int32_t il = 0; il < layers_; ++il) {
      switch (keys_[0]->type) {
        case GGML_TYPE_F16: compress_layer<kvevict::half>(il, pass.get(), attention, length); break;
        case GGML_TYPE_BF16: compress_layer<kvevict::bfloat16>(il, pass.get(), attention, length); break;
        default: compress_layer<float>(il, pass.get(), attention, length); break;
      }
    }
    // 3. llama.cpp's bookkeeping of the cells now filled (positions of layer 0,
    // head 0; the newest raised to length - 1, where the next token follows)
    const std::int32_t kept = std::min(length, capacity() - 1);
    std::vector<llama_pos> positions(std::size_t(kept), 0);
    for (std::int32_t c = 0; c < kept; ++c) positions[std::size_t(c)] = position(0, 0, c);
    *std::max_element(positions.begin(), positions.end()) = length - 1;
    if (llama_kv_head_cells_occupy(ctx_, positions.data(), kept) != 0)
      throw error("head_cells_cache::prefill: llama_kv_head_cells_occupy refused the cells");
    return logits;
  }

  std::int32_t capacity() const noexcept { return spec_.budget + 1; }
  /// Seconds spent in this adapter's calls (append, reading the
  /// probabilities, observe + evict), for the cost per token and layer.
  double seconds() const noexcept { return seconds_; }
  /// The position of the token in (layer, head, cell), -1 for a free cell.
  std::int32_t position(std::int32_t il, std::int32_t h, std::int32_t cell) const {
    return std::visit([&](const auto& policy) { return policy.state().slots.positions_of(0, h)[cell]; },
                      policies_.at(std::size_t(il)));
  }

 private:
  using h2o_layer = kvevict::batched_policy<kvevict::h2o_policy>;
  using window_layer = kvevict::batched_policy<kvevict::recent_window_policy>;
  using random_layer = kvevict::batched_policy<kvevict::random_policy>;
  using layer_policy = std::variant<h2o_layer, window_layer, random_layer>;

  bool needs_probs() const noexcept { return spec_.kind == policy_kind::h2o; }

  layer_policy make_layer(std::int32_t cells) const {
    const kvevict::policy_shape shape{1, heads_, q_heads_, cells};
    switch (spec_.kind) {
      case policy_kind::recent_window:
        return window_layer(shape, tinyllm::recent_window_config_of(spec_));
      case policy_kind::random:
        return random_layer(shape, tinyllm::random_config_of(spec_));
      case policy_kind::key_diff:  // KeyDiff's running anchor lives in the state
        return h2o_layer(shape, tinyllm::h2o_config_of(spec_), kvevict::key_diff_extent(head_dim_));
      default:
        return h2o_layer(shape, tinyllm::h2o_config_of(spec_));
    }
  }

  void require_bound(const char* call) const {
    if (!ctx_) throw error(std::string("head_cells_cache::") + call + ": bind a context first");
  }

  // cb_eval: llama.cpp asks for every node of the graph, then hands over
  // the ones we asked for once computed. Each layer's softmax output is
  // [n_kv cells][n_tokens][query heads]; cells past n_kv are free.
  static bool on_tensor(ggml_tensor* t, bool ask, void* user) {
    const std::int32_t il = softmax_layer(t);
    if (il < 0) return !ask;
    if (ask) return true;
    auto* self = static_cast<head_cells_cache*>(user);
    const timer clock(self->seconds_);
    if (il >= self->layers_ || t->type != GGML_TYPE_F32 || t->ne[1] != 1 || t->ne[2] != self->q_heads_ ||
        t->ne[0] > self->capacity())
      return false;  // stops the decode; after_decode reports the layer
    const std::int32_t cap = self->capacity();
    float* row = self->probs_.data() + std::size_t(il) * self->q_heads_ * cap;
    for (std::int32_t q = 0; q < self->q_heads_; ++q) {
      const auto* src = reinterpret_cast<const float*>(static_cast<const char*>(t->data) + q * t->nb[2]);
      std::copy_n(src, t->ne[0], row + std::size_t(q) * cap);
      std::fill(row + std::size_t(q) * cap + t->ne[0], row + std::size_t(q + 1) * cap, 0.0f);
    }
    self->seen_[std::size_t(il)] = 1;
    return true;
  }

  // The layer's keys as kvevict sees them: one sequence, cell-major rows of
  // heads x head_dim (llama.cpp's K layout), in the cache's element type.
  // The key rules read K only; v names the layer's V buffer (same bytes,
  // transposed without flash attention) so that the view's two halves are
  // the distinct buffers the library requires.
  template <class T>
  kvevict::kv_view<T, kvevict::strided_layout> keys_of(std::int32_t il) const {
    const ggml_tensor* k = keys_[std::size_t(il)];
    auto* keys = static_cast<T*>(k->data);  // read only: scoring never writes the cache
    auto* values = static_cast<T*>(values_[std::size_t(il)]->data);
    const kvevict::strided_layout layout{0, head_dim_, static_cast<std::int64_t>(k->nb[1] / sizeof(T))};
    return {keys, values, layout, 1, heads_, capacity(), head_dim_};
  }

  // One layer's prompt: its K/V rows from the prompt's context into a kvevict
  // cache (BSHD; llama.cpp's V is transposed without flash attention), the
  // batched prefill in a state of the prompt's size, then the first
  // budget + 1 slots' rows into this context's cells and the state into
  // policies_[il].
  template <class T>
  void compress_layer(std::int32_t il, llama_context* pass, const prompt_attention& attention, std::int32_t length) {
    ggml_tensor *pk = nullptr, *pv = nullptr;
    bool trans = false;
    if (llama_kv_head_cells_layer(pass, il, &pk, &pv, &trans) != 0 || !trans)
      throw error("head_cells_cache::prefill: the prompt's context has no K/V for layer " + std::to_string(il));
    const std::int32_t cells = std::max(length, capacity()), width = heads_ * head_dim_;
    const std::int64_t pass_cells = pk->ne[1];
    auto cache = kvevict::make_bshd_cache<T>(1, heads_, cells, head_dim_);
    const auto view = cache.view();
    const T* k = static_cast<const T*>(pk->data);
    const T* v = static_cast<const T*>(pv->data);
    for (std::int32_t p = 0; p < length; ++p)
      for (std::int32_t h = 0; h < heads_; ++h)
        for (std::int32_t e = 0; e < head_dim_; ++e) {
          view.k_row(0, h, p)[e] = k[std::int64_t{p} * width + h * head_dim_ + e];
          view.v_row(0, h, p)[e] = v[(std::int64_t{h} * head_dim_ + e) * pass_cells + p];
        }
    layer_policy large = make_layer(cells);
    std::visit(
        [&](auto& small) {
          auto& big = std::get<std::decay_t<decltype(small)>>(large);
          run_prefill(big.state(), il, attention, length, view);
          kvevict::copy_state(big.state(), small.state());
        },
        policies_[std::size_t(il)]);
    // the kept rows (slots [0, kept) after the prefill) into cells [0, budget + 1)
    T* dk = static_cast<T*>(keys_[std::size_t(il)]->data);
    T* dv = static_cast<T*>(values_[std::size_t(il)]->data);
    for (std::int32_t c = 0; c < std::min(cells, capacity()); ++c)
      for (std::int32_t h = 0; h < heads_; ++h)
        for (std::int32_t e = 0; e < head_dim_; ++e) {
          dk[std::int64_t{c} * width + h * head_dim_ + e] = view.k_row(0, h, c)[e];
          dv[(std::int64_t{h} * head_dim_ + e) * capacity() + c] = view.v_row(0, h, c)[e];
        }
  }

  template <class T>
  void run_prefill(const kvevict::batch_state_view& st, std::int32_t il, const prompt_attention& attention,
                   std::int32_t length, const kvevict::kv_view<T, kvevict::strided_layout>& view) const {
    using kvevict::make_tensor_view;
    const kvevict::prompt_lengths prompts{&length, length};
    const kvevict::active_set all = kvevict::active_set::all();
    std::uint64_t status = kvevict::batch_status_clear;
    switch (spec_.prefill) {
      case tinyllm::prefill_kind::attention:
        kvevict::batched_prefill(st, all, prompts,
                                 kvevict::batch_prefill_sums{make_tensor_view<const float>(attention.layer(il), 1, q_heads_, length)},
                                 view, nullptr, &status);
        break;
      case tinyllm::prefill_kind::snapkv:
        kvevict::batched_prefill(
            st, all, prompts,
            kvevict::batch_window_probs{make_tensor_view<const float>(attention.layer(il), 1, q_heads_, spec_.snap_window, length),
                                        kvevict::snap_window{spec_.snap_window, 7, kvevict::snap_pooling::max}},
            view, nullptr, &status);
        break;
      case tinyllm::prefill_kind::key_diff:
        kvevict::batched_prefill(st, all, prompts, kvevict::key_diff<T, kvevict::strided_layout>{view}, nullptr, &status);
        break;
      case tinyllm::prefill_kind::key_norm:
        kvevict::batched_prefill(st, all, prompts, kvevict::key_norms<T, kvevict::strided_layout>{view}, nullptr, &status);
        break;
      default:  // recent: the sinks and the newest, no scores
        kvevict::batched_prefill(st, all, prompts, view, nullptr, &status);
        break;
    }
    kvevict::throw_if_error(status, "batched_prefill");
  }

  template <class Input>
  static void observe_evict(h2o_layer& policy, const Input& in) {
    policy.observe_evict(in);
    policy.check();
  }

  template <class T>
  void observe_keys(h2o_layer& policy, std::int32_t il) {
    if (spec_.kind == policy_kind::key_norm) return observe_evict(policy, kvevict::key_norms<T, kvevict::strided_layout>{keys_of<T>(il)});
    return observe_evict(policy, kvevict::key_diff<T, kvevict::strided_layout>{keys_of<T>(il)});
  }

  void observe_evict(h2o_layer& policy, std::int32_t il) {
    if (spec_.kind == policy_kind::h2o) {
      const float* p = probs_.data() + std::size_t(il) * q_heads_ * capacity();
      return observe_evict(policy, kvevict::batch_probs{kvevict::make_tensor_view<const float>(p, 1, q_heads_, capacity())});
    }
    switch (keys_[std::size_t(il)]->type) {
      case GGML_TYPE_F16: return observe_keys<kvevict::half>(policy, il);
      case GGML_TYPE_BF16: return observe_keys<kvevict::bfloat16>(policy, il);
      default: return observe_keys<float>(policy, il);
    }
  }

  // recent_window and random decide without scores: an empty observation
  template <class Policy>
  void observe_evict(Policy& policy, std::int32_t il) {
    (void)il;
    policy.observe_evict(kvevict::batch_probs{kvevict::make_tensor_view<const float>(zeros_.data(), 1, q_heads_, capacity())});
    policy.check();
  }

  struct timer {  // adds its lifetime to a total
    explicit timer(double& total) : total_(total), start_(std::chrono::steady_clock::now()) {}
    ~timer() { total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
    double& total_;
    std::chrono::steady_clock::time_point start_;
  };

  const llama_model* model_;
  policy_spec spec_;
  std::int32_t layers_ = 0, heads_ = 0, q_heads_ = 0, head_dim_ = 0;
  double seconds_ = 0.0;
  llama_context* ctx_ = nullptr;
  std::vector<ggml_tensor*> keys_, values_;
  std::vector<layer_policy> policies_;
  std::vector<float> probs_;  // [layers][q heads][cells]: this step's attention
  std::vector<float> zeros_;  // [q heads][cells]: the observation of rules without scores
  std::vector<std::uint8_t> seen_;
  std::vector<std::int32_t> cells_;  // [layers][KV heads]: the new token's cells
};

}  // namespace kvevict_llama
