// Programmatic dependent launch (sm_90+): a kernel launched with
// launch_dependent may be scheduled while the kernel before it on the stream
// is still finishing, so the launch latency between two short kernels
// overlaps the first one's last blocks. The kernel must call
// wait_for_previous_grid before it touches global memory: that waits until
// the previous grid has finished and its writes are visible, exactly what
// stream order gives without the attribute. allow_dependent_launch lets the
// next such kernel be scheduled before this one ends (it still waits for this
// one's writes). Both compile to nothing below sm_90, so a kernel may be
// launched this way only where its code was compiled for sm_90 or later:
// waits_for_previous_grid asks that of the kernel the device will run.
// launch_dependent also launches in thread block clusters (sm_90+ too).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "../common/launch_check.h"

namespace fusedattn::cuda {

__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether `kernel`, as the current device (`device`) runs it, contains the
// wait: the device must be sm_90 or later and the kernel's code compiled from
// PTX for sm_90 or later (a build that embeds compute_80 PTX, JIT-compiled on
// a newer GPU, has neither instruction). Driver queries; callers cache it.
inline bool waits_for_previous_grid(const void* kernel, int device) {
  int major = 0;
  FUSEDATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaFuncAttributes attributes = {};
  FUSEDATTN_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return major >= 9 && attributes.ptxVersion >= 90;
}

// The launch attribute for clusters of `size` consecutive blocks along x
// (sm_90+): for launches and for occupancy queries alike.
inline cudaLaunchAttribute cluster_attribute(unsigned size) {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = size;
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  return attribute;
}

// kernel<<<grid, block, smem_bytes, stream>>>(args...), as a programmatic
// dependent launch when `dependent` (waits_for_previous_grid(kernel)), in
// clusters of `cluster_size` consecutive blocks along x when that is over 1
// (sm_90+; grid.x a multiple of it).
template <typename... KernelArgs, typename... Args>
void launch_dependent(void (*kernel)(KernelArgs...), bool dependent, unsigned cluster_size, dim3 grid, dim3 block,
                      size_t smem_bytes, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2] = {};
  if (dependent) {
    attributes[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[config.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_size > 1) attributes[config.numAttrs++] = cluster_attribute(cluster_size);
  config.attrs = attributes;
  const cudaError_t launched = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  // Clears the launch's error, as <<<>>> followed by cudaGetLastError does,
  // so that no later check reports it against another call.
  const cudaError_t last = cudaGetLastError();
  FUSEDATTN_CUDA_CHECK(launched != cudaSuccess ? launched : last);
}

}  // namespace fusedattn::cuda
