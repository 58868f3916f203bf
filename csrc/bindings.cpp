// Torch extension `hybridrl._reshard`: element plans over torch tensors -> the address tables of the kernels in
// reshard_cpu.cpp / reshard_cuda.cu.
//
//   block_copy(src, dst, plan)      plan rows (src_offset, dst_offset, length): one flat destination buffer
//   block_scatter(src, dsts, plan)  plan rows (src_offset, dst_index, dst_offset, length): many destination
//                                   tensors (e.g. a vLLM model's parameters), still one pass / one launch
//
// The CUDA path is compiled only with -DHYBRIDRL_WITH_CUDA (setup.py's CUDAExtension, or hybridrl/ops/_native.py's
// JIT build on a machine with a GPU). The plan is read on the host: keep it a CPU tensor (a CUDA plan is copied
// back, which synchronizes). Bounds are checked here too, so a bad plan raises instead of corrupting memory.
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "reshard.h"
#include "shm_barrier.h"

#ifdef HYBRIDRL_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

void check_buffer(const torch::Tensor& src, const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_contiguous(), "block_copy needs contiguous buffers, got a strided ", what, " ", t.sizes());
  TORCH_CHECK(src.scalar_type() == t.scalar_type(), "block_copy needs one dtype, got src ", src.scalar_type(),
              " and ", what, " ", t.scalar_type());
  TORCH_CHECK(src.device() == t.device(), "block_copy needs one device, got src ", src.device(), " and ", what, " ",
              t.device());
}

torch::Tensor host_plan(const torch::Tensor& plan, int64_t cols) {
  TORCH_CHECK(plan.scalar_type() == torch::kInt64 && plan.dim() == 2 && plan.size(1) == cols,
              "block_copy plan must be int64 (n, ", cols, "), got ", plan.scalar_type(), " ", plan.sizes());
  return plan.to(torch::kCPU).contiguous();
}

// Address rows (src_address, dst_address, n_bytes) of an element plan; `dst_col` < 0: every row targets dsts[0].
torch::Tensor address_rows(const torch::Tensor& src, const std::vector<torch::Tensor>& dsts, const torch::Tensor& plan,
                           int64_t dst_col) {
  const int64_t cols = plan.size(1), n = plan.size(0), es = src.element_size();
  const int64_t* p = plan.data_ptr<int64_t>();
  auto rows = torch::empty({n, 3}, torch::kInt64);  // read on the host only
  int64_t* r = rows.data_ptr<int64_t>();
  const auto base = reinterpret_cast<intptr_t>(src.data_ptr());
  int64_t kept = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t* row = p + cols * b;
    const int64_t s = row[0], i = dst_col < 0 ? 0 : row[dst_col], d = row[cols - 2], len = row[cols - 1];
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(dsts.size()), "block_copy plan row ", b, " names destination ", i,
                " of ", dsts.size());
    const int64_t dst_numel = dsts[i].numel();
    TORCH_CHECK(s >= 0 && d >= 0 && len >= 0 && s <= src.numel() - len && d <= dst_numel - len, "block_copy plan row ",
                b, " (", s, ", ", d, ", ", len, ") leaves src (", src.numel(), ") or dst (", dst_numel, ") elements");
    if (len == 0) continue;
    r[3 * kept] = static_cast<int64_t>(base + s * es);
    r[3 * kept + 1] = static_cast<int64_t>(reinterpret_cast<intptr_t>(dsts[i].data_ptr()) + d * es);
    r[3 * kept + 2] = len * es;
    ++kept;
  }
  return rows.narrow(0, 0, kept);
}

#ifdef HYBRIDRL_WITH_CUDA
void run_cuda(const torch::Tensor& src, const torch::Tensor& rows) {
  const c10::cuda::CUDAGuard guard(src.device());
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t n_chunks = hybridrl_block_copy_cuda_chunks(r, rows.size(0), nullptr);
  if (n_chunks == 0) return;
  auto chunks = torch::empty({n_chunks, 3}, torch::dtype(torch::kInt64).pinned_memory(true));
  hybridrl_block_copy_cuda_chunks(r, rows.size(0), chunks.data_ptr<int64_t>());
  // Pinned + non_blocking: the caching host allocator keeps `chunks` alive until the copy has run.
  const auto chunks_dev = chunks.to(src.device(), /*non_blocking=*/true);
  const cudaError_t err =
      hybridrl_block_copy_cuda(chunks_dev.data_ptr<int64_t>(), n_chunks, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "block_copy CUDA launch failed: ", cudaGetErrorString(err));
}
#endif

