// kvevict_bench_cuda: every CUDA benchmark family in one translation unit
// (nvcc compile time matters more than file count in CI): gpu_decode with
// its baselines, gpu_select, gpu_prefill and gpu_evict_to. Each family lives
// in its own header; docs/benchmarks.md describes them. Without a CUDA
// device the binary says so and exits 77 (ctest: skipped).
#include <benchmark/benchmark.h>

#include "gpu_bench_common.cuh"
#include "gpu_decode.cuh"
#include "gpu_decode_baselines.cuh"
#include "gpu_evict_to.cuh"
#include "gpu_prefill.cuh"
#include "gpu_select.cuh"

int main(int argc, char** argv) {
  if (!kvbench::gpu::device_present()) return 77;
  kvbench::gpu::decode::register_all();
  kvbench::gpu::decode::register_baselines();
  kvbench::gpu::select::register_all();
  kvbench::gpu::prefill::register_all();
  kvbench::gpu::evict_to::register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
