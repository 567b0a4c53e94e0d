// The sm90 forward: FlashAttention with Hopper's machinery. A block owns 64
// queries per consumer warpgroup (2 at d=128, 3 at d=64) of one head:
//   producer (warpgroup 0): one thread issues tensor-memory-accelerator loads,
//     Q once, then K and V tiles of kBlockN keys (176 at d=128 without a
//     mask, under causal from 16K keys; else 128; forward_traits.h) into two-stage rings guarded by
//     mbarriers ("full" when the bytes landed, "empty" when every consumer
//     warp is done reading); it gives its registers to the consumers (setmaxnreg).
//   consumers (warpgroups 1, 2[, 3]): 64 queries each, and per key tile j
//     S_j = Q K_j^T     wgmma m64n{kBlockN}k16, both operands from shared memory
//     O += P_{j-1} V    wgmma m64n{d}k16, P from registers, V read transposed,
//                       issued right behind S_j, so the online softmax of S_j
//                       runs while this GEMM is in flight;
//   the consumers take turns issuing their GEMMs (named barriers), so one
//   warpgroup's softmax overlaps the others' tensor-core work.
// The accumulators of each warp have mma.sync's C layout, so the softmax and P
// packing helpers of the sm80 kernel apply unchanged. attn_mask is read where
// the scores are, by a separate instantiation (no tile is skipped for it: the
// producer loads every tile).
// At d=128, and at d=64 under causal (sm90_forward_persistent), the blocks are
// persistent, one per SM: each takes work items (a query block
// of one head, in the launch's BlockOrder) from a counter until none are left,
// so the producer loads the next item's Q and first tiles while the
// consumers finish the last one, and no block is launched per item. The
// producer hands each item's index to the consumers with its Q. Elsewhere a
// block per item.
#pragma once

#include <algorithm>
#include <cmath>

#include "../common/device_math.cuh"
#include "../common/instantiation_dispatch.h"
#include "../common/launch_check.h"
#include "../common/mask.cuh"
#include "../common/online_softmax.cuh"
#include "../hopper/bulk_copy.cuh"
#include "../hopper/tma.cuh"
#include "../hopper/warpgroup.cuh"
#include "../hopper/wgmma.cuh"
#include "forward_sm90.h"
#include "forward_traits.h"

