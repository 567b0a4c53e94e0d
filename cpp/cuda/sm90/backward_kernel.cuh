// The sm90 backward's key-block kernel: FlashAttention 2's walk (the sm80
// kernel's; common/backward_passes.cuh runs the kernels around it) with
// every product on Hopper's warpgroup MMA and the loads on the tensor memory
// accelerator. A block owns 128 keys and is three warpgroups:
//   producer (warpgroup 0): one thread loads K and V once, then per step
//     (kBlockM queries of one query head: 64 at d=128, 128 at d=64) Q, dO, lse and delta into a two-stage
//     ring ("full" mbarrier: the bytes landed; "empty": every consumer warp is
//     done); it gives its registers to the consumers (setmaxnreg).
//   consumers (warpgroups 1, 2): 64 keys each, and per step
//     S^T  = K Q^T,  dP^T = V dO^T        wgmma m64n{kBlockM}k16, operands in shared memory
//     P^T  = 2^(S^T scale log2 e - lse log2 e),  dS^T = P^T (dP^T - delta)
//     dV  += P^T dO,  dK += dS^T Q        wgmma m64n{d}k16, P^T and dS^T from the
//                                         accumulators, Q and dO read transposed
//     dQ   = dS K                         dS^T stored transposed (stmatrix) as its
//                                         half of a K-major [query][128 keys] tile;
//                                         each consumer takes a 64 x 64 quarter of
//                                         dQ (64 columns of d at d=128, 64 queries
//                                         at d=64) over all 128 keys; staged in shared
//                                         memory and added to the float32 accumulator
//                                         by tensor reduces (TMA, adds in L2).
// The last three products of a step are asynchronous groups the consumers
// wait on only where they need a result: at d=128 (traits' kDkBehindDq) dV's
// run while they meet and dK's while dQ is added.
// dK and dV stay in registers across the walk (GQA's sum costs nothing).
// Under attn_mask (its kind a template argument) a block walks its key
// tile's lists (common/mask_tiles.h) and reads the mask on the steps they mark,
// each warp copying its entries to shared memory first.
// Not yet: overlap between one step's products and the next step's, and the
// deterministic mode (the dispatcher sends it to sm80).
#pragma once

#include <cmath>

#include "../common/backward_passes.cuh"
#include "../common/band.cuh"
#include "../common/device_math.cuh"
#include "../common/launch_check.h"
#include "../common/mask.cuh"
#include "../common/mask_tiles.h"
#include "../common/online_softmax.cuh"
#include "../hopper/bulk_copy.cuh"
#include "../hopper/tma.cuh"
#include "../hopper/warpgroup.cuh"
#include "../hopper/wgmma.cuh"
#include "backward_sm90.h"
#include "backward_traits.h"

