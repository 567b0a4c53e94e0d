#include "tensor_maps.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <stdexcept>
#include <string>

#include "../common/launch_check.h"

namespace fusedattn::cuda {
namespace {

// A driver function, found through the runtime (so the library does not link
// libcuda itself); null where the driver lacks it.
template <typename Function>
Function driver_function(const char* name) {
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &entry, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<Function>(entry);
}

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const auto fn = driver_function<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  return fn;
}

// Driver calls need a current context, and a thread that has made no runtime
// call that binds one has none, even where the runtime reports a current
// device (autograd's backward thread, say: PyTorch's device guard skips
// cudaSetDevice when the number matches). cudaSetDevice binds the device's
// primary context to the calling thread.
void bind_device_context() {
  static const auto current = driver_function<PFN_cuCtxGetCurrent_v4000>("cuCtxGetCurrent");
  CUcontext context = nullptr;
  if (current != nullptr && current(&context) == CUDA_SUCCESS && context != nullptr) return;
  int device = 0;
  FUSEDATTN_CUDA_CHECK(cudaGetDevice(&device));
  FUSEDATTN_CUDA_CHECK(cudaSetDevice(device));
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

std::string encode_head_tensor_map(CUtensorMap* map, DType dtype, const void* base, int64_t batch, int64_t heads,
                                   int64_t rows, int64_t head_dim, const TensorStrides& strides, int box_rows) {
  // The driver takes strides that are multiples of 16 bytes below 2^40, and extents below 2^32.
  constexpr cuuint64_t kMaxStride = cuuint64_t(1) << 40;
  constexpr int64_t kMaxExtent = int64_t(1) << 32;
  if (dtype != DType::Float16 && dtype != DType::BFloat16) return "it is not float16 or bfloat16";
  if (encode_tiled() == nullptr) return "the driver has no cuTensorMapEncodeTiled";
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return "its data does not start on 16 bytes";
  if (batch < 1 || heads < 1 || rows < 1 || head_dim < 1) return "an extent is 0";
  if (batch >= kMaxExtent || heads >= kMaxExtent || rows >= kMaxExtent) return "an extent is 2^32 or more";
  const ByteStrides byte_strides = byte_strides_of(batch, heads, rows, head_dim, strides);
  const std::string stride_text = "byte strides (row, head, batch) " + std::to_string(byte_strides.bytes[0]) + ", " +
                                  std::to_string(byte_strides.bytes[1]) + ", " +
                                  std::to_string(byte_strides.bytes[2]);
  for (cuuint64_t s : byte_strides.bytes)
    if (s == 0 || s % 16 != 0 || s >= kMaxStride)
      return "its " + stride_text + " are not all multiples of 16 between 16 and 2^40";
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  bind_device_context();
  const CUresult r = encode_tiled()(map, dtype == DType::Float16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                    4, const_cast<void*>(base), dims, byte_strides.bytes, box, element_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r == CUDA_SUCCESS) return {};
  // Past the rules above a refusal is not the operand's layout: an error, not a quiet fallback to sm80.
  throw std::runtime_error(
      "fusedattn: cuTensorMapEncodeTiled returned " + std::to_string(static_cast<int>(r)) +
      " for extents (d, rows, heads, batch) " + std::to_string(head_dim) + ", " + std::to_string(rows) + ", " +
      std::to_string(heads) + ", " + std::to_string(batch) + ", " + stride_text + ", boxes of 64 x " +
      std::to_string(box_rows) + ", data at " + std::to_string(reinterpret_cast<uintptr_t>(base) % 1024) +
      " mod 1024");
}

namespace {

// One operand's map, its failure named.
std::string named(const char* operand, const std::string& why) {
  return why.empty() ? why : std::string(operand) + ": " + why;
}

std::string encode_key_value_maps(const ForwardParams& p, CUtensorMap* k_map, CUtensorMap* v_map, int block_n) {
  const AttentionShape& sh = p.shape;
  if (sh.seqlen_k == 0) return {};  // no key tile is ever loaded
  std::string why = named("k", encode_head_tensor_map(k_map, p.dtype, p.k, sh.batch, sh.heads_kv, sh.seqlen_k,
                                                      sh.head_dim, p.k_strides, block_n));
  if (why.empty())
    why = named("v", encode_head_tensor_map(v_map, p.dtype, p.v, sh.batch, sh.heads_kv, sh.seqlen_k, sh.head_dim,
                                            p.v_strides, block_n));
  return why;
}

}  // namespace

std::string encode_forward_operand_maps(const ForwardParams& p, CUtensorMap* q_map, CUtensorMap* k_map,
                                        CUtensorMap* v_map, int block_m, int block_n) {
  const AttentionShape& sh = p.shape;
  const std::string why = named("q", encode_head_tensor_map(q_map, p.dtype, p.q, sh.batch, sh.heads_q, sh.seqlen_q,
                                                            sh.head_dim, p.q_strides, block_m));
  return why.empty() ? encode_key_value_maps(p, k_map, v_map, block_n) : why;
}

std::string encode_backward_operand_maps(const BackwardParams& p, CUtensorMap* q_map, CUtensorMap* grad_out_map,
                                         CUtensorMap* k_map, CUtensorMap* v_map, int block_m, int block_n) {
  const AttentionShape& sh = p.fwd.shape;
  // With no query rows only dK and dV (zeros) are written: no q or grad_out tile is loaded.
  if (sh.batch * sh.heads_q * sh.seqlen_q == 0) return encode_key_value_maps(p.fwd, k_map, v_map, block_n);
  const std::string why = encode_forward_operand_maps(p.fwd, q_map, k_map, v_map, block_m, block_n);
  return why.empty() ? named("grad_out", encode_head_tensor_map(grad_out_map, p.fwd.dtype, p.grad_out, sh.batch,
                                                                sh.heads_q, sh.seqlen_q, sh.head_dim,
                                                                p.grad_out_strides, block_m))
                     : why;
}

bool encode_rows_tensor_map(CUtensorMap* map, const float* base, int64_t count, int box) {
  const auto encode = encode_tiled();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || count < 1) return false;
  const cuuint64_t dims[1] = {cuuint64_t(count)};
  const cuuint32_t boxes[1] = {cuuint32_t(box)};
  const cuuint32_t element_strides[1] = {1};
  // A rank-1 map has no strides, but the array must not be null.
  const cuuint64_t no_strides[1] = {0};
  bind_device_context();
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
  bind_device_context();
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(base), dims, strides, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace fusedattn::cuda
