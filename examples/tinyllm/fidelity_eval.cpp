// kvevict_fidelity: what each eviction policy costs a real model in quality.
//
//   eval      teacher-forced streaming over windows of a text: every policy
//             variant of every window runs in one batch; reports perplexity
//             after the first eviction and overall, and top-1 agreement with
//             the full cache (markdown table on stdout, JSON with --json)
//   tokenize  writes the text's token ids, one per line (for the llama.cpp check)
//   score     one sequence, full cache: writes the float32 logits of each
//             position (for the llama.cpp check)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "tinyllm/engine.hpp"
#include "tinyllm/eval_common.hpp"

namespace {

using namespace tinyllm;

struct options {
  std::string mode = "eval";
  std::string model, text, out, json;
  std::int32_t window = 1024, windows = 4, offset = 0, positions = 1024;
  std::vector<int> budgets = {10, 20, 50};  // percent of the window
  std::vector<std::string> policies = {"full",     "h2o",      "tova",          "decayed",
                                       "recent_window", "key_norm", "key_diff", "random_protected",
                                       "exact_greedy_protected", "lookahead", "topk"};
  std::uint64_t seed = 1;
  std::int32_t horizon = 0;  // lookahead: future steps summed (0: the rest of the window)
  bool lse_check = false;
  numerics arithmetic;  // plain float
};

constexpr std::int32_t recent_window_sinks = eval_sinks;

bool known_policy(const std::string& p) {
  policy_spec probe;
  return p == "full" || decode_spec(p, 100, 0, 0, probe);
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "error: %s\n"
               "usage: kvevict_fidelity [eval|tokenize|score] --model FILE.gguf --text FILE.txt\n"
               "  eval:     [--window 1024] [--windows 4] [--offset 0] [--budgets 10,20,50]\n"
               "            [--policies full,h2o,tova,decayed,recent_window,key_norm,key_diff,\n"
               "                        random_protected,exact_greedy_protected,lookahead,topk]\n"
               "            (also recent_only, random, exact_greedy; *_protected: 4 sinks and h2o's\n"
               "             recent half never evicted; lookahead, topk: the oracles)\n"
               "            [--horizon 0 (lookahead's future steps; 0: the rest of the window)]\n"
               "            [--seed 1] [--lse-check] [--json FILE]\n"
               "  all:      [--numerics float|llama_cpp]  (default float; llama_cpp rounds as llama.cpp's CPU backend)\n"
               "  tokenize: --out FILE\n"
               "  score:    [--offset 0] [--positions 1024] --out FILE\n"
               "threads: OMP_NUM_THREADS\n",
               why.c_str());
  std::exit(2);
}

std::int32_t to_int(const std::string& flag, const std::string& v) {
  std::int32_t x = 0;
  if (parse_int(v, 0, 1 << 30, x)) return x;
  usage(flag + " expects a non-negative integer, got \"" + v + "\"");
}

options parse(int argc, char** argv) {
  options o;
  int i = 1;
  if (i < argc && argv[i][0] != '-') o.mode = argv[i++];
  if (o.mode != "eval" && o.mode != "tokenize" && o.mode != "score") usage("unknown mode " + o.mode);
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--lse-check") {
      o.lse_check = true;
      continue;
    }
    if (i + 1 >= argc) usage(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--model") o.model = v;
    else if (a == "--text") o.text = v;
    else if (a == "--out") o.out = v;
    else if (a == "--json") o.json = v;
    else if (a == "--numerics") {
      if (v == "float") o.arithmetic = numerics{};
      else if (v == "llama_cpp") o.arithmetic = numerics::llama_cpp();
      else usage("--numerics is float or llama_cpp, got " + v);
    }
    else if (a == "--window") o.window = to_int(a, v);
    else if (a == "--windows") o.windows = to_int(a, v);
    else if (a == "--offset") o.offset = to_int(a, v);
    else if (a == "--positions") o.positions = to_int(a, v);
    else if (a == "--seed") o.seed = static_cast<std::uint64_t>(to_int(a, v));
    else if (a == "--horizon") o.horizon = to_int(a, v);
    else if (a == "--policies") o.policies = split_list(v);
    else if (a == "--budgets") {
      o.budgets.clear();
      for (const std::string& b : split_list(v)) {
        const std::int32_t pct = to_int(a, b);
        if (pct < 1 || pct > 100) usage("--budgets are percentages in [1, 100], got " + b);
        o.budgets.push_back(pct);
      }
    } else usage("unknown option " + a);
  }
  if (o.model.empty() || o.text.empty()) usage("--model and --text are required");
  if (o.mode != "eval" && o.out.empty()) usage(o.mode + " needs --out");
  if (o.window < 2 || o.windows < 1) usage("--window must be at least 2 and --windows at least 1");
  if (o.mode == "score" && o.positions < 2) usage("--positions must be at least 2");
  for (const std::string& p : o.policies)
    if (!known_policy(p)) usage("unknown policy " + p);
  const bool has_h2o = std::find(o.policies.begin(), o.policies.end(), "h2o") != o.policies.end();
  if (o.lse_check && !has_h2o) usage("--lse-check compares with h2o, which --policies leaves out");
  bool has_protected = false;
  for (const std::string& p : o.policies) has_protected = has_protected || p.find("_protected") != std::string::npos;
  for (int pct : o.budgets) {
    const std::int64_t budget = std::int64_t{o.window} * pct / 100;
    if (budget <= recent_window_sinks)
      usage("a " + std::to_string(pct) + "% budget of a " + std::to_string(o.window) + "-token window leaves no room " +
            "beyond recent_window's " + std::to_string(recent_window_sinks) + " sinks");
    if (has_protected && budget - budget / 2 <= recent_window_sinks)
      usage("a " + std::to_string(pct) + "% budget of a " + std::to_string(o.window) + "-token window leaves the " +
            "*_protected policies nothing to evict beyond " + std::to_string(recent_window_sinks) +
            " sinks and h2o's recent half");
  }
  return o;
}

