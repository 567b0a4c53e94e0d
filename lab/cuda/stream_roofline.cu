// How fast can a kernel stream a KV cache through shared memory on this GPU,
// by each way of loading it? The decode kernel (cpp/cuda/decode) plateaus at
// 4.2-4.45 TB/s against cuDNN's 4.6-4.7 (H200, docs/cuda-notes.md); this
// driver takes the attention maths away and keeps only the loads, so its
// TB/s bound what each load path, ring depth and block count can give.
//
// A block walks its split of one (sequence, head)'s K and V tiles (64 keys,
// or 128 for the paths with one request per tile: FA3, TensorRT-LLM's XQA and
// cuDNN's published decode kernels take 64-176-key tiles at one block per SM)
// through a ring of `stages` buffers and touches 16 bytes of each tile once it
// has landed (so nothing is optimised away). Load paths:
//   cp.async    16-byte cp.async.cg by every thread, commit groups (the decode
//               kernel's path before sm_90); each refill after the wait for
//               the tile, so one stage is idle while the block waits
//   cp.async-early  the same, but the refill of the stage read last comes
//               before the wait: every stage in flight while the block waits
//   bulk-rows   one cp.async.bulk per 256-byte row, issued by the warps (its
//               sm_90 path)
//   bulk-tile   one cp.async.bulk per tile (a [B, H, N, d] cache's tile is 16
//               contiguous KB), issued by one thread
//   tma-tile    cp.async.bulk.tensor boxes of 64 columns, 128-byte swizzle (the
//               sm90 forward's loads; what ldmatrix could read without padding)
// B=8, H=32, d=128, float16, N = 4K, 32K, 128K; splits 1 and 8 per head.
// A second table puts a busy wait of D clock cycles after each refill, where
// the decode kernel runs its MMAs and softmax on the tile (wait, refill,
// compute): how long may that work take before it, not the loads, sets the
// rate? (A 128-key tile carries twice a 64-key tile's work: compare D at 128
// keys with D / 2 at 64.)
// "stages" counts ring buffers, as the decode kernel's kStages does: stages - 1
// tiles are in flight while one is read (2 stages: no overlap at all); with
// cp.async-early all of them while the block waits.
//
//   nvcc -std=c++17 -O3 -Icpp/include -gencode=arch=compute_90a,code=sm_90a \
//     lab/cuda/stream_roofline.cu cpp/cuda/hopper/tensor_maps.cu -o /tmp/stream_roofline
//   /tmp/stream_roofline [heads: 32, or 8 for GQA 32/8's bytes]
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "../../cpp/cuda/hopper/bulk_copy.cuh"
#include "../../cpp/cuda/common/device_math.cuh"
#include "../../cpp/cuda/hopper/tensor_maps.h"
#include "../../cpp/cuda/hopper/tma.cuh"

using namespace fusedattn;
using namespace fusedattn::cuda;

