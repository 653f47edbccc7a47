// kvevict_needle: needle retrieval on a real model (docs/fidelity.md).
//
// A haystack of the evaluation's text with one sentence carrying a secret
// word, said twice in a row, inserted at a chosen depth, then "Question: What
// is the secret word? Answer: The secret word is"; greedy decoding; a trial is
// correct when the answer contains the word. Per context length:
//   1. the full cache answers every trial (recording its attention when the
//      look-ahead oracle runs);
//   2. every other variant of every trial runs in one batch, so each step
//      reads the weights once for all of them:
//      (a) decode-time eviction: the whole prompt streamed through the decode
//          cycle at the budget;
//      (b) prompt compression: the prompt (the question inside) or the prompt
//          without its question (outside) processed with every key cached,
//          then the library's prefill keeps the budget; the question (when
//          outside) and the answer go through the decode cycle at the budget.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "tinyllm/engine.hpp"
#include "tinyllm/eval_common.hpp"

namespace {

using namespace tinyllm;

struct options {
  std::string model, text, json;
  std::vector<std::int32_t> lengths = {256, 512, 1024};
  std::vector<double> depths = {0.1, 0.5, 0.9};
  std::int32_t words = 4, generate = 8, offset = 1000, stride = 4000, horizon = 0;
  std::vector<int> budgets = {10, 20};
  std::vector<std::string> policies = {"h2o",      "tova",     "decayed",          "recent_window",
                                       "key_norm", "key_diff", "random_protected", "exact_greedy_protected",
                                       "lookahead", "topk"};
  std::vector<std::string> prefill = {"h2o", "tova", "key_norm", "key_diff", "snapkv"};
  std::vector<std::string> placements = {"in", "out"};
  std::uint64_t seed = 1;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "error: %s\n"
               "usage: kvevict_needle --model FILE.gguf --text FILE.txt [--json FILE]\n"
               "  [--lengths 256,512,1024] [--depths 0.1,0.5,0.9] [--words 4 (at most %d)] [--budgets 10,20]\n"
               "  [--policies h2o,tova,decayed,recent_window,key_norm,key_diff,random_protected,\n"
               "              exact_greedy_protected,lookahead,topk]  (decode time; \"none\": the full cache only)\n"
               "  [--prefill h2o,tova,key_norm,key_diff,snapkv,recent_window]  (prompt compression; \"none\")\n"
               "  [--placements in,out] [--generate 8] [--offset 1000] [--stride 4000] [--horizon 0] [--seed 1]\n"
               "threads: OMP_NUM_THREADS\n",
               why.c_str(), num_needle_words);
  std::exit(2);
}

std::int32_t to_int(const std::string& flag, const std::string& v, long lo, long hi) {
  std::int32_t x = 0;
  if (parse_int(v, lo, hi, x)) return x;
  usage(flag + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got \"" + v + "\"");
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--model") o.model = v;
    else if (a == "--text") o.text = v;
    else if (a == "--json") o.json = v;
    else if (a == "--lengths") {
      o.lengths.clear();
      for (const std::string& x : split_list(v)) o.lengths.push_back(to_int(a, x, 64, 1 << 16));
    } else if (a == "--depths") {
      o.depths.clear();
      for (const std::string& x : split_list(v)) {
        double d = 0.0;
        if (!parse_fraction(x, d)) usage("--depths are fractions in [0, 1], got " + x);
        o.depths.push_back(d);
      }
    } else if (a == "--budgets") {
      o.budgets.clear();
      for (const std::string& x : split_list(v)) o.budgets.push_back(to_int(a, x, 1, 99));
    } else if (a == "--words") o.words = to_int(a, v, 1, num_needle_words);
    else if (a == "--generate") o.generate = to_int(a, v, 1, 64);
    else if (a == "--offset") o.offset = to_int(a, v, 0, 1 << 30);
    else if (a == "--stride") o.stride = to_int(a, v, 0, 1 << 30);
    else if (a == "--horizon") o.horizon = to_int(a, v, 0, 1 << 30);
    else if (a == "--seed") o.seed = static_cast<std::uint64_t>(to_int(a, v, 0, 1 << 30));
    else if (a == "--policies") o.policies = names(v);
    else if (a == "--prefill") o.prefill = names(v);
    else if (a == "--placements") o.placements = names(v);
    else usage("unknown option " + a);
  }
  if (o.model.empty() || o.text.empty()) usage("--model and --text are required");
  policy_spec probe;
  for (const std::string& p : o.policies)
    if (!decode_spec(p, 100, 0, 0, probe)) usage("unknown --policies entry " + p);
  for (const std::string& p : o.prefill)
    if (!prefill_spec(p, 100, probe)) usage("unknown --prefill entry " + p);
  for (const std::string& p : o.placements)
    if (p != "in" && p != "out") usage("--placements are in and out, got " + p);
  return o;
}