/// -log softmax(logits)[target] and the argmax (lowest id on ties).
struct variant {
  std::string name;  // policy name as on the command line
  int percent = 100;
  policy_spec spec;
};

std::vector<variant> make_variants(const options& o) {
  std::vector<variant> out;
  out.push_back({"full", 100, {policy_kind::full, o.window, 0, 0}});  // always: the reference of every metric
  for (int pct : o.budgets) {
    const std::int32_t budget = static_cast<std::int32_t>(std::int64_t{o.window} * pct / 100);
    const auto add = [&](const std::string& name, policy_kind kind, std::int32_t sinks, score_source source,
                         std::int32_t recent = 0) {
      policy_spec s{kind, budget, sinks, o.seed};
      s.source = source;
      s.recent = recent;
      out.push_back({name, pct, s});
    };
    for (const std::string& p : o.policies) {  // names were checked by parse
      policy_spec s;
      if (p != "full" && decode_spec(p, budget, o.seed, o.horizon, s)) out.push_back({p, pct, s});
    }
    if (o.lse_check) add("h2o_lse", policy_kind::h2o, 0, score_source::lse);
  }
  return out;
}

/// For --lse-check, after step `step`: counts the (layer, window, KV head)
/// whose slot tables are identical under h2o fed probabilities and h2o fed
/// q + LSE, once the policies have started evicting (before that the tables
/// are equal by construction). A difference persists, so this counts
/// identical states, not identical single decisions.
void count_same_slot_tables(const llama_engine& engine, const std::vector<variant>& variants, std::int32_t windows,
                            std::int32_t step, std::int64_t& same, std::int64_t& total) {
  for (std::size_t by_probs = 0; by_probs < variants.size(); ++by_probs) {
    if (variants[by_probs].name != "h2o" || step < variants[by_probs].spec.budget) continue;
    for (std::size_t by_lse = 0; by_lse < variants.size(); ++by_lse) {
      if (variants[by_lse].name != "h2o_lse" || variants[by_lse].percent != variants[by_probs].percent) continue;
      for (std::int32_t l = 0; l < engine.layers(); ++l) {
        const auto& x = std::get<kvevict::h2o_policy>(engine.cache(l, std::int32_t(by_probs)).policy()).slots();
        const auto& y = std::get<kvevict::h2o_policy>(engine.cache(l, std::int32_t(by_lse)).policy()).slots();
        for (std::int32_t w = 0; w < windows; ++w)
          for (std::int32_t h = 0; h < x.num_heads(); ++h) {
            same += std::equal(x.positions_of(w, h), x.positions_of(w, h) + x.capacity(), y.positions_of(w, h));
            ++total;
          }
      }
    }
  }
}

int run_tokenize(const options& o, const bpe_tokenizer& tok, const std::vector<std::int32_t>& ids) {
  std::ofstream out(o.out);
  for (std::int32_t id : ids) out << id << '\n';
  if (!out) throw std::runtime_error("cannot write " + o.out);
  std::printf("%zu tokens (vocabulary %d) -> %s\n", ids.size(), tok.vocab_size(), o.out.c_str());
  return 0;
}

