#include "row_math.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "multiversion.h"

namespace fusedattn::cpu {
namespace {

// 2^x for x in [-127, 127]: x = n + f with n = round(x) and f in [-0.5, 0.5];
// 2^f by its degree-6 Taylor polynomial (truncation error < 1.3e-7), 2^n by
// writing n into the exponent bits. n = -127 gives exponent bits 0, i.e. 0.0,
// which is how -inf (clamped to -127) turns into an exact zero.
inline float exp2_clamped(float x) {
  x = std::min(std::max(x, -127.0f), 127.0f);
  // Round to nearest with the 1.5 * 2^23 trick: vectorises without a
  // rounding-mode instruction.
  constexpr float kRound = 12582912.0f;
  const float n = (x + kRound) - kRound;
  const float f = x - n;
  constexpr float c1 = 0.6931471805599453f;   // ln2
  constexpr float c2 = 0.2402265069591007f;   // ln2^2 / 2
  constexpr float c3 = 0.0555041086648216f;   // ln2^3 / 6
  constexpr float c4 = 0.0096181291076285f;   // ln2^4 / 24
  constexpr float c5 = 0.0013333558146428f;   // ln2^5 / 120
  constexpr float c6 = 0.0001540353039338f;   // ln2^6 / 720
  const float p = 1.0f + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * (c5 + f * c6)))));
  const int32_t exponent_bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(exponent_bits);
}

// tanh(y) for |y| <= 1 as y + y^3 P(y^2), P from lab/fit_tanh.py: 1.2e-7
// absolute in float32, and relative near 0, where the exponential form below
// cancels.
inline float tanh_near_zero(float y) {
  const float z = y * y;
  float p = 0.0010445386f;
  p = p * z - 0.006213699f;
  p = p * z + 0.020302922f;
  p = p * z - 0.05346617f;
  p = p * z + 0.13325578f;
  p = p * z - 0.33332914f;
  return y + y * z * p;
}

// tanh(y) about as accurately as std::tanh (1.2e-7 absolute), in operations
// a loop vectorises: both forms are computed and one kept. Past |y| = 1,
// sign(y) (1 - 2 / (e^2|y| + 1)) (on |y|: for y < -1 the sum would cancel),
// whose clamped exponential gives exactly +-1 far out; a NaN takes the
// polynomial, so it stays NaN.
inline float tanh_vectorisable(float y) {
  constexpr float kTwoLog2e = 2.8853900817779268f;  // 2 log2(e)
  const float a = std::fabs(y);
  const float far = std::copysign(1.0f - 2.0f / (exp2_clamped(kTwoLog2e * a) + 1.0f), y);
  return a > 1.0f ? far : tanh_near_zero(y);
}

// x[j] = cap tanh_of(x[j] / cap), and with slope, slope[j] = 1 - tanh^2.
template <typename Tanh>
inline void softcap_with(float* x, int64_t n, float cap, float* slope, Tanh tanh_of) {
  const float inv_cap = 1.0f / cap;
  if (slope == nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) x[j] = cap * tanh_of(x[j] * inv_cap);
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float t = tanh_of(x[j] * inv_cap);
    x[j] = cap * t;
    slope[j] = 1.0f - t * t;
  }
}

}  // namespace

FUSEDATTN_MULTIVERSION
float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

FUSEDATTN_MULTIVERSION
float exp2_shifted(float* x, int64_t n, float shift) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float p = exp2_clamped(x[j] - shift);
    x[j] = p;
    sum += p;
  }
  return sum;
}

FUSEDATTN_MULTIVERSION
void scale_row(float* x, int64_t n, float a) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= a;
}

FUSEDATTN_MULTIVERSION
float dot(const float* x, const float* y, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += x[j] * y[j];
  return sum;
}

FUSEDATTN_MULTIVERSION
void softmax_grad_row(float* dp, const float* p, int64_t n, float delta) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dp[j] = p[j] * (dp[j] - delta);
}

FUSEDATTN_MULTIVERSION
void softcap_row(float* x, int64_t n, float cap, float* slope) {
  // A row whose scores all lie within the cap (the usual case) needs the
  // polynomial only; a NaN is not counted, and the polynomial keeps it NaN.
  float widest = 0.0f;
#pragma omp simd reduction(max : widest)
  for (int64_t j = 0; j < n; ++j) widest = std::fabs(x[j]) > widest ? std::fabs(x[j]) : widest;
  if (widest <= cap)
    softcap_with(x, n, cap, slope, tanh_near_zero);
  else
    softcap_with(x, n, cap, slope, tanh_vectorisable);
}

FUSEDATTN_MULTIVERSION
void multiply_row(float* x, const float* y, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= y[j];
}

float add_valueless_logit(float s, float& m, float& l) {
  const float m_new = std::max(m, s);
  // Nothing seen and s = -inf: m stays -inf and nothing changes.
  if (m_new == -std::numeric_limits<float>::infinity()) return 1.0f;
  const float rescale = std::exp2(m - m_new);
  l = l * rescale + std::exp2(s - m_new);
  m = m_new;
  return rescale;
}

}  // namespace fusedattn::cpu
