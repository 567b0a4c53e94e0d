// The sm90 forward: FlashAttention with Hopper's machinery, in roles. A block
// owns 64 queries per consumer warpgroup (3 at d=64, else 2) of one head:
//   producer (warpgroup 0, one thread): the mainloop's load
//     (forward_mainloop.cuh) of Q and the K and V tiles into two-stage rings
//     guarded by mbarriers (forward_pipeline.cuh); it gives its registers to
//     the consumers (setmaxnreg).
//   consumers (warpgroups 1, 2[, 3]): per key tile j the mainloop's mma,
//     S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued right behind it, so the
//     softmax of S_j (forward_softmax.cuh: soft-capping, the band's and end
//     masks, attn_mask, the online step) runs while that GEMM is in flight; then the
//     epilogue (forward_epilogue.cuh). The consumers take turns issuing their
//     GEMMs (named barriers), so one warpgroup's softmax overlaps the others'
//     tensor-core work.
// Work items come from the tile scheduler (forward_scheduler.cuh; packed
// sequences too, from the planner's work list): from d=128 on,
// and at d=64 banded (tile_size.h), the blocks are persistent, one per
// SM, and the producer loads the next item's Q and first tiles while the
// consumers finish the last one; it hands each item's index to the consumers
// with its Q. Under attn_mask (a separate instantiation) an item visits the
// tiles of its mask list (common/mask_tiles.h, sorted before the launch) and
// reads the mask only on those the list marks.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "../common/device_math.cuh"
#include "../common/instantiation_dispatch.h"
#include "../common/launch_check.h"
#include "../common/mask_tiles.h"
#include "../common/online_softmax.cuh"
#include "../hopper/bulk_copy.cuh"
#include "../hopper/warpgroup.cuh"
#include "../hopper/wgmma.cuh"
#include "forward_epilogue.cuh"
#include "forward_mainloop.cuh"
#include "forward_pipeline.cuh"
#include "forward_scheduler.cuh"
#include "forward_sm90.h"
#include "forward_softmax.cuh"
#include "forward_traits.h"

namespace fusedattn::cuda {

template <int HeadDim, int BlockN, typename T, BandSides Sides, MaskKind Mask, bool Capped>
__global__ void __launch_bounds__(Sm90ForwardTraits<HeadDim, BlockN>::kThreads, 1)
    sm90_forward_kernel(const __grid_constant__ Sm90ForwardArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma and setmaxnreg exist only in sm_90a code
  using Tr = Sm90ForwardTraits<HeadDim, BlockN>;
  constexpr bool kBanded = Sides != BandSides::kNone;
  using Ring = RingPhases<Tr::kStages>;
  constexpr int kBlockN = Tr::kBlockN, kNTiles = kBlockN / 8, kDTiles = HeadDim / 8;
  constexpr bool kPersistent = sm90_forward_persistent(HeadDim, kBanded);
  constexpr bool kHasMask = Mask != MaskKind::None;

  extern __shared__ unsigned char smem_raw[];
  const Sm90ForwardSmem<Tr> smem(smem_raw);
  const ForwardParams& p = args.p;
  const Sm90ForwardScheduler<Tr::kBlockM, kBlockN, kBanded, kHasMask> scheduler(args.order, p);
  Ring ring;

  if (threadIdx.x == 0) smem.init_barriers();
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ---------------- producer ----------------
    warpgroup_release_registers<Tr::kProducerRegisters>();
    if (threadIdx.x != 0) return;
    const Sm90ForwardLoad<Tr, kHasMask> load{args, smem};
    load.prefetch_maps();
    unsigned index = scheduler.first();
    for (uint32_t item = 0;; ++item) {
      mbarrier_wait(smem.q_empty, (item & 1) ^ 1);  // the first item finds Q's buffer free
      *smem.item_slot = index;
      if (scheduler.done(index)) {
        mbarrier_arrive(smem.q_full);  // no Q: the consumers read the end of the work
        return;
      }
      const Sm90ForwardItem it = scheduler.item(index);
      if (it.n_tiles == 0) {
        mbarrier_arrive(smem.q_full);  // rows that see no key: the consumers write zeros
      } else {
        load.item(it, ring);
        ring.end_item(it.n_tiles);
      }
      if constexpr (!kPersistent) return;  // a block per item
      index = scheduler.next(p.work_counter);
    }
  }

  // ---------------- consumers ----------------
  warpgroup_claim_registers<Tr::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row = warp * 16;  // this warp's rows within the warpgroup's 64
  const Sm90ForwardMma<HeadDim, T, Tr> mma{smem, consumer};
  const Sm90ForwardSoftmax<kBlockN, T, Sides, Mask, Capped> softmax{
      p, SoftCap::of(p), warp_row, g, t, scheduler.seqlen_q};

  float acc[kDTiles][4];
  float m_i[2], l_i[2];
  float (&acc_flat)[kDTiles * 4] = reinterpret_cast<float (&)[kDTiles * 4]>(acc);
  float s[kNTiles][4];
  float (&s_flat)[kNTiles * 4] = reinterpret_cast<float (&)[kNTiles * 4]>(s);
  uint32_t p_a[kBlockN / 16][4];  // P of the previous tile, the A operand of O += P V

