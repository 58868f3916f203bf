"""The CUDA reshard kernel (csrc/reshard_cuda.cu) run on the CPU against the PyTorch reference.

No GPU runs here, so the .cu file is compiled for the host as it is, with tests/ops/cuda_emulation/cuda_emulation.h
supplying the CUDA names: a launch becomes a loop over every (block, thread), which for this kernel (no shared
memory, no barriers, disjoint writes) yields the bytes a GPU writes. The kernel's own code runs: the host's chunking
into 64 KiB work items, the grid-stride loop, the choice of access width from the src/dst skew, the scalar head to
the 16-byte boundary, the 4-deep unrolled vector body and the scalar tail. The emulation also counts every chunk's
vector access width and flags a misaligned one (a GPU faults on those; a CPU would not notice).

Speed and the torch glue of bindings.cpp (pinned table, stream) need a GPU: tests/gpu/run.sh checks those.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hybridrl.ops.reshard_ref import block_copy_reference
from tests.ops.test_reshard_kernel import CXX, random_buffer, random_plan

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "csrc"
WIDTHS = (1, 2, 4, 8, 16)


class Emulated:
    """ctypes handle on one host build of the kernel."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.emulated_block_copy.restype = ctypes.c_int64
        self.lib.emulated_block_copy.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        self.max_grid = ctypes.CFUNCTYPE(ctypes.c_int64)(("emulated_max_grid", self.lib))()
        self.chunk_bytes = ctypes.CFUNCTYPE(ctypes.c_int64)(("emulated_chunk_bytes", self.lib))()

    def copy(self, rows: torch.Tensor) -> tuple[int, dict[int, int], int]:
        """Runs the address ``rows`` (n, 3) int64; returns (chunks, chunks per access width, misaligned chunks)."""
        rows = rows.contiguous()
        stats = torch.zeros(17, dtype=torch.int64)
        n_chunks = self.lib.emulated_block_copy(rows.data_ptr(), rows.shape[0], stats.data_ptr())
        assert n_chunks >= 0, "the emulated launch reported an error"
        return n_chunks, {w: int(stats[w]) for w in WIDTHS}, int(stats[0])


