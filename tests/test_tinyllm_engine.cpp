// The tinyllm engine on a tiny random Llama model that the test writes as a
// GGUF file: the weights are made in Hugging Face's layout and permuted the way
// llama.cpp's converter permutes Q/K, and an independent dense reference
// (double precision, HF's half-split RoPE, attention over an explicit set of
// positions) checks the engine's logits with and without eviction.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

#include "support/gguf_writer.hpp"
#include "tinyllm/engine.hpp"
#include "tinyllm/gguf.hpp"

namespace {

using namespace tinyllm;

constexpr int n_layers = 2, dim = 32, n_heads = 4, n_kv = 2, hd = 8, ffn = 48, vocab = 40;
constexpr float eps = 1e-5f, rope_base = 10000.0f;

using matrix_d = std::vector<double>;  // row-major [rows][cols]

struct hf_layer {
  std::vector<double> attn_norm, ffn_norm;
  matrix_d wq, wk, wv, wo, gate, up, down;
};

/// Weights in HF layout; values exactly representable in the stored formats.
struct hf_model {
  std::vector<double> embd;  // [vocab][dim], stored as Q8_0: q / 64
  std::vector<std::int8_t> embd_q;
  std::vector<double> out_norm;
  std::vector<hf_layer> layers;
};

matrix_d random_matrix(std::mt19937& rng, int rows, int cols, double scale) {
  std::uniform_int_distribution<int> q(-256, 256);  // multiples of 1/1024: exact in float and half
  matrix_d m(std::size_t(rows) * cols);
  for (double& x : m) x = q(rng) / 1024.0 * scale;
  return m;
}

hf_model make_model(std::uint32_t seed) {
  std::mt19937 rng(seed);
  hf_model m;
  std::uniform_int_distribution<int> q(-64, 64);
  for (int i = 0; i < vocab * dim; ++i) {
    m.embd_q.push_back(static_cast<std::int8_t>(q(rng)));
    m.embd.push_back(m.embd_q.back() / 64.0);
  }
  std::uniform_int_distribution<int> n(768, 1280);
  for (int i = 0; i < dim; ++i) m.out_norm.push_back(n(rng) / 1024.0);
  for (int l = 0; l < n_layers; ++l) {
    hf_layer L;
    for (int i = 0; i < dim; ++i) L.attn_norm.push_back(n(rng) / 1024.0), L.ffn_norm.push_back(n(rng) / 1024.0);
    L.wq = random_matrix(rng, dim, dim, 2.0);
    L.wk = random_matrix(rng, n_kv * hd, dim, 2.0);
    L.wv = random_matrix(rng, n_kv * hd, dim, 1.0);
    L.wo = random_matrix(rng, dim, dim, 1.0);
    L.gate = random_matrix(rng, ffn, dim, 1.0);
    L.up = random_matrix(rng, ffn, dim, 1.0);
    L.down = random_matrix(rng, dim, ffn, 1.0);
    m.layers.push_back(std::move(L));
  }
  return m;
}

/// llama.cpp's converter: within each head, rows (half j, index i) move to 2i + j.
matrix_d permute_rope_rows(const matrix_d& w, int heads) {
  matrix_d out(w.size());
  for (int h = 0; h < heads; ++h)
    for (int j = 0; j < 2; ++j)
      for (int i = 0; i < hd / 2; ++i)
        for (int c = 0; c < dim; ++c)
          out[std::size_t((h * hd + 2 * i + j) * dim + c)] = w[std::size_t((h * hd + j * hd / 2 + i) * dim + c)];
  return out;
}

std::vector<float> to_f32(const matrix_d& m) { return {m.begin(), m.end()}; }

std::vector<std::uint8_t> to_f16_bytes(const matrix_d& m) {
  std::vector<std::uint8_t> out;
  for (double x : m) {
    const std::uint16_t b = kvevict::from_float<kvevict::half>(static_cast<float>(x)).bits;
    out.push_back(static_cast<std::uint8_t>(b & 0xFF));
    out.push_back(static_cast<std::uint8_t>(b >> 8));
  }
  return out;
}

std::vector<std::uint8_t> to_q8_0_bytes(const std::vector<std::int8_t>& q) {  // d = 1/64
  std::vector<std::uint8_t> out;
  const std::uint16_t d = kvevict::from_float<kvevict::half>(1.0f / 64.0f).bits;
  for (std::size_t b = 0; b < q.size(); b += 32) {
    out.push_back(static_cast<std::uint8_t>(d & 0xFF));
    out.push_back(static_cast<std::uint8_t>(d >> 8));
    for (std::size_t i = 0; i < 32; ++i) out.push_back(static_cast<std::uint8_t>(q[b + i]));
  }
  return out;
}

gguf_test::writer model_writer(const hf_model& m) {
  using namespace gguf_test;
  writer w;
  std::vector<std::string> tokens;
  for (int i = 0; i < vocab; ++i) tokens.push_back("t" + std::to_string(i));
  w.add("general.architecture", str("llama"))
      .add("llama.block_count", u32(n_layers))
      .add("llama.context_length", u32(256))
      .add("llama.embedding_length", u32(dim))
      .add("llama.feed_forward_length", u32(ffn))
      .add("llama.attention.head_count", u32(n_heads))
      .add("llama.attention.head_count_kv", u32(n_kv))
      .add("llama.attention.layer_norm_rms_epsilon", f32(eps))
      .add("llama.rope.freq_base", f32(rope_base))
      .add("tokenizer.ggml.tokens", strings(tokens));
  const auto u = [](int x) { return static_cast<std::uint64_t>(x); };
  w.tensor("token_embd.weight", {u(dim), u(vocab)}, g_q8_0, to_q8_0_bytes(m.embd_q));  // tied output
  w.tensor_f32("output_norm.weight", {u(dim)}, to_f32(m.out_norm));
  for (int l = 0; l < n_layers; ++l) {
    const hf_layer& L = m.layers[std::size_t(l)];
    const std::string p = "blk." + std::to_string(l) + ".";
    w.tensor_f32(p + "attn_norm.weight", {u(dim)}, to_f32(L.attn_norm));
    w.tensor_f32(p + "ffn_norm.weight", {u(dim)}, to_f32(L.ffn_norm));
    w.tensor_f32(p + "attn_q.weight", {u(dim), u(dim)}, to_f32(permute_rope_rows(L.wq, n_heads)));
    w.tensor_f32(p + "attn_k.weight", {u(dim), u(n_kv * hd)}, to_f32(permute_rope_rows(L.wk, n_kv)));
    w.tensor(p + "attn_v.weight", {u(dim), u(n_kv * hd)}, g_f16, to_f16_bytes(L.wv));
    w.tensor_f32(p + "attn_output.weight", {u(dim), u(dim)}, to_f32(L.wo));
    w.tensor_f32(p + "ffn_gate.weight", {u(dim), u(ffn)}, to_f32(L.gate));
    w.tensor_f32(p + "ffn_up.weight", {u(dim), u(ffn)}, to_f32(L.up));
    w.tensor(p + "ffn_down.weight", {u(ffn), u(dim)}, g_f16, to_f16_bytes(L.down));
  }
  return w;
}

// ---- the dense reference ---------------------------------------------------

std::vector<double> matvec(const matrix_d& w, const std::vector<double>& x, int rows) {
  std::vector<double> y(std::size_t(rows), 0.0);
  for (int r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < x.size(); ++c) y[std::size_t(r)] += w[std::size_t(r) * x.size() + c] * x[c];
  return y;
}

std::vector<double> rms(const std::vector<double>& x, const std::vector<double>& w) {
  double s = 0;
  for (double v : x) s += v * v;
  const double inv = 1.0 / std::sqrt(s / double(x.size()) + eps);
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

/// HF's rotate_half RoPE on one head: pairs (i, i + hd/2).
void rope_half_split(double* x, int pos) {
  for (int i = 0; i < hd / 2; ++i) {
    const double theta = pos * std::pow(double(rope_base), -2.0 * i / hd);
    const double a = x[i], b = x[i + hd / 2];
    x[i] = a * std::cos(theta) - b * std::sin(theta);
    x[i + hd / 2] = b * std::cos(theta) + a * std::sin(theta);
  }
}

/// Keeps every position's K/V; attends(layer, head, step, position) says
/// which of them the step may see.
struct reference {
  const hf_model& m;
  std::vector<std::vector<std::vector<double>>> k, v;  // [layer][position] -> [n_kv * hd]

  template <class Attends>
  std::vector<double> step(int token, int pos, const Attends& attends) {
    k.resize(n_layers), v.resize(n_layers);
    std::vector<double> x(m.embd.begin() + token * dim, m.embd.begin() + (token + 1) * dim);
    for (int l = 0; l < n_layers; ++l) {
      const hf_layer& L = m.layers[std::size_t(l)];
      const std::vector<double> xn = rms(x, L.attn_norm);
      std::vector<double> q = matvec(L.wq, xn, dim), kk = matvec(L.wk, xn, n_kv * hd);
      for (int h = 0; h < n_heads; ++h) rope_half_split(&q[std::size_t(h * hd)], pos);
      for (int h = 0; h < n_kv; ++h) rope_half_split(&kk[std::size_t(h * hd)], pos);
      k[std::size_t(l)].push_back(kk);
      v[std::size_t(l)].push_back(matvec(L.wv, xn, n_kv * hd));
      std::vector<double> att(std::size_t(dim), 0.0);
      for (int qh = 0; qh < n_heads; ++qh) {
        const int h = qh / (n_heads / n_kv);
        std::vector<double> w(std::size_t(pos + 1), 0.0);
        double max = -1e300, sum = 0;
        for (int p = 0; p <= pos; ++p) {
          if (!attends(l, h, pos, p)) continue;
          double s = 0;
          for (int i = 0; i < hd; ++i) s += q[std::size_t(qh * hd + i)] * k[std::size_t(l)][std::size_t(p)][std::size_t(h * hd + i)];
          w[std::size_t(p)] = s / std::sqrt(double(hd));
          max = std::max(max, w[std::size_t(p)]);
        }
        for (int p = 0; p <= pos; ++p)
          if (attends(l, h, pos, p)) sum += (w[std::size_t(p)] = std::exp(w[std::size_t(p)] - max));
        for (int p = 0; p <= pos; ++p)
          if (attends(l, h, pos, p))
            for (int i = 0; i < hd; ++i)
              att[std::size_t(qh * hd + i)] += w[std::size_t(p)] / sum * v[std::size_t(l)][std::size_t(p)][std::size_t(h * hd + i)];
      }
      const std::vector<double> o = matvec(L.wo, att, dim);
      for (int i = 0; i < dim; ++i) x[std::size_t(i)] += o[std::size_t(i)];
      const std::vector<double> xn2 = rms(x, L.ffn_norm);
      std::vector<double> g = matvec(L.gate, xn2, ffn);
      const std::vector<double> up = matvec(L.up, xn2, ffn);
      for (int i = 0; i < ffn; ++i) g[std::size_t(i)] = g[std::size_t(i)] / (1 + std::exp(-g[std::size_t(i)])) * up[std::size_t(i)];
      const std::vector<double> d = matvec(L.down, g, dim);
      for (int i = 0; i < dim; ++i) x[std::size_t(i)] += d[std::size_t(i)];
    }
    return matvec(m.embd, rms(x, m.out_norm), vocab);
  }
};

std::vector<int> random_tokens(std::uint32_t seed, int n) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> t(0, vocab - 1);
  std::vector<int> out;
  for (int i = 0; i < n; ++i) out.push_back(t(rng));
  return out;
}

struct loaded {
  gguf_file file;
  llama_config config;
  llama_weights weights;
  explicit loaded(const hf_model& m)
      : file(gguf_file::parse(model_writer(m).build())),
        config(llama_config::from_gguf(file)),
        weights(llama_weights::from_gguf(file, config)) {}
};

}  // namespace

