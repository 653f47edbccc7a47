// Writes the seed corpus of fuzz_gguf (fuzz/corpus/fuzz_gguf/): small valid
// GGUF files built with tests/support/gguf_writer.hpp, so the fuzzer starts
// from files that get past the header and exercises every reader path.
// Run by hand when the seeds need to change:
//   clang++ -std=c++17 -Itests fuzz/seeds/make_gguf_seeds.cpp -o /tmp/make_gguf_seeds
//   /tmp/make_gguf_seeds fuzz/corpus/fuzz_gguf
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "support/gguf_writer.hpp"

namespace {

using namespace gguf_test;

std::vector<float> ramp(std::size_t n, float scale) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * float(int(i % 17) - 8);
  return v;
}

std::vector<std::uint8_t> f16_bytes(std::size_t n) {  // 1.0 and -0.5 alternating
  std::vector<std::uint8_t> out;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint16_t bits = i % 2 ? 0xB800 : 0x3C00;
    out.push_back(std::uint8_t(bits & 0xFF));
    out.push_back(std::uint8_t(bits >> 8));
  }
  return out;
}

/// A one-layer llama model small enough to fuzz: dim 8, 2 heads, 1 KV head.
writer tiny_llama() {
  const std::uint32_t dim = 8, ffn = 16, vocab = 12;
  std::vector<std::string> tokens = {"a", "b", "c", "Ġ", "ab", "Ġa", "1", "2", "12", "é", "!", "<s>"};
  writer w;
  w.add("general.architecture", str("llama"))
      .add("llama.block_count", u32(1))
      .add("llama.embedding_length", u32(dim))
      .add("llama.feed_forward_length", u32(ffn))
      .add("llama.attention.head_count", u32(2))
      .add("llama.attention.head_count_kv", u32(1))
      .add("llama.attention.layer_norm_rms_epsilon", f32(1e-5f))
      .add("llama.rope.freq_base", f32(10000.0f))
      .add("tokenizer.ggml.model", str("gpt2"))
      .add("tokenizer.ggml.pre", str("smollm"))
      .add("tokenizer.ggml.tokens", strings(tokens))
      .add("tokenizer.ggml.merges", strings({"a b", "Ġ a", "1 2"}));
  w.tensor_f32("token_embd.weight", {dim, vocab}, ramp(dim * vocab, 0.125f));
  w.tensor_f32("output_norm.weight", {dim}, ramp(dim, 0.25f));
  w.tensor_f32("blk.0.attn_norm.weight", {dim}, ramp(dim, 0.25f));
  w.tensor_f32("blk.0.ffn_norm.weight", {dim}, ramp(dim, 0.25f));
  w.tensor_f32("blk.0.attn_q.weight", {dim, dim}, ramp(dim * dim, 0.0625f));
  w.tensor_f32("blk.0.attn_k.weight", {dim, dim / 2}, ramp(dim * dim / 2, 0.0625f));
  w.tensor("blk.0.attn_v.weight", {dim, dim / 2}, g_f16, f16_bytes(dim * dim / 2));
  w.tensor_f32("blk.0.attn_output.weight", {dim, dim}, ramp(dim * dim, 0.0625f));
  w.tensor_f32("blk.0.ffn_gate.weight", {dim, ffn}, ramp(dim * ffn, 0.0625f));
  w.tensor_f32("blk.0.ffn_up.weight", {dim, ffn}, ramp(dim * ffn, 0.0625f));
  w.tensor("blk.0.ffn_down.weight", {ffn, dim}, g_f16, f16_bytes(ffn * dim));
  return w;
}

/// Every metadata type, arrays of each, nested arrays.
writer all_metadata_types() {
  writer w;
  w.add("u8", u8(7)).add("i8", i8(-7)).add("u16", u16(700)).add("i16", i16(-700)).add("u32", u32(70000));
  w.add("i32", i32(-70000)).add("f32", f32(0.5f)).add("bool", boolean(true)).add("u64", u64(1ull << 40));
  w.add("i64", i64(-(1ll << 40))).add("f64", f64(0.25)).add("string", str("text"));
  w.add("strings", strings({"x", "", "yz"})).add("i32s", i32s({1, -2, 3})).add("f32s", f32s({1.5f, -2.5f}));
  w.add("nested", array(t_array, {i32s({1, 2}), strings({"a"})}));
  return w;
}

/// Quantized tensors of one block row each, and a custom alignment.
writer quantized_tensors() {
  writer w;
  w.version(2).alignment(64);
  std::vector<std::uint8_t> q4_0(18, 0x11), q4_1(20, 0x22), q8_0(34, 0x03);
  q4_0[0] = 0x00, q4_0[1] = 0x3C;  // block scale 1.0 (f16)
  w.tensor("q4_0", {32, 1}, g_q4_0, q4_0).tensor("q4_1", {32, 1}, g_q4_1, q4_1).tensor("q8_0", {32}, g_q8_0, q8_0);
  w.tensor("f16", {4, 2}, g_f16, f16_bytes(8));
  return w;
}

void save(const std::string& dir, const std::string& name, const std::vector<std::uint8_t>& bytes) {
  std::ofstream(dir + "/" + name, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                                         std::streamsize(bytes.size()));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  save(dir, "tiny_llama.gguf", tiny_llama().build());
  save(dir, "all_metadata_types.gguf", all_metadata_types().build());
  save(dir, "quantized_tensors.gguf", quantized_tensors().build());
  save(dir, "empty_v3.gguf", writer().build());
  const std::string text = "The quick brown fox: 12345 caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 it's  \t\n done";
  save(dir, "text.txt", std::vector<std::uint8_t>(text.begin(), text.end()));
  return 0;
}