def build(out: Path, *defines: str) -> Emulated:
    if CXX is None:
        pytest.skip("no C++ compiler on PATH: the CUDA kernel cannot be built for the host")
    cmd = [CXX, "-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Werror", "-Wno-unknown-pragmas",
           "-DHYBRIDRL_CUDA_EMULATION", *defines, f"-I{CSRC}", f"-I{HERE / 'cuda_emulation'}",
           str(HERE / "cuda_emulation" / "harness.cpp"), "-o", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"host build of csrc/reshard_cuda.cu failed:\n{done.stderr[-3000:]}"
    return Emulated(out)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> Emulated:
    return build(tmp_path_factory.mktemp("cuda_emulation") / "reshard_cuda_host.so")


def address_rows(src: torch.Tensor, dst: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """The bindings' table (bindings.cpp address_rows): element plan -> (src_address, dst_address, n_bytes)."""
    es = src.element_size()
    plan = plan[plan[:, 2] > 0]
    return torch.stack([src.data_ptr() + plan[:, 0] * es, dst.data_ptr() + plan[:, 1] * es, plan[:, 2] * es], 1)


def run_against_reference(kernel: Emulated, src: torch.Tensor, plan: torch.Tensor, dst: torch.Tensor):
    expected = block_copy_reference(src, dst.clone(), plan)
    rows = address_rows(src, dst, plan)
    n_chunks, widths, misaligned = kernel.copy(rows)
    assert torch.equal(dst, expected), f"emulated CUDA kernel != reference ({src.dtype}, {plan.shape[0]} blocks)"
    assert misaligned == 0, f"{misaligned} chunks used a vector access a GPU would fault on"
    assert n_chunks == sum(math.ceil(int(b) / kernel.chunk_bytes) for b in rows[:, 2]) == sum(widths.values())
    return widths


def offset_view(n: int, dtype: torch.dtype, shift: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random elements starting ``shift`` elements into a fresh allocation (an address off 16 bytes)."""
    return random_buffer(n + shift, dtype, gen)[shift:]


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.int64], ids=str)
def test_random_plans_match_reference(kernel, dtype):
    gen = torch.Generator().manual_seed(11)
    es = torch.empty((), dtype=dtype).element_size()
    chunk = kernel.chunk_bytes // es
    for src_shift, dst_shift in [(0, 0), (1, 0), (0, 3), (5, 7)]:
        src = offset_view(700_001, dtype, src_shift, gen)
        lengths = [1, 3, 15, 16, 17, 255, 4097, chunk - 1, chunk, chunk + 1, 2 * chunk, 4 * chunk + 29]
        lengths += torch.randint(0, 40, (2000,), generator=gen).tolist()  # zero-length blocks included
        plan, dst_numel = random_plan(lengths, src.numel(), gen)
        run_against_reference(kernel, src, plan, offset_view(dst_numel, dtype, dst_shift, gen))


def test_every_access_width_runs_aligned(kernel):
    """Blocks whose src and dst addresses differ by 0, 8, 4, 2 and 1 mod 16, each starting off a 16-byte
    boundary, long enough for head, unrolled body and tail: all five widths run, none misaligned."""
    gen = torch.Generator().manual_seed(12)
    src = offset_view(1 << 20, torch.uint8, 0, gen)
    dst = offset_view(1 << 20, torch.uint8, 0, gen)
    rows, cursor = [], 3
    for skew in (0, 8, 4, 2, 1, 3, 9):
        for length in (1, 31, 16 * 256 * 4 + 77, 40_000):
            rows.append((cursor + skew + 16 * (len(rows) % 32), cursor, length))
            cursor += length + 11
    plan = torch.tensor(rows, dtype=torch.int64)
    widths = run_against_reference(kernel, src, plan, dst)
    assert all(widths[w] > 0 for w in WIDTHS), f"chunks per access width: {widths}"


def test_grid_stride_loop(tmp_path):
    """More chunks than thread blocks: a build whose grid is capped at 3 blocks still copies every chunk."""
    small = build(tmp_path / "grid3.so", "-DHYBRIDRL_RESHARD_MAX_GRID=3")
    assert small.max_grid == 3
    gen = torch.Generator().manual_seed(13)
    src = offset_view(400_000, torch.float16, 1, gen)
    lengths = [small.chunk_bytes // 2 * 3 + 1, *torch.randint(1, 300, (200,), generator=gen).tolist()]
    plan, dst_numel = random_plan(lengths, src.numel(), gen)
    run_against_reference(small, src, plan, offset_view(dst_numel, torch.float16, 0, gen))


def test_emulation_sees_a_wrong_kernel(tmp_path):
    """The check can fail: a kernel whose vector path ignores the dst alignment (copy_row<uint4> whenever the src
    is 16-byte aligned) is flagged as misaligned, and one that skips the scalar tail leaves bytes uncopied."""
    source = (CSRC / "reshard_cuda.cu").read_text()
    broken = {
        "src_only": source.replace("if (skew % 16 == 0)", "if (reinterpret_cast<uintptr_t>(s) % 16 == 0)"),
        "no_tail": source.replace("for (int64_t j = head + body * w", "for (int64_t j = n"),
    }
    gen = torch.Generator().manual_seed(14)
    src = offset_view(100_000, torch.uint8, 0, gen)
    plan = torch.tensor([[0, 1, 50_000], [16, 60_000, 1001]], dtype=torch.int64)
    for name, text in broken.items():
        assert text != source, f"mutation {name} no longer applies to csrc/reshard_cuda.cu"
        folder = tmp_path / name
        shutil.copytree(CSRC, folder)
        (folder / "reshard_cuda.cu").write_text(text)
        wrong = build(tmp_path / f"{name}.so", f"-I{folder}")
        dst = offset_view(100_000, torch.uint8, 0, gen)
        expected = block_copy_reference(src, dst.clone(), plan)
        _, _, misaligned = wrong.copy(address_rows(src, dst, plan))
        assert misaligned > 0 or not torch.equal(dst, expected), f"the emulation did not notice mutation {name}"
