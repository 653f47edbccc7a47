#pragma once
// Shared by the CUDA translation units of the bindings: the stream cast and
// the one place a cudaError_t becomes cuda_failure.
#include <cuda_runtime.h>

#include <cstdint>

#include "common.hpp"
#include "kvevict/cuda/kvevict_cuda.cuh"

namespace kvevict_py {
namespace cuda {

inline cudaStream_t as_stream(void* stream) noexcept { return static_cast<cudaStream_t>(stream); }

inline void throw_on_error(cudaError_t code, const char* call) {
  if (code == cudaSuccess) return;
  throw cuda_failure(kvevict::detail::concat("kvevict::cuda: ", call, " failed: ", cudaGetErrorName(code), " (",
                                             cudaGetErrorString(code), ")"));
}

}  // namespace cuda
}  // namespace kvevict_py