int run_score(const options& o, const llama_config& c, const llama_weights& w, const std::vector<std::int32_t>& ids) {
  const std::int64_t end = std::int64_t{o.offset} + o.positions;
  if (end > std::int64_t(ids.size())) throw std::runtime_error("the text has only " + std::to_string(ids.size()) + " tokens");
  llama_engine engine(c, w, {{{policy_kind::full, 0, 0, 0}, 1}}, o.positions, o.arithmetic);
  std::vector<float> logits(static_cast<std::size_t>(c.vocab));
  std::ofstream out(o.out, std::ios::binary);
  double nll = 0.0;
  const auto t0 = clock_type::now();
  for (std::int32_t t = 0; t < o.positions; ++t) {
    const std::int32_t token = ids[std::size_t(o.offset + t)];
    engine.step(&token, logits.data());
    out.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * sizeof(float)));
    if (t + 1 < o.positions) nll += predict(logits.data(), c.vocab, ids[std::size_t(o.offset + t + 1)]).nll;
  }
  if (!out) throw std::runtime_error("cannot write " + o.out);
  std::printf("%d positions from token %d: perplexity %.4f, %.1f tokens/s -> %s\n", o.positions, o.offset,
              std::exp(nll / (o.positions - 1)), o.positions / seconds_since(t0), o.out.c_str());
  return 0;
}

