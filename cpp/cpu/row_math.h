// Vectorised loops over one row of a float32 tile (S, P, dP or an accumulator
// row). They are the element-wise half of the CPU kernels; the GEMMs are in
// blas.h. Scores are kept in base 2 (scale * log2(e) folded into the QK^T GEMM)
// so that every exponential is an exp2.
#pragma once

#include <cstdint>

namespace fusedattn::cpu {

// max_j x[j]; -inf for an empty or fully masked row.
float row_max(const float* x, int64_t n);

// x[j] = 2^(x[j] - shift) in place; returns sum_j x[j]. Elements equal to
// -inf become 0. Accurate to about 2 ulp.
float exp2_shifted(float* x, int64_t n, float shift);

// x[j] *= a
void scale_row(float* x, int64_t n, float a);

// sum_j x[j] * y[j]
float dot(const float* x, const float* y, int64_t n);

// dp[j] = p[j] * (dp[j] - delta): the softmax backward, dS = P * (dP - D).
void softmax_grad_row(float* dp, const float* p, int64_t n, float delta);

// Soft-capping: x[j] = cap * tanh(x[j] / cap) in place; with slope, also
// slope[j] = 1 - tanh^2, the derivative the backward multiplies dS by.
void softcap_row(float* x, int64_t n, float cap, float* slope = nullptr);

// x[j] *= y[j]
void multiply_row(float* x, const float* y, int64_t n);

// One more logit s that joins a row's online softmax (max m, sum l, both base
// 2) and carries no value, such as an attention sink: updates m and l and
// returns the factor by which the row's accumulator must be rescaled.
float add_valueless_logit(float s, float& m, float& l);

}  // namespace fusedattn::cpu
