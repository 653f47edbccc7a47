// main() of the gpu-labelled tests: runs doctest when a CUDA device is
// present; otherwise says why and exits 77, which ctest reports as skipped
// (SKIP_RETURN_CODE), never as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s); these tests need a GPU\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0");
    return 77;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device 0: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  return doctest::Context(argc, argv).run();
}
