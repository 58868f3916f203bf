// CPU reshard kernel: every row of a work table memcpy'd straight to its destination, in one OpenMP pass.
//
// The rows' bytes, laid end to end, form one byte stream of `total` bytes; thread t of T copies the stream's
// bytes [t * total / T, (t + 1) * total / T). Work is thus balanced by bytes whatever the row sizes: 10k small
// blocks are dealt out in runs, and a single huge block is cut between the threads. Destinations do not overlap,
// so no two threads write the same byte.
#include <algorithm>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "reshard.h"

namespace {

// Below this many bytes per thread, waking another thread costs more than it saves.
constexpr int64_t kMinBytesPerThread = int64_t{256} << 10;

char* address(int64_t a) { return reinterpret_cast<char*>(static_cast<intptr_t>(a)); }

// Copies the part of the stream [lo, hi) that falls in the rows; ends[b] is row b's exclusive end in the stream.
void copy_stream_range(const int64_t* rows, const std::vector<int64_t>& ends, int64_t lo, int64_t hi) {
  const auto n_rows = static_cast<int64_t>(ends.size());
  // First row ending after lo; zero-length rows (ends[b] == ends[b - 1]) are skipped by the search.
  int64_t b = std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin();
  for (; b < n_rows; ++b) {
    const int64_t* row = rows + 3 * b;
    const int64_t begin = ends[b] - row[2];
    const int64_t a = std::max(lo, begin);
    const int64_t e = std::min(hi, ends[b]);
    if (e > a) {
      std::memcpy(address(row[1]) + (a - begin), address(row[0]) + (a - begin), e - a);
    }
    if (ends[b] >= hi) break;
  }
}

}  // namespace

extern "C" void hybridrl_block_copy_cpu(const int64_t* rows, int64_t n_rows, int num_threads) {
  std::vector<int64_t> ends(n_rows);
  int64_t total = 0;
  for (int64_t b = 0; b < n_rows; ++b) {
    total += rows[3 * b + 2];
    ends[b] = total;
  }
  if (total == 0) return;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, total / kMinBytesPerThread));
  // Thread t's share starts at t * (total / T) + min(t, total % T): exact, and free of total * t overflow.
  const int64_t share = total / threads;
  const int64_t extra = total % threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1)
#endif
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t lo = t * share + std::min(t, extra);
    const int64_t hi = lo + share + (t < extra ? 1 : 0);
    copy_stream_range(rows, ends, lo, hi);
  }
}
