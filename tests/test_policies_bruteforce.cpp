// Every policy against a brute-force reference, step by step, on many seeded
// random streams for every dtype x layout x GQA group size, with ragged
// batches.
//
// The reference knows nothing about slots: per (sequence, KV head) it keeps a
// map position -> (score, K row, V row) and re-selects the whole keep set
// from scratch with the rule as docs/policies.md states it. After every call the
// library's slot table, scores and K/V bytes must equal the reference's.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/caches.hpp"
#include "support/bruteforce_reference.hpp"
#include "support/random_reference.hpp"

namespace {

using namespace kvevict;
using kvtest::layout_kind;
using kvtest::ref_head;
using kvtest::ref_token;
using kvtest::h2o_case;
using kvtest::random_case;
using kvtest::recent_window_case;
using kvtest::reduce_group;

enum class prob_mode { uniform, power_law, ties, all_equal };

struct stream_params {
  std::uint64_t seed = 0;
  std::int32_t seqs = 1, kv_heads = 1, group = 1, head_dim = 4, page_size = 1;
  std::vector<std::int32_t> prompt, steps;  // per sequence
  prob_mode probs = prob_mode::uniform;
  group_reduce reduce = group_reduce::sum;
};

float draw_prob(std::mt19937& rng, prob_mode mode) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  switch (mode) {
    case prob_mode::uniform: return u(rng);
    case prob_mode::power_law: return std::pow(u(rng), 6.0f);
    case prob_mode::ties: return std::floor(u(rng) * 3.0f) * 0.25f;
    case prob_mode::all_equal: return 0.125f;
  }
  return 0.0f;
}

// ---- the stream driver ----

template <class T, class Case>
struct stream_run {
  const stream_params& params;
  const Case& policy_case;
  std::mt19937 rng;
  std::int32_t capacity = 0;
  std::vector<ref_head<T>> ref;  // [b * H + h]
  std::vector<std::int32_t> lengths;
  std::int64_t checks = 0;

  stream_run(const stream_params& p, const Case& c) : params(p), policy_case(c), rng(std::uint32_t(p.seed)) {}

  /// The score decay: each step score <- decay * score + increment; prompt
  /// row i of L weighs decay^(L - 1 - i) (docs/semantics.md, "Scores").
  float decay() const {
    if constexpr (std::is_same_v<Case, h2o_case>) return policy_case.config.decay;
    return 1.0f;
  }

  std::int32_t heads() const { return params.kv_heads; }
  std::int32_t q_heads() const { return params.kv_heads * params.group; }
  ref_head<T>& head(std::int32_t b, std::int32_t h) { return ref[std::size_t(b * heads() + h)]; }

  template <class View, class Policy>
  void compare(const View& view, const Policy& policy, std::int32_t b) {
    for (std::int32_t h = 0; h < heads(); ++h) {
      const ref_head<T>& r = head(b, h);
      std::int32_t occupied = 0;
      for (std::int32_t s = 0; s < capacity; ++s) {
        const std::int32_t p = policy.slots().position(b, h, s);
        if (p < 0) {
          CHECK(policy.scores_of(b, h)[s] == 0.0f);
          continue;
        }
        ++occupied;
        const auto it = r.find(p);
        REQUIRE_MESSAGE(it != r.end(), "seed ", params.seed, ": library keeps position ", p, " at b=", b, " h=", h);
        CHECK(policy.scores_of(b, h)[s] == it->second.score);
        CHECK(kvtest::same_bits(view.k_row(b, h, s), it->second.k.data(), view.head_dim));
        CHECK(kvtest::same_bits(view.v_row(b, h, s), it->second.v.data(), view.head_dim));
      }
      REQUIRE_MESSAGE(occupied == std::int32_t(r.size()), "seed ", params.seed, ": b=", b, " h=", h);
      CHECK(policy.slots().count(b, h) == occupied);
      const std::int32_t next = policy.slots().next_slot(b, h);
      if (occupied < capacity) CHECK((next >= 0 && policy.slots().position(b, h, next) == -1));
      ++checks;
    }
    CHECK(policy.length(b) == lengths[std::size_t(b)]);
  }

