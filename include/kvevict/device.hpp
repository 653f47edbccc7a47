#pragma once
// Device tags: the one template argument that moves an engine's batched calls
// between the host and CUDA (batched_policy<Policy, Device>).
//
// No CUDA header is included: cudaStream_t is `struct CUstream_st*`, so the
// tag can name the stream type without the toolkit.
struct CUstream_st;

namespace kvevict {
namespace device {

/// Plain C++ over host memory; calls complete before they return.
struct host {
  /// Host calls take no stream; this empty value stands in so that engine
  /// code can pass `stream` on either device.
  struct stream_type {};
  static constexpr const char* name = "host";
};

/// CUDA kernels over device memory, stream-ordered.
struct cuda {
  using stream_type = CUstream_st*;  ///< cudaStream_t
  static constexpr const char* name = "cuda";
};

}  // namespace device
}  // namespace kvevict
