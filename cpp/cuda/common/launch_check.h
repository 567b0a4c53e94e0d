// Turning CUDA errors into exceptions in host launch code (no ATen here; the
// operator layer sees a std::runtime_error, which PyTorch reports as RuntimeError).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define FUSEDATTN_CUDA_CHECK(expr)                                                        \
  do {                                                                                    \
    const cudaError_t fusedattn_err_ = (expr);                                            \
    if (fusedattn_err_ != cudaSuccess)                                                    \
      throw std::runtime_error(std::string("fusedattn: CUDA error in ") + #expr + ": " + \
                               cudaGetErrorString(fusedattn_err_));                       \
  } while (0)
