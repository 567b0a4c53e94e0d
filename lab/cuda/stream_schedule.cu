// Does the schedule (which block streams which tiles) hold a short decode step
// below the HBM rate? The decode kernel gives every (sequence, head) its own
// blocks (one per split); at 4K keys that step reads 4.40 TB/s (MHA) and 3.62
// (GQA 32/8) against 4.67 at 128K, and the streaming ceiling with the same
// schedule (stream_roofline.cu) is 4.55 / 4.15. This driver streams the same
// bytes with no attention maths under four schedules (and two more forms, below):
//   per-item S  one block per (sequence, head, split), S splits: the decode
//               kernel's schedule
//   stream-k    one block per slot (SMs x blocks per SM), each an equal
//               contiguous run of the flat list of every item's tiles, the
//               ring kept full across items
//   dynamic C   one block per slot, taking runs of C tiles from an atomic
//               counter (the next run asked for one run ahead)
//   steal C     one block per slot; a block takes a whole item (the first
//               by its index, then from an item counter) and its tiles C at a
//               time from that item's own counter; once no item is left it
//               takes runs from the items after its last one (at most 16
//               tries): a block stays on one item as long as it can, so a real
//               kernel would write a partial per item visited, not per run
//   per-item 1, L2 +4  per-item 1, each tile's load also asking L2 for the
//               tile 4 further on (a record: it only slowed the stream)
//   plain loads no ring: 16-byte loads into registers, blocks striding over
//               the flat tile list (plain_read_kernel)
// All but plain loads use the d=128 decode kernel's ring as it was until d13
// (3 stages of 64-key K and V tiles, 16-byte cp.async with the L2 prefetch,
// 4 warps, 2 blocks per SM; 8 warps and 128-key tiles since) and its
// launch (programmatic dependent launch, the wait first). Per schedule it
// prints TB/s of 10 calls back to back and, for the last call, when blocks
// finished (us after the first block started): the first, the median and
// the last. Lengths per sequence (multiples of 64 here) stand for the
// bench's lengths 1..N; the schedules' tile offsets come from the host, so a
// real kernel would pay a scan of the lengths on top.
//
//   nvcc -std=c++17 -O3 -Icpp/include -gencode=arch=compute_90a,code=sm_90a \
//     lab/cuda/stream_schedule.cu -o /tmp/stream_schedule
//   /tmp/stream_schedule HEADS N [LENGTH x 8]   (no lengths: every sequence at N)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "../../cpp/cuda/hopper/bulk_copy.cuh"
#include "../../cpp/cuda/hopper/dependent_launch.cuh"
#include "../../cpp/cuda/common/device_math.cuh"

using namespace fusedattn::cuda;

namespace {

constexpr int kBatch = 8, kHeadDim = 128, kThreads = 128, kStages = 3, kTileRows = 64;
constexpr int kRowBytes = kHeadDim * 2, kTileBytes = kTileRows * kRowBytes;  // 16 KB of K or of V

enum class Schedule { PerItem, StreamK, Dynamic, Steal };

struct Args {
  const unsigned char* k;
  const unsigned char* v;
  int64_t max_len;  // rows of one (sequence, head) in memory
  int items;  // sequences x heads
  const int64_t* item_first;  // [items + 1]: flat index of each item's first tile
  int64_t total_tiles;
  Schedule schedule;
  int splits;  // per-item
  int chunk;  // dynamic, steal: tiles per run
  int prefetch;  // per-item, stream-k: L2 is asked for the tile this many past each one loaded (0: none)
  int* counter;  // dynamic: runs handed out past the first one per block; steal: items
                 // handed out past the first one per block, then each item's tiles taken
  unsigned long long* times;  // [blocks][2]: start, end (globaltimer, ns)
  float* sink;
};

__device__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__global__ void __launch_bounds__(kThreads, 2) stream_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ int64_t next_run, next_end;
  __shared__ int next_item;
  wait_for_previous_grid();
  const unsigned long long start = global_ns();

