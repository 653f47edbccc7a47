// Multi-token eviction (evict_to, for chunked prefill and speculative
// decoding): every KV head holds N tokens (a chunk of N - budget just
// appended and observed) and evict_to(budget) frees the surplus at once,
// budget = 20% or 50% of N, recent window 64, h2o. Both forms: the one that
// moves the kept rows in the cache (`cache`, bf16), and the one that reports
// the moves for the engine to make (`moves`); per sequence and batched.
//
// One item = one token freed (N - budget per (sequence, KV head)). Bytes =
// the probabilities of the observe that precedes it plus 12 bytes of state
// a slot; the rows the cache form moves (fewer than the tokens freed) come
// on top and are not counted.
//
// Baseline: plain_nth_element, the same step written plainly with the
// standard library and no checks: add the group-folded probabilities to the
// scores, nth_element on (score, position) keys of the unprotected for the
// ones to keep, and list the moves that refill the holes below the budget
// (the `moves` form's output), then apply them and append the next chunk.
//
// The timed loop is the whole multi-token step (append the chunk, observe,
// evict_to), since evict_to alone cannot be repeated without refilling;
// decode/h2o/probs of kvevict_bench_decode gives the cost of the observe.
#include "bench_common.hpp"

namespace {

using namespace kvevict;
using kvbench::scenario;

enum class form { cache, moves };

struct chunk_step {
  scenario sc;
  std::int32_t budget, chunk;
  std::vector<float> probs;  // [B][Hq][N]

