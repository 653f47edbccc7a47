// llama_kvevict: llama.cpp's own decode loop with kvevict owning the KV
// cells of every (layer, KV head) (kvevict_llama.hpp), beside stock
// llama.cpp with the full cache (docs/llama-cpp.md).
//
//   generate    a prompt, then greedy tokens: the text, KV bytes, tokens/s
//   perplexity  teacher-forced windows of a text, each policy streamed
//               token by token, with the metrics of tinyllm's evaluation
//               (kvevict_fidelity eval), so the two engines can be compared
//   needle      kvevict_needle's trials (the same prompts), the prompt
//               streamed through the decode cycle, greedy answers
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "kvevict_llama.hpp"
#include "tinyllm/eval_common.hpp"

namespace {

using kvevict_llama::head_cells_cache;
using tinyllm::clock_type;
using tinyllm::seconds_since;

struct options {
  std::string mode, model, prompt, text, json;
  std::vector<std::string> policies = {"full", "h2o", "tova", "recent_window", "key_norm"};
  std::vector<std::string> prefill;  // prompt compression rules (generate, needle)
  std::vector<std::string> placements = {"in"};
  std::vector<int> budgets = {20};  // percent of the context (generate, needle) or window (perplexity)
  std::vector<std::int32_t> lengths = {512};     // needle: prompt lengths
  std::vector<double> depths = {0.1, 0.5, 0.9};  // needle: where the needle sits
  std::int32_t words = 4, generate = 8, stride = 4000;  // needle: trials per depth, answer tokens, text stride
  std::int32_t tokens = 64, window = 1024, windows = 1, offset = 0, threads = 2, prompt_tokens = 0;
  ggml_type kv_type = GGML_TYPE_F16;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "%s\nusage: llama_kvevict generate   --model M (--prompt TEXT | --prompt-file F | --text F --prompt-tokens N)\n"
               "                                  [--tokens 64]\n"
               "       llama_kvevict perplexity --model M --text F [--window 1024] [--windows 1] [--offset 0]\n"
               "       llama_kvevict needle     --model M --text F [--lengths 512] [--depths 0.1,0.5,0.9] [--words 4]\n"
               "                                  [--generate 8] [--offset 1000] [--stride 4000]\n"
               "  all:  [--policies full,h2o,tova,decayed,recent_window,key_norm,key_diff,random] [--budgets 20]\n"
               "        [--prefill h2o,tova,decayed,key_norm,key_diff,snapkv,recent_window] [--placements in,out]\n"
               "        [--kv-type f16|f32] [--threads 2] [--json out.json]\n",
               why.c_str());
  std::exit(2);
}

std::int32_t to_int(const std::string& flag, const std::string& v) {
  std::int32_t x = 0;
  if (tinyllm::parse_int(v, 0, 0x7FFFFFFF, x)) return x;
  usage(flag + " takes a non-negative integer, got \"" + v + "\"");
}

