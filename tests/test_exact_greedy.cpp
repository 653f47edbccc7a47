// The exact-greedy oracle (DESIGN §6) against a naive recomputation: for every
// candidate v, recompute the softmax output over G \ {v} from scratch
// (O(|G|^2 * head_dim) per step) and compare it with attention over the
// whole history. The library must evict the argmin, on random streams for
// every dtype x layout x GQA group, and, from the same cache state, never
// cause a larger step error than h2o's choice.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/caches.hpp"

namespace {

using namespace kvevict;
using kvtest::layout_kind;

// Softmax attention of q over `rows` of (keys, values), in double, written
// directly from the definition.
std::vector<double> naive_output(const std::vector<float>& q, const std::map<std::int32_t, std::vector<float>>& keys,
                                 const std::map<std::int32_t, std::vector<float>>& values,
                                 const std::vector<std::int32_t>& rows, double scale) {
  const std::size_t d = q.size();
  std::vector<double> logits;
  for (std::int32_t r : rows) {
    double l = 0.0;
    for (std::size_t i = 0; i < d; ++i) l += double(q[i]) * double(keys.at(r)[i]);
    logits.push_back(l * scale);
  }
  const double m = *std::max_element(logits.begin(), logits.end());
  std::vector<double> out(d, 0.0);
  double z = 0.0;
  for (std::size_t j = 0; j < rows.size(); ++j) {
    const double w = std::exp(logits[j] - m);
    z += w;
    for (std::size_t i = 0; i < d; ++i) out[i] += w * values.at(rows[j])[i];
  }
  for (double& x : out) x /= z;
  return out;
}

double sq_dist(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return s;
}

// Naive error of evicting each member of `cached`, summed over the queries.
std::map<std::int32_t, double> naive_errors(const std::vector<std::vector<float>>& queries,
                                            const std::map<std::int32_t, std::vector<float>>& keys,
                                            const std::map<std::int32_t, std::vector<float>>& values,
                                            const std::vector<std::int32_t>& cached, double scale) {
  std::vector<std::int32_t> history;
  for (const auto& kv : keys) history.push_back(kv.first);
  std::map<std::int32_t, double> err;
  for (std::int32_t v : cached) err[v] = 0.0;
  for (const auto& q : queries) {
    const std::vector<double> target = naive_output(q, keys, values, history, scale);
    for (std::int32_t v : cached) {
      std::vector<std::int32_t> rest;
      for (std::int32_t p : cached)
        if (p != v) rest.push_back(p);
      err[v] += rest.empty() ? INFINITY : sq_dist(naive_output(q, keys, values, rest, scale), target);
    }
  }
  return err;
}

// True when `chosen` is the (error, position) minimum among candidates, up to
// a relative tolerance for rounding between the O(|G|) and naive formulas.
bool is_greedy_choice(const std::map<std::int32_t, double>& err, const std::vector<std::int32_t>& candidates,
                      std::int32_t chosen) {
  double best = INFINITY;
  for (std::int32_t p : candidates) best = std::min(best, err.at(p));
  const double tol = 1e-9 * std::max(1.0, std::abs(best));
  std::int32_t first = -1;  // the older token among (near-)ties
  for (std::int32_t p : candidates)
    if (err.at(p) <= best + tol && (first < 0 || p < first)) first = p;
  return chosen == first || err.at(chosen) <= best + tol;
}

TEST_CASE("leave_one_out errors equal the naive O(|G|^2 d) recomputation") {
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int32_t d = 1 + trial % 9, t = 2 + trial % 23;
    std::map<std::int32_t, std::vector<float>> keys, values;
    std::vector<float> kflat, vflat;
    for (std::int32_t p = 0; p < t; ++p)
      for (std::int32_t i = 0; i < d; ++i) {
        keys[p].push_back(n(rng) * 2.0f);
        values[p].push_back(n(rng));
        kflat.push_back(keys[p].back());
        vflat.push_back(values[p].back());
      }
    std::vector<std::int32_t> cached;
    for (std::int32_t p = 0; p < t; ++p)
      if (p == t - 1 || rng() % 3 != 0) cached.push_back(p);
    std::vector<float> q(static_cast<std::size_t>(d));
    for (float& x : q) x = n(rng);
    const float scale = 0.5f;
    std::vector<std::int32_t> all(static_cast<std::size_t>(t));
    for (std::int32_t p = 0; p < t; ++p) all[std::size_t(p)] = p;
    std::vector<double> target(static_cast<std::size_t>(d)),
        work(leave_one_out_work_size(t, d)), err(cached.size(), 0.0);
    attention_output(q.data(), kflat.data(), vflat.data(), d, scale, all.data(), t, target.data(), work.data());
    add_leave_one_out_errors(q.data(), kflat.data(), vflat.data(), d, scale, cached.data(),
                             std::int32_t(cached.size()), target.data(), err.data(), work.data());
    const auto naive = naive_errors({q}, keys, values, cached, scale);
    for (std::size_t j = 0; j < cached.size(); ++j) {
      const double want = naive.at(cached[j]);
      if (std::isinf(want)) {
        CHECK(std::isinf(err[j]));
      } else {
        CHECK(err[j] == doctest::Approx(want).epsilon(1e-9).scale(1e-12));
      }
    }
  }
}

