// kvevict demo: one synthetic decode stream with heavy-hitter structure, run
// through a full cache and through every policy at the same budget, printing
// what each policy keeps of the full cache's attention.
//
//   kvevict_demo [--steps N] [--seqs B] [--heads H] [--group G] [--head-dim D]
//                [--budget RATIO] [--dtype float|half|bfloat16]
//                [--layout bhsd|bshd|paged] [--page-size P] [--seed S]
//
// Each policy gets its own cache of budget + 1 slots per (sequence, head) and
// drives it through the decode cycle: next_slot, scatter the new K/V, append,
// attention over the occupied slots, observe, evict.
#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "demo_workload.hpp"

namespace {

struct options {
  std::int32_t steps = 2048, seqs = 4, heads = 8, group = 1, head_dim = 128, page_size = 16;
  double budget = 0.2;
  std::string dtype = "bfloat16", layout = "bhsd";
  std::uint64_t seed = 1;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "kvevict_demo: %s\nusage: kvevict_demo [--steps N] [--seqs B] [--heads H] [--group G] "
               "[--head-dim D] [--budget RATIO] [--dtype float|half|bfloat16] [--layout bhsd|bshd|paged] "
               "[--page-size P] [--seed S]\n",
               why);
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") usage("help");
    if (i + 1 >= argc) usage(("missing value for " + a).c_str());
    const char* v = argv[++i];
    if (a == "--steps") o.steps = std::atoi(v);
    else if (a == "--seqs") o.seqs = std::atoi(v);
    else if (a == "--heads") o.heads = std::atoi(v);
    else if (a == "--group") o.group = std::atoi(v);
    else if (a == "--head-dim") o.head_dim = std::atoi(v);
    else if (a == "--page-size") o.page_size = std::atoi(v);
    else if (a == "--budget") o.budget = std::atof(v);
    else if (a == "--dtype") o.dtype = v;
    else if (a == "--layout") o.layout = v;
    else if (a == "--seed") o.seed = std::strtoull(v, nullptr, 10);
    else usage(("unknown option " + a).c_str());
  }
  if (o.steps < 8 || o.seqs < 1 || o.heads < 1 || o.group < 1 || o.head_dim < 1 || o.page_size < 1)
    usage("sizes must be positive (and --steps at least 8)");
  return o;
}

/// Softmax attention of q over `n` rows given by row(j); writes the weights
/// to probs[j] and returns the output in out. Everything in float, as an
/// engine's kernel would accumulate.
template <class Row>
void attend(const float* q, std::int32_t n, std::int32_t d, float scale, Row row, float* probs, float* out,
            const std::int32_t* skip_free = nullptr) {
  float m = -INFINITY;
  for (std::int32_t j = 0; j < n; ++j) {
    if (skip_free && skip_free[j] < 0) continue;
    const auto* k = row(j, true);
    float acc[8] = {};  // independent partial sums, so the loop vectorises
    std::int32_t i = 0;
    for (; i + 8 <= d; i += 8)
      for (std::int32_t u = 0; u < 8; ++u) acc[u] += q[i + u] * kvevict::to_float(k[i + u]);
    for (; i < d; ++i) acc[0] += q[i] * kvevict::to_float(k[i]);
    probs[j] = (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) * scale;
    m = std::max(m, probs[j]);
  }
  float z = 0.0f;
  for (std::int32_t j = 0; j < n; ++j) {
    if (skip_free && skip_free[j] < 0) {
      probs[j] = 0.0f;
      continue;
    }
    probs[j] = std::exp(probs[j] - m);
    z += probs[j];
  }
  std::fill_n(out, d, 0.0f);
  for (std::int32_t j = 0; j < n; ++j) {
    if (probs[j] == 0.0f) continue;
    probs[j] /= z;
    const auto* v = row(j, false);
    for (std::int32_t i = 0; i < d; ++i) out[i] += probs[j] * kvevict::to_float(v[i]);
  }
}

struct metrics {
  double err_sum = 0.0, err_max = 0.0, mass_sum = 0.0, seconds = 0.0;
  std::int64_t samples = 0, steps = 0;
};

/// One policy with its own cache.
template <class T, class Cache, class Policy>
struct runner {
  std::string name;
  Cache cache;
  Policy policy;
  metrics m;
  std::vector<float> probs, out;  // [Hq][capacity], [Hq][D]
};

