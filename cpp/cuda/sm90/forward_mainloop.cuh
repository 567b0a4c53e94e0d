// The sm90 forward's mainloop: what the producer loads and the GEMMs the
// consumers issue on it.
//   load (producer, one thread): Q once per item, then K and V tiles of
//     kBlockN keys into the rings, K one tile ahead of V (the order the
//     consumers use them), each after its stage is released; under attn_mask
//     only the tiles of the item's mask list. A packed sequence's last tiles
//     reach into the next sequence's rows, which the softmax hides (keys) and
//     the epilogue does not write (queries).
//   mma (each consumer warpgroup, 64 queries):
//     S_j = Q K_j^T   wgmma m64n{kBlockN}k16, both operands from shared memory
//     O += P V_j      wgmma m64n{d}k16, P from registers, V read transposed
//   Both are issued, not waited for: the kernel (forward_kernel.cuh) decides
//   what overlaps what.
#pragma once

#include <cstdint>

#include "../hopper/bulk_copy.cuh"
#include "../hopper/tma.cuh"
#include "../hopper/wgmma.cuh"
#include "forward_pipeline.cuh"
#include "forward_scheduler.cuh"
#include "forward_traits.h"

namespace fusedattn::cuda {

template <typename Tr, bool HasMask>
struct Sm90ForwardLoad {
  const Sm90ForwardArgs& args;
  const Sm90ForwardSmem<Tr>& smem;

  __device__ __forceinline__ void prefetch_maps() const {
    prefetch_tensor_map(&args.q_map);
    prefetch_tensor_map(&args.k_map);
    prefetch_tensor_map(&args.v_map);
  }

  // The item's tile j (key tile `key_tile`) of K or V into its ring stage, once that stage is free.
  __device__ __forceinline__ void tile(const CUtensorMap* map, unsigned char* ring, uint64_t* full, uint64_t* empty,
                                       const RingPhases<Tr::kStages>& ring_phases, const Sm90ForwardItem& it,
                                       int j, int key_tile) const {
    const int s = RingPhases<Tr::kStages>::stage(j);
    mbarrier_wait(&empty[s], ring_phases.phase(j) ^ 1);  // the first round finds it free
    mbarrier_arrive_expect_bytes(&full[s], Tr::kTileBytes);
    for (int slab = 0; slab < Tr::kSlabs; ++slab)
      tma_load_box(ring + s * Tr::kTileBytes + slab * Tr::kBlockN * 128, map, 64 * slab,
                   it.k0 + key_tile * Tr::kBlockN, it.head_kv, it.batch, &full[s]);
  }

  // The item's Q, then every K and V tile it sees (n_tiles > 0).
  __device__ __forceinline__ void item(const Sm90ForwardItem& it, const RingPhases<Tr::kStages>& ring_phases) const {
    mbarrier_arrive_expect_bytes(smem.q_full, Tr::kQBytes);
    for (int slab = 0; slab < Tr::kSlabs; ++slab)
      tma_load_box(smem.q + slab * Tr::kBlockM * 128, &args.q_map, 64 * slab, it.q0 + it.row0, it.head, it.batch,
                   smem.q_full);
    int previous = 0;  // key tile j - 1
    for (int j = 0; j < it.n_tiles; ++j) {
      const int key_tile = MaskTiles::tile_of(tile_entry<HasMask>(args.p, it, j));
      tile(&args.k_map, smem.k, smem.k_full, smem.k_empty, ring_phases, it, j, key_tile);
      if (j > 0) tile(&args.v_map, smem.v, smem.v_full, smem.v_empty, ring_phases, it, j - 1, previous);
      previous = key_tile;
    }
    tile(&args.v_map, smem.v, smem.v_full, smem.v_empty, ring_phases, it, it.n_tiles - 1, previous);
  }
};

template <int HeadDim, typename T, typename Tr>
struct Sm90ForwardMma {
  static constexpr int kBlockN = Tr::kBlockN;
  const Sm90ForwardSmem<Tr>& smem;
  int consumer;

  // S_j = Q K_j^T from the K tile at ring stage `stage`, issued.
  __device__ __forceinline__ void scores(float (&s_flat)[kBlockN / 8 * 4], int stage) const {
    const unsigned char* k_tile = smem.k + stage * Tr::kTileBytes;
    fence_registers(s_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk)
      wgmma_ss<T, kBlockN>(s_flat, k_major_descriptor(smem.q + consumer * 64 * 128, Tr::kBlockM, kk),
                           k_major_descriptor(k_tile, kBlockN, kk), kk > 0);
    wgmma_commit();
  }

  // O += P V_j from the V tile at ring stage `stage`, issued.
  __device__ __forceinline__ void pv(float (&acc_flat)[HeadDim / 8 * 4], uint32_t (&p_a)[kBlockN / 16][4],
                                     int stage) const {
    const unsigned char* v_tile = smem.v + stage * Tr::kTileBytes;
    fence_registers(acc_flat);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) fence_registers(p_a[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma_rs<T, HeadDim>(acc_flat, p_a[kk], mn_major_descriptor(v_tile, kBlockN, kk), true);
    wgmma_commit();
  }
};

}  // namespace fusedattn::cuda