options parse(int argc, char** argv) {
  if (argc < 2) usage("no mode");
  options o;
  o.mode = argv[1];
  if (o.mode != "generate" && o.mode != "perplexity" && o.mode != "needle") usage("unknown mode " + o.mode);
  if (o.mode == "needle") o.offset = 1000;  // kvevict_needle's default
  for (int i = 2; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(a + " needs a value");
    const std::string v = argv[i + 1];
    if (a == "--model") o.model = v;
    else if (a == "--prompt") o.prompt = v;
    else if (a == "--prompt-file") o.prompt = tinyllm::read_file(v);
    else if (a == "--text") o.text = v;
    else if (a == "--json") o.json = v;
    else if (a == "--policies") o.policies = tinyllm::names(v);
    else if (a == "--prefill") o.prefill = tinyllm::names(v);
    else if (a == "--placements") o.placements = tinyllm::split_list(v);
    else if (a == "--budgets") {
      o.budgets.clear();
      for (const std::string& b : tinyllm::split_list(v)) o.budgets.push_back(to_int(a, b));
    } else if (a == "--tokens") o.tokens = to_int(a, v);
    else if (a == "--prompt-tokens") o.prompt_tokens = to_int(a, v);
    else if (a == "--window") o.window = to_int(a, v);
    else if (a == "--windows") o.windows = to_int(a, v);
    else if (a == "--offset") o.offset = to_int(a, v);
    else if (a == "--threads") o.threads = to_int(a, v);
    else if (a == "--words") o.words = to_int(a, v);
    else if (a == "--generate") o.generate = to_int(a, v);
    else if (a == "--stride") o.stride = to_int(a, v);
    else if (a == "--lengths") {
      o.lengths.clear();
      for (const std::string& x : tinyllm::split_list(v)) o.lengths.push_back(to_int(a, x));
    } else if (a == "--depths") {
      o.depths.clear();
      for (const std::string& x : tinyllm::split_list(v)) {
        double d = 0.0;
        if (!tinyllm::parse_fraction(x, d)) usage("--depths are fractions in [0, 1], got " + x);
        o.depths.push_back(d);
      }
    }
    else if (a == "--kv-type") {
      if (v == "f16") o.kv_type = GGML_TYPE_F16;
      else if (v == "f32") o.kv_type = GGML_TYPE_F32;
      else usage("--kv-type is f16 or f32, got " + v);
    } else usage("unknown option " + a);
  }
  if (o.model.empty()) usage("--model is required");
  if (o.mode == "generate" && o.prompt.empty() == (o.prompt_tokens == 0))
    usage("generate needs --prompt, --prompt-file, or --text with --prompt-tokens");
  if (o.mode != "generate" && o.text.empty()) usage(o.mode + " needs --text");
  if (o.words < 1 || o.words > tinyllm::num_needle_words || o.generate < 1)
    usage("--words in [1, " + std::to_string(tinyllm::num_needle_words) + "] and --generate >= 1");
  for (const std::string& p : o.placements)
    if (p != "in" && p != "out") usage("--placements are in and out, got " + p);
  if (o.mode == "perplexity" && !o.prefill.empty()) usage("perplexity streams every token: no --prefill");
  if (o.mode == "generate" && o.placements != std::vector<std::string>{"in"}) usage("generate compresses the whole prompt");
  if (o.window < 2 || o.windows < 1 || o.threads < 1) usage("--window >= 2, --windows >= 1 and --threads >= 1");
  for (int pct : o.budgets)
    if (pct < 1 || pct > 100) usage("--budgets are percentages in [1, 100]");
  return o;
}

// One configuration of the run: stock llama.cpp (full) or a kvevict policy.
struct variant {
  std::string name;
  int percent = 100;
  tinyllm::policy_spec spec;
  std::string placement;  // prompt compression (--prefill): "in" or "out", the question inside or after it
  bool full() const { return spec.kind == tinyllm::policy_kind::full; }
  bool compresses() const { return spec.prefill != tinyllm::prefill_kind::none; }
  std::string setting() const { return full() ? "full" : compresses() ? "prefill_" + placement : "decode"; }
};

// Every variant of the run, each kvevict spec checked against the model
// (head_cells_cache's constructor) before any context exists or any token runs.
std::vector<variant> make_variants(const options& o, const llama_model* model, std::int32_t context) {
  std::vector<variant> out;
  for (const std::string& name : o.policies) {
    if (name == "full") {
      out.push_back({"full", 100, {}, {}});
      continue;
    }
    for (int pct : o.budgets) {
      variant v{name, pct, {}, {}};
      const std::int32_t budget = static_cast<std::int32_t>(std::int64_t{context} * pct / 100);
      if (!tinyllm::decode_spec(name, budget, /*seed*/ 0, /*horizon*/ 0, v.spec))
        usage("unknown policy " + name);
      head_cells_cache check(model, v.spec);
      out.push_back(v);
    }
  }
  for (const std::string& name : o.prefill)
    for (const std::string& place : o.placements)
      for (int pct : o.budgets) {
        variant v{name, pct, {}, place};
        const std::int32_t budget = static_cast<std::int32_t>(std::int64_t{context} * pct / 100);
        if (!tinyllm::prefill_spec(name, budget, v.spec)) usage("unknown prefill " + name);
        head_cells_cache check(model, v.spec);
        out.push_back(v);
      }
  return out;
}

