// C interface of the reshard kernels (csrc/reshard_cpu.cpp, csrc/reshard_cuda.cu), free of torch headers.
//
// The kernels work on a table of n_rows rows (src_address, dst_address, n_bytes), int64: row i copies n_bytes
// from src_address to dst_address. The bindings (bindings.cpp) build it from an element plan and the buffers'
// data pointers, so one table may write into many destination tensors (block_scatter: a vLLM model's parameters).
// Destination ranges do not overlap each other nor any source range (the source is another buffer), so rows may
// be copied in any order and in parallel. Callers check bounds.
#pragma once

#include <cstdint>

#if defined(HYBRIDRL_WITH_CUDA) || defined(__CUDACC__) || defined(HYBRIDRL_CUDA_EMULATION)
#ifndef HYBRIDRL_CUDA_EMULATION  // tests/ops/cuda_emulation/ defines the few CUDA names used here for a host build
#include <cuda_runtime.h>
#endif
#define HYBRIDRL_RESHARD_HAS_CUDA_API 1
// Bytes of one GPU work item: a longer row is split into several items, copied by several thread blocks.
#define HYBRIDRL_RESHARD_CHUNK_BYTES (int64_t{64} << 10)
#endif

extern "C" {

// CPU: one OpenMP pass; the rows' bytes are split evenly over num_threads, so threads share a huge row.
void hybridrl_block_copy_cpu(const int64_t* rows, int64_t n_rows, int num_threads);

#ifdef HYBRIDRL_RESHARD_HAS_CUDA_API
// Host: write the GPU work table of `rows` (a host pointer) into `chunks`, rows of the same form each at most
// HYBRIDRL_RESHARD_CHUNK_BYTES long; returns the number of chunks. `chunks` may be null to only count.
int64_t hybridrl_block_copy_cuda_chunks(const int64_t* rows, int64_t n_rows, int64_t* chunks);

// Device: one kernel launch on `stream` copying every chunk of the work table `chunks_dev` (a device pointer).
cudaError_t hybridrl_block_copy_cuda(const int64_t* chunks_dev, int64_t n_chunks, cudaStream_t stream);
#endif

}  // extern "C"
