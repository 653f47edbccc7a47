#pragma once
// Host/device annotations without pulling in any CUDA header.
#if defined(__CUDACC__)
#define KVEVICT_HOST_DEVICE __host__ __device__
#else
#define KVEVICT_HOST_DEVICE
#endif
