#pragma once
// The query tile of the prefill kernels that score from queries + LSE (the
// causal prompt's, cuda/prefill_scores.cuh, and SnapKV's window,
// cuda/prefill_window.cuh): a block stages its tile's keys once, then its
// query rows kPrefillQueryRows at a time, in shared memory, and each
// thread scores its key against the staged rows. Its size grows with
// head_dim: the host refuses one the device cannot hold before anything
// changes, and opts the kernel in above the default 48 KiB.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cuda/prefill_workspace.cuh"
#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// Shared memory of the queries kernel: the tile's keys (rows padded by one
/// element against bank conflicts), the staged query rows and their LSE.
template <class Q, class T>
struct query_tile_layout {
  std::size_t key_bytes, query_bytes, lse_bytes;
  KVEVICT_HOST_DEVICE explicit query_tile_layout(std::int32_t head_dim)
      : key_bytes(round16(std::size_t(kPrefillKeys) * std::size_t(head_dim + 1) * sizeof(T))),
        query_bytes(round16(std::size_t(kPrefillQueryRows) * std::size_t(head_dim) * sizeof(Q))),
        lse_bytes(std::size_t(kPrefillQueryRows) * sizeof(float)) {}
  KVEVICT_HOST_DEVICE std::size_t total() const { return key_bytes + query_bytes + lse_bytes; }
  KVEVICT_HOST_DEVICE static std::size_t round16(std::size_t x) { return (x + 15) / 16 * 16; }
};

/// A queries kernel's shared memory, carved as query_tile_layout says, and
/// the staging both queries kernels (this one and SnapKV's) share: the
/// tile's keys once, then kPrefillQueryRows query rows at a time.
template <int Threads, class Q, class T>
struct query_tile {
  T* keys;
  Q* queries;
  float* lse;
  std::int32_t d, key_stride;

  __device__ query_tile(unsigned char* memory, std::int32_t head_dim) : d(head_dim), key_stride(head_dim + 1) {
    const query_tile_layout<Q, T> layout(head_dim);
    keys = reinterpret_cast<T*>(memory);
    queries = reinterpret_cast<Q*>(memory + layout.key_bytes);
    lse = reinterpret_cast<float*>(memory + layout.key_bytes + layout.query_bytes);
  }
  /// The keys of positions [first, first + count) of (b, h).
  template <class Layout>
  __device__ void stage_keys(const kv_view<T, Layout>& cache, std::int32_t b, std::int32_t h, std::int32_t first,
                             std::int32_t count, std::int32_t t) {
    for (std::int32_t x = t; x < count * d; x += Threads) {
      const std::int32_t r = x / d, e = x - r * d;
      keys[r * key_stride + e] = cache.k_row(b, h, first + r)[e];
    }
  }
  /// Rows [0, rows) of query(r, e) and lse_of(r). The caller syncs before
  /// (the previous rows are no longer read) and after.
  template <class Query, class Lse>
  __device__ void stage_rows(std::int32_t rows, std::int32_t t, Query query, Lse lse_of) {
    for (std::int32_t x = t; x < rows * d; x += Threads) {
      const std::int32_t r = x / d, e = x - r * d;
      queries[r * d + e] = query(r, e);
    }
    for (std::int32_t r = t; r < rows; r += Threads) lse[r] = lse_of(r);
  }
  __device__ const Q* query_row(std::int32_t r) const { return queries + r * d; }
  __device__ const T* key_of(std::int32_t t) const { return keys + t * key_stride; }
};

/// The query tile grows with head_dim: refuse one the device cannot hold
/// before the call's memset and prepare kernel change anything.
template <class Q, class T>
void require_query_tile(const kvevict::detail::site& w, std::int32_t head_dim) {
  const std::size_t shared = query_tile_layout<Q, T>(head_dim).total();
  int device = 0, limit = 0;
  if (shared > 48 * 1024 && cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
      shared > static_cast<std::size_t>(limit))
    kvevict::detail::fail<invalid_argument>(w, "cache.head_dim", "= ", head_dim, " needs ", shared,
                                            " bytes of shared memory per block for these dtypes; the device "
                                            "allows ", limit);
}

/// Beyond the default 48 KiB a kernel opts in (up to the device's limit,
/// which require_query_tile checked).
template <class Kernel>
cudaError_t opt_in_shared(Kernel kernel, std::size_t shared) {
  if (shared <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
}

}  // namespace detail
}  // namespace gpu
}  // namespace kvevict