struct model_deleter {
  void operator()(llama_model* m) const { llama_model_free(m); }
};
struct context_deleter {
  void operator()(llama_context* c) const { llama_free(c); }
};
using model_ptr = std::unique_ptr<llama_model, model_deleter>;
using context_ptr = std::unique_ptr<llama_context, context_deleter>;

// A context of `variant`: stock with `cells` cells, or kvevict's budget + 1.
struct session {
  std::unique_ptr<head_cells_cache> cache;  // null: stock llama.cpp
  context_ptr ctx;
  llama_context_params base;  // threads and K/V types, for a prompt's own context

  session(llama_model* model, const variant& v, const options& o, std::int32_t cells) {
    llama_context_params p = llama_context_default_params();
    p.n_ctx = static_cast<std::uint32_t>(cells);
    p.n_batch = static_cast<std::uint32_t>(std::max<std::int32_t>(cells, 1));  // a whole prompt per llama_decode
    p.n_ubatch = std::min<std::uint32_t>(p.n_batch, 512);                      // in llama.cpp's default ubatches
    p.n_threads = p.n_threads_batch = o.threads;
    p.type_k = p.type_v = o.kv_type;
    p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;  // the same attention arithmetic for every variant
    base = p;
    if (!v.full()) {
      cache = std::make_unique<head_cells_cache>(model, v.spec);
      p = cache->context_params(p);
      p.n_batch = p.n_ubatch = 512;
    }
    ctx.reset(llama_init_from_model(model, p));
    if (!ctx) throw kvevict_llama::error("llama_init_from_model failed for " + v.name);
    if (cache) cache->bind(ctx.get());
  }

  void reset() {
    if (cache) cache->reset();
    else llama_memory_clear(llama_get_memory(ctx.get()), true);
  }

  // One token through llama_decode (and, under kvevict, the cycle around it).
  const float* step(llama_token token) {
    if (cache) cache->before_decode();
    if (llama_decode(ctx.get(), llama_batch_get_one(&token, 1)) != 0) throw kvevict_llama::error("llama_decode failed");
    if (cache) cache->after_decode();
    return llama_get_logits_ith(ctx.get(), -1);
  }

  // Prompt compression: the prompt's pass and kvevict's prefill; the logits
  // of its last token.
  std::vector<float> compress(const std::vector<llama_token>& prompt) { return cache->prefill(prompt, base); }

  // The bytes of every layer's K and V tensors.
  std::size_t kv_bytes(std::int32_t layers) const {
    std::size_t total = 0;
    for (std::int32_t il = 0; il < layers; ++il) {
      ggml_tensor *k = nullptr, *v = nullptr;
      bool trans = false;
      if (llama_kv_head_cells_layer(ctx.get(), il, &k, &v, &trans) == 0) total += ggml_nbytes(k) + ggml_nbytes(v);
    }
    return total;
  }
};

std::vector<llama_token> tokenize(const llama_vocab* vocab, const std::string& text) {
  std::vector<llama_token> ids(text.size() + 16);
  const std::int32_t n = llama_tokenize(vocab, text.data(), static_cast<std::int32_t>(text.size()), ids.data(),
                                        static_cast<std::int32_t>(ids.size()), /*add_special*/ false, /*parse_special*/ false);
  if (n < 0) throw kvevict_llama::error("tokenize: the text does not fit its token buffer");
  ids.resize(std::size_t(n));
  return ids;
}

std::string piece(const llama_vocab* vocab, llama_token t) {
  char buf[256];
  const std::int32_t n = llama_token_to_piece(vocab, t, buf, sizeof buf, 0, false);
  return n > 0 ? std::string(buf, std::size_t(n)) : std::string();
}

std::int32_t argmax(const float* logits, std::int32_t vocab) {
  return static_cast<std::int32_t>(std::max_element(logits, logits + vocab) - logits);
}

