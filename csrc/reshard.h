// C interface of the reshard kernels (csrc/reshard_cpu.cpp, csrc/reshard_cuda.cu), free of torch headers.
//
// A plan is n_blocks rows (src_offset, dst_offset, length), int64, in elements of elem_size bytes; row i copies
// src[src_offset, src_offset + length) to dst[dst_offset, dst_offset + length). Destination ranges do not
// overlap, so blocks may be copied in any order and in parallel. Callers check bounds (bindings.cpp does).
#pragma once

#include <cstdint>

#if defined(HYBRIDRL_WITH_CUDA) || defined(__CUDACC__)
#include <cuda_runtime.h>
#define HYBRIDRL_RESHARD_HAS_CUDA_API 1
// Bytes of one GPU work item: a longer block is split into several items, copied by several thread blocks.
#define HYBRIDRL_RESHARD_CHUNK_BYTES (int64_t{64} << 10)
#endif

extern "C" {

// CPU: one OpenMP pass; the plan's bytes are split evenly over num_threads, so threads share a huge block.
void hybridrl_block_copy_cpu(const void* src, void* dst, const int64_t* plan, int64_t n_blocks, int64_t elem_size,
                             int num_threads);

#ifdef HYBRIDRL_RESHARD_HAS_CUDA_API
// Host: write the GPU work table of `plan` (a host pointer) into `chunks` as rows (src_byte, dst_byte, n_bytes),
// each at most HYBRIDRL_RESHARD_CHUNK_BYTES; returns the number of rows. `chunks` may be null to only count.
int64_t hybridrl_block_copy_cuda_chunks(const int64_t* plan, int64_t n_blocks, int64_t elem_size, int64_t* chunks);

// Device: one kernel launch on `stream` copying every row of the work table `chunks_dev` (a device pointer).
cudaError_t hybridrl_block_copy_cuda(const void* src, void* dst, const int64_t* chunks_dev, int64_t n_chunks,
                                     cudaStream_t stream);
#endif

}  // extern "C"