  chunk_step(const scenario& s, const kvbench::keep_fraction& keep)
      : sc(kvbench::cache_slice(s, sizeof(bfloat16))), budget(keep.of(s.slots)), chunk(s.slots - budget),
        probs(kvbench::probabilities(std::size_t(sc.seqs) * s.q_heads() * s.slots, s.slots,
                                     kvbench::distribution::powerlaw, 6)) {}
  policy_shape shape() const { return {sc.seqs, sc.kv_heads, sc.q_heads(), sc.slots}; }
  h2o_config config() const { return {budget - kvbench::kRecent, kvbench::kRecent}; }
  decode_probs of(std::int32_t b) const {
    return {make_tensor_view<const float>(probs.data() + std::size_t(b) * sc.q_heads() * sc.slots, sc.q_heads(),
                                          sc.slots)};
  }
  void report(benchmark::State& state) const {
    kvbench::report(state, sc.heads_total() * chunk,
                    std::int64_t(probs.size() * sizeof(float)) + sc.slots_total() * 3 * std::int64_t(sizeof(float)));
  }
};

void per_sequence(benchmark::State& state, scenario sc, kvbench::keep_fraction keep, form f) {
  const chunk_step step(sc, keep);
  h2o_policy policy(step.shape(), step.config());
  auto cache = make_bhsd_cache<bfloat16>(step.sc.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  std::vector<slot_move> moves(std::size_t(sc.kv_heads) * sc.slots);
  std::vector<std::int32_t> move_counts(std::size_t(sc.kv_heads));
  for (std::int32_t b = 0; b < step.sc.seqs; ++b) {  // fill to budget tokens
    policy.append(b, sc.slots, nullptr);
    policy.observe(b, step.of(b));
    policy.evict_to(b, step.budget, moves.data(), move_counts.data());
  }
  for (auto _ : state)
    for (std::int32_t b = 0; b < step.sc.seqs; ++b) {
      policy.append(b, step.chunk, nullptr);
      policy.observe(b, step.of(b));
      if (f == form::cache)
        benchmark::DoNotOptimize(policy.evict_to(b, step.budget, cache.view()));
      else
        benchmark::DoNotOptimize(policy.evict_to(b, step.budget, moves.data(), move_counts.data()));
    }
  step.report(state);
}

// Batched: append the chunk, observe_evict (which takes the first victim),
// then batched_evict_to for the rest.
void batched(benchmark::State& state, scenario sc, kvbench::keep_fraction keep, form f) {
  const chunk_step step(sc, keep);
  batched_policy<h2o_policy, device::host> layer(step.shape(), step.config());
  auto cache = make_bhsd_cache<bfloat16>(step.sc.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  std::vector<slot_move> moves(std::size_t(step.sc.heads_total()) * sc.slots);
  std::vector<std::int32_t> move_counts(std::size_t(step.sc.heads_total()));
  const batch_probs in{make_tensor_view<const float>(step.probs.data(), step.sc.seqs, sc.q_heads(), sc.slots)};
  std::uint64_t status = batch_status_clear;
  const auto multi_token_step = [&](std::int32_t tokens) {
    batched_append_tokens(layer.state(), active_set::all(), tokens, &status);
    layer.observe_evict(in);
    if (f == form::cache)
      batched_evict_to(layer.state(), active_set::all(), step.budget, cache.view(), nullptr, &status);
    else
      batched_evict_to(layer.state(), active_set::all(), step.budget, moves.data(), move_counts.data(), &status);
  };
  multi_token_step(sc.slots);  // fill
  throw_if_error(status, "fill");
  layer.check();
  for (auto _ : state) multi_token_step(step.chunk);
  throw_if_error(status, "batched_evict_to");
  layer.check();
  step.report(state);
}

void plain_nth_element(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  const chunk_step step(sc, keep);
  const std::size_t n = std::size_t(sc.slots);
  std::vector<float> score(std::size_t(step.sc.slots_total()), 0.0f);
  std::vector<std::int32_t> position(score.size());
  for (std::size_t i = 0; i < position.size(); ++i) position[i] = std::int32_t(i % n);
  std::vector<std::uint64_t> keys(n);
  std::vector<std::uint8_t> kept(n);
  std::vector<slot_move> moves(n);
  const std::int32_t heavy = step.budget - kvbench::kRecent;
  std::int32_t length = sc.slots;
  for (auto _ : state) {
    for (std::int64_t bh = 0; bh < step.sc.heads_total(); ++bh) {
      float* s = &score[std::size_t(bh) * n];
      std::int32_t* pos = &position[std::size_t(bh) * n];
      const float* p = &step.probs[std::size_t(bh) * sc.group * n];
      std::size_t m = 0;
      for (std::size_t j = 0; j < n; ++j) {
        float x = 0.0f;
        for (std::int32_t g = 0; g < sc.group; ++g) x += p[std::size_t(g) * n + j];
        s[j] += x;
        kept[j] = pos[j] >= length - kvbench::kRecent;
        if (!kept[j]) keys[m++] = (~eviction_key(s[j], pos[j]) & ~std::uint64_t{0xFFFFFFFFu}) | j;  // (key, slot)
      }
      // Highest keys first: the complement's lowest. Slots ride in the low
      // bits in place of positions; positions only break exact ties there.
      std::nth_element(keys.begin(), keys.begin() + heavy, keys.begin() + std::ptrdiff_t(m));
      for (std::int32_t i = 0; i < heavy; ++i) kept[std::size_t(keys[std::size_t(i)] & 0xFFFFFFFFu)] = 1;
      std::size_t hole = 0, count = 0;
      for (std::size_t from = std::size_t(step.budget); from < n; ++from) {
        if (!kept[from]) continue;
        while (kept[hole]) ++hole;
        moves[count++] = {std::int32_t(from), std::int32_t(hole++)};
      }
      // Apply the moves, then append the next chunk above the budget, as
      // the policy's state would see it.
      for (std::size_t i = 0; i < count; ++i) {
        s[std::size_t(moves[i].to)] = s[std::size_t(moves[i].from)];
        pos[std::size_t(moves[i].to)] = pos[std::size_t(moves[i].from)];
      }
      for (std::size_t j = std::size_t(step.budget); j < n; ++j) {
        s[j] = 0.0f;
        pos[j] = length + std::int32_t(j) - step.budget;
      }
      benchmark::DoNotOptimize(moves.data());
      benchmark::DoNotOptimize(count);
    }
    length += step.chunk;
    benchmark::ClobberMemory();
  }
  step.report(state);
}

const int registered = [] {
  for (const scenario& sc : kvbench::selected_scenarios())
    for (const kvbench::keep_fraction& keep : kvbench::kKeeps)
      for (const auto& [f, f_name] : {std::pair{form::cache, "cache"}, std::pair{form::moves, "moves"}}) {
        const auto unit = sc.slots_total() > 1'000'000 ? benchmark::kMillisecond : benchmark::kMicrosecond;
        const std::string dtype = f == form::cache ? "bf16" : "none";
        benchmark::RegisterBenchmark(
            kvbench::bench_name("evict_to", "h2o", f_name, sc.name, keep.name, "powerlaw", dtype).c_str(),
            per_sequence, sc, keep, f)
            ->Unit(unit);
        benchmark::RegisterBenchmark(
            kvbench::bench_name("evict_to", "h2o_batched", f_name, sc.name, keep.name, "powerlaw", dtype).c_str(),
            batched, sc, keep, f)
            ->Unit(unit);
        if (f == form::moves)
          benchmark::RegisterBenchmark(
              kvbench::bench_name("evict_to", "plain_nth_element", f_name, sc.name, keep.name, "powerlaw", dtype)
                  .c_str(),
              plain_nth_element, sc, keep)
              ->Unit(unit);
      }
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