int run_generate(const options& o, llama_model* model) {
  const llama_vocab* vocab = llama_model_get_vocab(model);
  std::vector<llama_token> prompt = tokenize(vocab, o.prompt_tokens ? tinyllm::read_file(o.text) : o.prompt);
  if (o.prompt_tokens) {  // the text's first tokens, for a context of a given length
    if (std::int64_t(prompt.size()) < o.prompt_tokens)
      throw kvevict_llama::error("the text has " + std::to_string(prompt.size()) + " tokens, fewer than --prompt-tokens");
    prompt.resize(std::size_t(o.prompt_tokens));
  }
  if (prompt.empty()) throw kvevict_llama::error("the prompt has no tokens");
  const std::int32_t context = static_cast<std::int32_t>(prompt.size()) + o.tokens;
  if (context > llama_model_n_ctx_train(model))
    throw kvevict_llama::error("prompt + tokens = " + std::to_string(context) + " exceeds the model's trained context " +
                               std::to_string(llama_model_n_ctx_train(model)));
  const std::int32_t n_vocab = llama_vocab_n_tokens(vocab);
  const std::vector<variant> variants = make_variants(o, model, context);
  std::ofstream js;
  if (!o.json.empty()) js.open(o.json);
  if (js) js << "{\"prompt_tokens\": " << prompt.size() << ", \"tokens\": " << o.tokens << ", \"threads\": " << o.threads << ", \"results\": [\n";
  std::printf("| policy | budget | KV bytes | prompt s | decode tokens/s | kvevict us per token and layer |\n"
              "|---|---|---|---|---|---|\n");
  std::vector<std::string> texts;
  for (std::size_t vi = 0; vi < variants.size(); ++vi) {
    const variant& v = variants[vi];
    session s(model, v, o, v.full() ? context : v.spec.budget + 1);
    std::vector<llama_token> ids = prompt;
    const auto t0 = clock_type::now();
    const float* logits = nullptr;
    std::vector<float> first;  // a compressed prompt's last logits
    if (v.full()) {  // stock llama.cpp: the prompt in one batch
      if (llama_decode(s.ctx.get(), llama_batch_get_one(ids.data(), static_cast<std::int32_t>(ids.size()))) != 0)
        throw kvevict_llama::error("llama_decode failed on the prompt");
      logits = llama_get_logits_ith(s.ctx.get(), -1);
    } else if (v.compresses()) {  // llama.cpp's prompt pass, then kvevict's prefill
      first = s.compress(prompt);
      logits = first.data();
    } else {  // the decode-time protocol: the prompt streamed through the cycle
      for (llama_token t : prompt) logits = s.step(t);
    }
    const double prompt_s = seconds_since(t0);
    std::string text;
    const auto t1 = clock_type::now();
    for (std::int32_t i = 0; i < o.tokens; ++i) {
      const llama_token next = argmax(logits, n_vocab);
      text += piece(vocab, next);
      if (i + 1 < o.tokens) logits = s.step(next);
    }
    const double decode_s = seconds_since(t1);
    const double tps = o.tokens > 1 ? (o.tokens - 1) / decode_s : 0.0;
    const std::int32_t layers = llama_model_n_layer(model);
    const std::size_t bytes = s.kv_bytes(layers);
    // the adapter's time over every step it served (prompt and answer)
    const double us = s.cache ? 1e6 * s.cache->seconds() / (double(prompt.size() + o.tokens - 1) * layers) : 0.0;
    char cost[32] = "-";
    if (s.cache) std::snprintf(cost, sizeof cost, "%.1f", us);
    const std::string label = v.compresses() ? v.name + " prefill" : v.name;
    std::printf("| %s | %d%% (%d) | %zu | %.2f | %.1f | %s |\n", label.c_str(), v.percent,
                v.full() ? context : v.spec.budget, bytes, prompt_s, tps, cost);
    texts.push_back(text);
    if (js) {
      std::string esc;
      for (char c : text) {
        if (c == '"' || c == '\\') esc += '\\', esc += c;
        else if (c == '\n') esc += "\\n";
        else if (static_cast<unsigned char>(c) < 0x20) esc += ' ';
        else esc += c;
      }
      js << "  {\"setting\": \"" << v.setting() << "\", \"policy\": \"" << v.name << "\", \"percent\": " << v.percent << ", \"kv_bytes\": " << bytes
         << ", \"prompt_seconds\": " << prompt_s << ", \"decode_tokens_per_second\": " << tps
         << ", \"kvevict_us_per_token_layer\": " << us << ", \"text\": \"" << esc
         << "\"}" << (vi + 1 < variants.size() ? "," : "") << "\n";
    }
  }
  for (std::size_t vi = 0; vi < variants.size(); ++vi)
    std::printf("\n--- %s%s %d%% ---\n%s\n", variants[vi].name.c_str(), variants[vi].compresses() ? " prefill" : "",
                variants[vi].percent, texts[vi].c_str());
  if (js) js << "]}\n";
  return 0;
}