namespace fusedattn::cuda {

template <int HeadDim, int BlockN, typename T, bool IsCausal, bool HasMask>
__global__ void __launch_bounds__(Sm90ForwardTraits<HeadDim, BlockN>::kThreads, 1)
    sm90_forward_kernel(const __grid_constant__ Sm90ForwardArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma and setmaxnreg exist only in sm_90a code
  using Tr = Sm90ForwardTraits<HeadDim, BlockN>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStages = Tr::kStages;
  constexpr int kNTiles = kBlockN / 8, kDTiles = HeadDim / 8;
  constexpr bool kPersistent = sm90_forward_persistent(HeadDim, IsCausal);

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* sQ = smem;
  unsigned char* sK = sQ + Tr::kQBytes;                    // stage s at s * kTileBytes
  unsigned char* sV = sK + kStages * Tr::kTileBytes;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(smem + Tr::kBarriersOffset);
  uint64_t* q_empty = q_full + 1;
  uint64_t* k_full = q_empty + 1;
  uint64_t* k_empty = k_full + kStages;
  uint64_t* v_full = k_empty + kStages;
  uint64_t* v_empty = v_full + kStages;
  // The index of the item whose Q is in sQ (n_items: no more work), written
  // by the producer before it arrives on q_full.
  volatile unsigned* item_slot = reinterpret_cast<volatile unsigned*>(v_empty + kStages);

  const ForwardParams& p = args.p;
  const AttentionShape& sh = p.shape;
  const unsigned n_items = static_cast<unsigned>(args.order.blocks());
  const unsigned heads_q = static_cast<unsigned>(sh.heads_q);
  const int group = static_cast<int>(sh.heads_q / sh.heads_kv);
  // Lengths fit in int here (forward_sm90 checks): 32-bit row arithmetic
  // leaves the consumers more of their registers.
  const int seqlen_q = static_cast<int>(sh.seqlen_q), seqlen_k = static_cast<int>(sh.seqlen_k);
  const int causal_offset = seqlen_k - seqlen_q;
  // The current item; both roles set it with `begin_item`.
  int batch = 0, head = 0, head_kv = 0, row0 = 0, rows = 0, key_end = 0, n_tiles = 0;
  auto begin_item = [&](unsigned index) {
    const GridBlock block = args.order.at<IsCausal>(index);  // common/block_order.h
    batch = static_cast<int>(block.pair / heads_q);
    head = static_cast<int>(block.pair % heads_q);
    head_kv = head / group;
    row0 = static_cast<int>(block.block) * kBlockM;
    rows = min(kBlockM, seqlen_q - row0);
    key_end = IsCausal ? max(0, min(seqlen_k, row0 + rows + causal_offset)) : seqlen_k;
    n_tiles = (key_end + kBlockN - 1) / kBlockN;
  };
  // Every item starts its tiles at stage 0 of both rings, so that stages
  // (and the wgmma descriptors made from them) follow from j alone, which
  // the compiler keeps in uniform registers (continuing the rings across
  // items moves that work to the vector pipe, with many more R2UR moves,
  // and runs slower). A stage's phase parity then depends on the items
  // before: bit s of `phases` is that of stage s at the item's start.
  // Q is released with the item's last K tile, so the next item's first
  // tiles cannot be needed earlier than the stage they wait for.
  uint32_t phases = 0;
  auto stage = [](int j) { return j % kStages; };
  auto phase = [&](int j) { return ((phases >> (j % kStages)) ^ static_cast<uint32_t>(j / kStages)) & 1u; };
  auto end_item_phases = [&] {
#pragma unroll
    for (int s = 0; s < kStages; ++s)
      if (((n_tiles + kStages - 1 - s) / kStages) & 1) phases ^= 1u << s;  // stage s used an odd number of times
  };

  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    mbarrier_init(q_empty, 4 * Tr::kConsumers);  // every consumer warp
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&k_full[s], 1);
      mbarrier_init(&v_full[s], 1);
      mbarrier_init(&k_empty[s], 4 * Tr::kConsumers);
      mbarrier_init(&v_empty[s], 4 * Tr::kConsumers);
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ---------------- producer ----------------
    warpgroup_release_registers<Tr::kProducerRegisters>();
    if (threadIdx.x != 0) return;
    prefetch_tensor_map(&args.q_map);
    prefetch_tensor_map(&args.k_map);
    prefetch_tensor_map(&args.v_map);
    // K runs one tile ahead of V, the order in which the consumers use them.
    auto load_tile = [&](const CUtensorMap* map, unsigned char* ring, uint64_t* full, uint64_t* empty, int j) {
      mbarrier_wait(&empty[stage(j)], phase(j) ^ 1);  // the first round finds it free
      mbarrier_arrive_expect_bytes(&full[stage(j)], Tr::kTileBytes);
      for (int slab = 0; slab < Tr::kSlabs; ++slab)
        tma_load_box(ring + stage(j) * Tr::kTileBytes + slab * kBlockN * 128, map, 64 * slab, j * kBlockN, head_kv,
                     batch, &full[stage(j)]);
    };
    unsigned index = blockIdx.x;
    for (uint32_t item = 0;; ++item) {
      mbarrier_wait(q_empty, (item & 1) ^ 1);  // the first item finds sQ free
      *item_slot = index;
      if (index >= n_items) {
        mbarrier_arrive(q_full);  // no Q: the consumers read the end of the work
        return;
      }
      begin_item(index);
      if (n_tiles == 0) {
        mbarrier_arrive(q_full);  // rows that see no key: the consumers write zeros
      } else {
        mbarrier_arrive_expect_bytes(q_full, Tr::kQBytes);
        for (int slab = 0; slab < Tr::kSlabs; ++slab)
          tma_load_box(sQ + slab * kBlockM * 128, &args.q_map, 64 * slab, row0, head, batch, q_full);
        for (int j = 0; j < n_tiles; ++j) {
          load_tile(&args.k_map, sK, k_full, k_empty, j);
          if (j > 0) load_tile(&args.v_map, sV, v_full, v_empty, j - 1);
        }
        load_tile(&args.v_map, sV, v_full, v_empty, n_tiles - 1);
        end_item_phases();
      }
      if constexpr (!kPersistent) return;  // a block per item
      // A grid smaller than the items takes the rest from the counter.
      index = gridDim.x < n_items ? warp_uniform(gridDim.x + atomicAdd(p.work_counter, 1u), 1u) : n_items;
    }
  }

  // ---------------- consumers ----------------
  warpgroup_claim_registers<Tr::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row = warp * 16;  // this warp's rows within the warpgroup's 64
  const float scale_log2 = p.scale * kLog2e;
  int wg_row0 = 0;  // this warpgroup's first query in the current item

  float acc[kDTiles][4];
  float m_i[2], l_i[2];
  float (&acc_flat)[kDTiles * 4] = reinterpret_cast<float (&)[kDTiles * 4]>(acc);
  float s[kNTiles][4];
  float (&s_flat)[kNTiles * 4] = reinterpret_cast<float (&)[kNTiles * 4]>(s);
  uint32_t p_a[kBlockN / 16][4];  // P of the previous tile, the A operand of O += P V

  // The turn-taking, round robin: consumer c issues GEMMs after a sync on
  // barrier 1 + c, then lets the next go by arriving on its barrier. The last
  // consumer first lets consumer 0 go; so consumer 0, after the last item,
  // takes the one turn more that this leaves it.
  const bool last_consumer = consumer == Tr::kConsumers - 1;
  const int my_turn = 1 + consumer, next_turn = 1 + (consumer + 1) % Tr::kConsumers;
  auto take_turn = [&] { named_barrier_sync(my_turn, 256); };
  auto pass_turn = [&] { named_barrier_arrive(next_turn, 256); };

  // S_j = Q K_j^T, issued (not waited for).
  auto issue_scores = [&](int j) {
    const unsigned char* k_tile = sK + stage(j) * Tr::kTileBytes;
    fence_registers(s_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk)
      wgmma_ss<T, kBlockN>(s_flat, k_major_descriptor(sQ + consumer * 64 * 128, kBlockM, kk),
                           k_major_descriptor(k_tile, kBlockN, kk), kk > 0);
    wgmma_commit();
  };
  // O += P V_j, issued (not waited for).
  auto issue_pv = [&](int j) {
    const unsigned char* v_tile = sV + stage(j) * Tr::kTileBytes;
    fence_registers(acc_flat);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) fence_registers(p_a[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma_rs<T, HeadDim>(acc_flat, p_a[kk], mn_major_descriptor(v_tile, kBlockN, kk), true);
    wgmma_commit();
  };
  // Hide the keys of the item's tile j past the end and (causal) above the
  // diagonal, and take the online-softmax step; returns the factor by which
  // O must be rescaled.
  // attn_mask (base-2 units) added to the visible scores of the tile at
  // col0: a hidden entry stays -inf whatever the mask holds there, and rows
  // past the queries read none of it. One loop per mask kind, each reading
  // its element type straight from the row's offset.
  auto add_mask = [&](int col0) {
    const int64_t mask_base = batch * p.mask.batch_stride + head * p.mask.head_stride;
    int64_t row_offset[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      row_offset[h] = mask_base + int64_t(wg_row0 + warp_row + g + 8 * h) * p.mask.row_stride +
                      int64_t(col0 + 2 * t) * p.mask.col_stride;
    const bool row_valid[2] = {wg_row0 + warp_row + g < seqlen_q, wg_row0 + warp_row + g + 8 < seqlen_q};
    auto add = [&](auto value_at) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (row_valid[e >> 1] && s[nt][e] != -INFINITY)
            s[nt][e] += value_at(row_offset[e >> 1] + (nt * 8 + (e & 1)) * p.mask.col_stride);
    };
    switch (p.mask.kind) {
      case MaskKind::Bool:
        add([&](int64_t i) { return static_cast<const uint8_t*>(p.mask.ptr)[i] ? 0.0f : -INFINITY; });
        break;
      case MaskKind::AdditiveFloat32:
        add([&](int64_t i) { return static_cast<const float*>(p.mask.ptr)[i] * kLog2e; });
        break;
      default:  // AdditiveInput
        add([&](int64_t i) { return to_float(static_cast<const T*>(p.mask.ptr)[i]) * kLog2e; });
        break;
    }
  };
  // Without attn_mask the scores stay raw until the exponent, which takes
  // the scale (>= FLT_MIN: use_sm90_forward) in one FFMA; a mask adds
  // base-2 values, so masked calls scale first.
  auto softmax = [&](int j, float (&rescale)[2]) {
    const int col0 = j * kBlockN;
    const bool needs_masking = col0 + kBlockN > key_end || (IsCausal && col0 + kBlockN - 1 > wg_row0 + causal_offset);
    if constexpr (HasMask) {
      // Scaled first: a scale of 0 must not meet -inf.
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= scale_log2;
    }
    if (needs_masking) {
      // Row h of this thread sees tile columns [0, visible[h]): the keys
      // before the end and (causal) on or below the diagonal. Subtracting the
      // thread's column 2t once leaves compile-time offsets in the loop.
      int visible[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        visible[h] = key_end - col0;
        if (IsCausal) visible[h] = min(visible[h], wg_row0 + warp_row + g + 8 * h + causal_offset - col0 + 1);
        visible[h] -= 2 * t;
      }
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (nt * 8 + (e & 1) >= visible[e >> 1]) s[nt][e] = -INFINITY;
    }
    if constexpr (HasMask) {
      add_mask(col0);
      online_softmax_scores(s, m_i, l_i, rescale);
    } else {
      online_softmax_scores</*RawScores=*/true>(s, m_i, l_i, rescale, scale_log2);
    }
  };
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
    mbarrier_wait(q_full, item & 1);
    // Lane 0 reads it, the lane that later releases sQ (and the slot) for
    // this warp: a read by another lane would not be ordered before that
    // arrival (compute-sanitizer racecheck: WAR with the producer's write).
    const unsigned index = __shfl_sync(0xffffffffu, lane == 0 ? *item_slot : 0u, 0);
    if (index >= n_items) break;
    begin_item(index);
    wg_row0 = row0 + 64 * consumer;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
    m_i[0] = m_i[1] = -INFINITY;
    l_i[0] = l_i[1] = 0.0f;

    if (n_tiles == 0) {
      release(q_empty);  // index read; no Q
    } else {
      float rescale[2];
      mbarrier_wait(&k_full[0], phase(0));
      take_turn();
      issue_scores(0);
      pass_turn();
      wgmma_wait<0>();
      fence_registers(s_flat);
      release(&k_empty[0]);
      if (n_tiles == 1) release(q_empty);  // the item's last read of Q
      softmax(0, rescale);                 // O is still zero: no rescale
      pack_probabilities();

      for (int j = 1; j < n_tiles; ++j) {
        mbarrier_wait(&k_full[stage(j)], phase(j));
        take_turn();
        issue_scores(j);
        mbarrier_wait(&v_full[stage(j - 1)], phase(j - 1));
        issue_pv(j - 1);
        pass_turn();
        wgmma_wait<1>();  // S_j done; P_{j-1} V still running
        fence_registers(s_flat);
        release(&k_empty[stage(j)]);
        if (j == n_tiles - 1) release(q_empty);
        softmax(j, rescale);
        wgmma_wait<0>();
        fence_registers(acc_flat);
        release(&v_empty[stage(j - 1)]);
        rescale_rows(acc, rescale);
        pack_probabilities();
      }

      mbarrier_wait(&v_full[stage(n_tiles - 1)], phase(n_tiles - 1));
      take_turn();
      issue_pv(n_tiles - 1);
      pass_turn();
      wgmma_wait<0>();
      fence_registers(acc_flat);
      release(&v_empty[stage(n_tiles - 1)]);
      end_item_phases();
    }

    // Epilogue: normalise once; fully masked rows (l = 0): out = 0, lse = -inf.
    float* lse = p.lse + (int64_t(batch) * sh.heads_q + head) * sh.seqlen_q;
    T* out = static_cast<T*>(p.out) + batch * p.out_strides.batch + head * p.out_strides.head;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = quad_sum(l_i[h]);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      const int r = wg_row0 + warp_row + g + h * 8;
      if (r >= row0 + rows) continue;
      if (t == 0) lse[r] = lse_from_log2(m_i[h], l);
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<uint32_t*>(out + int64_t(r) * p.out_strides.row + dt * 8 + 2 * t) =
            pack2<T>(acc[dt][2 * h] * inv, acc[dt][2 * h + 1] * inv);
    }
    if constexpr (!kPersistent) break;  // a block per item
  }
  if (consumer == 0) take_turn();