  void apply_keep(std::int32_t b, std::int32_t h, const std::vector<std::int32_t>& keep) {
    ref_head<T> kept;
    for (std::int32_t p : keep) kept.emplace(p, head(b, h).at(p));
    head(b, h) = std::move(kept);
  }

  ref_token<T> new_token(std::int32_t d) {
    ref_token<T> t;
    for (std::int32_t i = 0; i < d; ++i) {
      t.k.push_back(kvtest::random_value<T>(rng));
      t.v.push_back(kvtest::random_value<T>(rng));
    }
    return t;
  }

  template <class View, class Policy>
  void prefill(const View& view, Policy& policy, std::int32_t b, std::int32_t len) {
    const std::int32_t d = view.head_dim, hq = q_heads(), g = params.group;
    for (std::int32_t p = 0; p < len; ++p) {  // the engine writes prompt position p into slot p
      std::vector<T> k(std::size_t(heads() * d)), v(k.size());
      std::vector<std::int32_t> slots(std::size_t(heads()), p);
      for (std::int32_t h = 0; h < heads(); ++h) {
        ref_token<T> t = new_token(d);
        std::copy(t.k.begin(), t.k.end(), k.begin() + h * d);
        std::copy(t.v.begin(), t.v.end(), v.begin() + h * d);
        head(b, h).emplace(p, std::move(t));
      }
      scatter(view, b, slots.data(), make_tensor_view<const T>(k.data(), heads(), d),
              make_tensor_view<const T>(v.data(), heads(), d));
    }
    // Causal probabilities; entries above the diagonal are NaN: never read.
    std::vector<float> probs(std::size_t(hq) * len * len, std::nanf(""));
    std::vector<float> sums(std::size_t(hq) * len);
    for (std::int32_t q = 0; q < hq; ++q)
      for (std::int32_t i = 0; i < len; ++i)
        for (std::int32_t p = 0; p <= i; ++p) probs[(std::size_t(q) * len + i) * len + p] = draw_prob(rng, params.probs);
    // What each element adds to its column: weighted by its row's decay power.
    const auto term = [&](std::int32_t q, std::int32_t i, std::int32_t p) {
      const float weight = static_cast<float>(std::pow(double(decay()), double(len - 1 - i)));
      const volatile float x = weight * probs[(std::size_t(q) * len + i) * len + p];
      return float(x);
    };
    for (std::int32_t q = 0; q < hq; ++q)
      for (std::int32_t p = 0; p < len; ++p) {
        // The canonical order (docs/semantics.md): 64-row chunks aligned at
        // multiples of 64, each summed left to right, then the partials.
        float total = 0.0f;
        for (std::int32_t first = p / 64 * 64; first < len; first += 64) {
          float part = 0.0f;
          for (std::int32_t i = std::max(first, p); i < std::min(first + 64, len); ++i)
            part = i == std::max(first, p) ? term(q, i, p) : part + term(q, i, p);
          total = first == p / 64 * 64 ? part : total + part;
        }
        sums[std::size_t(q) * len + p] = total;
      }
    for (std::int32_t h = 0; h < heads(); ++h)
      for (auto& [p, tok] : head(b, h)) {
        std::vector<float> xs;
        for (std::int32_t j = 0; j < g; ++j) xs.push_back(sums[std::size_t(h * g + j) * len + p]);
        tok.score = reduce_group(xs, params.reduce);
      }
    lengths[std::size_t(b)] = len;
    const int mode = std::uniform_int_distribution<int>(0, 2)(rng);
    prefill_result result;
    if (mode == 0) {
      result = policy.prefill(b, len, prefill_probs{make_tensor_view<const float>(probs.data(), hq, len, len)}, view);
    } else if (mode == 1) {
      result = policy.prefill(b, len, prefill_column_sums{make_tensor_view<const float>(sums.data(), hq, len)}, view);
    } else {  // the engine compacts its own buffers from the slot table
      result = policy.prefill(b, len, prefill_column_sums{make_tensor_view<const float>(sums.data(), hq, len)});
      for (std::int32_t h = 0; h < heads(); ++h) {
        std::vector<std::int32_t> src;
        for (std::int32_t s = 0; s < capacity && policy.slots().position(b, h, s) >= 0; ++s)
          src.push_back(policy.slots().position(b, h, s));
        compact(view, b, h, src.data(), std::int32_t(src.size()));
      }
    }
    if (len > policy_case.budget())
      for (std::int32_t h = 0; h < heads(); ++h) apply_keep(b, h, policy_case.keep(head(b, h), len, b, h, 0));
    CHECK(result.kept == std::min(len, policy_case.budget()));
    if constexpr (std::is_same_v<typename View::layout_type, paged_layout>) {
      const std::int32_t ps = view.layout.page_size;
      if (mode != 2)  // without a view the policy knows no pages
        CHECK(result.reclaimable_pages ==
              std::max(0, (len + ps - 1) / ps - (std::min(policy_case.budget() + 1, capacity) + ps - 1) / ps));
    }
    compare(view, policy, b);
  }

