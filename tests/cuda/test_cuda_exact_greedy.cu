// exact_greedy on CUDA against the host backend: history in device memory,
// the leave-one-out errors computed in the host's order, so the scores are
// the host's bit for bit; every dtype x layout x GQA group {1, 4, 8}, ragged
// batches, bad query rows, device queries with and without an LSE (it is
// never read). Compiling this file instantiates the exact_greedy kernel for
// every dtype x layout.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kvevict/cuda/kvevict_cuda.cuh"
#include "support/batch_streams.hpp"
#include "support/caches.hpp"
#include "cuda/device_mirror.cuh"

namespace {

using namespace kvevict;
using kvtest::device_buffer;
using kvtest::layout_kind;

template <class T>
std::int64_t run_stream(std::uint32_t seed, layout_kind layout, std::int32_t group) {
  std::mt19937 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  exact_greedy_config config;
  config.budget = pick(2, 10);
  config.recent = pick(0, config.budget - 1);
  config.sinks = pick(0, config.budget - 1 - config.recent);
  kvtest::batch_dims dm;
  dm.seqs = pick(1, 4);
  dm.heads = pick(1, 2);
  dm.group = group;
  dm.head_dim = pick(0, 1) ? 8 : 20;
  dm.capacity = config.budget + 1 + pick(0, 1);
  const std::int32_t steps = pick(20, 60), B = dm.seqs, H = dm.heads, D = dm.head_dim, Hq = dm.q_heads();
  const policy_shape shape{B, H, Hq, dm.capacity};
  const history_extent history{steps, D};
  batched_policy<exact_greedy_policy> ref(shape, config, history);
  batched_policy<exact_greedy_policy, device::cuda> dev(shape, config, history);
  kvtest::host_state_mirror<exact_greedy_policy> mirror(shape, config, history);
  std::int64_t evictions = 0;
  kvtest::with_cache<T>(layout, B, H, dm.capacity, D, pick(1, 4), [&](const auto& view) {
    kvtest::device_cache dcache(view);
    device_buffer<std::int32_t> victims(std::size_t(B) * H);
    for (std::int32_t step = 0; step < steps; ++step) {
      CAPTURE(step);
      kvtest::batch_step<T> st = kvtest::draw_step<T>(rng, dm, 0.2);
      const bool bad = rng() % 25 == 0;
      if (bad) st.q[std::size_t(rng() % st.q.size())] = std::nanf("");
      const device_buffer<std::int32_t> list(st.list.empty() ? std::vector<std::int32_t>{-1} : st.list);
      const device_buffer<std::uint8_t> flags(st.flags);
      const active_set dactive = st.use_list ? active_set::of_list(list.get(), std::int32_t(st.list.size()))
                                             : active_set::of_flags(flags.get());
      const device_buffer<T> k(st.k_new), v(st.v_new);
      const device_buffer<float> q(st.q), lse(st.lse);
      ref.append(view, batch_rows<T>{make_tensor_view<const T>(st.k_new.data(), B, H, D)},
                 batch_rows<T>{make_tensor_view<const T>(st.v_new.data(), B, H, D)}, st.active_set());
      dev.append(dcache.view, batch_rows<T>{make_tensor_view<const T>(k.get(), B, H, D)},
                 batch_rows<T>{make_tensor_view<const T>(v.get(), B, H, D)}, dactive);
      std::vector<std::int32_t> want(std::size_t(B) * H, -7);
      KVTEST_CUDA(cudaMemcpy(victims.get(), want.data(), want.size() * 4, cudaMemcpyHostToDevice));
      ref.observe_evict(batch_queries<float>{make_tensor_view<const float>(st.q.data(), B, Hq, D),
                                             make_tensor_view<const float>(st.lse.data(), B, Hq), st.scale},
                        view, st.active_set(), want.data());
      // exact_greedy never reads the LSE: every other step the device call goes without one.
      const auto dlse = make_tensor_view<const float>(lse.get(), B, Hq);
      dev.observe_evict(batch_queries<float>{make_tensor_view<const float>(q.get(), B, Hq, D),
                                             step % 2 ? dlse : decltype(dlse){}, st.scale},
                        dcache.view, dactive, victims.get());
      CHECK(victims.download() == want);
      const std::uint64_t status = ref.status_word();
      CHECK(dev.status_word() == status);
      mirror.read(dev.state());
      kvtest::check_same_state(ref.state(), mirror.view);
      if (status != batch_status_clear) {
        CHECK_THROWS(ref.check());
        CHECK_THROWS(dev.check());
        // The head left unchanged misses a history row: a new request on its sequence.
        const std::int32_t sb = batch_status::unpack(status).sequence;
        const device_buffer<std::int32_t> db(std::vector<std::int32_t>{sb});
        ref.reset(active_set::of_list(&sb, 1));
        dev.reset(active_set::of_list(db.get(), 1));
      }
      for (std::int32_t x : want) evictions += x >= 0;
    }
  });
  return evictions;
}

}  // namespace

TEST_CASE("cuda exact_greedy equals the host backend bit for bit") {
  std::int64_t streams = 0, evictions = 0;
  std::uint32_t seed = 1;
  const int stride = kvtest::quick_stride(3);
  for (layout_kind layout : kvtest::all_layouts)
    for (std::int32_t group : {1, 4, 8})
      for (int i = 0; i < 3; ++i, ++seed, ++streams) {
        if (seed % stride != 0) continue;
        CAPTURE(seed);
        CAPTURE(std::string(kvtest::name(layout)));
        CAPTURE(group);
        switch ((seed / stride) % 4) {  // over the seeds that run: every dtype in quick mode too
          case 0: evictions += run_stream<float>(seed, layout, group); break;
          case 1: evictions += run_stream<kvevict::half>(seed, layout, group); break;
          case 2: evictions += run_stream<kvevict::bfloat16>(seed, layout, group); break;
          default: evictions += run_stream<kvevict::fp8_e5m2>(seed, layout, group); break;  // K and V x their scales
        }
      }
  MESSAGE(streams, " streams, ", evictions, " exact_greedy evictions compared");
  CHECK(evictions > 500 / stride);
}