  // The turn-taking, round robin: consumer c issues GEMMs after a sync on
  // barrier 1 + c, then lets the next go by arriving on its barrier, so one
  // warpgroup's softmax overlaps the others' tensor-core work. The last
  // consumer first lets consumer 0 go; so consumer 0, after the last item,
  // takes the one turn more that this leaves it.
  const bool last_consumer = consumer == Tr::kConsumers - 1;
  const int my_turn = 1 + consumer, next_turn = 1 + (consumer + 1) % Tr::kConsumers;
  auto take_turn = [&] { named_barrier_sync(my_turn, 256); };
  auto pass_turn = [&] { named_barrier_arrive(next_turn, 256); };
  auto pack_probabilities = [&] {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) probabilities_as_a<T>(p_a[kk], s, kk);
  };
  // Each warp releases a buffer once its own wgmma_wait has returned: a
  // warp's share of a wgmma runs on its own quarter of the SM, so one warp's
  // wait says nothing of the others' reads.
  auto release = [&](uint64_t* barrier) {
    if (lane == 0) mbarrier_arrive(barrier);
  };

  if (last_consumer) pass_turn();
  for (uint32_t item = 0;; ++item) {
    mbarrier_wait(smem.q_full, item & 1);
    // Lane 0 reads it, the lane that later releases Q (and the slot) for
    // this warp: a read by another lane would not be ordered before that
    // arrival (compute-sanitizer racecheck: WAR with the producer's write).
    const unsigned index = __shfl_sync(0xffffffffu, lane == 0 ? *smem.item_slot : 0u, 0);
    if (scheduler.done(index)) break;
    const Sm90ForwardItem it = scheduler.item(index);
    const int wg_row0 = it.row0 + 64 * consumer;  // this warpgroup's first query
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
    m_i[0] = m_i[1] = -INFINITY;
    l_i[0] = l_i[1] = 0.0f;

    const int n_tiles = it.n_tiles;
    if (n_tiles == 0) {
      release(smem.q_empty);  // index read; no Q
    } else {
      // S_j's softmax runs while P_{j-1} V_{j-1}, issued right behind S_j, is in flight.
      float rescale[2];
      // A tile's list entry is read before its wait, so the wait hides the load.
      int entry = tile_entry<kHasMask>(p, it, 0);
      mbarrier_wait(&smem.k_full[0], ring.phase(0));
      take_turn();
      mma.scores(s_flat, 0);
      pass_turn();
      wgmma_wait<0>();
      fence_registers(s_flat);
      release(&smem.k_empty[0]);
      if (n_tiles == 1) release(smem.q_empty);  // the item's last read of Q
      softmax.step(s, m_i, l_i, rescale, it, wg_row0, entry);  // O is still zero: no rescale
      pack_probabilities();

      for (int j = 1; j < n_tiles; ++j) {
        entry = tile_entry<kHasMask>(p, it, j);
        mbarrier_wait(&smem.k_full[Ring::stage(j)], ring.phase(j));
        take_turn();
        mma.scores(s_flat, Ring::stage(j));
        mbarrier_wait(&smem.v_full[Ring::stage(j - 1)], ring.phase(j - 1));
        mma.pv(acc_flat, p_a, Ring::stage(j - 1));
        pass_turn();
        wgmma_wait<1>();  // S_j done; P_{j-1} V still running
        fence_registers(s_flat);
        release(&smem.k_empty[Ring::stage(j)]);
        if (j == n_tiles - 1) release(smem.q_empty);
        softmax.step(s, m_i, l_i, rescale, it, wg_row0, entry);
        wgmma_wait<0>();
        fence_registers(acc_flat);
        release(&smem.v_empty[Ring::stage(j - 1)]);
        rescale_rows(acc, rescale);
        pack_probabilities();
      }

      mbarrier_wait(&smem.v_full[Ring::stage(n_tiles - 1)], ring.phase(n_tiles - 1));
      take_turn();
      mma.pv(acc_flat, p_a, Ring::stage(n_tiles - 1));
      pass_turn();
      wgmma_wait<0>();
      fence_registers(acc_flat);
      release(&smem.v_empty[Ring::stage(n_tiles - 1)]);
      ring.end_item(n_tiles);
    }
    store_output<HeadDim, T>(p, it, wg_row0 + warp_row + g, t, acc, m_i, l_i);
    if constexpr (!kPersistent) break;  // a block per item
  }
  if (consumer == 0) take_turn();
#else
  __trap();  // built for another target: sm90_available() keeps callers away
#endif
}

