// The sm90 backward's mainloop: what the producer loads and the GEMMs the
// consumers issue on it, per step of the key block's walk.
//   load (producer, one thread): K and V once, then per step Q, dO, lse and
//     delta into the ring, each step after its stage is released.
//   mma (each consumer warpgroup, 64 of the block's 128 keys):
//     S^T = K Q^T, dP^T = V dO^T   wgmma m64n{kBlockM}k16, operands in shared memory
//     dV += P^T dO, dK += dS^T Q   wgmma m64n{d}k16, P^T and dS^T from registers,
//                                  Q and dO read transposed
//     dQ  = dS K                   wgmma m64n64k16 over all 128 keys, dS from
//                                  shared memory (written by stage_ds)
//   Each is issued and committed; the kernel (backward_kernel.cuh) waits.
#pragma once

#include <cstdint>

#include "../common/backward_passes.cuh"
#include "../hopper/bulk_copy.cuh"
#include "../hopper/tma.cuh"
#include "../hopper/wgmma.cuh"
#include "backward_pipeline.cuh"
#include "backward_traits.h"

namespace fusedattn::cuda {

template <typename Tr, typename Walk>
struct Sm90BackwardLoad {
  const Sm90BackwardArgs& args;
  const Sm90BackwardSmem<Tr>& smem;
  const Walk& walk;

  __device__ __forceinline__ void prefetch_maps() const {
    for (const CUtensorMap* map : {&args.q_map, &args.k_map, &args.v_map, &args.do_map, &args.lse_map, &args.delta_map})
      prefetch_tensor_map(map);
  }

  // The block's K and V, once.
  __device__ __forceinline__ void key_block() const {
    const int key0 = static_cast<int>(walk.key0), batch = static_cast<int>(walk.batch);
    mbarrier_arrive_expect_bytes(smem.kv_full, 2 * Tr::kKVTileBytes);
    for (int slab = 0; slab < Tr::kSlabs; ++slab) {
      tma_load_box(smem.k + slab * Tr::kBlockN * 128, &args.k_map, 64 * slab, key0, static_cast<int>(walk.head_kv),
                   batch, smem.kv_full);
      tma_load_box(smem.v + slab * Tr::kBlockN * 128, &args.v_map, 64 * slab, key0, static_cast<int>(walk.head_kv),
                   batch, smem.kv_full);
    }
  }

  // Step s's Q, dO, lse and delta into its stage, once that stage is free.
  // lse and delta are flat: from the 16-byte boundary at or below the step's
  // first row (traits' kRowsBox), then (past the queries) the next head's
  // rows or zeros, which the consumers mask.
  __device__ __forceinline__ void step(int s, int first_row) const {
    const int stage = smem.stage(s), batch = static_cast<int>(walk.batch);
    mbarrier_wait(&smem.step_empty[stage], smem.phase(s) ^ 1);  // the first round finds it free
    mbarrier_arrive_expect_bytes(&smem.step_full[stage], 2 * Tr::kQTileBytes + 2 * Tr::kRowsBox * 4);
    const int head = static_cast<int>(walk.head(s)), m0 = static_cast<int>(walk.m0(s));
    for (int slab = 0; slab < Tr::kSlabs; ++slab) {
      tma_load_box(smem.q + stage * Tr::kQTileBytes + slab * Tr::kBlockM * 128, &args.q_map, 64 * slab, m0, head, batch,
                   &smem.step_full[stage]);
      tma_load_box(smem.dO + stage * Tr::kQTileBytes + slab * Tr::kBlockM * 128, &args.do_map, 64 * slab, m0, head,
                   batch, &smem.step_full[stage]);
    }
    const int row = first_row & ~3;
    tma_load_row(smem.lse + stage * Tr::kRowsSlot, &args.lse_map, row, &smem.step_full[stage]);
    tma_load_row(smem.delta + stage * Tr::kRowsSlot, &args.delta_map, row, &smem.step_full[stage]);
  }
};

template <int HeadDim, typename T, typename Tr>
struct Sm90BackwardMma {
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  static constexpr int kMTiles = kBlockM / 8, kDTiles = HeadDim / 8;
  const Sm90BackwardSmem<Tr>& smem;
  int consumer;