namespace fusedattn::cuda {

// Byte offset of dQ quarter element (row, column) in its staging buffer:
// boxes of 32 columns, [64 rows][128 bytes] each, 16-byte chunk j of row r at
// j ^ (r % 8) (the tensor map's 128-byte swizzle).
__device__ __forceinline__ int dq_stage_offset(int row, int column) {
  const int box = column / 32, within = column % 32;
  return box * 64 * 128 + row * 128 + (((within / 4) ^ (row % 8)) * 16) + (within % 4) * 4;
}

template <int HeadDim, typename T, bool Banded, MaskKind Mask>
__global__ void __launch_bounds__(Sm90BackwardTraits<HeadDim>::kThreads, 1)
    sm90_backward_kernel(const __grid_constant__ Sm90BackwardArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma, stmatrix and setmaxnreg exist only in sm_90a code
  using Tr = Sm90BackwardTraits<HeadDim>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStages = Tr::kStages;
  constexpr int kMTiles = kBlockM / 8;  // n-tiles of S^T (queries)
  constexpr int kDTiles = HeadDim / 8;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* sK = smem;                           // [128 keys][d], 64-column slabs of 128 rows
  unsigned char* sV = sK + Tr::kKVTileBytes;
  unsigned char* sQ = sV + Tr::kKVTileBytes;          // stage i at i * kQTileBytes, [kBlockM queries][d]
  unsigned char* sdO = sQ + kStages * Tr::kQTileBytes;
  unsigned char* sdS = sdO + kStages * Tr::kQTileBytes;  // buffer b at b * kDsBytes: [kBlockM queries][128 keys]
  unsigned char* sMask = smem + Tr::kMaskStageOffset;     // consumer warp w's at w * kMaskStageBytes
  float* sLse = reinterpret_cast<float*>(smem + Tr::kFloatsOffset);  // stage i at i * kRowsSlot, natural log
  float* sDelta = sLse + kStages * Tr::kRowsSlot;
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(sDelta + kStages * Tr::kRowsSlot);
  uint64_t* step_full = kv_full + 1;
  uint64_t* step_empty = step_full + kStages;
  // A listed walk's steps (head, first query, reads attn_mask) per stage: the
  // producer reads the list and hands each step over with its data.
  int32_t* step_info = reinterpret_cast<int32_t*>(step_empty + kStages);

  const BackwardParams& p = args.p;
  const ForwardParams& f = p.fwd;
  const AttentionShape& sh = f.shape;
  constexpr bool kListed = Mask != MaskKind::None;  // steps from the mask's lists
  using Walk = KeyBlockWalk<kBlockN, kBlockM, Banded, kListed>;
  const Walk walk(p, args.order);
  auto stage_of = [](int s) { return s % kStages; };
  auto phase_of = [](int s) { return static_cast<uint32_t>((s / kStages) & 1); };
  // A step's first row in the flat [B x Hq x Nq] lse and delta (m0 counts from the sequence's first query).
  auto flat_row = [&](int64_t head, int64_t m0) {
    return static_cast<int>((walk.batch * sh.heads_q + head) * sh.seqlen_q + walk.seq.q0 + m0);
  };

  if (threadIdx.x == 0) {
    mbarrier_init(kv_full, 1);
    for (int i = 0; i < kStages; ++i) {
      mbarrier_init(&step_full[i], 1);
      mbarrier_init(&step_empty[i], 4 * Tr::kConsumers);  // every consumer warp
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ---------------- producer ----------------
    warpgroup_release_registers<Tr::kProducerRegisters>();
    if (threadIdx.x != 0 || walk.steps == 0) return;
    for (const CUtensorMap* map :
         {&args.q_map, &args.k_map, &args.v_map, &args.do_map, &args.lse_map, &args.delta_map, &args.dq_map})
      prefetch_tensor_map(map);
    const int key0 = static_cast<int>(walk.seq.k0 + walk.key0), batch = static_cast<int>(walk.batch);
    const int q0 = static_cast<int>(walk.seq.q0);
    mbarrier_arrive_expect_bytes(kv_full, 2 * Tr::kKVTileBytes);
    for (int slab = 0; slab < Tr::kSlabs; ++slab) {
      tma_load_box(sK + slab * kBlockN * 128, &args.k_map, 64 * slab, key0, static_cast<int>(walk.head_kv), batch, kv_full);
      tma_load_box(sV + slab * kBlockN * 128, &args.v_map, 64 * slab, key0, static_cast<int>(walk.head_kv), batch, kv_full);
    }
    for (int s = 0; s < walk.steps; ++s) {
      const int stage = stage_of(s);
      mbarrier_wait(&step_empty[stage], phase_of(s) ^ 1);  // the first round finds it free
      const auto step = walk.at(s);
      const int head = static_cast<int>(step.head), m0 = static_cast<int>(step.m0);  // of the sequence
      if constexpr (kListed) {
        step_info[3 * stage] = head;
        step_info[3 * stage + 1] = m0;
        step_info[3 * stage + 2] = step.reads_mask;
      }
      // The arrival releases step_info's writes to the consumers, whose wait acquires them.
      mbarrier_arrive_expect_bytes(&step_full[stage], 2 * Tr::kQTileBytes + 2 * Tr::kRowsBox * 4);
      for (int slab = 0; slab < Tr::kSlabs; ++slab) {
        tma_load_box(sQ + stage * Tr::kQTileBytes + slab * kBlockM * 128, &args.q_map, 64 * slab, q0 + m0, head,
                     batch, &step_full[stage]);
        tma_load_box(sdO + stage * Tr::kQTileBytes + slab * kBlockM * 128, &args.do_map, 64 * slab, q0 + m0, head,
                     batch, &step_full[stage]);
      }
      // lse and delta are flat: from the 16-byte boundary at or below the
      // step's first row (traits' kRowsBox), then (past the queries) the next
      // head's rows or zeros, which the consumers mask.
      const int row = flat_row(head, m0) & ~3;
      tma_load_row(sLse + stage * Tr::kRowsSlot, &args.lse_map, row, &step_full[stage]);
      tma_load_row(sDelta + stage * Tr::kRowsSlot, &args.delta_map, row, &step_full[stage]);
    }
    return;
  }

  // ---------------- consumers ----------------
  warpgroup_claim_registers<Tr::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row = warp * 16;  // this warp's accumulator rows: keys of S^T, queries of dQ (after query0)
  using MaskEntry = MaskStorage<Mask, T>;
  MaskEntry* mask_stage = reinterpret_cast<MaskEntry*>(sMask + (4 * consumer + warp) * Tr::kMaskStageBytes);
  // Rounds of staging a step's mask entries (16 keys by kBlockM queries) take.
  constexpr int kMaskRounds = (16 * kBlockM * int(sizeof(MaskEntry)) + Tr::kMaskStageBytes - 1) / Tr::kMaskStageBytes;
  static_assert(kMTiles % kMaskRounds == 0);
  const int64_t my_key0 = walk.key0 + 64 * consumer;  // this warpgroup's 64 keys
  // The sequence's lengths (the call's, dense); banded: query i sees key j iff band.sees(i, j).
  const int64_t seqlen_q = walk.seq.seqlen_q, seqlen_k = walk.seq.seqlen_k;
  const Band band = Band::of(f, seqlen_q, seqlen_k);
  const float scale_log2 = f.scale * kLog2e;
  const unsigned char* k_mine = sK + consumer * 64 * 128;  // rows 64c.. of every slab
  const unsigned char* v_mine = sV + consumer * 64 * 128;
  unsigned char* sDq_mine = smem + Tr::kDqOffset + consumer * Tr::kDqTileBytes;
  const bool issues_dq = threadIdx.x % 128 == 0;  // one thread of each consumer issues its dQ reduces

  float dk[kDTiles][4] = {}, dv[kDTiles][4] = {};
  float (&dk_flat)[kDTiles * 4] = reinterpret_cast<float (&)[kDTiles * 4]>(dk);
  float (&dv_flat)[kDTiles * 4] = reinterpret_cast<float (&)[kDTiles * 4]>(dv);
  if (walk.steps > 0) mbarrier_wait(kv_full, 0);

  for (int s = 0; s < walk.steps; ++s) {
    const int stage = stage_of(s);
    mbarrier_wait(&step_full[stage], phase_of(s));
    const typename Walk::Step step = [&]() -> typename Walk::Step {
      if constexpr (kListed) return {step_info[3 * stage], step_info[3 * stage + 1], step_info[3 * stage + 2] != 0};
      return walk.at(s);
    }();
    const int64_t head = step.head, m0 = step.m0;
    const bool reads_mask = Mask != MaskKind::None && step.reads_mask;
    const unsigned char* q_tile = sQ + stage * Tr::kQTileBytes;
    const unsigned char* do_tile = sdO + stage * Tr::kQTileBytes;
    const int row_skew = flat_row(head, m0) & 3;  // where the step's rows start in the boxes
    const float* lse = sLse + stage * Tr::kRowsSlot + row_skew;
    const float* delta = sDelta + stage * Tr::kRowsSlot + row_skew;
    unsigned char* ds_tile = sdS + (s % 2) * Tr::kDsBytes;

    // S^T = K Q^T and dP^T = V dO^T: rows = this warpgroup's keys, columns = the step's queries.
    float st[kMTiles][4], dpt[kMTiles][4];
    float (&st_flat)[kMTiles * 4] = reinterpret_cast<float (&)[kMTiles * 4]>(st);
    float (&dpt_flat)[kMTiles * 4] = reinterpret_cast<float (&)[kMTiles * 4]>(dpt);
    fence_registers(st_flat);
    fence_registers(dpt_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk)
      wgmma_ss<T, kBlockM>(st_flat, k_major_descriptor(k_mine, kBlockN, kk), k_major_descriptor(q_tile, kBlockM, kk),
                           kk > 0);
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk)
      wgmma_ss<T, kBlockM>(dpt_flat, k_major_descriptor(v_mine, kBlockN, kk), k_major_descriptor(do_tile, kBlockM, kk),
                           kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(st_flat);
    fence_registers(dpt_flat);

    // P^T and dS^T, element (key row g + 8h, query column 2t + e) of each n-tile.
    const bool needs_masking = reads_mask || my_key0 + 64 > seqlen_k || m0 + kBlockM > seqlen_q ||
                               (Banded && band.cuts(m0, kBlockM, my_key0, 64));
    static_assert(4 * kMTiles <= 64, "a bit per element");
    // A hidden entry is 0 in P^T and dS^T outright: past the keys or the
    // queries (where lse and delta are the next head's, and a NaN there must
    // not reach dK), outside the band, or hidden by attn_mask (whose row's lse
    // may be -inf). On the steps that need it, a first pass marks those (bit
    // 4 nt + e) and, under attn_mask, turns S^T into base-2 scores with the
    // mask added; the exponentials stay one straight run the compiler
    // interleaves. A test per element in their loop became a branch per
    // element, which serialised them (docs/cuda-notes.md, rung 4).
    // Element (nt, e): past the keys or queries, or outside the band.
    const int64_t warp_key0 = my_key0 + warp_row;
    // Bitwise, not short-circuit: each || can become a branch.
    auto outside = [&](int nt, int e) {
      const int64_t key = warp_key0 + g + (e >> 1) * 8, query = m0 + nt * 8 + 2 * t + (e & 1);
      bool out = (key >= seqlen_k) | (query >= seqlen_q);
      if constexpr (Banded) out |= !band.sees(query, key);
      return out;
    };
    uint64_t hidden = 0;
    float score_scale = scale_log2;  // S^T to base-2 scores
    if constexpr (kListed) {
      if (needs_masking) {
        const int64_t mask_base = walk.batch * f.mask.batch_stride + head * f.mask.head_stride;
#pragma unroll
        for (int round = 0; round < kMaskRounds; ++round) {
          constexpr int kRoundTiles = kMTiles / kMaskRounds, kRoundRows = 8 * kRoundTiles;
          static_assert(16 * kRoundRows * int(sizeof(MaskEntry)) <= Tr::kMaskStageBytes, "a round fits the stage");
          // Entry (query r, key j) of the round at r * 16 + j: 16 lanes per
          // query row, loaded kBatch at a time before any is stored.
          if (reads_mask) {
            constexpr int kPerLane = kRoundRows * 16 / 32, kBatch = 8;
            static_assert(kPerLane % kBatch == 0);
            const int64_t query0 = m0 + round * kRoundRows;
            __syncwarp();  // the last round's reads are done
#pragma unroll
            for (int b0 = 0; b0 < kPerLane; b0 += kBatch) {
              MaskEntry staged[kBatch];
#pragma unroll
              for (int u = 0; u < kBatch; ++u) {
                const int i = (b0 + u) * 32 + lane;
                const int64_t query = query0 + i / 16, key = warp_key0 + i % 16;
                staged[u] = query < seqlen_q && key < seqlen_k
                                ? static_cast<const MaskEntry*>(f.mask.ptr)[mask_base + query * f.mask.row_stride +
                                                                            key * f.mask.col_stride]
                                : MaskEntry{};
              }
#pragma unroll
              for (int u = 0; u < kBatch; ++u) mask_stage[(b0 + u) * 32 + lane] = staged[u];
            }
            __syncwarp();
          }
#pragma unroll
          for (int j = 0; j < kRoundTiles; ++j) {
            const int nt = round * kRoundTiles + j;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key_row = g + (e >> 1) * 8, query_col = nt * 8 + 2 * t + (e & 1);
              bool is_outside = outside(nt, e);
              float added = 0.0f;
              if (reads_mask && !is_outside)
                added = mask_entry<Mask, T>(mask_stage, (query_col - round * kRoundRows) * 16 + key_row);
              is_outside |= added == -INFINITY;
              st[nt][e] = st[nt][e] * scale_log2 + added;
              hidden |= uint64_t(is_outside) << (4 * nt + e);
            }
          }
        }
        score_scale = 1.0f;
      }
    } else if (needs_masking) {
#pragma unroll
      for (int nt = 0; nt < kMTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) hidden |= uint64_t(outside(nt, e)) << (4 * nt + e);
    }
#pragma unroll
    for (int nt = 0; nt < kMTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = nt * 8 + 2 * t + (e & 1);
        const bool is_hidden = (hidden >> (4 * nt + e)) & 1u;
        const float prob = is_hidden ? 0.0f : exp2f(st[nt][e] * score_scale - lse_in_log2(lse[c]));
        st[nt][e] = prob;
        dpt[nt][e] = is_hidden ? 0.0f : prob * (dpt[nt][e] - delta[c]);
      }
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
    // dS^T Q (scaled at the end; Q and dO are B operands stored [query][d],
    // read transposed) with it, or (kDkBehindDq) after dQ = dS K, so dQ's
    // staging and the issue of its reduces run under dK's products.
    constexpr bool kDkBehindDq = Tr::kDkBehindDq;
    auto issue_dk = [&] {
#pragma unroll
      for (int kq = 0; kq < kBlockM / 16; ++kq) fence_registers(ds_a[kq]);
      fence_registers(dk_flat);
      wgmma_fence();
#pragma unroll
      for (int kq = 0; kq < kBlockM / 16; ++kq)
        wgmma_rs<T, HeadDim>(dk_flat, ds_a[kq], mn_major_descriptor(q_tile, kBlockM, kq), true);
    };
    // After the wait for dK (and dV): the stage's Q and dO are read.
    auto release_stage = [&] {
      fence_registers(dv_flat);
      fence_registers(dk_flat);
#pragma unroll
      for (int kq = 0; kq < kBlockM / 16; ++kq) {
        fence_registers(p_a[kq]);
        fence_registers(ds_a[kq]);
      }
      if (lane == 0) mbarrier_arrive(&step_empty[stage]);
    };
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) fence_registers(p_a[kq]);
    fence_registers(dv_flat);
    wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq)
      wgmma_rs<T, HeadDim>(dv_flat, p_a[kq], mn_major_descriptor(do_tile, kBlockM, kq), true);
    if constexpr (!kDkBehindDq) {
      issue_dk();
      wgmma_commit();
      wgmma_wait<0>();
      release_stage();
    } else {
      wgmma_commit();
    }
    // The last step's dQ quarter has been read out of sDq (the wait is the
    // issuing thread's; the barrier tells its warpgroup).
    if (issues_dq) bulk_wait<0, true>();
    // Both warpgroups' dS written (and fenced). It also orders this buffer's
    // next use, two steps on, after both warpgroups' dQ of this step.
    named_barrier_sync(Tr::kDsWrittenBarrier, 128 * Tr::kConsumers);

