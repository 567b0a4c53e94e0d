// Host code: a runtime (dtype, head dim) to the compile-time instantiation of
// a kernel family, shared by the families' dispatch files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../instantiations.h"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

namespace detail {

template <typename Element, int HeadDim, int... More, typename F>
decltype(auto) dispatch_head_dim(const char* what, int64_t head_dim, F& f) {
  if (head_dim == HeadDim) return f(std::integral_constant<int, HeadDim>{}, Element{});
  if constexpr (sizeof...(More) > 0) {
    return dispatch_head_dim<Element, More...>(what, head_dim, f);
  } else {
    throw std::invalid_argument(std::string("fusedattn: no ") + what + " for head dim " +
                                std::to_string(head_dim));
  }
}

}  // namespace detail

// f(std::integral_constant<int, head dim>{}, Element{}) with Element __half or
// __nv_bfloat16 and the head dim one of the list's (instantiations.h); `what`
// names the kernel in the error for anything else.
template <int... HeadDims, typename F>
decltype(auto) dispatch_instantiation(HeadDimList<HeadDims...>, const char* what, DType dtype, int64_t head_dim,
                                      F&& f) {
  switch (dtype) {
    case DType::Float16: return detail::dispatch_head_dim<__half, HeadDims...>(what, head_dim, f);
    case DType::BFloat16: return detail::dispatch_head_dim<__nv_bfloat16, HeadDims...>(what, head_dim, f);
    default: throw std::invalid_argument(std::string("fusedattn: the ") + what + " takes float16 or bfloat16");
  }
}

// Whether the list holds head_dim.
template <int... HeadDims>
constexpr bool instantiated(HeadDimList<HeadDims...>, int64_t head_dim) {
  return ((head_dim == HeadDims) || ...);
}

}  // namespace fusedattn::cuda