  // S^T = K Q^T and dP^T = V dO^T from ring stage `stage`: rows = this
  // warpgroup's keys, columns = the step's queries; issued.
  __device__ __forceinline__ void scores(float (&st_flat)[kMTiles * 4], float (&dpt_flat)[kMTiles * 4],
                                         int stage) const {
    const unsigned char* k_mine = smem.k + consumer * 64 * 128;  // rows 64c.. of every slab
    const unsigned char* v_mine = smem.v + consumer * 64 * 128;
    const unsigned char* q_tile = smem.q + stage * Tr::kQTileBytes;
    const unsigned char* do_tile = smem.dO + stage * Tr::kQTileBytes;
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
  }

  // dS = (dS^T)^T, [query][key], into dS buffer `buffer`: this warpgroup's 64
  // keys are slab `consumer` of the tile. The A fragment of k-step kq holds
  // the four 8x8 matrices (queries (2 kq + i / 2) * 8.., this warp's keys
  // (i % 2) * 8..) that a transposing stmatrix writes as 16-byte rows of dS.
  __device__ __forceinline__ void stage_ds(const uint32_t (&ds_a)[kBlockM / 16][4], int buffer, int warp,
                                           int lane) const {
    unsigned char* ds_tile = smem.ds + buffer * Tr::kDsBytes;
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) {
      const int i = lane / 8, query = (2 * kq + i / 2) * 8 + lane % 8, key_chunk = 2 * warp + i % 2;
      stmatrix_x4_trans(ds_a[kq], ds_tile + consumer * kBlockM * 128 + swizzled_chunk_offset(query, key_chunk, kBlockM));
    }
    fence_proxy_async_shared();  // dS: written through the generic proxy, read by wgmma
  }

  // dV += P^T dO, dK += dS^T Q (scaled at the end) from ring stage `stage`;
  // Q and dO are B operands stored [query][d], read transposed; issued.
  __device__ __forceinline__ void key_gradients(float (&dv_flat)[kDTiles * 4], float (&dk_flat)[kDTiles * 4],
                                                uint32_t (&p_a)[kBlockM / 16][4], uint32_t (&ds_a)[kBlockM / 16][4],
                                                int stage) const {
    const unsigned char* q_tile = smem.q + stage * Tr::kQTileBytes;
    const unsigned char* do_tile = smem.dO + stage * Tr::kQTileBytes;
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) {
      fence_registers(p_a[kq]);
      fence_registers(ds_a[kq]);
    }
    fence_registers(dv_flat);
    fence_registers(dk_flat);
    wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq)
      wgmma_rs<T, HeadDim>(dv_flat, p_a[kq], mn_major_descriptor(do_tile, kBlockM, kq), true);
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq)
      wgmma_rs<T, HeadDim>(dk_flat, ds_a[kq], mn_major_descriptor(q_tile, kBlockM, kq), true);
    wgmma_commit();
  }

  // dQ = dS K over all 128 keys for this warpgroup's quarter of the step's
  // [kBlockM][d]: 64 queries from query0() by 64 columns of d from column0()
  // (traits). The dS rows start query0 rows into each key slab, K's columns
  // at slab column0 / 64; issued.
  static __device__ __forceinline__ int query0(int consumer) { return Tr::kDqQueryOffset * consumer; }
  static __device__ __forceinline__ int column0(int consumer) { return Tr::kDqColumnOffset * consumer; }
  __device__ __forceinline__ void dq(float (&dq_flat)[32], int buffer) const {
    const unsigned char* ds_a_tile = smem.ds + buffer * Tr::kDsBytes + query0(consumer) * 128;
    const unsigned char* k_b_tile = smem.k + column0(consumer) / 64 * kBlockN * 128;
    fence_registers(dq_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma_ss<T, 64, true>(dq_flat, k_major_descriptor(ds_a_tile, kBlockM, kk), mn_major_descriptor(k_b_tile, kBlockN, kk),
                            kk > 0);
    wgmma_commit();
  }
};

}  // namespace fusedattn::cuda