int run_eval(const options& o, const llama_config& c, const llama_weights& w, const std::vector<std::int32_t>& ids) {
  const std::int32_t length = o.window, windows = o.windows;
  if (std::int64_t{o.offset} + std::int64_t{length} * windows > std::int64_t(ids.size()))
    throw std::runtime_error("the text has " + std::to_string(ids.size()) + " tokens, fewer than --offset + " +
                             "--windows x --window");
  const std::vector<variant> variants = make_variants(o);
  std::vector<sequence_group> groups;
  for (const variant& v : variants) groups.push_back({v.spec, windows});
  // The look-ahead oracle reads the full cache's attention of its window,
  // recorded first in a teacher-forced pass of the full cache alone.
  std::vector<std::unique_ptr<attention_record>> records;
  bool oracle = false;
  for (const variant& v : variants) oracle = oracle || v.spec.kind == policy_kind::lookahead;
  if (oracle) {
    llama_engine teacher(c, w, {{{policy_kind::full, 0, 0, 0}, windows}}, length, o.arithmetic);
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(windows));
    std::vector<float> logits(std::size_t(windows) * std::size_t(c.vocab));
    for (std::int32_t win = 0; win < windows; ++win) {
      records.push_back(std::make_unique<attention_record>(c.n_layers, c.n_kv_heads, length));
      teacher.set_record(win, records.back().get());
    }
    const auto t0 = clock_type::now();
    for (std::int32_t t = 0; t < length; ++t) {
      for (std::int32_t win = 0; win < windows; ++win) tokens[std::size_t(win)] = ids[std::size_t(o.offset + win * length + t)];
      teacher.step(tokens.data(), logits.data());
    }
    std::fprintf(stderr, "look-ahead oracle: full-cache attention of %d windows recorded in %.0f s\n", windows,
                 seconds_since(t0));
  }
  llama_engine engine(c, w, groups, length, o.arithmetic);
  const std::int32_t batch = engine.batch(), vocab = c.vocab;
  for (std::int32_t s = 0; s < batch; ++s)
    if (variants[std::size_t(s / windows)].spec.kind == policy_kind::lookahead)
      engine.set_future(s, records[std::size_t(s % windows)].get());
  std::fprintf(stderr, "%d variants x %d windows of %d tokens = batch %d, %d threads\n", int(variants.size()), windows, length, batch,
               omp_threads());

  // Sequence s = g * windows + win reads window win.
  std::vector<double> nll(std::size_t(batch) * length, 0.0);
  std::vector<std::int32_t> top1(std::size_t(batch) * length, -1);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(batch));
  std::vector<float> logits(std::size_t(batch) * vocab);
  std::int64_t lse_same = 0, lse_total = 0;
  const auto t0 = clock_type::now();
  for (std::int32_t t = 0; t < length; ++t) {
    for (std::int32_t s = 0; s < batch; ++s) tokens[std::size_t(s)] = ids[std::size_t(o.offset + (s % windows) * length + t)];
    engine.step(tokens.data(), logits.data());
    if (t + 1 < length)
      for (std::int32_t s = 0; s < batch; ++s) {
        const prediction p = predict(&logits[std::size_t(s) * vocab], vocab, ids[std::size_t(o.offset + (s % windows) * length + t + 1)]);
        nll[std::size_t(s) * length + t] = p.nll;
        top1[std::size_t(s) * length + t] = p.top1;
      }
    if (o.lse_check) count_same_slot_tables(engine, variants, windows, t, lse_same, lse_total);
    if ((t + 1) % 64 == 0 || t + 1 == length)
      std::fprintf(stderr, "step %d/%d, %.0f s\n", t + 1, length, seconds_since(t0));
  }
  const double elapsed = seconds_since(t0);

  std::vector<metrics> stats(variants.size());
  for (std::size_t g = 0; g < variants.size(); ++g) {
    const bool full = variants[g].spec.kind == policy_kind::full;
    const std::size_t first = g * std::size_t(windows) * length;  // group g's windows; full is group 0
    stats[g] = window_metrics(&nll[first], &top1[first], nll.data(), top1.data(), length, windows,
                              full ? length : variants[g].spec.budget, full);
  }

  std::printf("teacher-forced streaming: %d windows x %d tokens from token %d, batch %d, %.0f s (%d threads)\n\n", windows,
              length, o.offset, batch, elapsed, omp_threads());
  std::printf("| policy | budget | ppl after eviction | full cache, same positions | change | top-1 agreement | ppl overall |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (std::size_t g = 0; g < variants.size(); ++g) {
    const variant& v = variants[g];
    if (v.spec.kind == policy_kind::full) {
      std::printf("| full | 100%% | - | - | - | - | %.3f |\n", stats[g].ppl_all);
      continue;
    }
    std::printf("| %s | %d%% (%d) | %.3f | %.3f | %+.1f%% | %.1f%% | %.3f |\n", v.name.c_str(), v.percent,
                v.spec.budget, stats[g].ppl_evicted, stats[g].ppl_full_evicted,
                100.0 * (stats[g].ppl_evicted / stats[g].ppl_full_evicted - 1.0), 100.0 * stats[g].top1_agree, stats[g].ppl_all);
  }
  if (o.lse_check)
    std::printf("\nh2o fed q + LSE and h2o fed probabilities had identical slot tables in %lld of %lld "
                "(layer, window, KV head, step) checks after the first eviction\n",
                static_cast<long long>(lse_same), static_cast<long long>(lse_total));

  if (!o.json.empty()) {
    std::ofstream js(o.json);
    js << "{\n  \"model\": \"" << o.model.substr(o.model.find_last_of('/') + 1) << "\",\n"
       << "  \"text\": \"" << o.text.substr(o.text.find_last_of('/') + 1) << "\",\n"
       << "  \"window\": " << length << ", \"windows\": " << windows << ", \"offset\": " << o.offset << ", \"batch\": " << batch
       << ", \"seconds\": " << elapsed << ", \"threads\": " << omp_threads() << ", \"horizon\": " << o.horizon
       << ",\n  \"results\": [\n";
    for (std::size_t g = 0; g < variants.size(); ++g) {
      js << "    {\"policy\": \"" << variants[g].name << "\", \"percent\": " << variants[g].percent
         << ", \"budget\": " << (variants[g].spec.kind == policy_kind::full ? length : variants[g].spec.budget)
         << ", \"ppl_evicted\": " << stats[g].ppl_evicted << ", \"ppl_full_same_positions\": " << stats[g].ppl_full_evicted
         << ", \"top1_agreement\": " << stats[g].top1_agree << ", \"ppl_all\": " << stats[g].ppl_all
         << ", \"positions_after_eviction\": " << stats[g].positions_after_eviction << "}" << (g + 1 < variants.size() ? "," : "")
         << "\n";
    }
    js << "  ]";
    if (o.lse_check) js << ",\n  \"lse_check\": {\"same\": " << lse_same << ", \"total\": " << lse_total << "}";
    js << "\n}\n";
    if (!js) throw std::runtime_error("cannot write " + o.json);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    const auto t0 = clock_type::now();
    const gguf_file file = gguf_file::load(o.model);
    const llama_config config = llama_config::from_gguf(file);
    const llama_weights weights = llama_weights::from_gguf(file, config);
    const bpe_tokenizer tok = tokenizer_from_gguf(file);
    const std::vector<std::int32_t> ids = tok.encode(read_file(o.text));
    std::fprintf(stderr, "model: %d layers, %d/%d heads, head_dim %d, vocab %d; text: %zu tokens; loaded in %.1f s\n",
                 config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim, config.vocab, ids.size(),
                 seconds_since(t0));
    if (o.mode == "tokenize") return run_tokenize(o, tok, ids);
    if (o.mode == "score") return run_score(o, config, weights, ids);
    return run_eval(o, config, weights, ids);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvevict_fidelity: %s\n", e.what());
    return 1;
  }
}