TEST_CASE("tinyllm: config and weights are read from the GGUF metadata and tensor table") {
  const hf_model m = make_model(1);
  const loaded l(m);
  CHECK(l.config.n_layers == n_layers);
  CHECK(l.config.dim == dim);
  CHECK(l.config.n_heads == n_heads);
  CHECK(l.config.n_kv_heads == n_kv);
  CHECK(l.config.head_dim == hd);
  CHECK(l.config.ffn_dim == ffn);
  CHECK(l.config.vocab == vocab);
  CHECK(l.weights.tied_embeddings);
  CHECK(l.weights.output.data == l.weights.token_embd.data);
  CHECK(l.weights.layers.size() == std::size_t(n_layers));
}

TEST_CASE("tinyllm: the full cache matches a dense HF-layout reference on every step") {
  const hf_model m = make_model(2);
  const loaded l(m);
  const std::vector<int> tokens = random_tokens(3, 40);
  llama_engine engine(l.config, l.weights, {{{policy_kind::full, 0, 0, 0}, 1}}, 40);
  reference ref{m, {}, {}};
  std::vector<float> logits(static_cast<std::size_t>(vocab));
  double worst = 0;
  for (int t = 0; t < 40; ++t) {
    const std::int32_t token = tokens[std::size_t(t)];
    engine.step(&token, logits.data());
    const std::vector<double> want = ref.step(token, t, [](int, int, int, int) { return true; });
    for (int i = 0; i < vocab; ++i) worst = std::max(worst, std::abs(logits[std::size_t(i)] - want[std::size_t(i)]));
  }
  CHECK(worst < 2e-3);
  CHECK(engine.position(0) == 40);
}

