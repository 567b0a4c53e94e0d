// The sm90 backward: FlashAttention 2's walk (the sm80 kernel's;
// common/backward_passes.cuh runs the kernels around it and holds the walk
// itself, KeyBlockWalk: the tile scheduler's block order, longest first under
// causal) with every product on Hopper's warpgroup MMA and the loads on the
// tensor memory accelerator, in roles. A block owns 128 keys and is three
// warpgroups:
//   producer (warpgroup 0, one thread): the mainloop's load
//     (backward_mainloop.cuh): K and V once, then per step (kBlockM queries
//     of one query head: 64 at d=128, 128 at d=64) Q, dO, lse and delta into
//     a two-stage ring (backward_pipeline.cuh); it gives its registers to the
//     consumers (setmaxnreg).
//   consumers (warpgroups 1, 2): 64 keys each; per step the mainloop's mma
//     S^T = K Q^T and dP^T = V dO^T, the softmax step (backward_softmax.cuh:
//     P^T, dS^T and the masks), dS^T stored transposed as this warpgroup's
//     half of a [query][128 keys] tile, dV += P^T dO and dK += dS^T Q, then
//     dQ = dS K over all 128 keys for a 64 x 64 quarter, which the epilogue
//     (backward_epilogue.cuh) adds to the float32 accumulator.
// dK and dV stay in registers across the walk (GQA's sum costs nothing).
// Not yet: overlap between the products of one step and the next,
// attn_mask and the deterministic mode (the planner sends those to sm80).
#pragma once

#include <cmath>

#include "../common/backward_passes.cuh"
#include "../common/device_math.cuh"
#include "../common/launch_check.h"
#include "../hopper/bulk_copy.cuh"
#include "../hopper/warpgroup.cuh"
#include "../hopper/wgmma.cuh"
#include "backward_epilogue.cuh"
#include "backward_mainloop.cuh"
#include "backward_pipeline.cuh"
#include "backward_sm90.h"
#include "backward_softmax.cuh"
#include "backward_traits.h"

namespace fusedattn::cuda {

template <int HeadDim, typename T, bool IsCausal>
__global__ void __launch_bounds__(Sm90BackwardTraits<HeadDim>::kThreads, 1)
    sm90_backward_kernel(const __grid_constant__ Sm90BackwardArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma, stmatrix and setmaxnreg exist only in sm_90a code
  using Tr = Sm90BackwardTraits<HeadDim>;
  using Walk = KeyBlockWalk<Tr::kBlockN, Tr::kBlockM, IsCausal>;
  constexpr int kBlockM = Tr::kBlockM, kMTiles = kBlockM / 8, kDTiles = HeadDim / 8;

  extern __shared__ unsigned char smem_raw[];
  const Sm90BackwardSmem<Tr> smem(smem_raw);
  const BackwardParams& p = args.p;
  const AttentionShape& sh = p.fwd.shape;
  const Walk walk(p, args.order);
  // A step's first row in the flat [B x Hq x Nq] lse and delta.
  auto flat_row = [&](int64_t head, int64_t m0) {
    return static_cast<int>((walk.batch * sh.heads_q + head) * sh.seqlen_q + m0);
  };

  if (threadIdx.x == 0) smem.init_barriers();
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ---------------- producer ----------------
    warpgroup_release_registers<Tr::kProducerRegisters>();
    if (threadIdx.x != 0 || walk.steps == 0) return;
    const Sm90BackwardLoad<Tr, Walk> load{args, smem, walk};
    load.prefetch_maps();
    load.key_block();
    for (int s = 0; s < walk.steps; ++s) load.step(s, flat_row(walk.head(s), walk.m0(s)));
    return;
  }

  // ---------------- consumers ----------------
  warpgroup_claim_registers<Tr::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row = warp * 16;  // this warp's accumulator rows: keys of S^T, queries of dQ (after query0)
  const int64_t my_key0 = walk.key0 + 64 * consumer;  // this warpgroup's 64 keys
  using Mma = Sm90BackwardMma<HeadDim, T, Tr>;
  const Mma mma{smem, consumer};

  float dk[kDTiles][4] = {}, dv[kDTiles][4] = {};
  float (&dk_flat)[kDTiles * 4] = reinterpret_cast<float (&)[kDTiles * 4]>(dk);
  float (&dv_flat)[kDTiles * 4] = reinterpret_cast<float (&)[kDTiles * 4]>(dv);
  if (walk.steps > 0) mbarrier_wait(smem.kv_full, 0);

