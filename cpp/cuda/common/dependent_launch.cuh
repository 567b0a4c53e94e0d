// Programmatic dependent launch (sm_90+): a kernel launched with
// launch_dependent may be scheduled while the kernel before it on the stream
// is still finishing, so the launch latency between two short kernels
// overlaps the first one's last blocks. The kernel must call
// wait_for_previous_grid before it touches global memory: that waits until
// the previous grid has finished and its writes are visible, exactly what
// stream order gives without the attribute. allow_dependent_launch lets the
// next such kernel be scheduled before this one ends (it still waits for this
// one's writes). On older GPUs both are no-ops and the launch is a plain one.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <utility>

#include "launch_check.h"

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

// Whether the current device has programmatic dependent launch (compute
// capability 9.0 or later), asked of the driver once per device.
inline bool device_has_dependent_launch() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];  // 0: not asked, 1: no, 2: yes
  int device = 0;
  FUSEDATTN_CUDA_CHECK(cudaGetDevice(&device));
  if (device < kMaxDevices) {
    if (const int answer = known[device].load(std::memory_order_relaxed)) return answer == 2;
  }
  int major = 0;
  FUSEDATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (device < kMaxDevices) known[device].store(major >= 9 ? 2 : 1, std::memory_order_relaxed);
  return major >= 9;
}

// kernel<<<grid, block, smem_bytes, stream>>>(args...), as a programmatic
// dependent launch where the device has it.
template <typename... KernelArgs, typename... Args>
void launch_dependent(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (device_has_dependent_launch()) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  FUSEDATTN_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace fusedattn::cuda