    // dQ = dS K over all 128 keys for this warpgroup's quarter: 64 queries
    // (this warp's 16) from query0 by 64 columns of d from column0. The dS
    // rows start query0 rows into each key slab, K's columns at slab column0 / 64.
    const int query0 = Tr::kDqQueryOffset * consumer, column0 = Tr::kDqColumnOffset * consumer;
    const unsigned char* ds_a_tile = ds_tile + query0 * 128;
    const unsigned char* k_b_tile = sK + column0 / 64 * kBlockN * 128;
    float dq[8][4];
    float (&dq_flat)[32] = reinterpret_cast<float (&)[32]>(dq);
    fence_registers(dq_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma_ss<T, 64, true>(dq_flat, k_major_descriptor(ds_a_tile, kBlockM, kk), mn_major_descriptor(k_b_tile, kBlockN, kk),
                            kk > 0);
    wgmma_commit();
    if constexpr (kDkBehindDq) {
      issue_dk();
      wgmma_commit();
      wgmma_wait<1>();  // dV and dQ
    } else {
      wgmma_wait<0>();
    }
    fence_registers(dq_flat);
    // The quarter to sDq, then one tensor reduce per 32 columns adds it to
    // the accumulator. The box also covers rows past the queries (the next
    // head's or sequence's): they are staged as 0, as their dS is, so that
    // an inf or NaN in this block's keys stays in this head's dQ.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row + g + 8 * h;
      const bool is_query = m0 + query0 + row < seqlen_q;
#pragma unroll
      for (int dt = 0; dt < 8; ++dt)
        store_shared_float2(sDq_mine + dq_stage_offset(row, dt * 8 + 2 * t), is_query ? dq[dt][2 * h] : 0.0f,
                            is_query ? dq[dt][2 * h + 1] : 0.0f);
    }
    fence_proxy_async_shared();  // written through the generic proxy, read by the tensor reduce
    named_barrier_sync(Tr::kDqWrittenBarrier + consumer, 128);
    if (issues_dq) {
      const int row = flat_row(head, m0) + query0;
#pragma unroll
      for (int box = 0; box < 2; ++box)
        tma_reduce_add_box(sDq_mine + box * Tr::kDqBoxBytes, &args.dq_map, column0 + 32 * box, row);
      bulk_commit();
    }
    if constexpr (kDkBehindDq) {
      wgmma_wait<0>();
      release_stage();
    }
  }
  if (issues_dq) bulk_wait<0, false>();  // the reduces done before the block leaves
  store_key_gradients<HeadDim, T>(p, walk.batch, walk.head_kv, walk.seq.k0, my_key0 + warp_row, seqlen_k, dk, dv);