TEST_CASE("tinyllm: a recent window with sinks attends exactly to sinks + the newest tokens") {
  const hf_model m = make_model(4);
  const loaded l(m);
  const int steps = 36, sinks = 2, window = 5, seqs = 2;
  policy_spec spec{policy_kind::recent_window, sinks + window, sinks, 0};
  llama_engine engine(l.config, l.weights, {{spec, seqs}}, steps);
  std::vector<reference> refs(seqs, reference{m, {}, {}});
  std::vector<std::vector<int>> tokens = {random_tokens(5, steps), random_tokens(6, steps)};
  std::vector<float> logits(std::size_t(seqs * vocab));
  double worst = 0;
  for (int t = 0; t < steps; ++t) {
    const std::int32_t in[seqs] = {tokens[0][std::size_t(t)], tokens[1][std::size_t(t)]};
    engine.step(in, logits.data());
    for (int s = 0; s < seqs; ++s) {
      // before this step's eviction the cache holds budget + 1 tokens
      const std::vector<double> want =
          refs[std::size_t(s)].step(in[s], t, [&](int, int, int pos, int p) { return p < sinks || p >= pos - window; });
      for (int i = 0; i < vocab; ++i)
        worst = std::max(worst, std::abs(logits[std::size_t(s * vocab + i)] - want[std::size_t(i)]));
    }
  }
  CHECK(worst < 2e-3);
  const auto& slots = std::get<kvevict::recent_window_policy>(engine.cache(1, 0).policy()).slots();
  std::set<int> kept;
  for (int s = 0; s < slots.capacity(); ++s)
    if (slots.position(1, 0, s) >= 0) kept.insert(slots.position(1, 0, s));
  CHECK(kept == std::set<int>{0, 1, 31, 32, 33, 34, 35});
}

