// Torch extension `hybridrl._reshard`: block_copy(src, dst, plan) on CPU (reshard_cpu.cpp) or CUDA (reshard_cuda.cu).
//
// The CUDA path is compiled only with -DHYBRIDRL_WITH_CUDA (setup.py's CUDAExtension, or hybridrl/ops/_native.py's
// JIT build on a machine with a GPU). The plan is read on the host: keep it a CPU tensor (a CUDA plan is copied
// back, which synchronizes). Bounds are checked here too, so a bad plan raises instead of corrupting memory.
#include <torch/extension.h>

#include "reshard.h"

#ifdef HYBRIDRL_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace {

void check_args(const torch::Tensor& src, const torch::Tensor& dst, const torch::Tensor& plan) {
  TORCH_CHECK(src.dim() == 1 && dst.dim() == 1 && src.is_contiguous() && dst.is_contiguous(),
              "block_copy needs 1-D contiguous buffers, got src ", src.sizes(), " dst ", dst.sizes());
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "block_copy needs one dtype, got src ", src.scalar_type(),
              " and dst ", dst.scalar_type());
  TORCH_CHECK(src.device() == dst.device(), "block_copy needs one device, got src ", src.device(), " and dst ",
              dst.device());
  TORCH_CHECK(plan.scalar_type() == torch::kInt64 && plan.dim() == 2 && plan.size(1) == 3,
              "block_copy plan must be int64 (n, 3), got ", plan.scalar_type(), " ", plan.sizes());
}

void check_bounds(const int64_t* plan, int64_t n_blocks, int64_t src_numel, int64_t dst_numel) {
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t s = plan[3 * b], d = plan[3 * b + 1], n = plan[3 * b + 2];
    TORCH_CHECK(s >= 0 && d >= 0 && n >= 0 && s <= src_numel - n && d <= dst_numel - n, "block_copy plan row ", b,
                " (", s, ", ", d, ", ", n, ") leaves src (", src_numel, ") or dst (", dst_numel, ") elements");
  }
}

#ifdef HYBRIDRL_WITH_CUDA
void block_copy_cuda(const torch::Tensor& src, torch::Tensor& dst, const torch::Tensor& plan) {
  const c10::cuda::CUDAGuard guard(src.device());
  const int64_t* rows = plan.data_ptr<int64_t>();
  const int64_t n_blocks = plan.size(0);
  const int64_t n_chunks = hybridrl_block_copy_cuda_chunks(rows, n_blocks, src.element_size(), nullptr);
  if (n_chunks == 0) return;
  auto chunks = torch::empty({n_chunks, 3}, torch::dtype(torch::kInt64).pinned_memory(true));
  hybridrl_block_copy_cuda_chunks(rows, n_blocks, src.element_size(), chunks.data_ptr<int64_t>());
  // Pinned + non_blocking: the caching host allocator keeps `chunks` alive until the copy has run.
  const auto chunks_dev = chunks.to(src.device(), /*non_blocking=*/true);
  const cudaError_t err = hybridrl_block_copy_cuda(src.data_ptr(), dst.data_ptr(), chunks_dev.data_ptr<int64_t>(),
                                                   n_chunks, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "block_copy CUDA launch failed: ", cudaGetErrorString(err));
}
#endif

torch::Tensor block_copy(const torch::Tensor& src, torch::Tensor dst, const torch::Tensor& plan) {
  check_args(src, dst, plan);
  const auto host_plan = plan.to(torch::kCPU).contiguous();
  const int64_t n_blocks = host_plan.size(0);
  const int64_t* rows = host_plan.data_ptr<int64_t>();
  check_bounds(rows, n_blocks, src.numel(), dst.numel());
  if (n_blocks == 0) return dst;
  if (src.is_cpu()) {
    hybridrl_block_copy_cpu(src.data_ptr(), dst.data_ptr(), rows, n_blocks, src.element_size(),
                            at::get_num_threads());
    return dst;
  }
#ifdef HYBRIDRL_WITH_CUDA
  if (src.is_cuda()) {
    block_copy_cuda(src, dst, host_plan);
    return dst;
  }
#endif
  TORCH_CHECK(false, "block_copy: this build of hybridrl._reshard has no kernel for device ", src.device(),
              " (CUDA needs a build with HYBRIDRL_WITH_CUDA)");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hybridrl reshard kernels (csrc/): block copies between flat buffers";
  m.def("block_copy", &block_copy, "Copy plan's blocks (src_offset, dst_offset, length) from src into dst",
        py::arg("src"), py::arg("dst"), py::arg("plan"));
#ifdef HYBRIDRL_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
