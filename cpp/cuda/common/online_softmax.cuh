// The online softmax of FlashAttention on mma.sync fragments, shared by the
// kernel families. A warp holds a 16-row score tile S (m16n8 accumulators,
// NTiles of them side by side) and the output rows acc (DTiles m16n8
// accumulators); a thread owns rows g and g + 8 (see device_math.cuh).
#pragma once

#include <cmath>

#include "device_math.cuh"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// One step over a score tile, for the thread's two rows h = 0, 1, with the
// scores in base-2 units c S (c = scale log2 e; masked entries -inf):
//   m' = max(m, rowmax c S);  S = 2^(c S - m');  l = 2^(m - m') l + rowsum S
// and rescale[h] = 2^(m - m'), by which the caller multiplies the output rows
// (rescale_rows) once no MMA is writing them. By default the tile holds c S
// already. With RawScores it holds S and `scale_log2` is c, which must be
// a normal float > 0 (fast math flushes a denormal to 0, and 0 times a
// hidden -inf is NaN): the max of S times c is the max of c S, and c S - m' is
// one FFMA instead of a multiply and a subtract (the sm90 forward: about 16%
// fewer softmax instructions).
// l stays a per-thread partial sum over this thread's columns: quad_sum it at the end.
template <bool RawScores = false, int NTiles>
__device__ __forceinline__ void online_softmax_scores(float (&s)[NTiles][4], float (&m_i)[2],
                                                      float (&l_i)[2], float (&rescale)[2],
                                                      float scale_log2 = 1.0f) {
  // exp2 of c S - m', in one FFMA for raw scores.
  auto exponent = [&](float score, float shift) {
    return RawScores ? fmaf(score, scale_log2, -shift) : score - shift;
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float row_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NTiles; ++nt)
      row_max = fmaxf(row_max, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    const float m_new = fmaxf(m_i[h], RawScores ? quad_max(row_max) * scale_log2 : quad_max(row_max));
    // Nothing visible yet: shift by 0 so -inf scores give 0, not NaN.
    const float shift = m_new == -INFINITY ? 0.0f : m_new;
    rescale[h] = exp2f(m_i[h] - shift);
    float row_sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NTiles; ++nt) {
      s[nt][2 * h] = exp2f(exponent(s[nt][2 * h], shift));
      s[nt][2 * h + 1] = exp2f(exponent(s[nt][2 * h + 1], shift));
      row_sum += s[nt][2 * h] + s[nt][2 * h + 1];
    }
    l_i[h] = l_i[h] * rescale[h] + row_sum;
    m_i[h] = m_new;
  }
}

// acc (the thread's two output rows) *= rescale.
template <int DTiles>
__device__ __forceinline__ void rescale_rows(float (&acc)[DTiles][4], const float (&rescale)[2]) {
#pragma unroll
  for (int dt = 0; dt < DTiles; ++dt) {
    acc[dt][0] *= rescale[0];
    acc[dt][1] *= rescale[0];
    acc[dt][2] *= rescale[1];
    acc[dt][3] *= rescale[1];
  }
}

// Both at once, for kernels whose output rows are not in flight.
template <int NTiles, int DTiles>
__device__ __forceinline__ void online_softmax_step(float (&s)[NTiles][4], float (&m_i)[2],
                                                    float (&l_i)[2], float (&acc)[DTiles][4]) {
  float rescale[2];
  online_softmax_scores(s, m_i, l_i, rescale);
  rescale_rows(acc, rescale);
}

// The probabilities of key columns [16 kk, 16 kk + 16) as the A operand of
// P V: the C layout of two adjacent n-tiles is the A layout of one k-step.
template <typename T, int NTiles>
__device__ __forceinline__ void probabilities_as_a(uint32_t (&a)[4], const float (&p)[NTiles][4],
                                                   int kk) {
  a[0] = pack2<T>(p[2 * kk][0], p[2 * kk][1]);
  a[1] = pack2<T>(p[2 * kk][2], p[2 * kk][3]);
  a[2] = pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
  a[3] = pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
}

// Soft-capping (ForwardParams::softcap, Gemma 2's): a scaled score x becomes
// cap tanh(x / cap). The kernels multiply raw scores by `pre` = scale / cap,
// take tanh, and give the exponent cap log2 e where it would take scale log2
// e (scale_log2); with no cap scores stay raw.
struct SoftCap {
  float pre = 0.0f;
  float scale_log2 = 0.0f;  // the factor that takes a (capped) score to base-2 exponent units
  bool enabled = false;
  __host__ __device__ static SoftCap of(const ForwardParams& p) {
    const bool on = p.softcap > 0.0f;
    return {on ? p.scale / p.softcap : 0.0f, (on ? p.softcap : p.scale) * kLog2e, on};
  }
  __host__ __device__ bool on() const { return enabled; }
  // tanh(x pre) as 1 - 2 / (e^(2 x pre) + 1): float32-accurate (about 1e-7
  // absolute) for two MUFU ops, one more than tanh.approx, whose 2^-11
  // relative error would move a score capped at 50 by 0.02. Large |x| give
  // exactly +-1. (A polynomial on the FMA pipe for |x pre| <= 1, which left
  // the MUFU unit one op per score, ran slower: docs/cuda-notes.md.)
  __device__ __forceinline__ float operator()(float x) const {
    return fmaf(-2.0f, __fdividef(1.0f, exp2f(2.0f * kLog2e * pre * x) + 1.0f), 1.0f);
  }
  // The slope of tanh where it took the value `th`: a capped score's
  // derivative is scale slope(th), and the backward's dS takes the factor.
  __device__ __forceinline__ static float slope(float th) { return 1.0f - th * th; }
  template <int NTiles>
  __device__ __forceinline__ void apply(float (&s)[NTiles][4]) const {
#pragma unroll
    for (int nt = 0; nt < NTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = (*this)(s[nt][e]);
  }
};

// Natural-log LSE of a row from its base-2 running max and (full) sum; -inf
// for a row that saw no key.
__device__ __forceinline__ float lse_from_log2(float m, float l) {
  return l > 0.0f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// One more logit s (base 2) that joins a row's normaliser last and carries
// no value, such as an attention sink: takes it into the running max m and
// the full sum l, and returns the factor by which the row's output must be
// scaled (before 1 / l). Nothing seen and s = -inf: nothing changes.
__device__ __forceinline__ float add_valueless_logit(float s, float& m, float& l) {
  const float m_new = fmaxf(m, s);
  if (m_new == -INFINITY) return 1.0f;
  const float rescale = exp2f(m - m_new);
  l = l * rescale + exp2f(s - m_new);
  m = m_new;
  return rescale;
}

// The sink of query head `head` in base 2, -inf without sinks.
__device__ __forceinline__ float sink_in_log2(const float* sinks, int64_t head) {
  return sinks ? sinks[head] * kLog2e : -INFINITY;
}

// A row's LSE in base 2, for P = 2^(S scale log2 e - lse log2 e) in the
// backward; +inf for a row that saw no key (lse = -inf), so that P = 0.
__device__ __forceinline__ float lse_in_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

}  // namespace fusedattn::cuda
