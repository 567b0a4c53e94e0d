// The sm90 backward's key-block kernel: FlashAttention 2's walk (the sm80
// kernel's; common/backward_passes.cuh runs the kernels around it) with
// every product on Hopper's warpgroup MMA and the loads on the tensor memory
// accelerator, in roles. A block owns 128 keys and is three warpgroups:
//   producer (warpgroup 0): it gives its registers to the consumers
//     (setmaxnreg), and one thread runs the mainloop's load
//     (backward_mainloop.cuh; Ordered, warps 1 and 2 also write the
//     consumers' dQ, below): K and V once, then per step (kBlockM
//     queries of one query head: 64 at d=128, 128 at d=64) Q, dO, lse and
//     delta into a two-stage ring guarded by mbarriers
//     (backward_pipeline.cuh).
//   consumers (warpgroups 1, 2): 64 keys each, and per step the mainloop's
//     mma: S^T and dP^T; the softmax step (backward_softmax.cuh: P^T, dS^T,
//     the band's, the ends' and attn_mask's hidden entries); dV += P^T dO
//     and dK += dS^T Q from registers; dS^T stored transposed (stmatrix) as
//     its half of a K-major [query][128 keys] tile; dQ = dS K for one 64 x 64
//     quarter (64 columns of d at d=128, 64 queries at d=64) over all 128
//     keys, which the epilogue (backward_epilogue.cuh) stages and adds to the
//     float32 accumulator by tensor reduces.
// A step's products are asynchronous groups the consumers wait on only where
// they need a result: at d=128 P^T's exponentials run under dP^T's products
// (traits' kExponentialsUnderDp), dV's while the consumers meet and dK's
// while dQ is added (kDkBehindDq).
// dK and dV stay in registers across the walk (GQA's sum costs nothing).
// Under attn_mask (its kind a template argument) a block walks its key
// tile's lists (common/mask_tiles.h) and reads the mask on the steps they mark.
// Soft-capped (a template argument too) it has no attn_mask variant.
// Ordered (a template argument: the deterministic mode's kernels, without
// attn_mask), each consumer's dQ quarter is added at its turn
// (key_block_scheduler.cuh) by a writer warp of the producer warpgroup
// (backward_epilogue.cuh's run_dq_writer), which the consumer hands the
// staged quarter to.
// Not yet: overlap between one step's products and the next step's.
#pragma once

#include <type_traits>

#include "../common/backward_passes.cuh"
#include "../common/key_block_scheduler.cuh"
#include "../common/band.cuh"
#include "../common/device_math.cuh"
#include "../common/instantiation_dispatch.h"
#include "../common/launch_check.h"
#include "../common/mask.cuh"
#include "../common/mask_tiles.h"
#include "../common/online_softmax.cuh"
#include "../hopper/bulk_copy.cuh"
#include "../hopper/ring_phases.cuh"
#include "../hopper/warpgroup.cuh"
#include "../hopper/wgmma.cuh"
#include "backward_epilogue.cuh"
#include "backward_launch.cuh"
#include "backward_mainloop.cuh"
#include "backward_pipeline.cuh"
#include "backward_sm90.h"
#include "backward_softmax.cuh"
#include "backward_traits.h"
#include "backward_wide_kernel.cuh"
#include "fusedattn/plan.h"

namespace fusedattn::cuda {

template <int HeadDim, typename T, bool Banded, MaskKind Mask, bool Capped, bool Ordered>
__global__ void __launch_bounds__(Sm90BackwardTraits<HeadDim>::kThreads, 1)
    sm90_backward_kernel(const __grid_constant__ Sm90BackwardArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma, stmatrix and setmaxnreg exist only in sm_90a code
  using Tr = Sm90BackwardTraits<HeadDim>;
  using Smem = Sm90BackwardSmem<Tr>;
  const RingPhases<Tr::kStages> ring;  // the walk is one run of the step ring
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  constexpr int kMTiles = kBlockM / 8;  // n-tiles of S^T (queries)
  constexpr int kDTiles = HeadDim / 8;
  constexpr bool kListed = Mask != MaskKind::None;  // steps from the mask's lists
  static_assert(!(Ordered && kListed), "deterministic mode: calls without attn_mask (the planner's rule)");
  using Walk = KeyBlockWalk<kBlockN, kBlockM, Banded, kListed, Ordered>;

  extern __shared__ unsigned char smem_raw[];
  const Smem smem(smem_raw);
  const BackwardParams& p = args.p;
  const ForwardParams& f = p.fwd;
  const AttentionShape& sh = f.shape;
  const Walk walk(p, args.order, args.dq_rotation_blocks);

  if (threadIdx.x == 0) smem.init_barriers();
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    run_backward_producer<Tr, Walk, kListed, Ordered,
                          Ordered ? Tr::kOrderedProducerRegisters : Tr::kProducerRegisters>(args, smem, walk, ring);
    return;
  }