#else
  __trap();  // built for another target: sm90_available() keeps callers away
#endif
}

template <int HeadDim, int BlockN, typename T, bool IsCausal, bool HasMask>
void launch_sm90_forward_kernel(const Sm90ForwardArgs& args, cudaStream_t stream) {
  using Tr = Sm90ForwardTraits<HeadDim, BlockN>;
  auto kernel = sm90_forward_kernel<HeadDim, BlockN, T, IsCausal, HasMask>;
  FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  Sm90ForwardArgs launch_args = args;
  launch_args.order = make_query_block_order(args.p.shape, Tr::kBlockM, sizeof(T), IsCausal);
  // Persistent: one block per SM (its threads take 65536 / kThreads registers
  // each from entry, as setmaxnreg needs: 64512 or 65536, no room for a
  // second block), each taking items from the counter, zeroed here; else a
  // block per item.
  int64_t blocks = launch_args.order.blocks();
  if constexpr (sm90_forward_persistent(HeadDim, IsCausal)) {
    const int sms = current_device_sms();
    if (blocks > sms) {
      blocks = sms;
      FUSEDATTN_CUDA_CHECK(cudaMemsetAsync(args.p.work_counter, 0, sizeof(unsigned), stream));
    }
  }
  kernel<<<static_cast<unsigned>(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(launch_args);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

// The plan's tile width and persistence (plan.cu chose them with tile_size.h,
// and encoded the K/V tensor maps' boxes for that width); a plan with no
// instantiation here is a planner bug.
template <int HeadDim, typename Element, bool IsCausal, bool HasMask>
void launch_planned_sm90_forward(const Sm90ForwardArgs& args, const Plan& plan, cudaStream_t stream) {
  constexpr int kShortN = sm90_forward_block_n(HeadDim, IsCausal, HasMask, 0);
  constexpr int kLongN = sm90_forward_block_n(HeadDim, IsCausal, HasMask, kSm90CausalWideTileKeys);
  if (plan.persistent != sm90_forward_persistent(HeadDim, IsCausal))
    throw_planner_bug("the sm90 forward's persistence is fixed per head dim and causality");
  if (plan.block_n == kLongN)
    launch_sm90_forward_kernel<HeadDim, kLongN, Element, IsCausal, HasMask>(args, stream);
  else if (plan.block_n == kShortN)
    launch_sm90_forward_kernel<HeadDim, kShortN, Element, IsCausal, HasMask>(args, stream);
  else
    throw_planner_bug("no sm90 forward of " + std::to_string(plan.block_n) + "-key tiles");
}

template <int HeadDim, typename Element>
void launch_forward_sm90(const Sm90ForwardArgs& args, const Plan& plan, cudaStream_t stream) {
  const ForwardParams& p = args.p;
  if (p.mask.kind != MaskKind::None) {
    if constexpr (instantiated(Sm90ForwardMaskedHeadDims{}, HeadDim)) {
      if (p.is_causal)
        launch_planned_sm90_forward<HeadDim, Element, true, true>(args, plan, stream);
      else
        launch_planned_sm90_forward<HeadDim, Element, false, true>(args, plan, stream);
    } else {
      throw_planner_bug("the sm90 forward has no attn_mask variant at head dim " + std::to_string(HeadDim));
    }
  } else if (p.is_causal) {
    launch_planned_sm90_forward<HeadDim, Element, true, false>(args, plan, stream);
  } else {
    launch_planned_sm90_forward<HeadDim, Element, false, false>(args, plan, stream);
  }
}

}  // namespace fusedattn::cuda