struct variant {
  std::string setting, policy;  // setting: "decode", "prefill_in", "prefill_out" ("full" for the reference)
  int percent = 100;
  policy_spec spec;
};

/// Runs `groups` (one sequence per trial each) to the end of the prompts and
/// `generate` greedy tokens; returns each sequence's answer tokens.
std::vector<std::vector<std::int32_t>> run_batch(const llama_config& c, const llama_weights& w,
                                                 const std::vector<trial>& trials, const std::vector<variant>& variants,
                                                 std::int32_t generate, std::vector<std::unique_ptr<attention_record>>* record,
                                                 const std::vector<std::unique_ptr<attention_record>>* future) {
  const std::int32_t n = static_cast<std::int32_t>(trials.size()), length = std::int32_t(trials[0].prompt.size());
  std::vector<sequence_group> groups;
  for (const variant& v : variants) groups.push_back({v.spec, n});
  llama_engine engine(c, w, groups, length + generate);
  const std::int32_t batch = engine.batch();
  for (std::int32_t s = 0; s < batch; ++s) {  // sequence s = group * n + trial
    const variant& v = variants[std::size_t(s / n)];
    const trial& t = trials[std::size_t(s % n)];
    if (v.setting == "prefill_in") engine.set_prompt(s, length);
    if (v.setting == "prefill_out") engine.set_prompt(s, length - t.question);
    if (record) engine.set_record(s, (*record)[std::size_t(s % n)].get());
    if (v.spec.kind == policy_kind::lookahead) engine.set_future(s, (*future)[std::size_t(s % n)].get());
  }
  std::vector<std::vector<std::int32_t>> answers(static_cast<std::size_t>(batch));
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(batch));
  std::vector<float> logits(std::size_t(batch) * std::size_t(c.vocab));
  const auto t0 = clock_type::now();
  for (std::int32_t step = 0; step < length + generate - 1; ++step) {
    for (std::int32_t s = 0; s < batch; ++s)
      tokens[std::size_t(s)] = step < length ? trials[std::size_t(s % n)].prompt[std::size_t(step)] : answers[std::size_t(s)].back();
    engine.step(tokens.data(), logits.data());
    if (step + 1 >= length)
      for (std::int32_t s = 0; s < batch; ++s) {
        const float* l = &logits[std::size_t(s) * std::size_t(c.vocab)];
        answers[std::size_t(s)].push_back(std::int32_t(std::max_element(l, l + c.vocab) - l));
      }
    if ((step + 1) % 128 == 0)
      std::fprintf(stderr, "  step %d/%d, %.0f s\n", step + 1, length + generate - 1, seconds_since(t0));
  }
  return answers;
}

void write_json(const options& o, const std::string& rows, double seconds) {
  std::ofstream js(o.json);
  js << "{\n  \"model\": \"" << o.model.substr(o.model.find_last_of('/') + 1) << "\",\n  \"text\": \""
     << o.text.substr(o.text.find_last_of('/') + 1) << "\",\n  \"words\": " << o.words << ", \"generate\": " << o.generate
     << ", \"offset\": " << o.offset << ", \"stride\": " << o.stride << ", \"horizon\": " << o.horizon
     << ", \"seconds\": " << seconds << ", \"threads\": " << omp_threads() << ",\n  \"results\": [\n" << rows << "\n  ]\n}\n";
  if (!js) throw std::runtime_error("cannot write " + o.json);
}

