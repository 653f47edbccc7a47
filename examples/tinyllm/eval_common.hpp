#pragma once
// What the fidelity programs share: loading the model's tokenizer, reading
// numbers from the command line, and the policy names of docs/fidelity.md
// turned into engine specs.
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "tinyllm/gguf.hpp"
#include "tinyllm/layer_cache.hpp"
#include "tinyllm/tokenizer.hpp"

namespace tinyllm {

using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

inline int omp_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline bpe_tokenizer tokenizer_from_gguf(const gguf_file& f) {
  const std::string model = f.get_string("tokenizer.ggml.model");
  if (model != "gpt2") throw format_error("tokenizer.ggml.model = \"" + model + "\", only byte-level BPE (gpt2) is supported");
  return bpe_tokenizer(f.get_string_array("tokenizer.ggml.tokens"), f.get_string_array("tokenizer.ggml.merges"),
                       pretokenizer_from_name(f.get_string_or("tokenizer.ggml.pre", "default")));
}

inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

/// A comma list of names; "none" is the empty list.
inline std::vector<std::string> names(const std::string& v) {
  return v == "none" ? std::vector<std::string>{} : split_list(v);
}

/// The command lines' numbers: v as a whole integer in [lo, hi], or a
/// fraction in [0, 1]; false (out untouched) for anything else, so each
/// program words its own usage message.
inline bool parse_int(const std::string& v, long lo, long hi, std::int32_t& out) {
  try {
    std::size_t used = 0;
    const long x = std::stol(v, &used);
    if (used != v.size() || x < lo || x > hi) return false;
    out = static_cast<std::int32_t>(x);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}
inline bool parse_fraction(const std::string& v, double& out) {
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !(d >= 0.0 && d <= 1.0)) return false;
  out = d;
  return true;
}

/// The next token's negative log-likelihood (in double) and the top-1 token
/// of a row of logits.
struct prediction {
  double nll;
  std::int32_t top1;
};
inline prediction predict(const float* logits, std::int32_t vocab, std::int32_t target) {
  std::int32_t best = 0;
  for (std::int32_t i = 1; i < vocab; ++i)
    if (logits[i] > logits[best]) best = i;
  double sum = 0.0;
  for (std::int32_t i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - logits[best]);
  return {std::log(sum) + logits[best] - logits[target], best};
}

/// A policy's teacher-forced windows against the full cache's.
struct metrics {
  double ppl_evicted = 0, ppl_full_evicted = 0, ppl_all = 0, top1_agree = 0;
  std::int64_t positions_after_eviction = 0;
};

/// nll, top1 (and the full cache's ref_*): [windows][length], position t
/// predicting token t + 1 (the last position unused). "After eviction" is
/// t > budget, where the policy has already dropped a token (every position
/// for the full cache itself).
inline metrics window_metrics(const double* nll, const std::int32_t* top1, const double* ref_nll,
                              const std::int32_t* ref_top1, std::int32_t length, std::int32_t windows,
                              std::int32_t budget, bool full) {
  double sum_ev = 0, sum_full_ev = 0, sum_all = 0;
  std::int64_t n_ev = 0, n_all = 0, agree = 0;
  for (std::int64_t i = 0; i < std::int64_t{windows} * length; ++i) {
    const std::int32_t t = static_cast<std::int32_t>(i % length);
    if (t + 1 == length) continue;
    sum_all += nll[i];
    ++n_all;
    if (t > budget || full) {
      sum_ev += nll[i];
      sum_full_ev += ref_nll[i];
      agree += top1[i] == ref_top1[i];
      ++n_ev;
    }
  }
  metrics m;
  m.ppl_all = std::exp(sum_all / double(n_all));
  m.positions_after_eviction = n_ev;
  if (n_ev > 0) {
    m.ppl_evicted = std::exp(sum_ev / double(n_ev));
    m.ppl_full_evicted = std::exp(sum_full_ev / double(n_ev));
    m.top1_agree = double(agree) / double(n_ev);
  }
  return m;
}

/// Sinks of recent_window and of the *_protected rules (StreamingLLM's 4).
constexpr std::int32_t eval_sinks = 4;
/// The moving-attention decay between TOVA (0) and H2O (1) that `decayed`
/// names: attention j steps ago weighs 0.9^j, a half-life of about 6.6 steps.
constexpr float eval_decay = 0.9f;

/// Decode-time rules (streamed prompt, teacher-forced text). h2o, tova,
/// decayed, key_norm and key_diff share H2O's split (the newest budget / 2 kept, the
/// rest by score), so they differ only in the score; lookahead and topk are
/// the oracles. Returns false for an unknown name.
inline bool decode_spec(const std::string& name, std::int32_t budget, std::uint64_t seed, std::int32_t horizon,
                        policy_spec& out) {
  policy_spec s{policy_kind::full, budget, 0, seed};
  const std::int32_t recent_half = budget / 2;
  if (name == "h2o") s.kind = policy_kind::h2o;
  else if (name == "tova") s.kind = policy_kind::h2o, s.decay = 0.0f;
  else if (name == "decayed") s.kind = policy_kind::h2o, s.decay = eval_decay;
  else if (name == "key_norm") s.kind = policy_kind::key_norm;
  else if (name == "key_diff") s.kind = policy_kind::key_diff;
  else if (name == "recent_window") s.kind = policy_kind::recent_window, s.sinks = eval_sinks;
  else if (name == "recent_only") s.kind = policy_kind::recent_window;
  else if (name == "random") s.kind = policy_kind::random;
  else if (name == "random_protected") s.kind = policy_kind::random, s.sinks = eval_sinks, s.recent = recent_half;
  else if (name == "exact_greedy") s.kind = policy_kind::exact_greedy;
  else if (name == "exact_greedy_protected")
    s.kind = policy_kind::exact_greedy, s.sinks = eval_sinks, s.recent = recent_half;
  else if (name == "lookahead") s.kind = policy_kind::lookahead, s.horizon = horizon;
  else if (name == "topk") s.kind = policy_kind::topk;
  else return false;
  out = s;
  return true;
}

/// Prompt-compression rules: the prompt is processed with every key cached,
/// then the library's prefill keeps the budget (H2O's split again) and the
/// decode steps continue by the rule named (KeyDiff's running anchor for
/// key_diff, key norms for key_norm), h2o for snapkv.
inline bool prefill_spec(const std::string& name, std::int32_t budget, policy_spec& out) {
  policy_spec s{policy_kind::h2o, budget, 0, 0};
  if (name == "h2o") s.prefill = prefill_kind::attention;
  else if (name == "tova") s.prefill = prefill_kind::attention, s.decay = 0.0f;
  else if (name == "decayed") s.prefill = prefill_kind::attention, s.decay = eval_decay;
  else if (name == "key_norm") s.kind = policy_kind::key_norm, s.prefill = prefill_kind::key_norm;
  else if (name == "key_diff") s.kind = policy_kind::key_diff, s.prefill = prefill_kind::key_diff;
  else if (name == "snapkv") {
    s.prefill = prefill_kind::snapkv;
    s.snap_window = std::min(32, budget / 2);  // the paper's 32 rows, within the recent half at small budgets
  } else if (name == "recent_window")
    s.kind = policy_kind::recent_window, s.sinks = eval_sinks, s.prefill = prefill_kind::recent;
  else return false;
  out = s;
  return true;
}

// ---- needle retrieval (kvevict_needle, and the llama.cpp integration's check) ----
//
// A haystack of the evaluation's text with one sentence carrying a secret
// word, said twice in a row, inserted at a chosen depth, then "Question: What
// is the secret word? Answer: The secret word is"; a trial is correct when
// the greedy answer contains the word.

// Words absent from Botchan, so a correct answer can only come from the needle.
inline const char* const needle_words[] = {"pineapple", "telescope", "volcano",  "saxophone", "giraffe",  "lantern",
                                           "compass",   "dolphin",   "avalanche", "cinnamon", "harmonica", "kangaroo",
                                           "meteor",    "origami",   "pelican",  "tornado"};
inline constexpr std::int32_t num_needle_words = sizeof(needle_words) / sizeof(needle_words[0]);

struct trial {
  double depth;
  std::int32_t word;
  std::vector<std::int32_t> prompt;  // haystack with the needle, then the question
  std::int32_t question = 0;         // tokens of the question at the prompt's end
};

inline std::vector<std::int32_t> concat(std::vector<std::int32_t> a, const std::vector<std::int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// The prompt of `length` tokens: the text from `start`, the needle after the
/// sentence end nearest to depth x haystack (searched backwards), the
/// question. Tokenizer: encode(std::string) -> std::vector<std::int32_t> and
/// decode(std::vector<std::int32_t>) -> std::string (tinyllm's, or another
/// engine's own with the same vocabulary, so both ask the same questions).
template <class Tokenizer>
trial make_trial(const Tokenizer& tok, const std::vector<std::int32_t>& ids, std::int32_t start, std::int32_t length,
                 double depth, std::int32_t word) {
  const std::string w = needle_words[word];
  const std::vector<std::int32_t> needle =
      tok.encode(" The secret word is \"" + w + "\". The secret word is \"" + w + "\".");
  const std::vector<std::int32_t> question = tok.encode("\nQuestion: What is the secret word? Answer: The secret word is");
  const std::int64_t hay = std::int64_t{length} - std::int64_t(needle.size() + question.size());
  if (hay < 16) throw std::runtime_error("--lengths " + std::to_string(length) + " leaves no room for a haystack");
  if (start + hay > std::int64_t(ids.size())) throw std::runtime_error("the text is too short for this trial");
  std::int32_t at = static_cast<std::int32_t>(depth * double(hay) + 0.5);
  for (std::int32_t back = at; back > 0 && at - back < 64; --back)  // after a sentence's full stop
    if (tok.decode({ids[std::size_t(start + back - 1)]}).find('.') != std::string::npos) {
      at = back;
      break;
    }
  std::vector<std::int32_t> prompt(ids.begin() + start, ids.begin() + start + at);
  prompt = concat(concat(prompt, needle), std::vector<std::int32_t>(ids.begin() + start + at, ids.begin() + start + hay));
  trial t{depth, word, concat(prompt, question), static_cast<std::int32_t>(question.size())};
  return t;
}

inline bool contains_word(const std::string& answer, const std::string& word) {
  std::string lower = answer;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower.find(word) != std::string::npos;
}

}  // namespace tinyllm