  template <class View, class Policy>
  void decode_step(const View& view, Policy& policy, std::int32_t b) {
    const std::int32_t d = view.head_dim, hq = q_heads(), g = params.group;
    const std::int32_t pos = lengths[std::size_t(b)];
    std::vector<T> k(std::size_t(heads() * d)), v(k.size());
    std::vector<std::int32_t> slots(static_cast<std::size_t>(heads()));
    for (std::int32_t h = 0; h < heads(); ++h) {
      slots[std::size_t(h)] = policy.next_slot(b, h);
      ref_token<T> t = new_token(d);
      std::copy(t.k.begin(), t.k.end(), k.begin() + h * d);
      std::copy(t.v.begin(), t.v.end(), v.begin() + h * d);
      head(b, h).emplace(pos, std::move(t));
    }
    scatter(view, b, slots.data(), make_tensor_view<const T>(k.data(), heads(), d),
            make_tensor_view<const T>(v.data(), heads(), d));
    CHECK(policy.append(b) == pos);
    lengths[std::size_t(b)] = pos + 1;

    // Probabilities per (query head, position); free slots get NaN, which
    // the library must never read.
    std::vector<float> probs(std::size_t(hq) * capacity, std::nanf(""));
    for (std::int32_t h = 0; h < heads(); ++h)
      for (auto& [p, tok] : head(b, h)) {
        const std::int32_t s = policy.slots().slot_of(b, h, p);
        REQUIRE(s >= 0);
        std::vector<float> xs;
        for (std::int32_t j = 0; j < g; ++j) {
          const float x = draw_prob(rng, params.probs);
          probs[std::size_t(h * g + j) * capacity + s] = x;
          xs.push_back(x);
        }
        const volatile float decayed = decay() * tok.score;  // rounded before the increment is added
        tok.score = decayed + reduce_group(xs, params.reduce);
      }
    policy.observe(b, decode_probs{make_tensor_view<const float>(probs.data(), hq, capacity)});

    std::vector<std::int32_t> victims(static_cast<std::size_t>(heads()));
    const std::int32_t evicted = policy.evict(b, victims.data());
    const bool over = std::int32_t(head(b, 0).size()) > policy_case.budget();
    CHECK(evicted == (over ? heads() : 0));
    if (over)
      for (std::int32_t h = 0; h < heads(); ++h) {
        const std::vector<std::int32_t> keep = policy_case.keep(head(b, h), pos + 1, b, h, 1);
        REQUIRE(std::int32_t(keep.size()) == policy_case.budget());
        apply_keep(b, h, keep);
        CHECK(victims[std::size_t(h)] >= 0);
      }
    compare(view, policy, b);
  }