TEST_CASE("tinyllm: policies whose budget is never reached give the full cache's logits bit for bit") {
  const hf_model m = make_model(7);
  const loaded l(m);
  const int steps = 24;
  const std::vector<sequence_group> groups = {{{policy_kind::full, 0, 0, 0}, 1},
                                              {{policy_kind::h2o, steps, 0, 0}, 1},
                                              {{policy_kind::recent_window, steps, 4, 0}, 1},
                                              {{policy_kind::random, steps, 0, 9}, 1},
                                              {{policy_kind::exact_greedy, steps, 0, 0}, 1}};
  llama_engine engine(l.config, l.weights, groups, steps);
  const std::vector<int> tokens = random_tokens(8, steps);
  std::vector<float> logits(groups.size() * vocab);
  for (int t = 0; t < steps; ++t) {
    const std::vector<std::int32_t> in(groups.size(), tokens[std::size_t(t)]);
    engine.step(in.data(), logits.data());
    for (std::size_t g = 1; g < groups.size(); ++g)
      for (int i = 0; i < vocab; ++i) REQUIRE(logits[g * vocab + std::size_t(i)] == logits[std::size_t(i)]);
  }
}

TEST_CASE("tinyllm: h2o fed q + LSE makes the same decisions as h2o fed probabilities") {
  const hf_model m = make_model(10);
  const loaded l(m);
  const int steps = 40, budget = 6;
  policy_spec probs{policy_kind::h2o, budget, 0, 0};
  policy_spec lse = probs;
  lse.source = score_source::lse;
  llama_engine engine(l.config, l.weights, {{probs, 2}, {lse, 2}}, steps);
  const std::vector<int> a = random_tokens(11, steps), b = random_tokens(12, steps);
  std::vector<float> logits(4 * vocab);
  int evictions = 0;
  for (int t = 0; t < steps; ++t) {
    const std::int32_t in[4] = {a[std::size_t(t)], b[std::size_t(t)], a[std::size_t(t)], b[std::size_t(t)]};
    engine.step(in, logits.data());
    for (int layer = 0; layer < n_layers; ++layer) {
      const auto& x = std::get<kvevict::h2o_policy>(engine.cache(layer, 0).policy()).slots();
      const auto& y = std::get<kvevict::h2o_policy>(engine.cache(layer, 1).policy()).slots();
      for (int s = 0; s < 2; ++s)
        for (int h = 0; h < n_kv; ++h)
          for (int slot = 0; slot < x.capacity(); ++slot) REQUIRE(x.position(s, h, slot) == y.position(s, h, slot));
    }
    evictions += t > budget;
  }
  CHECK(evictions > 30);
}