  // ---------------- consumers ----------------
  warpgroup_claim_registers<Ordered ? Tr::kOrderedConsumerRegisters : Tr::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row = warp * 16;  // this warp's accumulator rows: keys of S^T, queries of dQ (after query0)
  const int64_t my_key0 = walk.key0 + 64 * consumer;  // this warpgroup's 64 keys
  const Sm90BackwardMma<HeadDim, T, Tr> mma{smem, consumer};
  using Softmax = Sm90BackwardSoftmax<Tr, T, Banded, Mask, Capped>;
  const Softmax softmax{f,
                        walk.batch,
                        reinterpret_cast<typename Softmax::MaskEntry*>(smem.mask +
                                                                       (4 * consumer + warp) * Tr::kMaskStageBytes),
                        static_cast<int>(my_key0),
                        warp_row,
                        static_cast<int>(walk.seq.seqlen_q),
                        static_cast<int>(walk.seq.seqlen_k),
                        Band32::of(f, walk.seq.seqlen_q, walk.seq.seqlen_k),
                        SoftCap::of(f),
                        lane,
                        g,
                        t};
  unsigned char* dq_stage = smem.dq_stage(consumer);
  const bool issues_dq = threadIdx.x % 128 == 0;  // one thread of each consumer issues its dQ reduces
  // This consumer's dQ quarter starts at query query0, column column0 of the step's.
  const int query0 = Tr::kDqQueryOffset * consumer, column0 = Tr::dq_first_column(consumer);

  float dk[kDTiles][4] = {}, dv[kDTiles][4] = {};
  float (&dk_flat)[kDTiles * 4] = reinterpret_cast<float (&)[kDTiles * 4]>(dk);
  float (&dv_flat)[kDTiles * 4] = reinterpret_cast<float (&)[kDTiles * 4]>(dv);
  if (walk.steps > 0) mbarrier_wait(smem.kv_full, 0);

  for (int s = 0; s < walk.steps; ++s) {
    const int stage = ring.stage(s);
    mbarrier_wait(&smem.step_full[stage], ring.phase(s));
    const typename Walk::Step step = [&]() -> typename Walk::Step {
      if constexpr (kListed)
        return {smem.step_info[3 * stage], smem.step_info[3 * stage + 1], smem.step_info[3 * stage + 2] != 0};
      return walk.at(s);
    }();
    const int64_t head = step.head, m0 = step.m0;
    const unsigned char* q_tile = smem.q + stage * Tr::kQTileBytes;
    const unsigned char* do_tile = smem.d_o + stage * Tr::kQTileBytes;
    const int row_skew = flat_row(sh, walk, head, m0) & 3;  // where the step's rows start in the boxes
    const float* lse = smem.lse + stage * Tr::kRowsSlot + row_skew;
    const float* delta = smem.delta + stage * Tr::kRowsSlot + row_skew;
    unsigned char* ds_tile = smem.ds + (s % 2) * Tr::kDsBytes;
    if constexpr (Ordered) {
      // For the writer warp, now, while registers are free: slot s % 2, whose
      // step s - 2 the writer has read before it freed the staging buffer.
      if (issues_dq) {
        int32_t* info = smem.dq_reduce_info + 4 * (2 * consumer + s % 2);
        info[0] = static_cast<int32_t>(walk.dq_turn_counter(f, head, m0, consumer, Tr::kConsumers));
        info[1] = walk.dq_turn(f, head, m0, args.dq_rotation_blocks);
        info[2] = flat_row(sh, walk, head, m0) + query0;
      }
    }

    float st[kMTiles][4], dpt[kMTiles][4];
    float (&st_flat)[kMTiles * 4] = reinterpret_cast<float (&)[kMTiles * 4]>(st);
    float (&dpt_flat)[kMTiles * 4] = reinterpret_cast<float (&)[kMTiles * 4]>(dpt);
    mma.scores(st_flat, q_tile);
    wgmma_commit();
    mma.probability_gradients(dpt_flat, do_tile);
    wgmma_commit();
    if constexpr (Tr::kExponentialsUnderDp && !Capped) {
      // P^T while dP^T's products run.
      wgmma_wait<1>();
      fence_registers(st_flat);
      const typename Softmax::Hidden hidden =
          softmax.hidden_entries(st, head, static_cast<int>(m0), kListed && step.reads_mask);
      softmax.probabilities(st, hidden, lse);
      wgmma_wait<0>();
      fence_registers(dpt_flat);
      softmax.score_gradients(st, dpt, hidden, delta);
    } else {
      wgmma_wait<0>();
      fence_registers(st_flat);
      fence_registers(dpt_flat);
      softmax(st, dpt, head, static_cast<int>(m0), kListed && step.reads_mask, lse, delta);
    }
    uint32_t p_a[kBlockM / 16][4], ds_a[kBlockM / 16][4];
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) {
      probabilities_as_a<T>(p_a[kq], st, kq);
      probabilities_as_a<T>(ds_a[kq], dpt, kq);
    }

