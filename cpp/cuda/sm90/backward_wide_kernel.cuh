// The sm90 backward's key-block kernel above d=128. The d<=128 kernel
// (backward_kernel.cuh) gives each consumer 64 keys as the products' M, so
// dK and dV would hold d registers per thread; this one turns the products
// around (FlashAttention 3's orientation at d=192 and 256): S = Q K^T with
// the step's 64 queries as M and each consumer's 32 keys as N, dK^T and dV^T
// (d x 32 keys, d / 4 registers each) accumulated from P and dS, which go
// through shared memory as [key][query] tiles (backward_wide_mainloop.cuh).
// A block owns 64 keys and is three warpgroups:
//   producer (warpgroup 0): backward_mainloop.cuh's load, as in the other kernel.
//   consumers (warpgroups 1, 2): per step S, dP; the softmax step
//     (backward_wide_softmax.cuh); P^T and dS^T stored (stmatrix,
//     transposed); dQ for this consumer's 64-column slabs of d, staged and
//     added to the float32 accumulator by tensor reduces (backward_epilogue.cuh)
//     while dV^T and dK^T run.
// At d=256 dQ's staging does not fit beside two stages of Q and dO: each
// thread adds its dQ elements by reductions instead (traits' kDqByReductions).
// Ordered (a template argument: the deterministic mode's kernel, at d=192),
// the staged slabs go to a writer warp of the producer warpgroup instead,
// which adds them at their turn, as in the d <= 128 kernel.
// Not yet: attn_mask and soft-capping; the planner sends those calls elsewhere.
#pragma once

#include <type_traits>

#include "../common/backward_passes.cuh"
#include "../common/key_block_scheduler.cuh"
#include "../common/band.cuh"
#include "../common/device_math.cuh"
#include "../common/launch_check.h"
#include "../common/online_softmax.cuh"
#include "../hopper/bulk_copy.cuh"
#include "../hopper/ring_phases.cuh"
#include "../hopper/warpgroup.cuh"
#include "../hopper/wgmma.cuh"
#include "backward_epilogue.cuh"
#include "backward_launch.cuh"
#include "backward_mainloop.cuh"
#include "backward_pipeline.cuh"
#include "backward_wide_mainloop.cuh"
#include "backward_wide_softmax.cuh"
#include "backward_wide_traits.h"
#include "fusedattn/plan.h"

namespace fusedattn::cuda {

// dK^T (scaled: S was scale Q K^T) and dV^T of one consumer warp: rows
// warp_row + g (+ 8) of each 64 columns of d, columns this consumer's keys
// from first_key (m64n32 accumulators); written, or added to the float32
// sums when the group's query heads are split over blocks, as in
// store_key_gradients.
template <int HeadDim, int Keys, typename T>
__device__ __forceinline__ void store_transposed_key_gradients(const BackwardParams& p, int64_t batch,
                                                               unsigned head_kv, int64_t k0, int64_t first_key,
                                                               int64_t seqlen_k, int warp_row,
                                                               const float (&dk)[HeadDim / 64][Keys / 2],
                                                               const float (&dv)[HeadDim / 64][Keys / 2]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float scale = p.fwd.scale;
  const KeyGradientRows<HeadDim, T> out(p, batch, head_kv, k0);
#pragma unroll
  for (int j = 0; j < HeadDim / 64; ++j)
#pragma unroll
    for (int nt = 0; nt < Keys / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 64 * j + warp_row + g + 8 * (e >> 1);
        const int64_t key = first_key + nt * 8 + 2 * t + (e & 1);
        if (key >= seqlen_k) continue;
        const float dk_value = dk[j][4 * nt + e] * scale, dv_value = dv[j][4 * nt + e];
        if (p.head_splits > 1) {
          float* dk_sum = out.dk_sum + key * HeadDim + col;
          atomicAdd(dk_sum, dk_value);
          atomicAdd(dk_sum + out.kv_size, dv_value);
        } else {
          out.grad_k[key * p.grad_k_strides.row + col] = from_float<T>(dk_value);
          out.grad_v[key * p.grad_v_strides.row + col] = from_float<T>(dv_value);
        }
      }
}

// This thread's dQ elements of a step (rows warp_row + g (+ 8) of the step's
// queries, from `row` of the flat accumulator; `queries` of them exist), its
// slabs from first_slab, added to the float32 accumulator by reductions.
template <int HeadDim, int Slabs>
__device__ __forceinline__ void add_dq_by_reductions(float* accum, const float (&dq)[Slabs * 32], int row,
                                                     int first_slab, int warp_row, int g, int t, int64_t queries) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp_row + g + 8 * h;
    if (r >= queries) continue;
    float* accum_row = accum + int64_t(row + r) * HeadDim + 64 * first_slab + 2 * t;
#pragma unroll
    for (int nt = 0; nt < Slabs * 8; ++nt) red_add_float2(accum_row + 8 * nt, dq[4 * nt + 2 * h], dq[4 * nt + 2 * h + 1]);
  }
}