template <class T, class MakeCache>
void run(const options& o, MakeCache make_cache) {
  using namespace kvevict;
  const std::int32_t B = o.seqs, H = o.heads, Hq = o.heads * o.group, D = o.head_dim, L = o.steps;
  const h2o_config h2o = h2o_from_ratios(L, o.budget / 2, o.budget / 2);
  const auto budget = static_cast<std::int32_t>(h2o.budget());
  const std::int32_t capacity = budget + 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const policy_shape shape{B, H, Hq, capacity};
  // Ragged batch: sequence b is 5% shorter than sequence b - 1.
  std::vector<std::int32_t> length(static_cast<std::size_t>(B));
  for (std::int32_t b = 0; b < B; ++b) length[std::size_t(b)] = std::max(budget + 2, L - L * b / 20);

  auto h2o_run = runner<T, decltype(make_cache(shape)), h2o_policy>{
      "h2o", make_cache(shape), h2o_policy(shape, h2o), {}, {}, {}};
  auto window_run = runner<T, decltype(make_cache(shape)), recent_window_policy>{
      "recent_window", make_cache(shape), recent_window_policy(shape, recent_window_config{4, budget - 4}), {}, {}, {}};
  auto random_run = runner<T, decltype(make_cache(shape)), random_policy>{
      "random", make_cache(shape), random_policy(shape, random_config{budget, 0, 0, o.seed}), {}, {}, {}};
  auto greedy_run = runner<T, decltype(make_cache(shape)), exact_greedy_policy>{
      "exact_greedy", make_cache(shape), exact_greedy_policy(shape, exact_greedy_config{budget, h2o.recent}), {}, {}, {}};

  demo::workload_config wc;
  wc.head_dim = D;
  wc.seed = o.seed;
  std::vector<demo::head_stream> streams;
  for (std::int32_t b = 0; b < B; ++b)
    for (std::int32_t h = 0; h < H; ++h) streams.emplace_back(wc, b, h, length[std::size_t(b)]);

  // The full cache, as the dtype rounds it: [B][H][L][D].
  std::vector<T> full_k(std::size_t(B) * H * L * D), full_v(full_k.size());
  std::vector<float> q(std::size_t(Hq) * D), full_probs(std::size_t(Hq) * L), full_out(std::size_t(Hq) * D);
  std::vector<T> new_k(std::size_t(H) * D), new_v(new_k.size());
  std::vector<float> kf(static_cast<std::size_t>(D)), vf(static_cast<std::size_t>(D));
  std::vector<std::int32_t> slots(static_cast<std::size_t>(H));

  auto step_policy = [&](auto& r, std::int32_t b, std::int32_t t) {
    auto view = r.cache.view();
    for (std::int32_t h = 0; h < H; ++h) slots[std::size_t(h)] = r.policy.next_slot(b, h);
    scatter(view, b, slots.data(), make_tensor_view<const T>(new_k.data(), H, D),
            make_tensor_view<const T>(new_v.data(), H, D));
    r.policy.append(b);
    r.probs.assign(std::size_t(Hq) * capacity, 0.0f);
    r.out.assign(std::size_t(Hq) * D, 0.0f);
    const bool full = t + 1 > budget;
    for (std::int32_t qh = 0; qh < Hq; ++qh) {
      const std::int32_t h = qh / o.group;
      attend(
          &q[std::size_t(qh) * D], capacity, D, scale,
          [&](std::int32_t s, bool key) -> const T* { return key ? view.k_row(b, h, s) : view.v_row(b, h, s); },
          &r.probs[std::size_t(qh) * capacity], &r.out[std::size_t(qh) * D], r.policy.slots().positions_of(b, h));
    }
    if (full) {
      for (std::int32_t qh = 0; qh < Hq; ++qh) {
        const std::int32_t h = qh / o.group;
        double diff = 0.0, ref = 0.0, mass = 0.0;
        for (std::int32_t i = 0; i < D; ++i) {
          const double a = r.out[std::size_t(qh) * D + i], f = full_out[std::size_t(qh) * D + i];
          diff += (a - f) * (a - f);
          ref += f * f;
        }
        for (std::int32_t s = 0; s < capacity; ++s) {
          const std::int32_t p = r.policy.slots().position(b, h, s);
          if (p >= 0) mass += full_probs[std::size_t(qh) * L + p];
        }
        const double rel = std::sqrt(diff / ref);
        r.m.err_sum += rel;
        r.m.err_max = std::max(r.m.err_max, rel);
        r.m.mass_sum += mass;
        ++r.m.samples;
      }
    }
    const auto start = std::chrono::steady_clock::now();
    if constexpr (std::is_same_v<decltype(r.policy), exact_greedy_policy>) {
      r.policy.observe(b, decode_queries<float>{make_tensor_view<const float>(q.data(), Hq, D), {}, scale}, view);
    } else {
      r.policy.observe(b, decode_probs{make_tensor_view<const float>(r.probs.data(), Hq, capacity)});
    }
    r.policy.evict(b);
    r.m.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++r.m.steps;
  };

  for (std::int32_t t = 0; t < L; ++t)
    for (std::int32_t b = 0; b < B; ++b) {
      if (t >= length[std::size_t(b)]) continue;
      for (std::int32_t h = 0; h < H; ++h) {
        demo::head_stream& st = streams[std::size_t(b * H + h)];
        st.token(t, kf.data(), vf.data());
        for (std::int32_t i = 0; i < D; ++i) {
          new_k[std::size_t(h) * D + i] = from_float<T>(kf[std::size_t(i)]);
          new_v[std::size_t(h) * D + i] = from_float<T>(vf[std::size_t(i)]);
        }
        const std::size_t row = ((std::size_t(b) * H + h) * L + t) * D;
        std::copy_n(&new_k[std::size_t(h) * D], D, &full_k[row]);
        std::copy_n(&new_v[std::size_t(h) * D], D, &full_v[row]);
        for (std::int32_t j = 0; j < o.group; ++j) st.query(&q[std::size_t(h * o.group + j) * D]);
      }
      for (std::int32_t qh = 0; qh < Hq; ++qh) {
        const std::size_t base = (std::size_t(b) * H + qh / o.group) * L * D;
        attend(
            &q[std::size_t(qh) * D], t + 1, D, scale,
            [&](std::int32_t p, bool key) -> const T* {
              return (key ? full_k.data() : full_v.data()) + base + std::size_t(p) * D;
            },
            &full_probs[std::size_t(qh) * L], &full_out[std::size_t(qh) * D]);
      }
      step_policy(h2o_run, b, t);
      step_policy(window_run, b, t);
      step_policy(random_run, b, t);
      step_policy(greedy_run, b, t);
    }

  std::size_t full_bytes = 0;
  for (std::int32_t b = 0; b < B; ++b) full_bytes += std::size_t(length[std::size_t(b)]) * H * D * 2 * sizeof(T);
  std::printf("kvevict demo: %d sequences (%d..%d tokens) x %d KV heads x %d query heads, head_dim %d, %s, %s, "
              "budget %d tokens (%.0f%% of %d; h2o %d heavy + %d recent; recent_window 4 sinks)\n\n",
              B, length.back(), length.front(), H, Hq, D, dtype_traits<T>::name, o.layout.c_str(), budget,
              100.0 * budget / L, L, h2o.heavy, h2o.recent);
  std::printf("%-14s %12s %8s %14s %14s %16s %16s\n", "policy", "KV bytes", "% full", "mean rel err", "max rel err",
              "attention kept", "evict us/step");
  std::printf("%-14s %12zu %7.1f%% %14.4f %14.4f %15.1f%% %16s\n", "full", full_bytes, 100.0, 0.0, 0.0, 100.0, "-");
  auto row = [&](const auto& r) {
    const double n = double(std::max<std::int64_t>(r.m.samples, 1));
    std::printf("%-14s %12zu %7.1f%% %14.4f %14.4f %15.1f%% %16.1f\n", r.name.c_str(), r.cache.bytes(),
                100.0 * double(r.cache.bytes()) / double(full_bytes), r.m.err_sum / n, r.m.err_max,
                100.0 * r.m.mass_sum / n, 1e6 * r.m.seconds / double(std::max<std::int64_t>(r.m.steps, 1)));
  };
  row(h2o_run);
  row(window_run);
  row(random_run);
  row(greedy_run);
  std::printf("\nerrors and attention kept are averaged over every (sequence, query head, step) after the cache "
              "first fills;\nevict us/step is observe + evict for one sequence step, all heads.\n");
}

template <class T>
void run_dtype(const options& o) {
  using namespace kvevict;
  if (o.layout == "bhsd") {
    run<T>(o, [&](const policy_shape& s) { return make_bhsd_cache<T>(s.num_seqs, s.num_kv_heads, s.capacity, o.head_dim); });
  } else if (o.layout == "bshd") {
    run<T>(o, [&](const policy_shape& s) { return make_bshd_cache<T>(s.num_seqs, s.num_kv_heads, s.capacity, o.head_dim); });
  } else if (o.layout == "paged") {
    run<T>(o, [&](const policy_shape& s) {
      return make_paged_cache<T>(s.num_seqs, s.num_kv_heads, s.capacity, o.head_dim, o.page_size, page_order::nhd);
    });
  } else {
    usage(("unknown layout " + o.layout).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    if (o.dtype == "float") run_dtype<float>(o);
    else if (o.dtype == "half") run_dtype<kvevict::half>(o);
    else if (o.dtype == "bfloat16") run_dtype<kvevict::bfloat16>(o);
    else usage(("unknown dtype " + o.dtype).c_str());
  } catch (const kvevict::error& e) {
    std::fprintf(stderr, "kvevict_demo: %s\n", e.what());
    return 1;
  }
  return 0;
}