void run(const torch::Tensor& src, const std::vector<torch::Tensor>& dsts, const torch::Tensor& plan, int64_t dst_col) {
  const auto rows = address_rows(src, dsts, plan, dst_col);
  if (rows.size(0) == 0) return;
  if (src.is_cpu()) {
    hybridrl_block_copy_cpu(rows.data_ptr<int64_t>(), rows.size(0), at::get_num_threads());
    return;
  }
#ifdef HYBRIDRL_WITH_CUDA
  if (src.is_cuda()) {
    run_cuda(src, rows);
    return;
  }
#endif
  TORCH_CHECK(false, "block_copy: this build of hybridrl._reshard has no kernel for device ", src.device(),
              " (CUDA needs a build with HYBRIDRL_WITH_CUDA)");
}

torch::Tensor block_copy(const torch::Tensor& src, torch::Tensor dst, const torch::Tensor& plan) {
  TORCH_CHECK(src.dim() == 1 && dst.dim() == 1 && src.is_contiguous() && dst.is_contiguous(),
              "block_copy needs 1-D contiguous buffers, got src ", src.sizes(), " dst ", dst.sizes());
  check_buffer(src, dst, "dst");
  run(src, {dst}, host_plan(plan, 3), -1);
  return dst;
}

void block_scatter(const torch::Tensor& src, const std::vector<torch::Tensor>& dsts, const torch::Tensor& plan) {
  TORCH_CHECK(src.dim() == 1 && src.is_contiguous(), "block_copy needs a 1-D contiguous src, got ", src.sizes());
  for (const auto& d : dsts) check_buffer(src, d, "destination");
  run(src, dsts, host_plan(plan, 4), 1);
}

// hybridrl_shm_barrier over an int64 CPU tensor of counters (a view of a shared mapping), without the GIL while it
// waits (other Python threads of the rank go on). Returns (code, peer): code 0 ok, 1 timeout, 2 peer gone.
std::tuple<int64_t, int64_t> shm_barrier(const torch::Tensor& counters, int64_t stride, int64_t rank, int64_t round,
                                         double timeout_s, double spin_us, const std::vector<int64_t>& pids) {
  const auto world = static_cast<int64_t>(pids.size());
  TORCH_CHECK(counters.is_cpu() && counters.scalar_type() == torch::kInt64 && counters.is_contiguous(),
              "shm_barrier needs a contiguous int64 CPU tensor of counters, got ", counters.scalar_type(), " ",
              counters.device());
  TORCH_CHECK(stride >= 1 && world >= 1 && rank >= 0 && rank < world && counters.numel() >= world * stride,
              "shm_barrier: rank ", rank, " of ", world, " with stride ", stride, " needs ", world * stride,
              " counters, got ", counters.numel());
  int64_t* c = counters.data_ptr<int64_t>();
  int64_t peer = -1;
  int64_t code;
  {
    pybind11::gil_scoped_release no_gil;
    code = hybridrl_shm_barrier(c, stride, world, rank, round, timeout_s, spin_us, pids.data(), &peer);
  }
  return {code, peer};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hybridrl native code (csrc/): the reshard block copies and the shared-memory barrier";
  m.def("block_copy", &block_copy, "Copy plan's blocks (src_offset, dst_offset, length) from src into dst",
        py::arg("src"), py::arg("dst"), py::arg("plan"));
  m.def("block_scatter", &block_scatter,
        "Copy plan's blocks (src_offset, dst_index, dst_offset, length) from src into dsts[dst_index]",
        py::arg("src"), py::arg("dsts"), py::arg("plan"));
  m.def("shm_barrier", &shm_barrier,
        "Barrier of one host's processes over shared-memory counters: (code, peer), code 0 ok, 1 timeout, 2 peer gone",
        py::arg("counters"), py::arg("stride"), py::arg("rank"), py::arg("round"), py::arg("timeout_s"),
        py::arg("spin_us"), py::arg("pids"));
#ifdef HYBRIDRL_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
