// Runtime (dtype, head dim) -> the compile-time instantiation, and whether
// this build and device can run the family at all.
#include <mutex>
#include <stdexcept>
#include <vector>

#include "../common/instantiation_dispatch.h"
#include "../common/launch_check.h"
#include "forward_sm90.h"

namespace fusedattn::cuda {
namespace {

// Writes 1 when this file was compiled for sm_90a (wgmma available), else 0.
__global__ void sm90a_probe_kernel(int* built_for_sm90a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *built_for_sm90a = 1;
#else
  *built_for_sm90a = 0;
#endif
}

bool probe_device(int device) {
  cudaDeviceProp prop{};
  FUSEDATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (prop.major != 9) return false;
  int* flag = nullptr;
  FUSEDATTN_CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
  sm90a_probe_kernel<<<1, 1>>>(flag);
  int built = 0;
  const cudaError_t launched = cudaGetLastError();
  if (launched == cudaSuccess) FUSEDATTN_CUDA_CHECK(cudaMemcpy(&built, flag, sizeof(int), cudaMemcpyDeviceToHost));
  FUSEDATTN_CUDA_CHECK(cudaFree(flag));
  return launched == cudaSuccess && built == 1;
}

}  // namespace

bool sm90_forward_available() {
  static std::mutex lock;
  static std::vector<int> known;  // per device: -1 unknown, 0 no, 1 yes
  int device = 0;
  FUSEDATTN_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> guard(lock);
  if (known.size() <= static_cast<size_t>(device)) known.resize(device + 1, -1);
  if (known[device] < 0) known[device] = probe_device(device) ? 1 : 0;
  return known[device] == 1;
}

void forward_sm90(const ForwardParams& p, cudaStream_t stream) {
  if (p.mask.kind != MaskKind::None) throw std::invalid_argument("fusedattn: the sm90 forward takes no attn_mask yet");
  dispatch_instantiation<64, 128>("sm90 forward", p.dtype, p.shape.head_dim, [&](auto head_dim, auto element) {
    launch_forward_sm90<decltype(head_dim)::value, decltype(element)>(p, stream);
  });
}

}  // namespace fusedattn::cuda
