#include "tensor_maps.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <mutex>

namespace fusedattn::cuda {
namespace {

// cuTensorMapEncodeTiled is a driver function: found through the runtime, so
// the library does not link libcuda itself.
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
  });
  return fn;
}

// The operand's (row, head, batch) strides in bytes. A dimension of extent 1
// is never stepped: it gets a stride the driver accepts whatever the tensor
// says (PyTorch reports any value there).
struct ByteStrides {
  cuuint64_t bytes[3];
};
ByteStrides byte_strides_of(int64_t batch, int64_t heads, int64_t rows, int64_t head_dim,
                            const TensorStrides& strides) {
  constexpr int64_t kElementBytes = 2;
  auto stride_bytes = [](int64_t extent, int64_t stride, int64_t fallback) {
    return static_cast<cuuint64_t>((extent > 1 ? stride : fallback) * kElementBytes);
  };
  return {{stride_bytes(rows, strides.row, head_dim), stride_bytes(heads, strides.head, rows * head_dim),
           stride_bytes(batch, strides.batch, heads * rows * head_dim)}};
}

}  // namespace

bool head_tensor_map_fits(const void* base, int64_t batch, int64_t heads, int64_t rows, int64_t head_dim,
                          const TensorStrides& strides) {
  // The driver takes strides that are multiples of 16 bytes below 2^40, and extents below 2^32.
  constexpr cuuint64_t kMaxStride = cuuint64_t(1) << 40;
  constexpr int64_t kMaxExtent = int64_t(1) << 32;
  if (encode_tiled() == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  if (batch < 1 || heads < 1 || rows < 1 || head_dim < 1) return false;
  for (cuuint64_t s : byte_strides_of(batch, heads, rows, head_dim, strides).bytes)
    if (s == 0 || s % 16 != 0 || s >= kMaxStride) return false;
  return batch < kMaxExtent && heads < kMaxExtent && rows < kMaxExtent;
}

bool encode_head_tensor_map(CUtensorMap* map, DType dtype, const void* base, int64_t batch, int64_t heads,
                            int64_t rows, int64_t head_dim, const TensorStrides& strides, int box_rows) {
  if ((dtype != DType::Float16 && dtype != DType::BFloat16) ||
      !head_tensor_map_fits(base, batch, heads, rows, head_dim, strides))
    return false;
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(batch)};
  const ByteStrides byte_strides = byte_strides_of(batch, heads, rows, head_dim, strides);
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode_tiled()(map, dtype == DType::Float16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                    4, const_cast<void*>(base), dims, byte_strides.bytes, box, element_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

bool encode_rows_tensor_map(CUtensorMap* map, const float* base, int64_t count, int box) {
  const auto encode = encode_tiled();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || count < 1) return false;
  const cuuint64_t dims[1] = {cuuint64_t(count)};
  const cuuint32_t boxes[1] = {cuuint32_t(box)};
  const cuuint32_t element_strides[1] = {1};
  // A rank-1 map has no strides, but the array must not be null.
  const cuuint64_t no_strides[1] = {0};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 1, const_cast<float*>(base), dims, no_strides, boxes,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool encode_float_matrix_tensor_map(CUtensorMap* map, const float* base, int64_t rows, int64_t cols, int box_rows) {
  const auto encode = encode_tiled();
  // Rows below 2^31: the kernels' box coordinates are signed 32-bit.
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || rows < 1 || cols % 32 != 0 ||
      rows >= (int64_t(1) << 31))
    return false;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * sizeof(float)};
  const cuuint32_t box[2] = {32, cuuint32_t(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(base), dims, strides, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace fusedattn::cuda