  // The load cursor: flat tile `tile` of the run [tile, run_end), in item `item`.
  int64_t tile = 0, run_end = 0;
  int pending = 0;  // dynamic, steal, thread 0: the run after the current one
  int item = 0;
  bool fresh_items = true;  // steal, thread 0: the item counter may still hand one out
  int tries = 0;  // steal, thread 0: items tried since the last fresh one
  if (a.schedule == Schedule::PerItem) {
    item = blockIdx.x / a.splits;
    const int split = blockIdx.x % a.splits;
    const int64_t n = a.item_first[item + 1] - a.item_first[item];
    const int64_t per = (n + a.splits - 1) / a.splits;
    tile = a.item_first[item] + min(n, split * per);
    run_end = a.item_first[item] + min(n, (split + 1) * per);
  } else if (a.schedule == Schedule::StreamK) {
    tile = a.total_tiles * blockIdx.x / gridDim.x;
    run_end = a.total_tiles * (blockIdx.x + 1) / gridDim.x;
  } else if (a.schedule == Schedule::Steal) {
    item = blockIdx.x % a.items;
    tile = run_end = 0;  // the first load asks for a run
    if (threadIdx.x == 0) pending = blockIdx.x < a.items ? atomicAdd(a.counter + 1 + item, a.chunk) : INT32_MAX;
  } else {
    tile = int64_t(blockIdx.x) * a.chunk;
    run_end = min(a.total_tiles, tile + a.chunk);
    if (threadIdx.x == 0) pending = atomicAdd(a.counter, 1) + gridDim.x;
  }
  while (a.item_first[item + 1] <= tile && item < a.items - 1) ++item;
  auto item_tiles = [&](int i) { return a.item_first[i + 1] - a.item_first[i]; };
  bool done = false;  // steal

  // Warp w's first lane asks L2 for the w-th quarter of tile t's K and V, if
  // t is in the block's run and in the current item.
  auto prefetch_tile = [&](int64_t t) {
    if (t >= run_end || t >= a.item_first[item + 1] || threadIdx.x % 32 != 0) return;
    constexpr int quarter = kTileBytes / (kThreads / 32);
    const int64_t offset =
        (item * a.max_len + (t - a.item_first[item]) * kTileRows) * kRowBytes + threadIdx.x / 32 * quarter;
    bulk_prefetch_l2(a.k + offset, quarter);
    bulk_prefetch_l2(a.v + offset, quarter);
  };

  int load_stage = 0, loaded = 0;
  auto load_next = [&] {
    if (tile == run_end && run_end < a.total_tiles && a.schedule == Schedule::Dynamic) {
      if (threadIdx.x == 0) {
        next_run = int64_t(pending) * a.chunk;
        pending = atomicAdd(a.counter, 1) + gridDim.x;
      }
      __syncthreads();
      tile = min(a.total_tiles, next_run);
      run_end = min(a.total_tiles, tile + a.chunk);
      __syncthreads();  // next_run read before thread 0 writes it again
    }
    if (tile == run_end && !done && a.schedule == Schedule::Steal) {
      if (threadIdx.x == 0) {
        int i = item, r = pending;
        while (r >= item_tiles(i)) {
          if (fresh_items) {
            const int f = atomicAdd(a.counter, 1) + gridDim.x;
            if (f < a.items) {
              i = f;
              r = atomicAdd(a.counter + 1 + i, a.chunk);
              continue;
            }
            fresh_items = false;
          }
          if (++tries > 16) break;
          i = i + 1 == a.items ? 0 : i + 1;
          r = atomicAdd(a.counter + 1 + i, a.chunk);
        }
        const bool got = r < item_tiles(i);
        next_item = got ? i : -1;
        next_run = got ? a.item_first[i] + r : 0;
        next_end = got ? a.item_first[i] + min(item_tiles(i), int64_t(r) + a.chunk) : 0;
        if (got) pending = atomicAdd(a.counter + 1 + i, a.chunk);
      }
      __syncthreads();
      done = next_item < 0;
      if (!done) item = next_item;
      tile = next_run;
      run_end = next_end;
      __syncthreads();
    }
    if (tile < run_end) {
      while (a.item_first[item + 1] <= tile) ++item;
      const int64_t offset = (item * a.max_len + (tile - a.item_first[item]) * kTileRows) * kRowBytes;
      unsigned char* sk = ring + load_stage * 2 * kTileBytes;
      for (int c = threadIdx.x; c < kTileBytes / 16; c += kThreads) {
        cp_async_16<128>(sk + 16 * c, a.k + offset + 16 * c, true);
        cp_async_16<128>(sk + kTileBytes + 16 * c, a.v + offset + 16 * c, true);
      }
      if (a.prefetch > 0) {
        // The first load asks for the tiles the ring will not hold, then one
        // more per load.
        for (int64_t t = loaded == 0 ? tile + kStages : tile + a.prefetch; t <= tile + a.prefetch; ++t)
          prefetch_tile(t);
      }
      ++tile;
      ++loaded;
      load_stage = load_stage == kStages - 1 ? 0 : load_stage + 1;
    }
    cp_async_commit();
  };