  for (int s = 0; s < walk.steps; ++s) {
    const int stage = smem.stage(s);
    mbarrier_wait(&smem.step_full[stage], smem.phase(s));
    const int64_t head = walk.head(s), m0 = walk.m0(s);
    const int row_skew = flat_row(head, m0) & 3;  // where the step's rows start in the boxes
    const float* lse = smem.lse + stage * Tr::kRowsSlot + row_skew;
    const float* delta = smem.delta + stage * Tr::kRowsSlot + row_skew;

    float st[kMTiles][4], dpt[kMTiles][4];
    float (&st_flat)[kMTiles * 4] = reinterpret_cast<float (&)[kMTiles * 4]>(st);
    float (&dpt_flat)[kMTiles * 4] = reinterpret_cast<float (&)[kMTiles * 4]>(dpt);
    mma.scores(st_flat, dpt_flat, stage);
    wgmma_wait<0>();
    fence_registers(st_flat);
    fence_registers(dpt_flat);

    backward_probabilities<kBlockM, IsCausal>(st, dpt, lse, delta, static_cast<int>(sh.seqlen_q),
                                              static_cast<int>(sh.seqlen_k), p.fwd.scale * kLog2e,
                                              static_cast<int>(my_key0), static_cast<int>(m0),
                                              warp_row + g, t);
    uint32_t p_a[kBlockM / 16][4], ds_a[kBlockM / 16][4];
    pack_probabilities<kBlockM, T>(p_a, ds_a, st, dpt);
    mma.stage_ds(ds_a, s % 2, warp, lane);

    mma.key_gradients(dv_flat, dk_flat, p_a, ds_a, stage);
    // Waiting here frees P^T's and dS^T's registers for dQ's, and the stage.
    wgmma_wait<0>();
    fence_registers(dv_flat);
    fence_registers(dk_flat);
    if (lane == 0) mbarrier_arrive(&smem.step_empty[stage]);
    // Both warpgroups' dS written (and fenced). It also orders this buffer's
    // next use, two steps on, after both warpgroups' dQ of this step.
    named_barrier_sync(Tr::kDsWrittenBarrier, 128 * Tr::kConsumers);

    float dq[8][4];
    float (&dq_flat)[32] = reinterpret_cast<float (&)[32]>(dq);
    mma.dq(dq_flat, s % 2);
    wgmma_wait<0>();
    fence_registers(dq_flat);
    add_query_gradient<HeadDim>(p, walk.batch, head, m0, Mma::query0(consumer) + warp_row + g, Mma::column0(consumer),
                                t, dq);
  }
  store_key_gradients<HeadDim, T>(p, walk.batch, walk.head_kv, my_key0 + warp_row, dk, dv);
#else
  __trap();  // built for another target: sm90_available() keeps callers away
#endif
}

template <int HeadDim, typename T, bool IsCausal>
void launch_sm90_backward_kernel(const Sm90BackwardArgs& args, cudaStream_t stream) {
  using Tr = Sm90BackwardTraits<HeadDim>;
  auto kernel = sm90_backward_kernel<HeadDim, T, IsCausal>;
  FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  Sm90BackwardArgs launch_args = args;
  launch_args.order = make_key_block_order(args.p.fwd.shape, Tr::kBlockN, args.p.head_splits, sizeof(T), IsCausal);
  kernel<<<static_cast<unsigned>(launch_args.order.blocks()), Tr::kThreads, Tr::kSmemBytes, stream>>>(launch_args);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

template <int HeadDim, typename Element>
void launch_backward_sm90(const Sm90BackwardArgs& args, cudaStream_t stream) {
  const BackwardParams& p = args.p;
  run_backward_passes<Element>(p, stream, [&] {
    if (p.fwd.shape.batch * p.fwd.shape.heads_kv * p.fwd.shape.seqlen_k == 0) return;
    if (p.fwd.is_causal)
      launch_sm90_backward_kernel<HeadDim, Element, true>(args, stream);
    else
      launch_sm90_backward_kernel<HeadDim, Element, false>(args, stream);
  });
}

}  // namespace fusedattn::cuda
