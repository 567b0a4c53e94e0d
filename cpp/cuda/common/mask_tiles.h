// attn_mask sorted into a kernel's tiles (params.h: MaskTiles): one pass over
// the mask, before the attention kernel, that finds per query tile the key
// tiles whose entries the mask (and the band) leave visible and whether a
// tile may skip reading the mask (every visible entry adds 0).
#pragma once

#include <cuda_runtime.h>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// The tile lists of p's mask for block_m x block_n tiles, without storage:
// rows (a row per query tile of each batch and head the mask varies over),
// capacity (key tiles per row) and the strides. The caller gives lists
// rows x capacity and counts rows int32s, and classes mask_tiles_class_bytes.
MaskTiles mask_tiles_layout(const ForwardParams& p, int block_m, int block_n);
int64_t mask_tiles_class_bytes(const MaskTiles& layout);

// Fills p.mask.tiles (laid out by mask_tiles_layout for these tiles) on `stream`.
void sort_mask_into_tiles(const ForwardParams& p, int block_m, int block_n, cudaStream_t stream);

// The same transposed, for a backward whose blocks own block_keys keys and
// walk the blocks of block_queries queries that see them: a row per key tile,
// lists of query tiles.
MaskTiles mask_tiles_layout_by_keys(const ForwardParams& p, int block_keys, int block_queries);
void sort_mask_into_key_tiles(const ForwardParams& p, int block_keys, int block_queries, cudaStream_t stream);

}  // namespace fusedattn::cuda
