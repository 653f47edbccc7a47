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