int run(const options& o, const llama_config& c, const llama_weights& w, const bpe_tokenizer& tok,
        const std::vector<std::int32_t>& ids) {
  const auto t0 = clock_type::now();
  const bool oracle = std::find(o.policies.begin(), o.policies.end(), "lookahead") != o.policies.end();
  std::string rows;  // JSON rows
  std::printf("| setting | policy | budget | length | correct / trials |\n|---|---|---|---|---|\n");
  for (std::int32_t length : o.lengths) {
    std::vector<trial> trials;
    for (double depth : o.depths)
      for (std::int32_t k = 0; k < o.words; ++k)
        trials.push_back(make_trial(tok, ids, o.offset + k * o.stride, length, depth, k));
    const std::int32_t n = std::int32_t(trials.size());
    std::vector<variant> variants;
    for (int pct : o.budgets) {
      const std::int32_t budget = length * pct / 100;
      policy_spec s;
      for (const std::string& p : o.policies)
        if (decode_spec(p, budget, o.seed, o.horizon, s)) variants.push_back({"decode", p, pct, s});
      for (const std::string& place : o.placements)
        for (const std::string& p : o.prefill)
          if (prefill_spec(p, budget, s)) variants.push_back({"prefill_" + place, p, pct, s});
    }
    std::fprintf(stderr, "length %d: %d trials; full cache first, then %zu variants (batch %zu), %d threads\n", length,
                 n, variants.size(), variants.size() * trials.size(), omp_threads());
    std::vector<std::unique_ptr<attention_record>> record;
    if (oracle)
      for (std::int32_t i = 0; i < n; ++i)
        record.push_back(std::make_unique<attention_record>(c.n_layers, c.n_kv_heads, length + o.generate));
    const std::vector<variant> full = {{"full", "full", 100, {policy_kind::full, 0, 0, 0}}};
    std::vector<std::vector<std::int32_t>> answers = run_batch(c, w, trials, full, o.generate, oracle ? &record : nullptr, nullptr);
    if (!variants.empty()) {
      const auto more = run_batch(c, w, trials, variants, o.generate, nullptr, &record);
      answers.insert(answers.end(), more.begin(), more.end());
    }
    std::vector<variant> all = full;
    all.insert(all.end(), variants.begin(), variants.end());
    for (std::size_t g = 0; g < all.size(); ++g) {
      std::int32_t correct = 0;
      std::string cells;
      for (std::int32_t i = 0; i < n; ++i) {
        const std::string answer = tok.decode(answers[g * std::size_t(n) + std::size_t(i)]);
        const bool ok = contains_word(answer, needle_words[trials[std::size_t(i)].word]);
        correct += ok;
        if (g == 0 && !ok) std::fprintf(stderr, "  full cache missed %s at depth %.2f: \"%s\"\n", needle_words[trials[std::size_t(i)].word],
                                        trials[std::size_t(i)].depth, answer.c_str());
        cells += std::string(cells.empty() ? "" : ", ") + "[" + std::to_string(trials[std::size_t(i)].depth) + ", " + (ok ? "1" : "0") + "]";
      }
      const variant& v = all[g];
      std::printf("| %s | %s | %d%% | %d | %d / %d |\n", v.setting.c_str(), v.policy.c_str(), v.percent, length, correct, n);
      rows += std::string(rows.empty() ? "" : ",\n") + "    {\"setting\": \"" + v.setting + "\", \"policy\": \"" + v.policy +
              "\", \"percent\": " + std::to_string(v.percent) + ", \"length\": " + std::to_string(length) +
              ", \"correct\": " + std::to_string(correct) + ", \"trials\": " + std::to_string(n) + ", \"by_depth\": [" +
              cells + "]}";
    }
    std::fflush(stdout);
    // after every length, so that a long run stopped early keeps what it measured
    if (!o.json.empty()) write_json(o, rows, seconds_since(t0));
  }
  std::fprintf(stderr, "needle: %.0f s\n", seconds_since(t0));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    const gguf_file file = gguf_file::load(o.model);
    const llama_config config = llama_config::from_gguf(file);
    const llama_weights weights = llama_weights::from_gguf(file, config);
    const bpe_tokenizer tok = tokenizer_from_gguf(file);
    const std::vector<std::int32_t> ids = tok.encode(read_file(o.text));
    return run(o, config, weights, tok, ids);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvevict_needle: %s\n", e.what());
    return 1;
  }
}
