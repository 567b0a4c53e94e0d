// Standalone timing of the decode kernel (cpp/cuda/decode) without PyTorch,
// for trying kernel variants quickly: edit DecodeTraits, rebuild this one
// file (seconds), run. B=8, Hq=32, d=128, float16, one query per sequence,
// caches of 4K, 32K and 128K positions (all full, then per-sequence lengths in
// [1, N]), over 1, 2, 4, 8 and 16 splits; prints TB/s of the valid K and V.
//
//   nvcc -std=c++17 -O3 --use_fast_math -Icpp/include -gencode=arch=compute_90a,code=sm_90a \
//     lab/cuda/decode_splits.cu -o /tmp/decode_splits
//   /tmp/decode_splits [kv heads, default 32]
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../../cpp/cuda/decode/decode_kernel.cuh"

using namespace fusedattn;

namespace {

__global__ void fill(__half* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2half(float(i * 2654435761u % 1000) / 1000.0f - 0.5f);
}

__global__ void set_lengths(int* lengths, int n, int batch, bool varlen) {
  const int i = threadIdx.x;
  if (i < batch) lengths[i] = varlen ? 1 + int(i * 2654435761u % unsigned(n)) : n;
}

#define CHECK(x)                                                               \
  do {                                                                         \
    cudaError_t e = (x);                                                       \
    if (e != cudaSuccess) {                                                    \
      std::printf("%s: %s\n", #x, cudaGetErrorString(e));                      \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  const int B = 8, H = 32, d = 128, max_splits = 16;
  const int Hkv = argc > 1 ? std::atoi(argv[1]) : 32;
  const long max_n = 131072;
  const size_t cache = size_t(B) * Hkv * max_n * d;
  __half *k, *v, *q, *out;
  float *lse, *partial_out, *partial_lse;
  int *lengths, *split_arrivals;
  CHECK(cudaMalloc(&k, cache * 2));
  CHECK(cudaMalloc(&v, cache * 2));
  CHECK(cudaMalloc(&q, B * H * d * 2));
  CHECK(cudaMalloc(&out, B * H * d * 2));
  CHECK(cudaMalloc(&lse, B * H * 4));
  CHECK(cudaMalloc(&partial_out, size_t(max_splits) * B * H * d * 4));
  CHECK(cudaMalloc(&partial_lse, size_t(max_splits) * B * H * 4));
  CHECK(cudaMalloc(&lengths, B * 4));
  CHECK(cudaMalloc(&split_arrivals, B * H * 4));  // at least B x Hkv x row tiles
  CHECK(cudaMemset(split_arrivals, 0, B * H * 4));  // the kernel leaves it zeroed
  fill<<<4096, 256>>>(k, cache);
  fill<<<4096, 256>>>(v, cache);
  fill<<<64, 256>>>(q, B * H * d);

  std::printf("B=%d Hq=%d Hkv=%d d=%d float16, TB/s of K+V by split count\n", B, H, Hkv, d);
  for (bool varlen : {false, true}) {
    for (long n : {4096L, 32768L, 131072L}) {
      set_lengths<<<1, 32>>>(lengths, int(n), B, varlen);
      std::vector<int> host(B);
      CHECK(cudaMemcpy(host.data(), lengths, B * 4, cudaMemcpyDeviceToHost));
      double bytes = 0;
      for (int x : host) bytes += 2.0 * x * Hkv * d * 2;
      std::printf("%s N=%6ld:", varlen ? "1..N" : "N   ", n);
      for (int splits = 1; splits <= max_splits; splits *= 2) {
        KVCacheParams p;
        p.attn.shape = {B, H, Hkv, 1, n, d, d};
        p.attn.dtype = DType::Float16;
        p.attn.q = q;
        p.attn.k = k;
        p.attn.v = v;
        p.attn.out = out;
        p.attn.lse = lse;
        p.attn.q_strides = {H * d, d, d};
        p.attn.out_strides = p.attn.q_strides;
        p.attn.k_strides = {Hkv * n * d, n * d, d};
        p.attn.v_strides = p.attn.k_strides;
        p.attn.scale = 0.088f;
        p.cache_seqlens = lengths;
        p.num_splits = splits;
        p.partial_out = partial_out;
        p.partial_lse = partial_lse;
        p.split_arrivals = split_arrivals;
        p.merge_in_cluster = false;  // always the global merge (the operator may merge in clusters)
        Plan plan;  // the plan the planner gives on Hopper, but for its split count
        plan.family = Family::Decode;
        plan.warps = 8;
        plan.num_splits = splits;
        plan.dependent_launch = cuda::decode_dependent_launch<128, __half>(plan.warps);
        auto step = [&] { cuda::launch_decode<128, __half>(p, plan, nullptr); };
        for (int i = 0; i < 3; ++i) step();
        const int iterations = n > 40000 ? 10 : 50;
        cudaEvent_t start, end;
        CHECK(cudaEventCreate(&start));
        CHECK(cudaEventCreate(&end));
        CHECK(cudaEventRecord(start));
        for (int i = 0; i < iterations; ++i) step();
        CHECK(cudaEventRecord(end));
        CHECK(cudaEventSynchronize(end));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, start, end));
        std::printf("  %2d: %.2f", splits, bytes / (ms / iterations * 1e-3) / 1e12);
      }
      std::printf("\n");
    }
  }
  CHECK(cudaGetLastError());
}
