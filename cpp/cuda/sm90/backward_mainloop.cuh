// The sm90 backward's mainloop: what the producer loads and the GEMMs the
// consumers issue on it.
//   load (producer, one thread): K and V of the block's keys once, then per
//     step of the walk (common/backward_passes.cuh's KeyBlockWalk) Q, dO, lse
//     and delta into the ring stage the step's consumers have released;
//     under attn_mask it hands each step (head, first query, reads the mask)
//     to the consumers with its data.
//   mma (each consumer warpgroup, 64 keys):
//     S^T  = K Q^T,  dP^T = V dO^T    wgmma m64n{kBlockM}k16, operands in shared memory
//     dV  += P^T dO,  dK += dS^T Q    wgmma m64n{d}k16, P^T and dS^T from registers,
//                                     Q and dO read transposed
//     dQ   = dS K                     wgmma m64n64k16 on the dS tile both consumers
//                                     wrote, for this consumer's quarter of dQ
//   Each is issued, not committed or waited for: the kernel
//   (backward_kernel.cuh) decides what overlaps what.
#pragma once

#include <cstdint>

#include "../hopper/bulk_copy.cuh"
#include "../hopper/ring_phases.cuh"
#include "../hopper/tma.cuh"
#include "../hopper/warpgroup.cuh"
#include "../hopper/wgmma.cuh"
#include "backward_epilogue.cuh"
#include "backward_pipeline.cuh"
#include "backward_traits.h"

namespace fusedattn::cuda {

// A step's first row in the flat [B x Hq x Nq] lse and delta (m0 counts from
// the sequence's first query).
template <typename Walk>
__device__ __forceinline__ int flat_row(const AttentionShape& sh, const Walk& walk, int64_t head, int64_t m0) {
  return static_cast<int>((walk.batch * sh.heads_q + head) * sh.seqlen_q + walk.seq.q0 + m0);
}

template <typename Tr, typename Walk, bool Listed>
struct Sm90BackwardLoad {
  const Sm90BackwardArgs& args;
  const Sm90BackwardSmem<Tr>& smem;
  const Walk& walk;

  __device__ __forceinline__ void prefetch_maps() const {
    for (const CUtensorMap* map :
         {&args.q_map, &args.k_map, &args.v_map, &args.do_map, &args.lse_map, &args.delta_map, &args.dq_map})
      prefetch_tensor_map(map);
  }

  // The block's K and V, once.
  __device__ __forceinline__ void keys_and_values() const {
    const int key0 = static_cast<int>(walk.seq.k0 + walk.key0), batch = static_cast<int>(walk.batch);
    mbarrier_arrive_expect_bytes(smem.kv_full, 2 * Tr::kKVTileBytes);
    for (int slab = 0; slab < Tr::kSlabs; ++slab) {
      tma_load_box(smem.k + slab * Tr::kBlockN * 128, &args.k_map, 64 * slab, key0, static_cast<int>(walk.head_kv),
                   batch, smem.kv_full);
      tma_load_box(smem.v + slab * Tr::kBlockN * 128, &args.v_map, 64 * slab, key0, static_cast<int>(walk.head_kv),
                   batch, smem.kv_full);
    }
  }

