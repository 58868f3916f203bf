// The CUDA names csrc/reshard_cuda.cu uses, defined for a host compiler, so the kernel runs on a CPU.
//
// A launch becomes a loop over every (block, thread) pair, one after another. That is exact for this kernel: it has
// no shared memory and no barriers, and its threads write disjoint bytes, so any order of the threads gives the
// bytes a GPU would. What the emulation cannot show: speed, and faults a GPU raises that a CPU does not; the one
// such fault this kernel could hit, a misaligned vector access, is checked by HYBRIDRL_CUDA_ROW_HOOK below.
#pragma once

#include <cstdint>

#define __global__
#define __device__
#define __launch_bounds__(n)

struct hybridrl_dim3 {
  unsigned int x = 0, y = 0, z = 0;
};
inline hybridrl_dim3 threadIdx, blockIdx, blockDim, gridDim;

// CUDA's uint4 / uint2 are 16- / 8-byte aligned; these are not, so that a misaligned access the hook below reports
// does not also crash the test process (x86 tolerates unaligned loads of a plain struct).
struct uint4 {
  unsigned int x, y, z, w;
};
struct uint2 {
  unsigned int x, y;
};
static_assert(sizeof(uint4) == 16 && sizeof(uint2) == 8, "access widths of the emulated vector types");

using cudaError_t = int;
using cudaStream_t = void*;
constexpr cudaError_t cudaSuccess = 0;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

template <typename Body>
void hybridrl_emulated_launch(unsigned int grid, unsigned int threads, Body body) {
  gridDim.x = grid;
  blockDim.x = threads;
  for (unsigned int b = 0; b < grid; ++b) {
    for (unsigned int t = 0; t < threads; ++t) {
      blockIdx.x = b;
      threadIdx.x = t;
      body();
    }
  }
}

// Per launch: chunks copied with each access width (index = width in bytes, 1..16), and vector accesses that a GPU
// would fault on (a T-wide load or store at an address that is not a multiple of sizeof(T)).
inline int64_t hybridrl_chunks_by_width[17];
inline int64_t hybridrl_misaligned_chunks;

#define HYBRIDRL_CUDA_ROW_HOOK(src_vec, dst_vec, width, n_vec)                                                     \
  do {                                                                                                             \
    if (threadIdx.x == 0) ++hybridrl_chunks_by_width[width];                                                        \
    if (threadIdx.x == 0 && (n_vec) > 0 &&                                                                        \
        (reinterpret_cast<uintptr_t>(src_vec) % (width) || reinterpret_cast<uintptr_t>(dst_vec) % (width)))        \
      ++hybridrl_misaligned_chunks;                                                                                 \
  } while (0)
