// The CPU operators over GGUF blocks: argument checks, then cpp/cpu/gguf_blocks.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <string_view>
#include <utility>

#include "../cpu/gguf_blocks.h"

namespace {

using fusedattn::cpu::BlockFormat;

constexpr std::pair<std::string_view, BlockFormat> kFormats[] = {
    {"q4_0", BlockFormat::q4_0}, {"q4_1", BlockFormat::q4_1}, {"q5_0", BlockFormat::q5_0},
    {"q8_0", BlockFormat::q8_0}, {"q4_K", BlockFormat::q4_K}, {"q5_K", BlockFormat::q5_K},
    {"q6_K", BlockFormat::q6_K}};

BlockFormat parse_format(const char* op, std::string_view format) {
  std::string names;
  for (const auto& [name, value] : kFormats) {
    if (format == name) return value;
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  TORCH_CHECK(false, op, ": format must be one of ", names, ", got '", format, "'");
}

// k, the values per row, after checking blocks.
int64_t check_blocks(const char* op, const at::Tensor& blocks, BlockFormat format) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2, op,
              ": blocks must be a 2-D uint8 CPU tensor [rows, row bytes], got ", blocks.scalar_type(), " ",
              blocks.sizes(), " on ", blocks.device());
  const int64_t bytes = fusedattn::cpu::block_bytes(format);
  TORCH_CHECK(blocks.size(1) % bytes == 0 && blocks.size(1) > 0, op, ": a row of blocks must be a positive multiple of ",
              bytes, " bytes, got ", blocks.size(1));
  return blocks.size(1) / bytes * fusedattn::cpu::block_values(format);
}

at::Tensor block_dequantize_cpu(const at::Tensor& blocks, c10::string_view format_name) {
  const BlockFormat format = parse_format("block_dequantize", format_name);
  const int64_t k = check_blocks("block_dequantize", blocks, format);
  const at::Tensor b = blocks.contiguous();
  at::Tensor out = at::empty({b.size(0), k}, b.options().dtype(at::kFloat));
  fusedattn::cpu::dequantize_rows(b.data_ptr<uint8_t>(), b.size(0), b.size(1), format, k, out.data_ptr<float>());
  return out;
}

at::Tensor block_linear_cpu(const at::Tensor& x, const at::Tensor& blocks, c10::string_view format_name) {
  const BlockFormat format = parse_format("block_linear", format_name);
  const int64_t k = check_blocks("block_linear", blocks, format);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == k,
              "block_linear: x must be a float32 CPU tensor [..., ", k, "] (the blocks' row length), got ",
              x.scalar_type(), " ", x.sizes(), " on ", x.device());
  const at::Tensor rows = x.reshape({-1, k}).contiguous();
  const at::Tensor b = blocks.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = b.size(0);
  at::Tensor out = at::empty(shape, x.options());
  if (rows.size(0) > 0)
    fusedattn::cpu::block_linear(rows.data_ptr<float>(), rows.size(0), k, b.data_ptr<uint8_t>(), b.size(0),
                                 b.size(1), format, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedattn, CPU, m) {
  m.impl("block_linear", &block_linear_cpu);
  m.impl("block_dequantize", &block_dequantize_cpu);
}
