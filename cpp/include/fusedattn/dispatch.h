// Turning the runtime dtype into a compile-time constant, so kernels are
// specialised on them. Each backend maps the DType constant to its own element
// type (c10::Half on the CPU, __half in CUDA code).
#pragma once

#include <stdexcept>
#include <type_traits>

#include "fusedattn/params.h"

namespace fusedattn {

template <DType D>
using DTypeConstant = std::integral_constant<DType, D>;

// f(DTypeConstant<dtype>{})
template <typename F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: return f(DTypeConstant<DType::Float32>{});
    case DType::Float16: return f(DTypeConstant<DType::Float16>{});
    case DType::BFloat16: return f(DTypeConstant<DType::BFloat16>{});
  }
  throw std::invalid_argument("fusedattn: unknown DType");
}

}  // namespace fusedattn