  for (int i = 0; i < kStages - 1; ++i) load_next();
  float sum = 0.0f;
  int read_stage = 0;
  for (int consumed = 0; consumed < loaded; ++consumed) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const unsigned char* sk = ring + read_stage * 2 * kTileBytes;
    sum += reinterpret_cast<const float*>(sk)[threadIdx.x * 4] +
           reinterpret_cast<const float*>(sk + kTileBytes)[threadIdx.x * 4];
    read_stage = read_stage == kStages - 1 ? 0 : read_stage + 1;
    __syncthreads();  // every thread is done with the stage the next load refills
    load_next();
  }
  allow_dependent_launch();
  if (sum == 12345.678f) a.sink[blockIdx.x] = sum;  // never true for these data; keeps the reads
  if (threadIdx.x == 0) {
    a.times[2 * blockIdx.x] = start;
    a.times[2 * blockIdx.x + 1] = global_ns();
  }
}

// The same bytes with no ring and no shared memory: every thread loads 16
// bytes of K and of V per 16-byte column of a tile (Tiles tiles at a time,
// 8 x Tiles loads in flight per thread), blocks striding over the flat tile
// list (tile, tile + gridDim.x, ...), so no block has more than one tile
// more than another (tiles only grow, so the item search goes forward). What
// a kernel free of the decode ring's design could stream: 4 blocks of 256
// threads per SM with one tile at a time (128 KB in flight per SM, the ring's
// 2 x 2 stages x 32 KB), 3 blocks with two (192 KB).
constexpr int kPlainThreads = 256;