int run_perplexity(const options& o, llama_model* model) {
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const std::vector<llama_token> ids = tokenize(vocab, tinyllm::read_file(o.text));
  const std::int32_t length = o.window, windows = o.windows;
  if (std::int64_t{o.offset} + std::int64_t{length} * windows > std::int64_t(ids.size()))
    throw kvevict_llama::error("the text has " + std::to_string(ids.size()) + " tokens, fewer than --offset + --windows x --window");
  std::vector<variant> variants = make_variants(o, model, length);
  if (variants.empty() || !variants.front().full()) variants.insert(variants.begin(), variant{"full", 100, {}, {}});
  const std::int32_t n_vocab = llama_vocab_n_tokens(vocab);
  const std::size_t per = std::size_t(windows) * length;
  std::vector<double> nll(variants.size() * per, 0.0);
  std::vector<std::int32_t> top1(variants.size() * per, -1);
  std::vector<double> seconds(variants.size());
  for (std::size_t g = 0; g < variants.size(); ++g) {
    session s(model, variants[g], o, variants[g].full() ? length : variants[g].spec.budget + 1);
    const auto t0 = clock_type::now();
    for (std::int32_t win = 0; win < windows; ++win) {
      s.reset();
      const std::size_t base = g * per + std::size_t(win) * length, first = std::size_t(o.offset) + std::size_t(win) * length;
      for (std::int32_t t = 0; t < length; ++t) {
        const float* logits = s.step(ids[first + t]);
        if (t + 1 < length) {
          const tinyllm::prediction p = tinyllm::predict(logits, n_vocab, ids[first + t + 1]);
          nll[base + t] = p.nll;
          top1[base + t] = p.top1;
        }
      }
    }
    seconds[g] = seconds_since(t0);
    std::fprintf(stderr, "%s %d%%: %.1f s\n", variants[g].name.c_str(), variants[g].percent, seconds[g]);
  }
  std::printf("llama.cpp teacher-forced streaming: %d windows x %d tokens from token %d (%d threads)\n\n", windows, length,
              o.offset, o.threads);
  std::printf("| policy | budget | ppl after eviction | full cache, same positions | top-1 agreement | ppl overall | tokens/s |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  std::ofstream js;
  if (!o.json.empty()) {
    js.open(o.json);
    js << "{\n  \"engine\": \"llama.cpp\", \"window\": " << length << ", \"windows\": " << windows << ", \"offset\": " << o.offset
       << ", \"threads\": " << o.threads << ", \"kv_type\": \"" << ggml_type_name(o.kv_type) << "\",\n  \"results\": [\n";
  }
  for (std::size_t g = 0; g < variants.size(); ++g) {
    const variant& v = variants[g];
    const tinyllm::metrics m = tinyllm::window_metrics(&nll[g * per], &top1[g * per], nll.data(), top1.data(), length,
                                                       windows, v.full() ? length : v.spec.budget, v.full());
    const double tps = double(per) / seconds[g];
    std::printf("| %s | %d%% (%d) | %.4f | %.4f | %.1f%% | %.4f | %.1f |\n", v.name.c_str(), v.percent,
                v.full() ? length : v.spec.budget, m.ppl_evicted, m.ppl_full_evicted, 100.0 * m.top1_agree, m.ppl_all, tps);
    if (js)
      js << "    {\"policy\": \"" << v.name << "\", \"percent\": " << v.percent << ", \"budget\": "
         << (v.full() ? length : v.spec.budget) << ", \"ppl_evicted\": " << m.ppl_evicted
         << ", \"ppl_full_same_positions\": " << m.ppl_full_evicted << ", \"top1_agreement\": " << m.top1_agree
         << ", \"ppl_all\": " << m.ppl_all << ", \"positions_after_eviction\": " << m.positions_after_eviction
         << ", \"tokens_per_second\": " << tps << "}" << (g + 1 < variants.size() ? "," : "") << "\n";
  }
  if (js) js << "  ]\n}\n";
  return 0;
}

// llama.cpp's tokenizer in the form tinyllm::make_trial takes.
struct llama_tokenizer {
  const llama_vocab* vocab;
  std::vector<std::int32_t> encode(const std::string& text) const { return tokenize(vocab, text); }
  std::string decode(const std::vector<std::int32_t>& ids) const {
    std::string out;
    for (std::int32_t id : ids) out += piece(vocab, id);
    return out;
  }
};

int run_needle(const options& o, llama_model* model) {
  const llama_tokenizer tok{llama_model_get_vocab(model)};
  const std::vector<llama_token> ids = tok.encode(tinyllm::read_file(o.text));
  const std::int32_t n_vocab = llama_vocab_n_tokens(tok.vocab);
  std::ofstream js;
  if (!o.json.empty()) js.open(o.json);
  if (js) js << "{\"engine\": \"llama.cpp\", \"generate\": " << o.generate << ", \"results\": [\n";
  std::printf("| setting | policy | budget | length | correct / trials |\n|---|---|---|---|---|\n");
  std::string rows;
  for (std::int32_t length : o.lengths) {
    std::vector<tinyllm::trial> trials;
    for (double depth : o.depths)
      for (std::int32_t k = 0; k < o.words; ++k)
        trials.push_back(tinyllm::make_trial(tok, ids, o.offset + k * o.stride, length, depth, k));
    std::vector<variant> variants = make_variants(o, model, length);
    for (const variant& v : variants) {
      session s(model, v, o, v.full() ? length + o.generate : v.spec.budget + 1);
      std::int32_t correct = 0;
      std::string cells;
      for (const tinyllm::trial& t : trials) {
        s.reset();
        const float* logits = nullptr;
        std::size_t fed = 0;
        std::vector<float> first;
        if (v.compresses()) {  // the prompt, or (out) the prompt without its question, compressed
          fed = t.prompt.size() - (v.placement == "out" ? std::size_t(t.question) : 0);
          first = s.compress(std::vector<llama_token>(t.prompt.begin(), t.prompt.begin() + std::ptrdiff_t(fed)));
          logits = first.data();
        }
        for (std::size_t i = fed; i < t.prompt.size(); ++i) logits = s.step(t.prompt[i]);
        std::vector<std::int32_t> answer;
        for (std::int32_t i = 0; i < o.generate; ++i) {
          answer.push_back(argmax(logits, n_vocab));
          if (i + 1 < o.generate) logits = s.step(answer.back());
        }
        const bool ok = tinyllm::contains_word(tok.decode(answer), tinyllm::needle_words[t.word]);
        correct += ok;
        cells += std::string(cells.empty() ? "" : ", ") + "[" + std::to_string(t.depth) + ", " + (ok ? "1" : "0") + "]";
      }
      std::printf("| %s | %s | %d%% | %d | %d / %zu |\n", v.setting().c_str(), v.name.c_str(), v.percent, length, correct,
                  trials.size());
      std::fflush(stdout);
      rows += std::string(rows.empty() ? "" : ",\n") + "  {\"setting\": \"" + v.setting() +
              "\", \"policy\": \"" + v.name + "\", \"percent\": " + std::to_string(v.percent) + ", \"length\": " +
              std::to_string(length) + ", \"correct\": " + std::to_string(correct) + ", \"trials\": " +
              std::to_string(trials.size()) + ", \"by_depth\": [" + cells + "]}";
    }
  }
  if (js) js << rows << "\n]}\n";
  return 0;
}

void quiet_log(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  llama_log_set(quiet_log, nullptr);
  llama_backend_init();
  try {
    llama_model_params mp = llama_model_default_params();
    model_ptr model(llama_model_load_from_file(o.model.c_str(), mp));
    if (!model) throw kvevict_llama::error("cannot load " + o.model);
    if (o.mode == "needle") return run_needle(o, model.get());
    return o.mode == "generate" ? run_generate(o, model.get()) : run_perplexity(o, model.get());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama_kvevict: %s\n", e.what());
    return 1;
  }
}