    // dS = (dS^T)^T, [query][key]: this warpgroup's 64 keys are slab
    // `consumer` of the tile. The A fragment of k-step kq holds the four 8x8
    // matrices (queries (2 kq + i / 2) * 8.., this warp's keys (i % 2) * 8..)
    // that a transposing stmatrix writes as 16-byte rows of dS.
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) {
      const int i = lane / 8, query = (2 * kq + i / 2) * 8 + lane % 8, key_chunk = 2 * warp + i % 2;
      stmatrix_x4_trans(ds_a[kq], ds_tile + consumer * kBlockM * 128 + swizzled_chunk_offset(query, key_chunk, kBlockM));
    }
    fence_proxy_async_shared();  // dS: written through the generic proxy, read by wgmma

    // dV += P^T dO is issued before the consumers meet (dS written); dK +=
    // dS^T Q with it, or (kDkBehindDq) after dQ = dS K, so dQ's staging and
    // the issue of its reduces run under dK's products.
    constexpr bool kDkBehindDq = Tr::kDkBehindDq;
    // After the wait for dK (and dV): the stage's Q and dO are read.
    auto release_stage = [&] {
      fence_registers(dv_flat);
      fence_registers(dk_flat);
#pragma unroll
      for (int kq = 0; kq < kBlockM / 16; ++kq) {
        fence_registers(p_a[kq]);
        fence_registers(ds_a[kq]);
      }
      if (lane == 0) mbarrier_arrive(&smem.step_empty[stage]);
    };
    mma.key_gradient_product(dv_flat, p_a, do_tile);  // dV
    if constexpr (!kDkBehindDq) {
      mma.key_gradient_product(dk_flat, ds_a, q_tile);  // dK
      wgmma_commit();
      wgmma_wait<0>();
      release_stage();
    } else {
      wgmma_commit();
    }
    // The last step's dQ quarter has been read out of its stage (the wait is
    // the issuing thread's; the barrier tells its warpgroup). Deterministic:
    // the writer warp says so, below.
    if constexpr (!Ordered)
      if (issues_dq) bulk_wait<0, true>();
    // Both warpgroups' dS written (and fenced). It also orders this buffer's
    // next use, two steps on, after both warpgroups' dQ of this step.
    named_barrier_sync(Tr::kDsWrittenBarrier, 128 * Tr::kConsumers);

    float dq[8][4];
    float (&dq_flat)[32] = reinterpret_cast<float (&)[32]>(dq);
    mma.query_gradient(dq_flat, ds_tile, query0, column0);
    wgmma_commit();
    if constexpr (kDkBehindDq) {
      mma.key_gradient_product(dk_flat, ds_a, q_tile);  // dK
      wgmma_commit();
      wgmma_wait<1>();  // dV and dQ
    } else {
      wgmma_wait<0>();
    }
    fence_registers(dq_flat);
    if constexpr (Ordered)
      if (s > 0) named_barrier_sync(Tr::kDqEmptyBarrier + consumer, Tr::kDqWriterThreads);
    stage_dq_quarter(dq_stage, dq, warp_row, g, t, m0 + query0, walk.seq.seqlen_q);
    fence_proxy_async_shared();  // written through the generic proxy, read by the tensor reduce
    if constexpr (Ordered) {
      named_barrier_arrive(Tr::kDqFullBarrier + consumer, Tr::kDqWriterThreads);
    } else {
      named_barrier_sync(Tr::kDqWrittenBarrier + consumer, 128);
      if (issues_dq) reduce_dq_tiles<Tr>(smem, &args.dq_map, consumer, flat_row(sh, walk, head, m0) + query0);
    }
    if constexpr (kDkBehindDq) {
      wgmma_wait<0>();
      release_stage();
    }
  }
  if constexpr (!Ordered)
    if (issues_dq) bulk_wait<0, false>();  // the reduces done before the block leaves
  store_key_gradients<HeadDim, T>(p, walk.batch, walk.head_kv, walk.seq.k0, my_key0 + warp_row, walk.seq.seqlen_k, dk,
                                  dv);