template <class T>
struct greedy_stream {
  std::mt19937 rng;
  std::int32_t seqs, heads, group, d, budget, recent, capacity;
  std::vector<std::int32_t> prompt, steps;
  float scale;
  // Reference per (b, h): the whole history (as the dtype rounds it) and the cached set.
  std::vector<std::map<std::int32_t, std::vector<float>>> keys, values;
  std::vector<std::vector<std::int32_t>> cached;
  std::int64_t decisions = 0, h2o_comparisons = 0;

  explicit greedy_stream(std::uint32_t seed) : rng(seed) {
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    seqs = pick(1, 2);
    heads = pick(1, 2);
    group = pick(0, 1) ? 4 : 1;
    d = pick(0, 1) ? 4 : 8;
    budget = pick(2, 6);
    recent = pick(0, budget - 1);
    for (std::int32_t b = 0; b < seqs; ++b) {
      prompt.push_back(pick(0, 1) ? pick(1, 12) : 0);
      steps.push_back(pick(0, 20));
    }
    capacity = std::max(budget + 1, *std::max_element(prompt.begin(), prompt.end()));
    scale = 1.0f / std::sqrt(float(d));
    keys.resize(std::size_t(seqs * heads));
    values.resize(keys.size());
    cached.resize(keys.size());
    h2o_scores.resize(keys.size());
  }

  std::vector<T> random_rows(std::int32_t n) {
    std::vector<T> r(std::size_t(n) * d);
    for (T& x : r) x = kvtest::random_value<T>(rng);
    return r;
  }
  std::vector<std::vector<float>> group_queries(const std::vector<T>& q, std::int32_t h) const {
    std::vector<std::vector<float>> out;
    for (std::int32_t j = 0; j < group; ++j) {
      std::vector<float> row;
      for (std::int32_t i = 0; i < d; ++i) row.push_back(to_float(q[std::size_t((h * group + j) * d + i)]));
      out.push_back(row);
    }
    return out;
  }

  template <class View>
  void write_token(const View& view, std::int32_t b, std::int32_t pos, const std::int32_t* slots) {
    const std::vector<T> k = random_rows(heads), v = random_rows(heads);
    scatter(view, b, slots, make_tensor_view<const T>(k.data(), heads, d), make_tensor_view<const T>(v.data(), heads, d));
    for (std::int32_t h = 0; h < heads; ++h) {
      auto& kr = keys[std::size_t(b * heads + h)][pos];
      auto& vr = values[std::size_t(b * heads + h)][pos];
      for (std::int32_t i = 0; i < d; ++i) {
        kr.push_back(to_float(k[std::size_t(h * d + i)]));
        vr.push_back(to_float(v[std::size_t(h * d + i)]));
      }
      cached[std::size_t(b * heads + h)].push_back(pos);
    }
  }

  // Per (b, h): h2o scores accumulated along the greedy trajectory.
  std::vector<std::map<std::int32_t, float>> h2o_scores;

  template <class View>
  void check_cache(const View& view, const exact_greedy_policy& policy, std::int32_t b) {
    for (std::int32_t h = 0; h < heads; ++h) {
      std::vector<std::int32_t> lib;
      for (std::int32_t s = 0; s < capacity; ++s) {
        const std::int32_t p = policy.slots().position(b, h, s);
        if (p < 0) continue;
        lib.push_back(p);
        std::vector<float> row;
        for (std::int32_t i = 0; i < d; ++i) row.push_back(to_float(view.k_row(b, h, s)[i]));
        CHECK(row == keys[std::size_t(b * heads + h)].at(p));
      }
      std::sort(lib.begin(), lib.end());
      std::vector<std::int32_t> want = cached[std::size_t(b * heads + h)];
      std::sort(want.begin(), want.end());
      REQUIRE(lib == want);
    }
  }