  std::int64_t run(layout_kind kind) {
    const std::int32_t max_prompt = *std::max_element(params.prompt.begin(), params.prompt.end());
    capacity = std::max(policy_case.budget() + 1, max_prompt);
    ref.assign(std::size_t(params.seqs * heads()), {});
    lengths.assign(std::size_t(params.seqs), 0);
    policy_shape shape{params.seqs, heads(), q_heads(), capacity};
    auto policy = policy_case.make(shape);
    kvtest::with_cache<T>(kind, params.seqs, heads(), capacity, params.head_dim, params.page_size,
                          [&](const auto& view) {
                            std::vector<std::int32_t> done(std::size_t(params.seqs), 0);
                            std::vector<std::int32_t> order(std::size_t(params.seqs));
                            for (std::int32_t b = 0; b < params.seqs; ++b) order[std::size_t(b)] = b;
                            bool active = true;
                            while (active) {  // ragged batch: rounds in random order
                              active = false;
                              std::shuffle(order.begin(), order.end(), rng);
                              for (std::int32_t b : order) {
                                std::int32_t& n = done[std::size_t(b)];
                                if (n == 0 && params.prompt[std::size_t(b)] > 0) {
                                  prefill(view, policy, b, params.prompt[std::size_t(b)]);
                                  n = 1;
                                } else if (n < params.steps[std::size_t(b)] + 1) {
                                  decode_step(view, policy, b);
                                  ++n;
                                }
                                active = active || n < params.steps[std::size_t(b)] + 1;
                              }
                            }
                          });
    return checks;
  }
};

stream_params draw_params(std::uint64_t seed, std::int32_t group, std::int32_t max_prompt) {
  std::mt19937 rng(std::uint32_t(seed * 2654435761u + 17));
  stream_params p;
  p.seed = seed;
  p.seqs = std::uniform_int_distribution<int>(1, 3)(rng);
  p.kv_heads = std::uniform_int_distribution<int>(1, 2)(rng);
  p.group = group;
  p.head_dim = std::uniform_int_distribution<int>(0, 1)(rng) ? 4 : 8;
  const int page_sizes[] = {1, 2, 3, 4, 8};
  p.page_size = page_sizes[std::uniform_int_distribution<int>(0, 4)(rng)];
  p.probs = static_cast<prob_mode>(std::uniform_int_distribution<int>(0, 3)(rng));
  p.reduce = static_cast<group_reduce>(std::uniform_int_distribution<int>(0, 2)(rng));
  for (std::int32_t b = 0; b < p.seqs; ++b) {
    const bool has_prompt = std::uniform_int_distribution<int>(0, 2)(rng) > 0;
    p.prompt.push_back(has_prompt ? std::uniform_int_distribution<int>(1, max_prompt)(rng) : 0);
    p.steps.push_back(std::uniform_int_distribution<int>(0, 40)(rng));
  }
  return p;
}

constexpr int kSeedsPerCombo = 100;  // x 5 layouts x 2 groups = 1000 streams per policy, dtypes in turn

template <class Case>
void run_all(const char* policy_name) {
  std::int64_t streams = 0, checks = 0;
  for (layout_kind kind : kvtest::all_layouts)
    for (std::int32_t group : {1, 4})
      for (int i = 0; i < kSeedsPerCombo; ++i) {
        const std::uint64_t seed = std::uint64_t(streams) + 1;
        stream_params params = draw_params(seed, group, 16);
        std::mt19937 rng(static_cast<std::uint32_t>(seed));
        const Case c = Case::draw(rng, params.reduce);
        if (!std::is_same_v<Case, h2o_case>) params.reduce = group_reduce::sum;  // only h2o takes a reduction
        CAPTURE(seed);
        const std::string layout = kvtest::name(kind);
        CAPTURE(layout);
        switch (streams % 3) {
          case 0: checks += stream_run<float, Case>(params, c).run(kind); break;
          case 1: checks += stream_run<half, Case>(params, c).run(kind); break;
          default: checks += stream_run<bfloat16, Case>(params, c).run(kind); break;
        }
        ++streams;
      }
  MESSAGE(std::string(policy_name), ": ", streams, " streams, ", checks, " (sequence, head) states compared");
  CHECK(streams >= 1000);
}

}  // namespace

TEST_CASE("h2o (with sinks, and decays: TOVA and between) equals the brute-force real-drop reference on random streams") { run_all<h2o_case>("h2o"); }

TEST_CASE("recent_window equals first-sinks + last-window on random streams") {
  run_all<recent_window_case>("recent_window");
}

TEST_CASE("random equals the reference Philox draws on random streams") { run_all<random_case>("random"); }
