// Turning CUDA errors into exceptions in host launch code (no ATen here; the
// operator layer sees a std::runtime_error, which PyTorch reports as RuntimeError),
// and what launch code asks of the current device.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>

#define FUSEDATTN_CUDA_CHECK(expr)                                                        \
  do {                                                                                    \
    const cudaError_t fusedattn_err_ = (expr);                                            \
    if (fusedattn_err_ != cudaSuccess)                                                    \
      throw std::runtime_error(std::string("fusedattn: CUDA error in ") + #expr + ": " + \
                               cudaGetErrorString(fusedattn_err_));                       \
  } while (0)

namespace fusedattn::cuda {

// The current device's SM count.
inline int current_device_sms() {
  int device = 0, sms = 0;
  FUSEDATTN_CUDA_CHECK(cudaGetDevice(&device));
  FUSEDATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// Devices whose answers once_per_device keeps (later ones ask every time).
inline constexpr int kMaxCachedDevices = 64;

// ask(device) for the current device, asked once per device: `known` holds
// each device's answer, which must not be zero (zero: not asked yet).
template <typename T, typename Ask>
T once_per_device(std::atomic<T> (&known)[kMaxCachedDevices], Ask ask) {
  int device = 0;
  FUSEDATTN_CUDA_CHECK(cudaGetDevice(&device));
  if (device < kMaxCachedDevices) {
    if (const T answer = known[device].load(std::memory_order_acquire)) return answer;
  }
  const T answer = ask(device);
  if (device < kMaxCachedDevices) known[device].store(answer, std::memory_order_release);
  return answer;
}

// The current device's SM count, asked of the driver once per device.
inline int device_sms() {
  static std::atomic<int> known[kMaxCachedDevices];
  return once_per_device(known, [](int) { return current_device_sms(); });
}

}  // namespace fusedattn::cuda