TEST_CASE("tinyllm: bad input is rejected with a message that names it, and changes nothing") {
  const hf_model m = make_model(13);
  const loaded l(m);
  llama_engine engine(l.config, l.weights, {{{policy_kind::full, 0, 0, 0}, 1}}, 8);
  std::vector<float> logits(static_cast<std::size_t>(vocab));
  const std::int32_t bad = vocab;
  CHECK_THROWS_WITH_AS(engine.step(&bad, logits.data()), doctest::Contains("tokens[0] = 40"), std::out_of_range);
  CHECK(engine.position(0) == 0);

  gguf_test::writer w = model_writer(m);
  w.add("llama.attention.head_count_kv", gguf_test::u32(3));  // duplicate key: rejected by the reader
  CHECK_THROWS_AS(gguf_file::parse(w.build()), format_error);

  // a model without one tensor
  hf_model broken = m;
  gguf_test::writer w2 = model_writer(broken);
  const gguf_file f = gguf_file::parse(w2.build());
  llama_config c = llama_config::from_gguf(f);
  c.n_layers = 3;  // the file has two
  CHECK_THROWS_WITH_AS(llama_weights::from_gguf(f, c), doctest::Contains("blk.2.attn_norm.weight"), format_error);
  c = llama_config::from_gguf(f);
  c.ffn_dim = 50;  // wrong shape
  CHECK_THROWS_WITH_AS(llama_weights::from_gguf(f, c), doctest::Contains("ffn_gate.weight"), format_error);
}

TEST_CASE("tinyllm: h2o and random attend exactly to what their slot tables kept, per layer and head") {
  const hf_model m = make_model(14);
  const loaded l(m);
  const int steps = 30, budget = 7;
  for (const policy_kind kind : {policy_kind::h2o, policy_kind::random}) {
    CAPTURE(static_cast<int>(kind));
    llama_engine engine(l.config, l.weights, {{{kind, budget, 0, 5}, 1}}, steps);
    reference ref{m, {}, {}};
    const std::vector<int> tokens = random_tokens(15, steps);
    std::vector<float> logits(static_cast<std::size_t>(vocab));
    std::vector<std::set<int>> kept(std::size_t(n_layers * n_kv));  // after the previous step
    double worst = 0;
    for (int t = 0; t < steps; ++t) {
      const std::int32_t token = tokens[std::size_t(t)];
      engine.step(&token, logits.data());
      const std::vector<double> want = ref.step(token, t, [&](int layer, int h, int pos, int p) {
        return p == pos || kept[std::size_t(layer * n_kv + h)].count(p) > 0;
      });
      for (int i = 0; i < vocab; ++i) worst = std::max(worst, std::abs(logits[std::size_t(i)] - want[std::size_t(i)]));
      for (int layer = 0; layer < n_layers; ++layer) {
        const kvevict::slot_table& slots = std::visit(
            [](const auto& p) -> const kvevict::slot_table& { return p.slots(); }, engine.cache(layer, 0).policy());
        for (int h = 0; h < n_kv; ++h) {
          std::set<int>& k = kept[std::size_t(layer * n_kv + h)];
          k.clear();
          for (int s = 0; s < slots.capacity(); ++s)
            if (slots.position(0, h, s) >= 0) k.insert(slots.position(0, h, s));
          CHECK(k.size() == std::size_t(std::min(t + 1, budget)));
          CHECK(k.count(t) == (kind == policy_kind::h2o ? 1u : k.count(t)));  // h2o keeps its recent half
        }
      }
    }
    CHECK(worst < 2e-3);
  }
}

