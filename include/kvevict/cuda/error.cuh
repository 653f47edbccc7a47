#pragma once
// CUDA errors as the library's exception, for the owning batched_policy and
// for callers who prefer exceptions to the launchers' cudaError_t.
#include <cuda_runtime.h>

#include <string>

#include "kvevict/error.hpp"

namespace kvevict {
namespace gpu {

/// A CUDA runtime call or kernel launch failed.
class cuda_error : public error {
 public:
  cuda_error(cudaError_t code, const std::string& what) : error(what), code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

/// Throws cuda_error naming `call` unless `code` is cudaSuccess.
inline void throw_on_error(cudaError_t code, const char* call) {
  if (code == cudaSuccess) return;
  throw cuda_error(code, kvevict::detail::concat("kvevict::cuda: ", call, " failed: ", cudaGetErrorName(code), " (",
                                        cudaGetErrorString(code), ")"));
}

}  // namespace gpu
}  // namespace kvevict