template <int Tiles>
__global__ void __launch_bounds__(kPlainThreads, Tiles == 1 ? 4 : 3) plain_read_kernel(const __grid_constant__ Args a) {
  constexpr int kLoads = kTileBytes / 16 / kPlainThreads;  // per thread, of K and of V
  wait_for_previous_grid();
  const unsigned long long start = global_ns();
  uint4 sum = {0, 0, 0, 0};
  int item = 0;
  for (int64_t first = blockIdx.x; first < a.total_tiles; first += int64_t(Tiles) * gridDim.x) {
    uint4 r[Tiles][2 * kLoads];
#pragma unroll
    for (int j = 0; j < Tiles; ++j) {
      const int64_t tile = first + int64_t(j) * gridDim.x;
      if (tile >= a.total_tiles) break;
      while (a.item_first[item + 1] <= tile) ++item;
      const int64_t offset = (item * a.max_len + (tile - a.item_first[item]) * kTileRows) * kRowBytes;
      const uint4* k = reinterpret_cast<const uint4*>(a.k + offset) + threadIdx.x;
      const uint4* v = reinterpret_cast<const uint4*>(a.v + offset) + threadIdx.x;
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        r[j][u] = __ldcs(k + u * kPlainThreads);
        r[j][kLoads + u] = __ldcs(v + u * kPlainThreads);
      }
    }
#pragma unroll
    for (int j = 0; j < Tiles; ++j) {
      if (first + int64_t(j) * gridDim.x >= a.total_tiles) break;
#pragma unroll
      for (int u = 0; u < 2 * kLoads; ++u) sum.x ^= r[j][u].x ^ r[j][u].y ^ r[j][u].z ^ r[j][u].w;
    }
  }
  allow_dependent_launch();
  if (sum.x == 0x12345678u) a.sink[blockIdx.x] = 1.0f;  // never true for these data; keeps the reads
  if (threadIdx.x == 0) {
    a.times[2 * blockIdx.x] = start;
    a.times[2 * blockIdx.x + 1] = global_ns();
  }
}

