// Weights kept as a GGUF file stores them: rows of blocks, each block its
// scales and quantised values (32 values a block; 256 in the k-quants'
// super-blocks, with a 6- or 8-bit scale per sub-block of 32 or 16). The
// engine multiplies by them without ever holding them in float32: a quarter
// to an eighth of the memory, and of the bytes a decoding step reads.
#pragma once

#include <cstdint>

namespace fusedattn::cpu {

enum class BlockFormat { q4_0, q4_1, q5_0, q8_0, q4_K, q5_K, q6_K };

// Values one block holds: 32, or 256 for q4_K, q5_K and q6_K.
int64_t block_values(BlockFormat format);

// Bytes of one block.
int64_t block_bytes(BlockFormat format);

// out[r, :] = the float32 values of row r: rows of `row_bytes` bytes each, k
// values. Exactly gguf-py's dequantisation: its float32 operations in its
// order, and every product exact in float32 (at most 23 significant bits), so
// that the AVX2 and AVX-512 clones' fused multiply-adds round once, as its
// multiply then add does (a format with inexact products would need
// -ffp-contract=off).
void dequantize_rows(const uint8_t* blocks, int64_t rows, int64_t row_bytes, BlockFormat format, int64_t k,
                     float* out);

// out[m x n] = x[m x k] W^T, W [n x k] as blocks (rows of `row_bytes` bytes).
// Every output is one GEMM sum over k, so with m a multiple of 8 (the engine
// pads to it: BLAS libraries may compute a lone row differently) a row's
// result does not depend on the rows beside it; on oneDNN's GEMM not even
// without the padding.
void block_linear(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, int64_t row_bytes,
                  BlockFormat format, float* out);

}  // namespace fusedattn::cpu
