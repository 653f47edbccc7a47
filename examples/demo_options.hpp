#pragma once
// Command line of the demos (kvevict_demo, kvevict_demo_cuda): strict
// parsing and validation in the user's terms, before anything runs.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "kvevict/policy/budget.hpp"

namespace demo {

struct options {
  std::int32_t steps = 2048, seqs = 4, heads = 8, group = 1, head_dim = 128;
  std::int32_t page_size = 0;  ///< 0 until parsed: --page-size, or 16 capped at the capacity
  double budget = 0.2;
  std::string dtype = "bfloat16", layout = "bhsd";
  std::uint64_t seed = 1;

  /// Tokens each policy keeps: the budget fraction of the longest sequence,
  /// split like the H2O paper's "20%" (half heavy, half recent), each half
  /// rounded down.
  std::int32_t half_budget() const { return kvevict::tokens_for_ratio(steps, budget / 2); }
  std::int32_t budget_tokens() const { return 2 * half_budget(); }
};

/// What --help prints (to stdout) and errors print after the message (to stderr).
inline void print_usage(std::FILE* out, const char* program) {
  std::fprintf(out,
               "usage: %s [options]\n"
               "\n"
               "Streams a synthetic decode workload with heavy hitters through a full cache and\n"
               "through every kvevict policy at the same budget, and prints what each keeps.\n"
               "\n"
               "  --steps N        tokens of the longest sequence (default 2048); the others are\n"
               "                   5%% shorter each, so the batch is ragged\n"
               "  --seqs B         sequences in the batch (default 4)\n"
               "  --heads H        KV heads (default 8)\n"
               "  --group G        query heads per KV head, the GQA group size (default 1: MHA)\n"
               "  --head-dim D     elements per K/V row (default 128)\n"
               "  --budget F       tokens kept, as a fraction in (0, 1) of --steps (default 0.2):\n"
               "                   h2o keeps F/2 heavy hitters and F/2 recent tokens, recent_window\n"
               "                   4 sinks and the rest recent, random and exact_greedy F of any\n"
               "  --dtype T        K/V element type: float, half or bfloat16 (default bfloat16)\n"
               "  --layout L       K/V layout: bhsd, bshd or paged (default bhsd)\n"
               "  --page-size P    slots per page with --layout paged, at most the cache's capacity\n"
               "                   (the budget + 1 spare slot); default 16, or the capacity if smaller\n"
               "  --seed S         seed of the workload and of the random policy (default 1)\n"
               "  --help           this text\n",
               program);
}

namespace detail {

inline std::string number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

[[noreturn]] inline void fail(const char* program, const std::string& why) {
  std::fprintf(stderr, "%s: %s\n(%s --help lists the options)\n", program, why.c_str(), program);
  std::exit(2);
}

inline bool parse_integer(const std::string& text, long long lo, long long hi, long long& out) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || x < lo || x > hi) return false;
  out = x;
  return true;
}

}  // namespace detail

/// Parses and validates the command line; exits 0 after --help, 2 with a
/// message on stderr for anything wrong.
inline options parse(int argc, char** argv) {
  const char* program = argc > 0 ? argv[0] : "kvevict_demo";
  options o;
  const auto integer = [&](const std::string& flag, const std::string& text, long long lo, long long hi) {
    long long x = 0;
    if (!detail::parse_integer(text, lo, hi, x))
      detail::fail(program, flag + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                "], got \"" + text + "\"");
    return x;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      print_usage(stdout, program);
      std::exit(0);
    }
    if (flag.rfind("--", 0) != 0) detail::fail(program, "unexpected argument \"" + flag + "\"");
    if (i + 1 >= argc || std::string(argv[i + 1]).rfind("--", 0) == 0) detail::fail(program, flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--steps") o.steps = static_cast<std::int32_t>(integer(flag, v, 1, 1 << 20));
    else if (flag == "--seqs") o.seqs = static_cast<std::int32_t>(integer(flag, v, 1, 1024));
    else if (flag == "--heads") o.heads = static_cast<std::int32_t>(integer(flag, v, 1, 1024));
    else if (flag == "--group") o.group = static_cast<std::int32_t>(integer(flag, v, 1, 64));
    else if (flag == "--head-dim") o.head_dim = static_cast<std::int32_t>(integer(flag, v, 1, 4096));
    else if (flag == "--page-size") o.page_size = static_cast<std::int32_t>(integer(flag, v, 1, 1 << 20));
    else if (flag == "--seed") o.seed = static_cast<std::uint64_t>(integer(flag, v, 0, std::numeric_limits<long long>::max()));
    else if (flag == "--budget") {
      errno = 0;
      char* end = nullptr;
      const double x = v.empty() ? NAN : std::strtod(v.c_str(), &end);
      if (v.empty() || errno != 0 || *end != '\0' || !(x > 0.0 && x < 1.0))
        detail::fail(program, "--budget must be a fraction in (0, 1), got \"" + v + "\" (0.2 keeps 20%)");
      o.budget = x;
    } else if (flag == "--dtype") {
      if (v != "float" && v != "half" && v != "bfloat16")
        detail::fail(program, "--dtype must be float, half or bfloat16, got \"" + v + "\"");
      o.dtype = v;
    } else if (flag == "--layout") {
      if (v != "bhsd" && v != "bshd" && v != "paged")
        detail::fail(program, "--layout must be bhsd, bshd or paged, got \"" + v + "\"");
      o.layout = v;
    } else {
      detail::fail(program, "unknown option " + flag);
    }
  }
  // The policies need room: recent_window keeps 4 sinks and at least one
  // recent token; h2o at least one heavy and one recent; that is 3 per half.
  if (o.half_budget() < 3) {
    const long long need = static_cast<long long>(std::ceil(6.0 / o.budget));
    detail::fail(program, "--steps " + std::to_string(o.steps) + " with --budget " + detail::number(o.budget) +
                              " keeps " + std::to_string(o.budget_tokens()) +
                              " tokens; the policies need at least 6, so use --steps " + std::to_string(need) +
                              " or more (or a larger --budget)");
  }
  const std::int32_t capacity = o.budget_tokens() + 1;
  if (o.page_size == 0) o.page_size = std::min(16, capacity);
  if (o.layout == "paged" && o.page_size > capacity)
    detail::fail(program, "--page-size " + std::to_string(o.page_size) + " is larger than the cache's capacity of " +
                              std::to_string(capacity) + " slots (the budget + 1 spare); a page that size would be "
                              "mostly empty");
  const double full_bytes = 2.0 * o.seqs * o.heads * double(o.steps) * o.head_dim * (o.dtype == "float" ? 4 : 2);
  if (full_bytes > 8.0 * (1 << 30))
    detail::fail(program, "the full-cache reference would need " + detail::number(full_bytes / (1 << 30)) +
                              " GiB; lower --seqs, --heads, --steps or --head-dim");
  return o;
}

}  // namespace demo
