// Lets one inline function serve host code (CPU backend, tests) and CUDA device code.
#ifndef LOSSD_KERNELS_HOST_DEVICE_H_
#define LOSSD_KERNELS_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define LOSSD_HD __host__ __device__ __forceinline__
#else
#define LOSSD_HD inline
#endif

#endif  // LOSSD_KERNELS_HOST_DEVICE_H_
