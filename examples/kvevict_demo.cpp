// kvevict demo: one synthetic decode stream with heavy-hitter structure, run
// through a full cache and through every policy at the same budget, printing
// what each policy keeps of the full cache's attention. `--help` lists the
// options (demo_options.hpp).
//
// Each policy gets its own cache of budget + 1 slots per (sequence, head) and
// drives it through the decode cycle, one sequence at a time with the
// per-sequence API: next_slot, scatter the new K/V, append, attention over
// the occupied slots, observe, evict. (kvevict_demo_cuda runs the same
// stream through the batched API on both devices.)
#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "demo_options.hpp"
#include "demo_report.hpp"
#include "demo_workload.hpp"

namespace {

using demo::metrics;
using demo::options;

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
  const std::int32_t budget = o.budget_tokens(), capacity = budget + 1;
  const policy_shape shape{B, H, Hq, capacity};
  demo::full_reference<T> ref(o);
  const std::vector<std::int32_t>& length = ref.lengths();

  auto h2o_run = runner<T, decltype(make_cache(shape)), h2o_policy>{
      "h2o", make_cache(shape), h2o_policy(shape, h2o_config{o.half_budget(), o.half_budget()}), {}, {}, {}};
  auto window_run = runner<T, decltype(make_cache(shape)), recent_window_policy>{
      "recent_window", make_cache(shape), recent_window_policy(shape, recent_window_config{4, budget - 4}), {}, {}, {}};
  auto random_run = runner<T, decltype(make_cache(shape)), random_policy>{
      "random", make_cache(shape), random_policy(shape, random_config{budget, 0, 0, o.seed}), {}, {}, {}};
  auto greedy_run = runner<T, decltype(make_cache(shape)), exact_greedy_policy>{
      "exact_greedy", make_cache(shape), exact_greedy_policy(shape, exact_greedy_config{budget, o.half_budget()}),
      {}, {}, {}};
  std::vector<std::int32_t> slots(static_cast<std::size_t>(H));

  auto step_policy = [&](auto& r, std::int32_t b, std::int32_t t) {
    auto view = r.cache.view();
    for (std::int32_t h = 0; h < H; ++h) slots[std::size_t(h)] = r.policy.next_slot(b, h);
    scatter(view, b, slots.data(), make_tensor_view<const T>(&ref.new_k[std::size_t(b) * H * D], H, D),
            make_tensor_view<const T>(&ref.new_v[std::size_t(b) * H * D], H, D));
    r.policy.append(b);
    r.probs.assign(std::size_t(Hq) * capacity, 0.0f);
    r.out.assign(std::size_t(Hq) * D, 0.0f);
    const float* q = &ref.q[std::size_t(b) * Hq * D];
    for (std::int32_t qh = 0; qh < Hq; ++qh) {
      const std::int32_t h = qh / o.group;
      demo::attend(
          q + std::size_t(qh) * D, capacity, D, ref.scale(),
          [&](std::int32_t s, bool key) -> const T* { return key ? view.k_row(b, h, s) : view.v_row(b, h, s); },
          &r.probs[std::size_t(qh) * capacity], &r.out[std::size_t(qh) * D], r.policy.slots().positions_of(b, h));
      if (t + 1 > budget)  // once the cache has filled
        demo::add_sample(r.m, &r.out[std::size_t(qh) * D], &ref.out[(std::size_t(b) * Hq + qh) * D], D,
                         &ref.probs[(std::size_t(b) * Hq + qh) * L], capacity,
                         [&](std::int32_t s) { return r.policy.slots().position(b, h, s); });
    }
    const auto start = std::chrono::steady_clock::now();
    if constexpr (std::is_same_v<decltype(r.policy), exact_greedy_policy>) {
      r.policy.observe(b, decode_queries<float>{make_tensor_view<const float>(q, Hq, D), {}, ref.scale()}, view);
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
      ref.step(b, t);
      step_policy(h2o_run, b, t);
      step_policy(window_run, b, t);
      step_policy(random_run, b, t);
      step_policy(greedy_run, b, t);
    }

  const std::size_t full = demo::full_bytes(o, sizeof(T));
  demo::print_header(o, dtype_traits<T>::name, "");
  demo::print_full_row(full);
  demo::print_row(h2o_run.name, h2o_run.cache.bytes(), full, h2o_run.m);
  demo::print_row(window_run.name, window_run.cache.bytes(), full, window_run.m);
  demo::print_row(random_run.name, random_run.cache.bytes(), full, random_run.m);
  demo::print_row(greedy_run.name, greedy_run.cache.bytes(), full, greedy_run.m);
  demo::print_footer("observe + evict for one sequence step, all heads");
}

template <class T>
void run_dtype(const options& o) {
  using namespace kvevict;
  if (o.layout == "bhsd") {
    run<T>(o, [&](const policy_shape& s) { return make_bhsd_cache<T>(s.num_seqs, s.num_kv_heads, s.capacity, o.head_dim); });
  } else if (o.layout == "bshd") {
    run<T>(o, [&](const policy_shape& s) { return make_bshd_cache<T>(s.num_seqs, s.num_kv_heads, s.capacity, o.head_dim); });
  } else {  // paged (parse accepts nothing else)
    run<T>(o, [&](const policy_shape& s) {
      return make_paged_cache<T>(s.num_seqs, s.num_kv_heads, s.capacity, o.head_dim, o.page_size, page_order::nhd);
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  const options o = demo::parse(argc, argv);
  try {
    if (o.dtype == "float") run_dtype<float>(o);
    else if (o.dtype == "half") run_dtype<kvevict::half>(o);
    else run_dtype<kvevict::bfloat16>(o);
  } catch (const kvevict::error& e) {
    std::fprintf(stderr, "kvevict_demo: %s\n", e.what());
    return 1;
  }
  return 0;
}