TEST_CASE("tinyllm: llama.cpp-style 8-bit activations follow their formulas") {
  std::mt19937 rng(16);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> x(96);
  for (float& v : x) v = u(rng);
  x[40] = 0.0f;
  std::vector<q8_activations> blocks(3);
  quantize_q8(x.data(), 96, blocks.data());
  for (int b = 0; b < 3; ++b) {
    float amax = 0;
    int sum = 0, qmax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(x[std::size_t(b * 32 + j)]));
    const float d = amax / 127.0f;
    for (int j = 0; j < 32; ++j) {
      const int q = blocks[std::size_t(b)].q[j];
      sum += q;
      qmax = std::max(qmax, std::abs(q));
      CHECK(std::abs(x[std::size_t(b * 32 + j)] - static_cast<float>(q) * d) <= d * 0.5f * 1.0001f);  // nearest level
    }
    CHECK(qmax == 127);
    CHECK(blocks[std::size_t(b)].d == round_to_half(d));
    CHECK(blocks[std::size_t(b)].s == round_to_half(d * float(sum)));
  }
  CHECK_THROWS_AS(quantize_q8(x.data(), 40, blocks.data()), format_error);

  // One Q4_1 and one Q8_0 row of three blocks against the formula.
  std::vector<std::uint8_t> q41, q80;
  std::vector<int> nib(96), w8(96);
  const float dw = 0.125f, mw = -0.5f;
  for (int b = 0; b < 3; ++b) {
    const auto put_half = [](std::vector<std::uint8_t>& out, float v) {
      const std::uint16_t h = kvevict::float_to_half(v).bits;
      out.push_back(static_cast<std::uint8_t>(h & 0xFF));
      out.push_back(static_cast<std::uint8_t>(h >> 8));
    };
    put_half(q41, dw);
    put_half(q41, mw);
    put_half(q80, dw);
    for (int j = 0; j < 16; ++j) {
      nib[std::size_t(b * 32 + j)] = (j * 7 + b) % 16;
      nib[std::size_t(b * 32 + j + 16)] = (j * 5 + 3 * b) % 16;
      q41.push_back(static_cast<std::uint8_t>(nib[std::size_t(b * 32 + j)] | nib[std::size_t(b * 32 + j + 16)] << 4));
    }
    for (int j = 0; j < 32; ++j) {
      w8[std::size_t(b * 32 + j)] = (j * 37 + b * 11) % 255 - 127;
      q80.push_back(static_cast<std::uint8_t>(static_cast<std::int8_t>(w8[std::size_t(b * 32 + j)])));
    }
  }
  double want41 = 0, want80 = 0;
  for (int b = 0; b < 3; ++b) {
    const q8_activations& a = blocks[std::size_t(b)];
    long s41 = 0, s80 = 0;
    for (int j = 0; j < 32; ++j) {
      s41 += nib[std::size_t(b * 32 + j)] * a.q[j];
      s80 += w8[std::size_t(b * 32 + j)] * a.q[j];
    }
    want41 += double(dw) * a.d * double(s41) + double(mw) * a.s;
    want80 += double(dw) * a.d * double(s80);
  }
  CHECK(dot_q8(ggml_type::q4_1, q41.data(), blocks.data(), 96) == doctest::Approx(want41).epsilon(1e-5));
  CHECK(dot_q8(ggml_type::q8_0, q80.data(), blocks.data(), 96) == doctest::Approx(want80).epsilon(1e-5));
  CHECK_THROWS_AS(dot_q8(ggml_type::f32, q80.data(), blocks.data(), 96), format_error);
}

TEST_CASE("tinyllm: llama.cpp-style rounding stays close to the exact model") {
  const hf_model m = make_model(17);
  const loaded l(m);
  const int steps = 20;
  llama_engine engine(l.config, l.weights, {{{policy_kind::full, 0, 0, 0}, 1}}, steps, numerics::llama_cpp());
  reference ref{m, {}, {}};
  const std::vector<int> tokens = random_tokens(18, steps);
  std::vector<float> logits(static_cast<std::size_t>(vocab));
  double worst = 0, scale = 0;
  for (int t = 0; t < steps; ++t) {
    const std::int32_t token = tokens[std::size_t(t)];
    engine.step(&token, logits.data());
    const std::vector<double> want = ref.step(token, t, [](int, int, int, int) { return true; });
    for (int i = 0; i < vocab; ++i) {
      worst = std::max(worst, std::abs(logits[std::size_t(i)] - want[std::size_t(i)]));
      scale = std::max(scale, std::abs(want[std::size_t(i)]));
    }
  }
  CHECK(worst > 0.0);  // it does round
  CHECK(worst < 0.05 * scale);
  const std::int32_t token = 0;
  CHECK_THROWS_AS(engine.step(&token, logits.data()), std::length_error);  // past max_tokens
}
