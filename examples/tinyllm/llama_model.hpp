#pragma once
// A Llama-architecture model as stored in a GGUF file: hyper-parameters from
// the metadata, and weight matrices left in their stored (quantised) format
// (matmul.hpp multiplies them).
#include <cstdint>
#include <string>
#include <vector>

#include "tinyllm/gguf.hpp"
#include "tinyllm/matmul.hpp"
#include "tinyllm/quant.hpp"

namespace tinyllm {

struct llama_config {
  std::int32_t n_layers = 0;
  std::int32_t dim = 0;  ///< embedding width
  std::int32_t ffn_dim = 0;
  std::int32_t n_heads = 0;
  std::int32_t n_kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t vocab = 0;
  float rms_eps = 1e-5f;
  float rope_base = 10000.0f;

  static llama_config from_gguf(const gguf_file& f) {
    const std::string arch = f.get_string("general.architecture");
    if (arch != "llama") throw format_error("general.architecture = \"" + arch + "\", only \"llama\" is supported");
    const auto key = [&](const char* k) { return "llama." + std::string(k); };
    llama_config c;
    c.n_layers = to_i32(f.get_u32(key("block_count")), "llama.block_count");
    c.dim = to_i32(f.get_u32(key("embedding_length")), "llama.embedding_length");
    c.ffn_dim = to_i32(f.get_u32(key("feed_forward_length")), "llama.feed_forward_length");
    c.n_heads = to_i32(f.get_u32(key("attention.head_count")), "llama.attention.head_count");
    c.n_kv_heads = to_i32(f.get_u32_or(key("attention.head_count_kv"), std::uint32_t(c.n_heads)),
                          "llama.attention.head_count_kv");
    c.rms_eps = f.get_f32(key("attention.layer_norm_rms_epsilon"));
    c.rope_base = f.get_f32_or(key("rope.freq_base"), 10000.0f);
    if (c.n_heads <= 0 || c.n_kv_heads <= 0 || c.n_heads % c.n_kv_heads != 0 || c.dim % c.n_heads != 0)
      throw format_error("head counts " + std::to_string(c.n_heads) + " / " + std::to_string(c.n_kv_heads) +
                         " do not divide embedding width " + std::to_string(c.dim));
    c.head_dim = c.dim / c.n_heads;
    const std::uint32_t rope_dims = f.get_u32_or(key("rope.dimension_count"), std::uint32_t(c.head_dim));
    if (rope_dims != std::uint32_t(c.head_dim))
      throw format_error("llama.rope.dimension_count = " + std::to_string(rope_dims) +
                         ": partial rotary embeddings are not supported");
    c.vocab = static_cast<std::int32_t>(f.get_string_array("tokenizer.ggml.tokens").size());
    return c;
  }

 private:
  static std::int32_t to_i32(std::uint32_t v, const char* key) {
    if (v == 0 || v > 1u << 24) throw format_error(std::string(key) + " = " + std::to_string(v) + " is implausible");
    return static_cast<std::int32_t>(v);
  }
};

struct llama_layer_weights {
  std::vector<float> attn_norm, ffn_norm;
  weight_matrix wq, wk, wv, wo, gate, up, down;
};

/// Views of one GGUF file's tensors; the file must outlive the weights.
struct llama_weights {
  weight_matrix token_embd, output;  // output == token_embd when tied
  std::vector<float> output_norm;
  std::vector<llama_layer_weights> layers;
  bool tied_embeddings = false;

  static llama_weights from_gguf(const gguf_file& f, const llama_config& c) {
    llama_weights w;
    w.token_embd = matrix(f, "token_embd.weight", c.vocab, c.dim);
    w.tied_embeddings = f.find_tensor("output.weight") == nullptr;
    w.output = w.tied_embeddings ? w.token_embd : matrix(f, "output.weight", c.vocab, c.dim);
    w.output_norm = vector(f, "output_norm.weight", c.dim);
    const std::int32_t kv_dim = c.n_kv_heads * c.head_dim;
    for (std::int32_t l = 0; l < c.n_layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      llama_layer_weights L;
      L.attn_norm = vector(f, p + "attn_norm.weight", c.dim);
      L.ffn_norm = vector(f, p + "ffn_norm.weight", c.dim);
      L.wq = matrix(f, p + "attn_q.weight", c.dim, c.dim);
      L.wk = matrix(f, p + "attn_k.weight", kv_dim, c.dim);
      L.wv = matrix(f, p + "attn_v.weight", kv_dim, c.dim);
      L.wo = matrix(f, p + "attn_output.weight", c.dim, c.dim);
      L.gate = matrix(f, p + "ffn_gate.weight", c.ffn_dim, c.dim);
      L.up = matrix(f, p + "ffn_up.weight", c.ffn_dim, c.dim);
      L.down = matrix(f, p + "ffn_down.weight", c.dim, c.ffn_dim);
      w.layers.push_back(std::move(L));
    }
    return w;
  }

 private:
  static const gguf_tensor& shaped(const gguf_file& f, const std::string& name, std::int64_t rows, std::int64_t cols) {
    const gguf_tensor& t = f.tensor(name);
    if (t.row_length() != cols || t.rows() != rows)
      throw format_error("tensor " + name + " is [" + std::to_string(t.rows()) + "][" +
                         std::to_string(t.row_length()) + "], expected [" + std::to_string(rows) + "][" +
                         std::to_string(cols) + "]");
    return t;
  }
  static weight_matrix matrix(const gguf_file& f, const std::string& name, std::int64_t rows, std::int64_t cols) {
    const gguf_tensor& t = shaped(f, name, rows, cols);
    return {t.data, t.type, rows, cols, t.row_stride()};
  }
  static std::vector<float> vector(const gguf_file& f, const std::string& name, std::int64_t n) {
    const gguf_tensor& t = shaped(f, name, 1, n);
    std::vector<float> out(static_cast<std::size_t>(n));
    dequantize_row(t.type, t.data, out.data(), n);
    return out;
  }
};

}  // namespace tinyllm
