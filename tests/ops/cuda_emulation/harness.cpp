// csrc/reshard_cuda.cu built for the host (see cuda_emulation.h) behind a C entry point for ctypes.
#include "cuda_emulation.h"
// The kernel file itself, unchanged: this is the code nvcc compiles.
#include "reshard_cuda.cu"

#include <vector>

// Copies the rows (src_address, dst_address, n_bytes) of a host table the way the bindings do on a GPU: the host
// cuts them into chunks, one launch copies the chunks. Returns the number of chunks; stats[w] = chunks copied with
// w-byte accesses (w = 1, 2, 4, 8, 16), stats[0] = chunks with a misaligned vector access.
extern "C" int64_t emulated_block_copy(const int64_t* rows, int64_t n_rows, int64_t* stats) {
  const int64_t n_chunks = hybridrl_block_copy_cuda_chunks(rows, n_rows, nullptr);
  std::vector<int64_t> chunks(3 * n_chunks);
  hybridrl_block_copy_cuda_chunks(rows, n_rows, chunks.data());
  for (auto& c : hybridrl_chunks_by_width) c = 0;
  hybridrl_misaligned_chunks = 0;
  if (hybridrl_block_copy_cuda(chunks.data(), n_chunks, nullptr) != cudaSuccess) return -1;
  for (int w = 1; w <= 16; ++w) stats[w] = hybridrl_chunks_by_width[w];
  stats[0] = hybridrl_misaligned_chunks;
  return n_chunks;
}

extern "C" int64_t emulated_max_grid() { return kMaxGrid; }
extern "C" int64_t emulated_chunk_bytes() { return HYBRIDRL_RESHARD_CHUNK_BYTES; }