#else
  __trap();  // built for another target: sm90_available() keeps callers away
#endif
}

template <int HeadDim, typename T, bool Banded, MaskKind Mask>
void launch_sm90_backward_kernel(const Sm90BackwardArgs& args, cudaStream_t stream) {
  using Tr = Sm90BackwardTraits<HeadDim>;
  auto kernel = sm90_backward_kernel<HeadDim, T, Banded, Mask>;
  FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  Sm90BackwardArgs launch_args = args;
  launch_args.order = make_key_block_order(args.p.fwd.shape, Tr::kBlockN, args.p.head_splits, sizeof(T), Banded);
  if constexpr (Mask != MaskKind::None) sort_mask_into_key_tiles(args.p.fwd, Tr::kBlockN, Tr::kBlockM, stream);
  const VarlenParams& varlen = args.p.fwd.varlen;
  const unsigned blocks = grid_blocks(launch_args.order, varlen.on(), varlen.key_items, args.p.fwd.shape.heads_kv);
  kernel<<<blocks, Tr::kThreads, Tr::kSmemBytes, stream>>>(launch_args);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

template <int HeadDim, typename Element>
void launch_backward_sm90(const Sm90BackwardArgs& args, cudaStream_t stream) {
  const BackwardParams& p = args.p;
  run_backward_passes<Element>(p, stream, [&] {
    if (p.fwd.shape.batch * p.fwd.shape.heads_kv * p.fwd.shape.seqlen_k == 0) return;
    auto with_band = [&](auto mask) {
      constexpr MaskKind kMask = decltype(mask)::value;
      if (p.fwd.banded())
        launch_sm90_backward_kernel<HeadDim, Element, true, kMask>(args, stream);
      else
        launch_sm90_backward_kernel<HeadDim, Element, false, kMask>(args, stream);
    };
    dispatch_each_mask_kind(p.fwd.mask.kind, with_band);
  });
}

}  // namespace fusedattn::cuda