namespace {

constexpr int kBatch = 8, kHeadDim = 128;
constexpr int kThreads = 128;
constexpr int kRowBytes = kHeadDim * 2;

enum class Path { CpAsync, CpAsyncEarly, BulkRows, BulkTile, TmaTile };
const char* path_name(Path p) {
  switch (p) {
    case Path::CpAsync: return "cp.async";
    case Path::CpAsyncEarly: return "cp.async-early";
    case Path::BulkRows: return "bulk-rows";
    case Path::BulkTile: return "bulk-tile";
    default: return "tma-tile";
  }
}

struct StreamArgs {
  CUtensorMap k_map[2], v_map[2];  // tma-tile only: boxes of 64 and of 128 rows
  const unsigned char* k;
  const unsigned char* v;
  int heads;  // per sequence: 32, or 8 for GQA 32/8's bytes
  int64_t seqlen;
  int splits;
  float* sink;  // one float per block: the touched bytes, so loads stay live
  int64_t delay_cycles;  // busy wait per tile after its refill (0: none)
};

template <Path kPath, int kStages, int kTileRows>
__global__ void __launch_bounds__(kThreads) stream_kernel(const __grid_constant__ StreamArgs a) {
  constexpr int kTileBytes = kTileRows * kRowBytes;  // one K or V tile: 16 KB at 64 keys
  extern __shared__ unsigned char smem_raw[];
  unsigned char* ring = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t landed[kStages];

  const int split = blockIdx.x % a.splits;
  const int64_t bh = blockIdx.x / a.splits;
  const int64_t tiles = a.seqlen / kTileRows;
  const int64_t per_split = (tiles + a.splits - 1) / a.splits;
  const int64_t first = split * per_split;
  const int64_t last = first + per_split < tiles ? first + per_split : tiles;
  const int64_t head_offset = bh * a.seqlen * kRowBytes;

  constexpr bool kCpAsync = kPath == Path::CpAsync || kPath == Path::CpAsyncEarly;
  if (!kCpAsync) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) mbarrier_init(&landed[s], kPath == Path::BulkRows ? kThreads / 32 : 1);
      mbarrier_init_fence();
    }
    __syncthreads();
  }

  auto load = [&](int64_t tile) {
    const int stage = static_cast<int>((tile - first) % kStages);
    unsigned char* sk = ring + stage * 2 * kTileBytes;
    unsigned char* sv = sk + kTileBytes;
    const unsigned char* gk = a.k + head_offset + tile * kTileBytes;
    const unsigned char* gv = a.v + head_offset + tile * kTileBytes;
    if constexpr (kCpAsync) {
      for (int c = threadIdx.x; c < kTileBytes / 16; c += kThreads) {
        cp_async_16<128>(sk + 16 * c, gk + 16 * c, true);  // with the decode kernel's L2 prefetch
        cp_async_16<128>(sv + 16 * c, gv + 16 * c, true);
      }
      cp_async_commit();
    } else if constexpr (kPath == Path::BulkRows) {
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      constexpr int kRowsPerWarp = kTileRows / (kThreads / 32);
      if (lane == 0) mbarrier_arrive_expect_bytes(&landed[stage], 2 * kRowsPerWarp * kRowBytes);
      __syncwarp();
      if (lane < kRowsPerWarp) {
        const int r = warp * kRowsPerWarp + lane;
        bulk_copy_to_shared(sk + r * kRowBytes, gk + r * kRowBytes, kRowBytes, &landed[stage]);
        bulk_copy_to_shared(sv + r * kRowBytes, gv + r * kRowBytes, kRowBytes, &landed[stage]);
      }
    } else if (threadIdx.x == 0) {
      mbarrier_arrive_expect_bytes(&landed[stage], 2 * kTileBytes);
      if constexpr (kPath == Path::BulkTile) {
        bulk_copy_to_shared(sk, gk, kTileBytes, &landed[stage]);
        bulk_copy_to_shared(sv, gv, kTileBytes, &landed[stage]);
      } else {
        const int row = static_cast<int>(tile * kTileRows);
        const int head = static_cast<int>(bh % a.heads), batch = static_cast<int>(bh / a.heads);
        for (int slab = 0; slab < kHeadDim / 64; ++slab) {
          tma_load_box(sk + slab * kTileRows * 128, &a.k_map[kTileRows == 128], 64 * slab, row, head, batch,
                       &landed[stage]);
          tma_load_box(sv + slab * kTileRows * 128, &a.v_map[kTileRows == 128], 64 * slab, row, head, batch,
                       &landed[stage]);
        }
      }
    }
  };

  float sum = 0.0f;
  for (int64_t t = first; t < first + kStages - 1 && t < last; ++t) load(t);
  for (int64_t t = first; t < last; ++t) {
    const int stage = static_cast<int>((t - first) % kStages);
    if constexpr (kPath == Path::CpAsyncEarly) {
      // Every thread is done with the stage tile t - 1 held, which the refill
      // reuses; past the end an empty group keeps the wait count.
      __syncthreads();
      if (t + kStages - 1 < last) load(t + kStages - 1); else cp_async_commit();
      cp_async_wait<kStages - 1>();
      __syncthreads();
    } else if constexpr (kPath == Path::CpAsync) {
      // Groups issued after tile t: min(kStages - 2, tiles left after t).
      if (last - 1 - t >= kStages - 2) cp_async_wait<kStages - 2>(); else cp_async_wait<0>();
      __syncthreads();
    } else {
      mbarrier_wait(&landed[stage], static_cast<uint32_t>((t - first) / kStages) & 1);
    }
    const unsigned char* tile = ring + stage * 2 * kTileBytes;
    sum += reinterpret_cast<const float*>(tile)[threadIdx.x * 4] + reinterpret_cast<const float*>(tile + kTileBytes)[threadIdx.x * 4];
    // Every thread is done with the stage that load(t + kStages - 1) reuses.
    __syncthreads();
    if (!kCpAsync) fence_proxy_async_shared();
    if (kPath != Path::CpAsyncEarly && t + kStages - 1 < last) load(t + kStages - 1);
    if (a.delay_cycles > 0) {
      const long long until = clock64() + a.delay_cycles;
      while (clock64() < until) {
      }
    }
  }
  if (sum == 12345.678f) a.sink[blockIdx.x] = sum;  // never true for these data; keeps the reads
}