  // Step s's Q, dO, lse and delta into its ring stage, once that stage is free.
  __device__ __forceinline__ void step(int s, const RingPhases<Tr::kStages>& ring) const {
    const int stage = ring.stage(s), batch = static_cast<int>(walk.batch);
    const int q0 = static_cast<int>(walk.seq.q0);
    mbarrier_wait(&smem.step_empty[stage], ring.phase(s) ^ 1);  // the first round finds it free
    const auto at = walk.at(s);
    const int head = static_cast<int>(at.head), m0 = static_cast<int>(at.m0);  // of the sequence
    if constexpr (Listed) {
      smem.step_info[3 * stage] = head;
      smem.step_info[3 * stage + 1] = m0;
      smem.step_info[3 * stage + 2] = at.reads_mask;
    }
    // The arrival releases step_info's writes to the consumers, whose wait acquires them.
    mbarrier_arrive_expect_bytes(&smem.step_full[stage], 2 * Tr::kQTileBytes + 2 * Tr::kRowsBox * 4);
    for (int slab = 0; slab < Tr::kSlabs; ++slab) {
      tma_load_box(smem.q + stage * Tr::kQTileBytes + slab * Tr::kBlockM * 128, &args.q_map, 64 * slab, q0 + m0,
                   head, batch, &smem.step_full[stage]);
      tma_load_box(smem.d_o + stage * Tr::kQTileBytes + slab * Tr::kBlockM * 128, &args.do_map, 64 * slab, q0 + m0,
                   head, batch, &smem.step_full[stage]);
    }
    // lse and delta are flat: from the 16-byte boundary at or below the
    // step's first row (traits' kRowsBox), then (past the queries) the next
    // head's rows or zeros, which the consumers mask.
    const int row = flat_row(args.p.fwd.shape, walk, head, m0) & ~3;
    tma_load_row(smem.lse + stage * Tr::kRowsSlot, &args.lse_map, row, &smem.step_full[stage]);
    tma_load_row(smem.delta + stage * Tr::kRowsSlot, &args.delta_map, row, &smem.step_full[stage]);
  }
};

// The walk's loads, by one thread of the producer warpgroup.
template <typename Tr, typename Walk, bool Listed>
__device__ __forceinline__ void run_backward_loads(const Sm90BackwardArgs& args, const Sm90BackwardSmem<Tr>& smem,
                                                   const Walk& walk, const RingPhases<Tr::kStages>& ring) {
  if (threadIdx.x != 0 || walk.steps == 0) return;
  const Sm90BackwardLoad<Tr, Walk, Listed> load{args, smem, walk};
  load.prefetch_maps();
  load.keys_and_values();
  for (int s = 0; s < walk.steps; ++s) load.step(s, ring);
}

// The producer warpgroup of either sm90 backward kernel: it keeps Registers
// and gives the rest to the consumers (the whole warpgroup at once); one
// thread runs the walk's loads, and in deterministic mode (Ordered) warp
// 1 + c adds consumer c's dQ at its turns (backward_epilogue.cuh).
template <typename Tr, typename Walk, bool Listed, bool Ordered, int Registers>
__device__ __forceinline__ void run_backward_producer(const Sm90BackwardArgs& args, const Sm90BackwardSmem<Tr>& smem,
                                                      const Walk& walk, const RingPhases<Tr::kStages>& ring) {
  warpgroup_release_registers<Registers>();
  const int warp = threadIdx.x / 32;
  if (warp == 0)
    run_backward_loads<Tr, Walk, Listed>(args, smem, walk, ring);
  else if (Ordered && warp <= Tr::kConsumers)
    run_dq_writer<Tr>(args, smem, walk.steps, warp - 1);
}

template <int HeadDim, typename T, typename Tr>
struct Sm90BackwardMma {
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  static constexpr int kMTiles = kBlockM / 8, kDTiles = HeadDim / 8;
  const Sm90BackwardSmem<Tr>& smem;
  int consumer;  // its 64 keys are rows 64 consumer.. of every K and V slab

  // S^T = K Q^T: rows = this warpgroup's keys, columns = the step's queries.
  __device__ __forceinline__ void scores(float (&st_flat)[kMTiles * 4], const unsigned char* q_tile) const {
    key_rows_by_queries(st_flat, smem.k + consumer * 64 * 128, q_tile);
  }

  // dP^T = V dO^T, the same way.
  __device__ __forceinline__ void probability_gradients(float (&dpt_flat)[kMTiles * 4],
                                                        const unsigned char* do_tile) const {
    key_rows_by_queries(dpt_flat, smem.v + consumer * 64 * 128, do_tile);
  }

  // acc += A B over the step's queries, A (P^T or dS^T) from registers, B (dO
  // or Q, stored [query][d]) read transposed: dV += P^T dO and dK += dS^T Q
  // (dK scaled at the end).
  __device__ __forceinline__ void key_gradient_product(float (&acc_flat)[kDTiles * 4],
                                                       uint32_t (&a)[kBlockM / 16][4],
                                                       const unsigned char* b_tile) const {
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) fence_registers(a[kq]);
    fence_registers(acc_flat);
    wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq)
      wgmma_rs<T, HeadDim>(acc_flat, a[kq], mn_major_descriptor(b_tile, kBlockM, kq), true);
  }

  // dQ = dS K over all kBlockN keys for one quarter: 64 queries from query0
  // by 64 columns of d from column0 (traits' kDqQueryOffset, kDqColumnOffset).
  // The dS rows start query0 rows into each key slab, K's columns at slab column0 / 64.
  __device__ __forceinline__ void query_gradient(float (&dq_flat)[32], const unsigned char* ds_tile, int query0,
                                                 int column0) const {
    const unsigned char* ds_a_tile = ds_tile + query0 * 128;
    const unsigned char* k_b_tile = smem.k + column0 / 64 * kBlockN * 128;
    fence_registers(dq_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma_ss<T, 64, true>(dq_flat, k_major_descriptor(ds_a_tile, kBlockM, kk),
                            mn_major_descriptor(k_b_tile, kBlockN, kk), kk > 0);
  }

  // acc = A B^T, A this warpgroup's 64 rows of a K or V slab set, B a step tile.
  __device__ __forceinline__ void key_rows_by_queries(float (&acc_flat)[kMTiles * 4], const unsigned char* a_mine,
                                                      const unsigned char* b_tile) const {
    fence_registers(acc_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk)
      wgmma_ss<T, kBlockM>(acc_flat, k_major_descriptor(a_mine, kBlockN, kk), k_major_descriptor(b_tile, kBlockM, kk),
                           kk > 0);
  }
};

}  // namespace fusedattn::cuda