template <int HeadDim, typename T, bool Banded, bool Ordered>
__global__ void __launch_bounds__(Sm90WideBackwardTraits<HeadDim>::kThreads, 1)
    sm90_wide_backward_kernel(const __grid_constant__ Sm90BackwardArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma, stmatrix and setmaxnreg exist only in sm_90a code
  using Tr = Sm90WideBackwardTraits<HeadDim>;
  using Smem = Sm90BackwardSmem<Tr>;
  const RingPhases<Tr::kStages> ring;  // the walk is one run of the step ring
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kKeys = Tr::kKeysPerConsumer;
  constexpr int kChunks = HeadDim / 64, kNTiles = kKeys / 8;
  static_assert(!(Ordered && Tr::kDqByReductions), "deterministic mode: the writers add staged dQ tiles");
  using Walk = KeyBlockWalk<kBlockN, kBlockM, Banded, false, Ordered>;

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
    run_backward_producer<Tr, Walk, false, Ordered,
                          Ordered ? Tr::kOrderedProducerRegisters : Tr::kProducerRegisters>(args, smem, walk, ring);
    return;
  }

  // ---------------- consumers ----------------
  warpgroup_claim_registers<Ordered ? Tr::kOrderedConsumerRegisters : Tr::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row = warp * 16;  // this warp's accumulator rows: queries of S and dQ, columns of d in dK^T
  const int64_t my_key0 = walk.key0 + kKeys * consumer;
  const Sm90WideBackwardMma<HeadDim, T, Tr> mma{smem, consumer};
  const Sm90WideBackwardSoftmax<kBlockM, kKeys, Banded> softmax{
      static_cast<int>(my_key0),
      warp_row,
      static_cast<int>(walk.seq.seqlen_q),
      static_cast<int>(walk.seq.seqlen_k),
      Band32::of(f, walk.seq.seqlen_q, walk.seq.seqlen_k),
      SoftCap::of(f).scale_log2,
      g,
      t};
  const int first_slab = Tr::dq_first_tile(consumer);  // of dQ's columns
  unsigned char* dq_stage = smem.dq_stage(consumer);
  unsigned char* pt_tile = smem.ds + Tr::kPtOffset;
  const bool issues_dq = threadIdx.x % 128 == 0;  // one thread of each consumer issues its dQ reduces

  float dk[kChunks][kKeys / 2] = {}, dv[kChunks][kKeys / 2] = {};
  if (walk.steps > 0) mbarrier_wait(smem.kv_full, 0);

  for (int s = 0; s < walk.steps; ++s) {
    const int stage = ring.stage(s);
    mbarrier_wait(&smem.step_full[stage], ring.phase(s));
    const typename Walk::Step step = walk.at(s);
    const int64_t head = step.head, m0 = step.m0;
    const unsigned char* q_tile = smem.q + stage * Tr::kQTileBytes;
    const unsigned char* do_tile = smem.d_o + stage * Tr::kQTileBytes;
    const int row_skew = flat_row(sh, walk, head, m0) & 3;  // where the step's rows start in the boxes
    const float* lse = smem.lse + stage * Tr::kRowsSlot + row_skew;
    const float* delta = smem.delta + stage * Tr::kRowsSlot + row_skew;
    unsigned char* dst_tile = smem.ds + (s % 2) * Tr::kDsBytes;
    if constexpr (Ordered) {
      // For the writer warp (slot s % 2, read before it freed the staging
      // buffer two steps ago).
      if (issues_dq) {
        int32_t* info = smem.dq_reduce_info + 4 * (2 * consumer + s % 2);
        info[0] = static_cast<int32_t>(walk.dq_turn_counter(f, head, m0, consumer, Tr::kConsumers));
        info[1] = walk.dq_turn(f, head, m0, args.dq_rotation_blocks);
        info[2] = flat_row(sh, walk, head, m0);
      }
    }

    float sc[kNTiles][4], dp[kNTiles][4];
    float (&sc_flat)[kNTiles * 4] = reinterpret_cast<float (&)[kNTiles * 4]>(sc);
    float (&dp_flat)[kNTiles * 4] = reinterpret_cast<float (&)[kNTiles * 4]>(dp);
    mma.scores(sc_flat, dp_flat, q_tile, do_tile);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(sc_flat);
    fence_registers(dp_flat);
    softmax(sc, dp, static_cast<int>(m0), lse, delta);

    // P^T and dS^T, [key][query]: this consumer's keys are rows kKeys
    // consumer.. The A fragment of k-step kq holds the four 8x8 matrices
    // (this warp's queries (i % 2) * 8.., keys kq * 16 + (i / 2) * 8..) that a
    // transposing stmatrix writes as 16-byte rows (8 queries) of a key.
#pragma unroll
    for (int kq = 0; kq < kKeys / 16; ++kq) {
      uint32_t p_a[4], ds_a[4];
      probabilities_as_a<T>(p_a, sc, kq);
      probabilities_as_a<T>(ds_a, dp, kq);
      const int i = lane / 8, key = consumer * kKeys + kq * 16 + (i / 2) * 8 + lane % 8, query_chunk = 2 * warp + i % 2;
      stmatrix_x4_trans(p_a, pt_tile + swizzled_chunk_offset(key, query_chunk, kBlockN));
      stmatrix_x4_trans(ds_a, dst_tile + swizzled_chunk_offset(key, query_chunk, kBlockN));
    }
    fence_proxy_async_shared();  // written through the generic proxy, read by wgmma
    // The last step's dQ slabs have been read out of their stage (the wait is
    // the issuing thread's; the barrier tells its warpgroup). Deterministic:
    // the writer warp says so, below.
    if constexpr (!Ordered)
      if (issues_dq) bulk_wait<0, true>();
    // Both consumers' P^T and dS^T written (and fenced). The next step's
    // barrier is passed only after both consumers' dQ of this step is done,
    // so dS^T's buffer is free again two steps on.
    named_barrier_sync(Tr::kDsWrittenBarrier, 128 * Tr::kConsumers);

    // dQ first, then dV^T and dK^T, which run while dQ is staged and added.
    auto dq_share = [&](auto slabs) {
      constexpr int kSlabs = decltype(slabs)::value;
      float dq[kSlabs * 32];
      mma.template query_gradient<kSlabs>(dq, dst_tile, first_slab);
      wgmma_commit();
      mma.key_gradient_product(dv, do_tile, pt_tile);
      mma.key_gradient_product(dk, q_tile, dst_tile);
      wgmma_commit();
      wgmma_wait<1>();  // dQ
      fence_registers(dq);
      if constexpr (Tr::kDqByReductions) {
        add_dq_by_reductions<HeadDim, kSlabs>(p.grad_q_accum, dq, flat_row(sh, walk, head, m0), first_slab, warp_row,
                                              g, t, walk.seq.seqlen_q - m0);
      } else {
        if constexpr (Ordered)
          if (s > 0) named_barrier_sync(Tr::kDqEmptyBarrier + consumer, Tr::kDqWriterThreads);
#pragma unroll
        for (int j = 0; j < kSlabs; ++j)
          stage_dq_quarter(dq_stage + j * Tr::kDqTileBytes, reinterpret_cast<const float (&)[8][4]>(dq[32 * j]),
                           warp_row, g, t, m0, walk.seq.seqlen_q);
        fence_proxy_async_shared();  // written through the generic proxy, read by the tensor reduce
        if constexpr (Ordered) {
          named_barrier_arrive(Tr::kDqFullBarrier + consumer, Tr::kDqWriterThreads);
        } else {
          named_barrier_sync(Tr::kDqWrittenBarrier + consumer, 128);
          if (issues_dq) reduce_dq_tiles<Tr>(smem, &args.dq_map, consumer, flat_row(sh, walk, head, m0));
        }
      }
    };
    if (consumer == 0)
      dq_share(std::integral_constant<int, Tr::kDqSlabs0>{});
    else
      dq_share(std::integral_constant<int, Tr::kDqSlabs1>{});
    wgmma_wait<0>();  // dV^T and dK^T: the stage's Q and dO and this consumer's P^T are read
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      fence_registers(dk[j]);
      fence_registers(dv[j]);
    }
    if (lane == 0) mbarrier_arrive(&smem.step_empty[stage]);
  }
  if constexpr (!Ordered)
    if (issues_dq) bulk_wait<0, false>();  // the reduces done before the block leaves
  store_transposed_key_gradients<HeadDim, kKeys, T>(p, walk.batch, walk.head_kv, walk.seq.k0, my_key0,
                                                    walk.seq.seqlen_k, warp_row, dk, dv);
