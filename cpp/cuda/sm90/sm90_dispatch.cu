// The sm90 family's host side: whether this build and device can run it, and
// a plan (plan.cu's) into tensor maps and the compile-time instantiation.
#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/instantiation_dispatch.h"
#include "../common/key_block_scheduler.cuh"
#include "../common/launch_check.h"
#include "backward_sm90.h"
#include "backward_wide_traits.h"
#include "forward_sm90.h"
#include "forward_traits.h"
#include "../hopper/tensor_maps.h"

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

bool sm90_available() {
  static std::mutex lock;
  static std::vector<int> known;  // per device: -1 unknown, 0 no, 1 yes
  int device = 0, devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();  // no device: no sm90 (the error is not sticky)
    return false;
  }
  FUSEDATTN_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> guard(lock);
  if (known.size() <= static_cast<size_t>(device)) known.resize(device + 1, -1);
  if (known[device] < 0) known[device] = probe_device(device) ? 1 : 0;
  return known[device] == 1;
}

void forward_sm90(const ForwardParams& p, const Plan& plan, cudaStream_t stream) {
  const AttentionShape& sh = p.shape;
  if (sh.batch * sh.heads_q == 0 || sh.seqlen_q == 0) return;
  if (p.work_counter == nullptr) throw std::invalid_argument("fusedattn: forward_sm90 needs p.work_counter");
  dispatch_instantiation(Sm90ForwardHeadDims{}, "sm90 forward", p.dtype, sh.head_dim, [&](auto head_dim, auto element) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    Sm90ForwardArgs args{};
    args.p = p;
    if (plan.block_m != sm90_forward_block_m(kHeadDim))
      throw_planner_bug("the sm90 forward at head dim " + std::to_string(kHeadDim) + " has no " +
                        std::to_string(plan.block_m) + "-query blocks");
    const std::string why =
        encode_forward_operand_maps(p, &args.q_map, &args.k_map, &args.v_map, plan.block_m, plan.block_n);
    if (!why.empty()) throw_planner_bug("the sm90 forward's tensor maps cannot describe " + why);
    launch_forward_sm90<kHeadDim, decltype(element)>(args, plan, stream);
  });
}

int64_t sm90_backward_dq_turns(const ForwardParams& p, const Plan& plan) {
  return plan.ordered_dq() ? dq_turn_counters(p, plan.block_m, kSm90BackwardConsumers) : 0;
}

void backward_sm90(const BackwardParams& p, const Plan& plan, cudaStream_t stream) {
  // The kernels' launches refuse the mode's other calls (attn_mask, d=256, d=192 soft-capped).
  if (p.deterministic && p.head_splits != 1)
    throw_planner_bug("the sm90 backward's deterministic mode takes no head splits");
  if (plan.family != Family::Sm90 || plan.head_splits != p.head_splits || plan.deterministic != p.deterministic)
    throw_planner_bug("backward_sm90 was handed the plan " + plan.describe());
  if (p.fwd.mask.kind != MaskKind::None && p.fwd.mask.tiles.lists == nullptr)
    throw_planner_bug("the sm90 backward takes attn_mask sorted into key tiles only");
  const AttentionShape& sh = p.fwd.shape;
  const int64_t rows = sh.batch * sh.heads_q * sh.seqlen_q;
  dispatch_instantiation(Sm90BackwardHeadDims{}, "sm90 backward", p.fwd.dtype, sh.head_dim, [&](auto head_dim, auto element) {
    using Tr = Sm90BackwardTraitsOf<decltype(head_dim)::value>;
    if (plan.block_m != Tr::kBlockM || plan.block_n != Tr::kBlockN || plan.warps != Tr::kThreads / 32)
      throw_planner_bug("the sm90 backward at head dim " + std::to_string(decltype(head_dim)::value) + " runs " +
                        std::to_string(Tr::kBlockM) + " x " + std::to_string(Tr::kBlockN) + " tiles of " +
                        std::to_string(Tr::kThreads / 32) + " warps, got the plan " + plan.describe());
    Sm90BackwardArgs args{};
    args.p = p;
    // The first operand whose map fails, named in the error.
    std::string why = encode_backward_operand_maps(p, &args.q_map, &args.do_map, &args.k_map, &args.v_map,
                                                   Tr::kBlockM, Tr::kBlockN);
    if (why.empty() && rows > 0)
      why = !encode_rows_tensor_map(&args.lse_map, p.fwd.lse, rows, Tr::kRowsBox)     ? "lse"
            : !encode_rows_tensor_map(&args.delta_map, p.delta, rows, Tr::kRowsBox) ? "delta"
            : !encode_float_matrix_tensor_map(&args.dq_map, p.grad_q_accum, rows, sh.head_dim, Tr::kDqBoxRows)
                ? "dq's accumulator"
                : "";
    if (!why.empty()) throw_planner_bug("the sm90 backward's tensor maps cannot describe " + why);
    launch_backward_sm90<decltype(head_dim)::value, decltype(element)>(args, stream);
  });
}

}  // namespace fusedattn::cuda