template <int HeadDim, int BlockN, typename T, BandSides Sides, MaskKind Mask, bool Capped>
void launch_sm90_forward_kernel(const Sm90ForwardArgs& args, const Plan& plan, cudaStream_t stream) {
  using Tr = Sm90ForwardTraits<HeadDim, BlockN>;
  constexpr bool kBanded = Sides != BandSides::kNone;
  auto kernel = sm90_forward_kernel<HeadDim, BlockN, T, Sides, Mask, Capped>;
  FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  Sm90ForwardArgs launch_args = args;
  launch_args.order = make_query_block_order(args.p.shape, Tr::kBlockM, sizeof(T), kBanded);
  if constexpr (Mask != MaskKind::None) sort_mask_into_tiles(args.p, Tr::kBlockM, Tr::kBlockN, stream);
  // Persistent: the plan's resident blocks at most (one per SM), each taking
  // items from the counter, zeroed here; else a block per item.
  const VarlenParams& varlen = args.p.varlen;
  int64_t blocks = grid_blocks(launch_args.order, varlen.on(), varlen.query_items, args.p.shape.heads_q);
  if constexpr (sm90_forward_persistent(HeadDim, kBanded)) {
    if (blocks > plan.resident_blocks) {
      blocks = plan.resident_blocks;
      FUSEDATTN_CUDA_CHECK(cudaMemsetAsync(args.p.work_counter, 0, sizeof(unsigned), stream));
    }
  }
  kernel<<<static_cast<unsigned>(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(launch_args);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

// The plan's tile width and persistence (plan.cu chose them with tile_size.h,
// and encoded the K/V tensor maps' boxes for that width); a plan with no
// instantiation here is a planner bug.
template <int HeadDim, typename Element, BandSides Sides, MaskKind Mask, bool Capped>
void launch_planned_sm90_forward(const Sm90ForwardArgs& args, const Plan& plan, cudaStream_t stream) {
  constexpr bool kBanded = Sides != BandSides::kNone;
  constexpr int kShortN = sm90_forward_block_n(HeadDim, kBanded, Mask != MaskKind::None, 0);
  constexpr int kLongN = sm90_forward_block_n(HeadDim, kBanded, Mask != MaskKind::None, kSm90CausalWideTileKeys);
  if (plan.persistent != sm90_forward_persistent(HeadDim, kBanded) || (plan.persistent && plan.resident_blocks < 1))
    throw_planner_bug("the sm90 forward's persistence is fixed per head dim and band, with resident blocks");
  if (plan.block_n == kLongN)
    launch_sm90_forward_kernel<HeadDim, kLongN, Element, Sides, Mask, Capped>(args, plan, stream);
  else if (plan.block_n == kShortN)
    launch_sm90_forward_kernel<HeadDim, kShortN, Element, Sides, Mask, Capped>(args, plan, stream);
  else
    throw_planner_bug("no sm90 forward of " + std::to_string(plan.block_n) + "-key tiles");
}

// Soft-capped calls have their own kernels, without attn_mask, at the capped
// head dims (the planner sends the others to sm80). Without attn_mask a call
// whose band is open on the left (is_causal, or a window without a left side)
// runs a kernel that tests the band's right side alone, keeping the left
// side's code out of its tile loop. Under attn_mask one kernel tests both
// sides (the masked variants stay one per band).
template <int HeadDim, typename Element>
void launch_forward_sm90(const Sm90ForwardArgs& args, const Plan& plan, cudaStream_t stream) {
  const ForwardParams& p = args.p;
  auto with_band = [&](auto mask, auto capped) {
    constexpr MaskKind kMask = decltype(mask)::value;
    constexpr bool kCapped = decltype(capped)::value;
    BandSides sides = band_sides(p);
    if (kMask != MaskKind::None && sides == BandSides::kRight) sides = BandSides::kBoth;
    with_band_sides(sides, [&](auto s) {
      constexpr BandSides kSides = decltype(s)::value;
      if constexpr (kMask == MaskKind::None || kSides != BandSides::kRight)
        launch_planned_sm90_forward<HeadDim, Element, kSides, kMask, kCapped>(args, plan, stream);
      else
        throw_planner_bug("the sm90 forward's attn_mask kernels test both sides of the band");
    });
  };
  using Unmasked = std::integral_constant<MaskKind, MaskKind::None>;
  if (p.softcap > 0.0f) {
    if constexpr (instantiated(Sm90ForwardCappedHeadDims{}, HeadDim)) {
      if (p.mask.kind != MaskKind::None) throw_planner_bug("the sm90 forward soft-caps calls without attn_mask only");
      with_band(Unmasked{}, std::true_type{});
    } else {
      throw_planner_bug("the sm90 forward has no soft-capped variant at head dim " + std::to_string(HeadDim));
    }
  } else if constexpr (instantiated(Sm90ForwardMaskedHeadDims{}, HeadDim)) {
    dispatch_each_mask_kind(p.mask.kind, [&](auto mask) { with_band(mask, std::false_type{}); });
  } else {
    if (p.mask.kind != MaskKind::None)
      throw_planner_bug("the sm90 forward has no attn_mask variant at head dim " + std::to_string(HeadDim));
    with_band(Unmasked{}, std::false_type{});
  }
}

}  // namespace fusedattn::cuda