#else
  __trap();  // built for another target: sm90_available() keeps callers away
#endif
}

// The launch, for calls without attn_mask or soft-capping, deterministic
// where the dQ tiles are staged (the planner's rule).
template <int HeadDim, typename Element>
void launch_wide_backward_sm90(const Sm90BackwardArgs& args, cudaStream_t stream) {
  using Tr = Sm90WideBackwardTraits<HeadDim>;
  const BackwardParams& p = args.p;
  if (p.fwd.mask.kind != MaskKind::None || p.fwd.softcap > 0.0f)
    throw_planner_bug("the sm90 backward above d=128 takes no attn_mask and no soft-capping");
  run_backward_passes<Element>(p, stream, [&] {
    if (p.fwd.shape.batch * p.fwd.shape.heads_kv * p.fwd.shape.seqlen_k == 0) return;
    auto with_band = [&](auto ordered) {
      constexpr bool kOrdered = decltype(ordered)::value;
      if (p.fwd.banded())
        launch_sm90_key_blocks<Tr, Element, true, kOrdered>(sm90_wide_backward_kernel<HeadDim, Element, true, kOrdered>,
                                                            args, stream);
      else
        launch_sm90_key_blocks<Tr, Element, false, kOrdered>(
            sm90_wide_backward_kernel<HeadDim, Element, false, kOrdered>, args, stream);
    };
    if (!p.deterministic) {
      with_band(std::false_type{});
    } else if constexpr (!Tr::kDqByReductions) {
      with_band(std::true_type{});
    } else {
      throw_planner_bug("the sm90 backward's deterministic mode has no kernel at head dim " + std::to_string(HeadDim));
    }
  });
}

}  // namespace fusedattn::cuda
