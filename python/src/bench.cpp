// The benchmark hook (benchmarks/python/bench_python.py): not part of the API.
#include "bindings.hpp"

#include <chrono>

namespace kvevict_py {

namespace {

/// Benchmark hook (benchmarks/python/bench_python.py): the time per decode
/// step of `steps` steps of batched_append + batched_observe_evict from
/// `probs` on a host state, in C++ with no Python in between: the baseline
/// the Python calls' overhead is measured against. Returns nanoseconds per
/// step; raises like the calls it times.
double bench_decode_steps(const Descriptor& desc, nb::handle memory, nb::handle probs_obj, nb::handle victims_obj,
                          std::int64_t steps) {
  const char* call = "bench_decode_steps";
  const state_ref st = resolve_state(desc, memory, call);
  if (st.dev.cuda()) fail_arg(call, "state", "must be in host memory");
  const kvevict::batch_probs in{float_input<3>(probs_obj, st.dev, call, "probs", "[num_seqs][num_q_heads][slots]")};
  std::int32_t* victims =
      int32_output(victims_obj, st.dev, std::size_t(st.view.num_seqs()) * st.view.num_heads(), call, "victims");
  const kvevict::active_set all = kvevict::active_set::all();
  std::chrono::steady_clock::duration elapsed{};
  {
    nb::gil_scoped_release release;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < steps; ++i) {
      kvevict::batched_append(st.view, all, st.status);
      kvevict::batched_observe_evict(st.view, all, in, victims, st.status);
    }
    elapsed = std::chrono::steady_clock::now() - t0;
  }
  raise_host_status(st.status, call);
  return std::chrono::duration<double, std::nano>(elapsed).count() / double(steps > 0 ? steps : 1);
}

}  // namespace

void bind_bench(nb::module_& m) {
  m.def("_bench_decode_steps", &bench_decode_steps, "desc"_a, "state"_a, "probs"_a, "victims"_a, "steps"_a);
}

}  // namespace kvevict_py
