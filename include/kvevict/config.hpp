#pragma once
// Host/device annotations without pulling in any CUDA header.
#if defined(__CUDACC__)
#define KVEVICT_HOST_DEVICE __host__ __device__
#else
#define KVEVICT_HOST_DEVICE
#endif

// Before a __host__ __device__ template that calls a callable: the host
// backend passes host-only lambdas, the kernels device lambdas; nvcc would
// warn about the host instantiation otherwise (as Thrust does, this turns
// the check off for that template).
#if defined(__CUDACC__) && !defined(__clang__)
#define KVEVICT_EXEC_CHECK_DISABLE _Pragma("nv_exec_check_disable")
#else
#define KVEVICT_EXEC_CHECK_DISABLE
#endif

// Full unrolling of a loop with a constant trip count, so that the arrays it
// indexes stay in registers on a GPU (an index that is not a compile-time
// constant puts them in local memory). Host compilers decide for themselves.
#if defined(__CUDA_ARCH__)
#define KVEVICT_UNROLL _Pragma("unroll")
#else
#define KVEVICT_UNROLL
#endif

// Keeps a rarely taken path (e.g. a fallback for huge sizes) out of its
// caller, so the caller's registers are not sized for it.
#if defined(__CUDACC__)
#define KVEVICT_NOINLINE __noinline__
#elif defined(__GNUC__)
#define KVEVICT_NOINLINE __attribute__((noinline))
#else
#define KVEVICT_NOINLINE
#endif