void run(const char* name, Args a, int blocks, int64_t bytes, void (*kernel)(Args) = stream_kernel,
         int threads = kThreads, int smem = kStages * 2 * kTileBytes, int calls_per_timing = 10) {
  std::vector<int*> counters(2 + calls_per_timing);  // zeroed, 1 + items per call
  const size_t per_call = 1 + a.items;
  cudaMalloc(&counters[0], sizeof(int) * per_call * counters.size());
  cudaMemset(counters[0], 0, sizeof(int) * per_call * counters.size());
  for (size_t i = 1; i < counters.size(); ++i) counters[i] = counters[0] + i * per_call;
  cudaEvent_t begin, end;
  cudaEventCreate(&begin);
  cudaEventCreate(&end);
  for (int i = 0; i < 2 + calls_per_timing; ++i) {
    if (i == 2) cudaEventRecord(begin);
    a.counter = counters[i];
    launch_dependent(kernel, true, 1, dim3(blocks), dim3(threads), smem, nullptr, a);
  }
  cudaEventRecord(end);
  cudaEventSynchronize(end);
  float ms = 0;
  cudaEventElapsedTime(&ms, begin, end);
  std::vector<unsigned long long> t(2 * blocks);
  cudaMemcpy(t.data(), a.times, sizeof(unsigned long long) * t.size(), cudaMemcpyDeviceToHost);
  unsigned long long first_start = ~0ull;
  std::vector<double> ends(blocks);
  for (int b = 0; b < blocks; ++b) first_start = std::min(first_start, t[2 * b]);
  for (int b = 0; b < blocks; ++b) ends[b] = (t[2 * b + 1] - first_start) * 1e-3;
  std::sort(ends.begin(), ends.end());
  std::printf("| %-20s | %5d | %7.1f | %5.2f | %7.1f | %7.1f | %7.1f |\n", name, blocks,
              ms * 1e3 / calls_per_timing, bytes * double(calls_per_timing) / (ms * 1e-3) / 1e12, ends.front(),
              ends[blocks / 2], ends.back());
  cudaFree(counters[0]);
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && argc != 3 + kBatch) {
    std::fprintf(stderr, "usage: %s HEADS N [LENGTH x %d]\n", argv[0], kBatch);
    return 2;
  }
  const int heads = std::atoi(argv[1]);
  const int64_t n = std::atoll(argv[2]);
  std::vector<int64_t> lengths(kBatch, n);
  for (int b = 0; argc > 3 && b < kBatch; ++b)  // rounded up to whole tiles
    lengths[b] = std::min<int64_t>(n, (std::atoll(argv[3 + b]) + kTileRows - 1) / kTileRows * kTileRows);

  int sms = 0, per_sm = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  constexpr int smem = kStages * 2 * kTileBytes;
  cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stream_kernel, kThreads, smem);
  const int slots = sms * per_sm;

  const int items = kBatch * heads;
  std::vector<int64_t> item_first(items + 1, 0);
  for (int i = 0; i < items; ++i) item_first[i + 1] = item_first[i] + lengths[i / heads] / kTileRows;
  const int64_t total_tiles = item_first[items];
  const int64_t bytes = total_tiles * 2 * kTileBytes;

  const size_t cache_bytes = size_t(items) * n * kRowBytes;
  Args a{};
  unsigned char *k = nullptr, *v = nullptr;
  int64_t* first = nullptr;
  if (cudaMalloc(&k, cache_bytes) != cudaSuccess || cudaMalloc(&v, cache_bytes) != cudaSuccess) {
    std::printf("out of memory\n");
    return 1;
  }
  cudaMemset(k, 0, cache_bytes);
  cudaMemset(v, 0, cache_bytes);
  cudaMalloc(&first, sizeof(int64_t) * item_first.size());
  cudaMemcpy(first, item_first.data(), sizeof(int64_t) * item_first.size(), cudaMemcpyHostToDevice);
  const int max_blocks = items * 64 + slots;
  cudaMalloc(&a.times, sizeof(unsigned long long) * 2 * max_blocks);
  cudaMalloc(&a.sink, sizeof(float) * max_blocks);
  a.k = k;
  a.v = v;
  a.max_len = n;
  a.items = items;
  a.item_first = first;
  a.total_tiles = total_tiles;

  std::printf("B=%d H=%d d=%d N=%lld, lengths", kBatch, heads, kHeadDim, static_cast<long long>(n));
  for (int64_t l : lengths) std::printf(" %lld", static_cast<long long>(l));
  std::printf("; %d SMs x %d blocks; %.3f GB of K and V\n\n", sms, per_sm, bytes * 1e-9);
  std::printf("| schedule | blocks | us/step | TB/s | first end, us | median end | last end |\n"
              "|---|---|---|---|---|---|---|\n");
  char name[32];
  a.schedule = Schedule::PerItem;
  for (int splits : {1, 2, 4, 8, 16}) {
    a.splits = splits;
    std::snprintf(name, sizeof(name), "per-item %d", splits);
    run(name, a, items * splits, bytes);
  }
  // Asking L2 for tiles ahead of the ring, 4 to 16 tiles ahead, slowed every
  // row: MHA 4K 3.04 / 2.62 / 2.67 TB/s at +4 / +8 / +16 against 4.47
  // without (H200, 2026-12-01 10:44, docs/cuda-notes.md d12).
  a.splits = 1;
  a.prefetch = 4;
  run("per-item 1, L2 +4", a, items, bytes);
  a.prefetch = 0;
  a.schedule = Schedule::StreamK;
  run("stream-k", a, slots, bytes);
  a.schedule = Schedule::Dynamic;
  for (int chunk : {2, 4, 8, 16}) {
    a.chunk = chunk;
    std::snprintf(name, sizeof(name), "dynamic %d", chunk);
    run(name, a, static_cast<int>(std::min<int64_t>(slots, (total_tiles + chunk - 1) / chunk)), bytes);
  }
  a.schedule = Schedule::Steal;
  for (int chunk : {2, 4, 8}) {
    a.chunk = chunk;
    std::snprintf(name, sizeof(name), "steal %d", chunk);
    run(name, a, slots, bytes);
  }
  for (auto [kernel, tiles] : {std::pair{plain_read_kernel<1>, 1}, std::pair{plain_read_kernel<2>, 2}}) {
    int plain_per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&plain_per_sm, kernel, kPlainThreads, 0);
    std::snprintf(name, sizeof(name), "plain loads, %d tile%s", tiles, tiles > 1 ? "s" : "");
    run(name, a, sms * plain_per_sm, bytes, kernel, kPlainThreads, 0);
  }
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) std::printf("CUDA error: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
