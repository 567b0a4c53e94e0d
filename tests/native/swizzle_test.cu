// Host-side check of swizzled_offset (cpp/cuda/common/tile_loads.cuh), the
// decode kernel's shared-memory layout, for the head dims it is built for:
// each row's chunks stay in the row and never collide; a 128-byte line of the
// cache (rows are contiguous in global memory) lands in one 128-byte line of
// shared memory, which is what sends one L2 request per line; and the 8 rows
// an ldmatrix reads at one column hit 8 different 16-byte bank groups. The
// padded layout the kernel had before must fail the line check (so the check
// can fail). Built and run by .ci/check_cuda_compiles.sh; exits 1 on a failure.
#include <cstdio>
#include <functional>
#include <set>

#include "../../cpp/cuda/common/tile_loads.cuh"

namespace {

constexpr int kRows = 128;  // the largest tile the decode kernel swizzles
int failures = 0;

void expect(bool ok, const char* what, int d) {
  if (!ok && failures++ < 10) std::printf("FAIL %s at d=%d\n", what, d);
}

using Layout = std::function<int(int, int)>;  // (row, column) -> element offset

bool rows_are_bijections(int d, const Layout& offset) {
  for (int r = 0; r < kRows; ++r) {
    std::set<int> seen;
    for (int col = 0; col < d; col += 8) {
      const int o = offset(r, col);
      if (o % 8 != 0 || o < r * d || o >= (r + 1) * d || !seen.insert(o).second) return false;
    }
  }
  return true;
}

// Elements 64 L .. 64 L + 63 of the contiguous rows all land in one 64-element line.
bool lines_stay_whole(int d, const Layout& offset) {
  for (int line = 0; line < kRows * d / 64; ++line) {
    std::set<int> lines;
    for (int e = 64 * line; e < 64 * line + 64; e += 8) lines.insert(offset(e / d, e % d) / 64);
    if (lines.size() != 1) return false;
  }
  return true;
}

bool ldmatrix_is_conflict_free(int d, const Layout& offset) {
  for (int r0 = 0; r0 < kRows; r0 += 8)
    for (int col = 0; col < d; col += 8) {
      std::set<int> groups;
      for (int r = r0; r < r0 + 8; ++r) groups.insert(offset(r, col) / 8 % 8);
      if (groups.size() != 8) return false;
    }
  return true;
}

template <int D>
void check() {
  const Layout swizzled = [](int r, int col) { return fusedattn::cuda::swizzled_offset<D>(r, col); };
  expect(rows_are_bijections(D, swizzled), "chunks stay in their row, distinct", D);
  expect(lines_stay_whole(D, swizzled), "a global 128-byte line lands in one shared line", D);
  expect(ldmatrix_is_conflict_free(D, swizzled), "ldmatrix rows in 8 bank groups", D);
  const Layout padded = [](int r, int col) { return r * (D + 8) + col; };
  expect(!lines_stay_whole(D, padded), "the padded layout fails the line check", D);
}

}  // namespace

int main() {
  check<32>();
  check<64>();
  check<128>();
  std::printf("swizzle_test: 3 head dims, %d failures\n", failures);
  return failures ? 1 : 0;
}
