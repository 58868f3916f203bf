// GPU reshard kernel: every row of a work table copied to its destination in one launch, 16 bytes per access.
//
// Plain CUDA (no torch headers): `nvcc -c reshard_cuda.cu` compiles it alone. Rows are (src_address,
// dst_address, n_bytes), so one launch may write into many destination tensors. The host cuts the rows into
// chunks of at most HYBRIDRL_RESHARD_CHUNK_BYTES (hybridrl_block_copy_cuda_chunks), so a huge block is spread
// over many thread blocks and small blocks cost one chunk each; the kernel gives each thread block one chunk
// at a time (grid-stride). A row is copied with the widest access its src and dst share an alignment for:
// uint4 (16 B) when both addresses are equal mod 16, after a scalar head that reaches the 16-byte boundary and
// before a scalar tail; 8/4/2/1-byte accesses otherwise.
//
// tests/ops/cuda_emulation/ also compiles this file for the host, with HYBRIDRL_CUDA_EMULATION: the launch below
// becomes a loop over every (block, thread) and HYBRIDRL_CUDA_ROW_HOOK checks each row's vector accesses are
// aligned, so machines without a GPU test the kernel's index arithmetic against the PyTorch reference.
#include <algorithm>
#include <cstdint>

#include "reshard.h"

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;       // loads in flight per thread before the stores
#ifndef HYBRIDRL_RESHARD_MAX_GRID  // the emulation test lowers it to run the grid-stride loop on small tables
#define HYBRIDRL_RESHARD_MAX_GRID (1 << 20)
#endif
#ifndef HYBRIDRL_CUDA_ROW_HOOK
#define HYBRIDRL_CUDA_ROW_HOOK(src_vec, dst_vec, width, n_vec)
#endif
constexpr int64_t kMaxGrid = HYBRIDRL_RESHARD_MAX_GRID;  // chunks beyond this are handled by the grid-stride loop

// Copies n bytes from s to d (s and d equal mod sizeof(T)) with the thread block's threads.
template <typename T>
__device__ void copy_row(const char* __restrict__ s, char* __restrict__ d, int64_t n) {
  constexpr int64_t w = sizeof(T);
  const int64_t to_boundary = static_cast<int64_t>((w - reinterpret_cast<uintptr_t>(d) % w) % w);
  const int64_t head = to_boundary < n ? to_boundary : n;
  const int64_t body = (n - head) / w;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) d[i] = s[i];
  const T* __restrict__ sv = reinterpret_cast<const T*>(s + head);
  T* __restrict__ dv = reinterpret_cast<T*>(d + head);
  HYBRIDRL_CUDA_ROW_HOOK(sv, dv, w, body);
  const int64_t step = blockDim.x;
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * step < body; i += kUnroll * step) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = sv[i + u * step];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dv[i + u * step] = v[u];
  }
  for (; i < body; i += step) dv[i] = sv[i];
  for (int64_t j = head + body * w + threadIdx.x; j < n; j += blockDim.x) d[j] = s[j];
}

__global__ void __launch_bounds__(kThreads)
    block_copy_kernel(const int64_t* __restrict__ chunks, int64_t n_chunks) {
  for (int64_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
    const char* s = reinterpret_cast<const char*>(static_cast<intptr_t>(chunks[3 * c]));
    char* d = reinterpret_cast<char*>(static_cast<intptr_t>(chunks[3 * c + 1]));
    const int64_t n = chunks[3 * c + 2];
    const auto skew = reinterpret_cast<uintptr_t>(s) ^ reinterpret_cast<uintptr_t>(d);  // uniform per row
    if (skew % 16 == 0) {
      copy_row<uint4>(s, d, n);
    } else if (skew % 8 == 0) {
      copy_row<uint2>(s, d, n);
    } else if (skew % 4 == 0) {
      copy_row<uint32_t>(s, d, n);
    } else if (skew % 2 == 0) {
      copy_row<uint16_t>(s, d, n);
    } else {
      copy_row<uint8_t>(s, d, n);
    }
  }
}

}  // namespace

extern "C" int64_t hybridrl_block_copy_cuda_chunks(const int64_t* rows, int64_t n_rows, int64_t* chunks) {
  int64_t n = 0;
  for (int64_t b = 0; b < n_rows; ++b) {
    const int64_t src = rows[3 * b];
    const int64_t dst = rows[3 * b + 1];
    const int64_t bytes = rows[3 * b + 2];
    for (int64_t off = 0; off < bytes; off += HYBRIDRL_RESHARD_CHUNK_BYTES, ++n) {
      if (chunks != nullptr) {
        chunks[3 * n] = src + off;
        chunks[3 * n + 1] = dst + off;
        chunks[3 * n + 2] = std::min<int64_t>(HYBRIDRL_RESHARD_CHUNK_BYTES, bytes - off);
      }
    }
  }
  return n;
}

extern "C" cudaError_t hybridrl_block_copy_cuda(const int64_t* chunks_dev, int64_t n_chunks, cudaStream_t stream) {
  if (n_chunks == 0) return cudaSuccess;
  const auto grid = static_cast<unsigned int>(std::min(n_chunks, kMaxGrid));
#ifdef HYBRIDRL_CUDA_EMULATION
  (void)stream;
  hybridrl_emulated_launch(grid, kThreads, [=] { block_copy_kernel(chunks_dev, n_chunks); });
#else
  block_copy_kernel<<<grid, kThreads, 0, stream>>>(chunks_dev, n_chunks);
#endif
  return cudaGetLastError();
}