#else
  __trap();  // built for another target: sm90_available() keeps callers away
#endif
}

template <int HeadDim, typename T, bool Banded, MaskKind Mask, bool Capped, bool Ordered = false>
void launch_sm90_backward_kernel(const Sm90BackwardArgs& args, cudaStream_t stream) {
  using Tr = Sm90BackwardTraits<HeadDim>;
  if constexpr (Mask != MaskKind::None) sort_mask_into_key_tiles(args.p.fwd, Tr::kBlockN, Tr::kBlockM, stream);
  launch_sm90_key_blocks<Tr, T, Banded, Ordered>(sm90_backward_kernel<HeadDim, T, Banded, Mask, Capped, Ordered>,
                                                 args, stream);
}

// Soft-capped calls have their own kernels, without attn_mask, at the head
// dims of the table's capped variants; attn_mask at its masked ones (the
// planner sends the others elsewhere), as in the forward. Above d=128 the
// wide kernel, which has neither. The deterministic mode has kernels of its
// own (the writer warps), without attn_mask, soft-capped or not up to d=128,
// at d=192 the wide kernel's, so that the default's are what they were.
template <int HeadDim, typename Element>
void launch_backward_sm90(const Sm90BackwardArgs& args, cudaStream_t stream) {
  static_assert(!(HeadDim > 128 && (instantiated(Sm90BackwardMaskedHeadDims{}, HeadDim) ||
                                    instantiated(Sm90BackwardCappedHeadDims{}, HeadDim))),
                "the wide backward has no attn_mask or soft-capped variant");
  if constexpr (HeadDim > 128) {
    launch_wide_backward_sm90<HeadDim, Element>(args, stream);
  } else {
    const BackwardParams& p = args.p;
    run_backward_passes<Element>(p, stream, [&] {
      if (p.fwd.shape.batch * p.fwd.shape.heads_kv * p.fwd.shape.seqlen_k == 0) return;
      auto with_band = [&](auto mask, auto capped, auto ordered) {
        constexpr MaskKind kMask = decltype(mask)::value;
        constexpr bool kCapped = decltype(capped)::value, kOrdered = decltype(ordered)::value;
        if (p.fwd.banded())
          launch_sm90_backward_kernel<HeadDim, Element, true, kMask, kCapped, kOrdered>(args, stream);
        else
          launch_sm90_backward_kernel<HeadDim, Element, false, kMask, kCapped, kOrdered>(args, stream);
      };
      using Unmasked = std::integral_constant<MaskKind, MaskKind::None>;
      if (p.deterministic) {  // without attn_mask (the planner's rule)
        if (p.fwd.mask.kind != MaskKind::None)
          throw_planner_bug("the sm90 backward's deterministic mode takes calls without attn_mask only");
        if (p.fwd.softcap > 0.0f)
          with_band(Unmasked{}, std::true_type{}, std::true_type{});
        else
          with_band(Unmasked{}, std::false_type{}, std::true_type{});
      } else if (p.fwd.softcap > 0.0f) {
        if constexpr (instantiated(Sm90BackwardCappedHeadDims{}, HeadDim)) {
          if (p.fwd.mask.kind != MaskKind::None)
            throw_planner_bug("the sm90 backward soft-caps calls without attn_mask only");
          with_band(Unmasked{}, std::true_type{}, std::false_type{});
        } else {
          throw_planner_bug("the sm90 backward has no soft-capped variant at head dim " + std::to_string(HeadDim));
        }
      } else if constexpr (instantiated(Sm90BackwardMaskedHeadDims{}, HeadDim)) {
        dispatch_each_mask_kind(p.fwd.mask.kind,
                                [&](auto mask) { with_band(mask, std::false_type{}, std::false_type{}); });
      } else {
        if (p.fwd.mask.kind != MaskKind::None)
          throw_planner_bug("the sm90 backward has no attn_mask variant at head dim " + std::to_string(HeadDim));
        with_band(Unmasked{}, std::false_type{}, std::false_type{});
      }
    });
  }
}

}  // namespace fusedattn::cuda