template <Path kPath, int kStages, int kTileRows = 64>
void run(const StreamArgs& base, int64_t seqlen, int splits, int sms, int64_t delay_cycles = 0) {
  static_assert(kTileRows == 64 || kTileRows == 128);
  auto kernel = stream_kernel<kPath, kStages, kTileRows>;
  const int smem = kStages * 2 * kTileRows * kRowBytes + 1024;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return;
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
  if (per_sm == 0) return;
  StreamArgs a = base;
  a.seqlen = seqlen;
  a.splits = splits;
  a.delay_cycles = delay_cycles;
  const int blocks = kBatch * a.heads * splits;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 2; ++i) kernel<<<blocks, kThreads, smem>>>(a);
  constexpr int kRepeats = 10;
  cudaEventRecord(start);
  for (int i = 0; i < kRepeats; ++i) kernel<<<blocks, kThreads, smem>>>(a);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  const cudaError_t err = cudaGetLastError();
  const double bytes = 2.0 * kBatch * a.heads * double(seqlen) * kRowBytes;
  std::printf("| %-14s | %3d | %6lld | %d | %d | %2d | %4d | %5lld | %s |\n", path_name(kPath), kTileRows,
              static_cast<long long>(seqlen), kStages, per_sm, splits, (blocks + per_sm * sms - 1) / (per_sm * sms),
              static_cast<long long>(delay_cycles),
              err == cudaSuccess ? std::to_string(bytes * kRepeats / (ms * 1e-3) / 1e12).substr(0, 4).c_str()
                                 : cudaGetErrorString(err));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

template <Path kPath, int kTileRows = 64>
void run_stages(const StreamArgs& a, int64_t n, int splits, int sms) {
  // Configurations whose ring does not fit in shared memory print nothing.
  run<kPath, 2, kTileRows>(a, n, splits, sms);
  run<kPath, 3, kTileRows>(a, n, splits, sms);
  run<kPath, 4, kTileRows>(a, n, splits, sms);
  run<kPath, 6, kTileRows>(a, n, splits, sms);
}

}  // namespace

int main(int argc, char** argv) {
  // With a head count below 32 (8: GQA 32/8's K and V) only the decode
  // kernel's configuration runs, over split counts: what the launch, the
  // ring's start and the last blocks cost a stream of a quarter of the bytes.
  const int heads = argc > 1 ? std::atoi(argv[1]) : 32;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  std::printf("KV-cache streaming ceiling, B=%d H=%d d=%d float16, TB/s of K and V\n\n", kBatch, heads, kHeadDim);
  std::printf("| path | keys/tile | N | stages | blocks/SM | splits | waves | delay | TB/s |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  for (int64_t n : {int64_t(4096), int64_t(32768), int64_t(131072)}) {
    const size_t bytes = size_t(kBatch) * heads * n * kRowBytes;
    unsigned char *k = nullptr, *v = nullptr;
    float* sink = nullptr;
    if (cudaMalloc(&k, bytes) != cudaSuccess || cudaMalloc(&v, bytes) != cudaSuccess ||
        cudaMalloc(&sink, sizeof(float) * kBatch * heads * 64) != cudaSuccess) {
      std::printf("out of memory at N=%lld\n", static_cast<long long>(n));
      return 1;
    }
    cudaMemset(k, 0, bytes);
    cudaMemset(v, 0, bytes);
    StreamArgs a{};
    a.k = k;
    a.v = v;
    a.sink = sink;
    a.heads = heads;
    const TensorStrides strides{heads * n * kHeadDim, n * kHeadDim, kHeadDim};
    for (int wide = 0; wide < 2; ++wide) {
      const int rows = wide ? 128 : 64;
      std::string why = encode_head_tensor_map(&a.k_map[wide], DType::Float16, k, kBatch, heads, n, kHeadDim, strides,
                                               rows);
      if (why.empty())
        why = encode_head_tensor_map(&a.v_map[wide], DType::Float16, v, kBatch, heads, n, kHeadDim, strides, rows);
      if (!why.empty()) {
        std::printf("tensor maps refused: %s\n", why.c_str());
        return 1;
      }
    }
    if (heads < 32) {
      for (int splits : {1, 2, 4, 8, 16}) run<Path::CpAsync, 3>(a, n, splits, sms);
    } else {
      for (int splits : {1, 8}) {
        run_stages<Path::CpAsync>(a, n, splits, sms);
        run_stages<Path::CpAsyncEarly>(a, n, splits, sms);
        run_stages<Path::BulkRows>(a, n, splits, sms);
        run_stages<Path::BulkTile>(a, n, splits, sms);
        run_stages<Path::TmaTile>(a, n, splits, sms);
        run_stages<Path::BulkTile, 128>(a, n, splits, sms);
        run_stages<Path::TmaTile, 128>(a, n, splits, sms);
      }
      // The d=128 decode kernel's configuration until d13 (3 stages, 2 blocks per SM) with work per tile.
      for (int64_t delay : {250, 500, 1000, 2000, 4000}) {
        run<Path::CpAsync, 3>(a, n, 1, sms, delay);
        run<Path::CpAsyncEarly, 3>(a, n, 1, sms, delay);
        run<Path::BulkRows, 3>(a, n, 1, sms, delay);
        run<Path::TmaTile, 3>(a, n, 1, sms, delay);
        // Twice the keys, twice the work per tile.
        run<Path::TmaTile, 2, 128>(a, n, 1, sms, 2 * delay);
        run<Path::TmaTile, 3, 128>(a, n, 1, sms, 2 * delay);
      }
    }
    cudaFree(k);
    cudaFree(v);
    cudaFree(sink);
  }
  return 0;
}