  template <class View>
  void run(const View& view) {
    exact_greedy_policy policy(policy_shape{seqs, heads, heads * group, capacity}, exact_greedy_config{budget, recent});
    for (std::int32_t b = 0; b < seqs; ++b) {
      std::int32_t len = 0;
      if (prompt[std::size_t(b)] > 0) {
        len = prompt[std::size_t(b)];
        for (std::int32_t p = 0; p < len; ++p) {
          std::vector<std::int32_t> slots(static_cast<std::size_t>(heads), p);
          write_token(view, b, p, slots.data());
        }
        const std::vector<T> q = random_rows(heads * group);
        policy.prefill(b, len, decode_queries<T>{make_tensor_view<const T>(q.data(), heads * group, d), {}, scale}, view);
        for (std::int32_t h = 0; h < heads; ++h) {  // reference: naive greedy removal
          auto& c = cached[std::size_t(b * heads + h)];
          while (std::int32_t(c.size()) > budget) {
            const auto err = naive_errors(group_queries(q, h), keys[std::size_t(b * heads + h)],
                                          values[std::size_t(b * heads + h)], c, scale);
            std::int32_t victim = -1;
            for (std::int32_t p : c)
              if (p < len - recent && (victim < 0 || err.at(p) < err.at(victim))) victim = p;
            c.erase(std::find(c.begin(), c.end(), victim));
          }
        }
        check_cache(view, policy, b);
      }
      for (std::int32_t step = 0; step < steps[std::size_t(b)]; ++step, ++len) {
        std::vector<std::int32_t> slots(static_cast<std::size_t>(heads));
        for (std::int32_t h = 0; h < heads; ++h) slots[std::size_t(h)] = policy.next_slot(b, h);
        write_token(view, b, len, slots.data());
        policy.append(b);
        const std::vector<T> q = random_rows(heads * group);
        policy.observe(b, decode_queries<T>{make_tensor_view<const T>(q.data(), heads * group, d), {}, scale}, view);
        std::vector<std::int32_t> victims(static_cast<std::size_t>(heads));
        const bool over = std::int32_t(cached[std::size_t(b * heads)].size()) > budget;
        CHECK(policy.evict(b, victims.data()) == (over ? heads : 0));
        if (!over) continue;
        for (std::int32_t h = 0; h < heads; ++h) {
          auto& c = cached[std::size_t(b * heads + h)];
          const auto qs = group_queries(q, h);
          const auto err = naive_errors(qs, keys[std::size_t(b * heads + h)], values[std::size_t(b * heads + h)], c,
                                        scale);
          std::vector<std::int32_t> candidates;
          for (std::int32_t p : c)
            if (p < len + 1 - recent) candidates.push_back(p);
          REQUIRE(victims[std::size_t(h)] >= 0);
          // The victim's position: the freed slot no longer holds it, so find
          // which cached position the library dropped.
          std::int32_t chosen = -1;
          for (std::int32_t p : c)
            if (policy.slots().slot_of(b, h, p) < 0) chosen = p;
          REQUIRE(chosen >= 0);
          CHECK(is_greedy_choice(err, candidates, chosen));
          ++decisions;
          // h2o from the same state: lowest accumulated attention (this
          // trajectory's softmax weights, summed over the group), older first.
          // Its choice can never cause a smaller error than the greedy one.
          auto& acc = h2o_scores[std::size_t(b * heads + h)];
          for (std::int32_t p : c)
            for (const auto& row : qs) acc[p] += float(naive_attention_weight(row, b, h, p, c));
          std::int32_t h2o_victim = candidates.front();
          for (std::int32_t p : candidates)
            if (evicts_before(acc[p], p, acc[h2o_victim], h2o_victim)) h2o_victim = p;
          CHECK(err.at(chosen) <= err.at(h2o_victim) * (1 + 1e-9) + 1e-15);
          ++h2o_comparisons;
          c.erase(std::find(c.begin(), c.end(), chosen));
          acc.erase(chosen);
        }
        check_cache(view, policy, b);
      }
    }
  }

  // Softmax weight of position p for query q over the cached set (this
  // step's attention, what an h2o score would add).
  double naive_attention_weight(const std::vector<float>& q, std::int32_t b, std::int32_t h, std::int32_t p,
                                const std::vector<std::int32_t>& set) const {
    const auto& k = keys[std::size_t(b * heads + h)];
    auto logit = [&](std::int32_t r) {
      double l = 0.0;
      for (std::int32_t i = 0; i < d; ++i) l += double(q[std::size_t(i)]) * k.at(r)[std::size_t(i)];
      return l * scale;
    };
    double z = 0.0;
    for (std::int32_t r : set) z += std::exp(logit(r));
    return std::exp(logit(p)) / z;
  }
};

}  // namespace

TEST_CASE("exact_greedy evicts the naive argmin, never worse than h2o from the same state") {
  std::int64_t streams = 0, decisions = 0, comparisons = 0;
  for (layout_kind kind : kvtest::all_layouts)
    for (int i = 0; i < 200; ++i, ++streams) {
      const std::uint32_t seed = std::uint32_t(streams + 1);
      const std::string layout = kvtest::name(kind);
      CAPTURE(seed);
      CAPTURE(layout);
      auto one = [&](auto tag) {
        using T = decltype(tag);
        greedy_stream<T> s(seed);
        kvtest::with_cache<T>(kind, s.seqs, s.heads, s.capacity, s.d, 1 + int(seed % 4),
                              [&](const auto& view) { s.run(view); });
        decisions += s.decisions;
        comparisons += s.h2o_comparisons;
      };
      switch (streams % 3) {
        case 0: one(float{}); break;
        case 1: one(half{}); break;
        default: one(bfloat16{}); break;
      }
    }
  MESSAGE(streams, " streams, ", decisions, " greedy decisions checked, ", comparisons, " compared with h2o");
  CHECK(streams >= 1000);
  CHECK(decisions > 10000);
}
