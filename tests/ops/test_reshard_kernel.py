"""The native reshard kernel (csrc/) against its PyTorch reference, and a compile check of the CUDA kernel.

The CPU kernel is built here (JIT, about a minute the first time, then cached) whenever a C++ compiler is on PATH;
a failed build fails these tests rather than skipping them. Plans are random: odd lengths, offsets off any 16-byte
boundary, 10k tiny blocks, one huge block shared by threads, blocks touching both buffer ends.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

import hybridrl.ops as ops
from hybridrl.ops import _native
from hybridrl.ops.reshard_ref import block_copy_reference, block_scatter_reference

CSRC = Path(__file__).resolve().parents[2] / "csrc"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64]
CXX = shutil.which(os.environ.get("CXX", "c++"))


@pytest.fixture(scope="module")
def ext():
    if CXX is None:
        pytest.skip(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH: the native kernel cannot be built")
    return _native.load()  # raises (the test fails) when the build fails


@pytest.fixture
def threads():
    """Four threads, so the kernel splits large plans between threads even on a 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield 4
    torch.set_num_threads(before)


def random_buffer(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), (n,), generator=gen, dtype=dtype)


def random_plan(lengths: list[int], src_numel: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Blocks of ``lengths`` in shuffled order with small gaps in dst, random (overlapping) src offsets."""
    order = torch.randperm(len(lengths), generator=gen).tolist()
    rows, cursor = [None] * len(lengths), 0
    for i in order:
        cursor += int(torch.randint(0, 4, (1,), generator=gen))
        src_offset = int(torch.randint(0, src_numel - lengths[i] + 1, (1,), generator=gen))
        rows[i] = (src_offset, cursor, lengths[i])
        cursor += lengths[i]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3), cursor + int(torch.randint(0, 5, (1,), generator=gen))


def assert_matches_reference(ext, src: torch.Tensor, plan: torch.Tensor, dst_numel: int, gen: torch.Generator):
    dst = random_buffer(dst_numel, src.dtype, gen)  # bytes outside the plan must survive
    expected = block_copy_reference(src, dst.clone(), plan)
    out = ext.block_copy(src, dst, plan)
    assert out.data_ptr() == dst.data_ptr()
    assert torch.equal(dst, expected), f"native != reference for {src.dtype}, {plan.shape[0]} blocks"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_plans_match_reference(ext, threads, dtype):
    gen = torch.Generator().manual_seed(0)
    src = random_buffer(300_001, dtype, gen)
    odd = [1, 3, 7, 1023, 1025, 4097]
    for trial in range(4):
        lengths = odd + torch.randint(1, 20_000 if trial % 2 else 64, (60,), generator=gen).tolist()
        plan, dst_numel = random_plan(lengths, src.numel(), gen)
        assert_matches_reference(ext, src, plan, dst_numel, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
def test_ten_thousand_small_blocks(ext, threads, dtype):
    gen = torch.Generator().manual_seed(1)
    src = random_buffer(50_003, dtype, gen)
    plan, dst_numel = random_plan(torch.randint(1, 9, (10_000,), generator=gen).tolist(), src.numel(), gen)
    assert_matches_reference(ext, src, plan, dst_numel, gen)


def test_one_huge_block_is_shared_by_threads(ext, threads):
    gen = torch.Generator().manual_seed(2)
    src = random_buffer(6_000_011, torch.bfloat16, gen)
    plan = torch.tensor([[5, 3, 6_000_001]])  # 12 MB at odd offsets: cut between the 4 threads mid-block
    assert_matches_reference(ext, src, plan, 6_000_007, gen)
    mixed = torch.tensor([[0, 0, 7], [11, 7, 5_999_990], [6_000_004, 5_999_997, 7]])  # huge block between tiny ones
    assert_matches_reference(ext, src, mixed, 6_000_004, gen)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blocks_at_buffer_ends(ext, dtype):
    gen = torch.Generator().manual_seed(3)
    n = 1031
    src = random_buffer(n, dtype, gen)
    swap_ends = torch.tensor([[0, n - 10, 10], [n - 10, 0, 10], [10, 10, n - 20]])  # tail/head swapped, middle kept
    whole = torch.tensor([[0, 0, n]])
    for plan in (swap_ends, whole):
        assert_matches_reference(ext, src, plan, n, gen)


def test_empty_plan_and_empty_blocks_leave_dst(ext):
    src, dst = torch.arange(8.0), torch.full((8,), -1.0)
    for plan in (torch.zeros(0, 3, dtype=torch.int64), torch.tensor([[0, 0, 0], [8, 8, 0]])):
        ext.block_copy(src, dst, plan)
        assert torch.equal(dst, torch.full((8,), -1.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA kernel is only compile-checked")
def test_cuda_kernel_matches_reference(ext):
    assert ext.with_cuda, "torch sees a GPU but the extension was built without the CUDA kernel"
    gen = torch.Generator().manual_seed(4)
    for dtype in DTYPES:
        src = random_buffer(2_000_003, dtype, gen)
        lengths = [1, 3, 7, 1023, 1_000_003, *torch.randint(1, 9, (10_000,), generator=gen).tolist()]
        plan, dst_numel = random_plan(lengths, src.numel(), gen)
        dst = random_buffer(dst_numel, dtype, gen)
        expected = block_copy_reference(src, dst.clone(), plan)
        out = ext.block_copy(src.cuda(), dst.cuda(), plan)  # plan stays on the CPU
        assert torch.equal(out.cpu(), expected), f"CUDA kernel != reference for {dtype}"
        dsts, splan = random_scatter(src.numel(), [(33,), (96, 1031), (1,), (700, 1001)], dtype, gen)
        want = [d.clone() for d in dsts]
        block_scatter_reference(src, want, splan)
        got = [d.cuda() for d in dsts]
        ext.block_scatter(src.cuda(), got, splan)
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True)), f"CUDA scatter != ref ({dtype})"


def random_scatter(src_numel: int, shapes: list[tuple[int, ...]], dtype, gen: torch.Generator):
    """Destination tensors of ``shapes`` (pre-filled with noise) and a plan that fills random disjoint pieces of
    them: every tensor cut at random points into blocks, blocks shuffled, ~1/8 of them left out (kept as is)."""
    dsts = [random_buffer(math.prod(s), dtype, gen).view(s) for s in shapes]
    rows = []
    for i, d in enumerate(dsts):
        cuts = sorted({0, d.numel(), *torch.randint(0, d.numel() + 1, (8,), generator=gen).tolist()})
        for a, b in itertools.pairwise(cuts):
            if int(torch.randint(0, 8, (1,), generator=gen)) != 0:
                rows.append((int(torch.randint(0, src_numel - (b - a) + 1, (1,), generator=gen)), i, a, b - a))
    order = torch.randperm(len(rows), generator=gen).tolist()
    return dsts, torch.tensor([rows[k] for k in order], dtype=torch.int64).reshape(-1, 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_into_many_tensors_matches_reference(ext, threads, dtype):
    gen = torch.Generator().manual_seed(5)
    src = random_buffer(400_003, dtype, gen)
    # vLLM-like targets: a norm, odd-sized matrices, a big one split between threads, a 1-element tensor
    shapes = [(33,), (7, 13), (96, 1031), (1,), (3, 5, 7), (389, 1000)]
    for _ in range(3):
        dsts, plan = random_scatter(src.numel(), shapes, dtype, gen)
        expected = [d.clone() for d in dsts]
        block_scatter_reference(src, expected, plan)
        ext.block_scatter(src, dsts, plan)
        for i, (got, want) in enumerate(zip(dsts, expected, strict=True)):
            assert torch.equal(got, want), f"native scatter != reference in destination {i} ({dtype})"


def test_targets_may_be_parameters(ext):
    """vLLM's parameters (requires_grad) are written in place by both paths, as plain tensors are."""
    src = torch.arange(10, dtype=torch.float32)
    plan = torch.tensor([[2, 0, 1, 3]])
    for impl in (block_scatter_reference, ext.block_scatter):
        dst = torch.nn.Parameter(torch.zeros(5))
        impl(src, [dst], plan)
        assert dst.detach().tolist() == [0, 2, 3, 4, 0] and dst.grad_fn is None
    dst = torch.nn.Parameter(torch.zeros(5))
    block_copy_reference(src, dst, torch.tensor([[2, 1, 3]]))
    assert dst.detach().tolist() == [0, 2, 3, 4, 0]


def test_scatter_equals_copy_into_views_of_one_buffer(ext):
    """block_scatter into views of one buffer == block_copy into the buffer with the offsets added."""
    gen = torch.Generator().manual_seed(6)
    src = random_buffer(10_007, torch.float32, gen)
    plan, dst_numel = random_plan(torch.randint(1, 300, (40,), generator=gen).tolist(), src.numel(), gen)
    whole = random_buffer(dst_numel, torch.float32, gen)
    split = whole.numel() // 3
    views = [whole[:split], whole[split:]]
    index = (plan[:, 1] >= split).long()
    scatter = torch.stack([plan[:, 0], index, plan[:, 1] - index * split, plan[:, 2]], dim=1)
    crossing = (index == 0) & (plan[:, 1] + plan[:, 2] > split)  # a block across the cut is split in two
    plan, scatter = plan[~crossing], scatter[~crossing]
    expected = ext.block_copy(src, whole.clone(), plan)
    ext.block_scatter(src, views, scatter)
    assert torch.equal(whole, expected)


BAD = {
    "past src end": (torch.zeros(10), torch.zeros(10), torch.tensor([[5, 0, 6]])),
    "past dst end": (torch.zeros(10), torch.zeros(10), torch.tensor([[0, 9, 2]])),
    "negative offset": (torch.zeros(10), torch.zeros(10), torch.tensor([[-1, 0, 1]])),
    "negative length": (torch.zeros(10), torch.zeros(10), torch.tensor([[2, 2, -1]])),
    "int32 plan": (torch.zeros(10), torch.zeros(10), torch.tensor([[0, 0, 1]], dtype=torch.int32)),
    "plan (n, 2)": (torch.zeros(10), torch.zeros(10), torch.tensor([[0, 0]])),
    "dtypes differ": (torch.zeros(10), torch.zeros(10, dtype=torch.float16), torch.tensor([[0, 0, 1]])),
    "2-D src": (torch.zeros(2, 5), torch.zeros(10), torch.tensor([[0, 0, 1]])),
    "strided dst": (torch.zeros(10), torch.zeros(20)[::2], torch.tensor([[0, 0, 1]])),
}


BAD_SCATTER = {
    "destination index past the list": ([torch.zeros(4)], torch.tensor([[0, 1, 0, 1]])),
    "past a destination's end": ([torch.zeros(4), torch.zeros(2, 3)], torch.tensor([[0, 1, 5, 2]])),
    "past src end": ([torch.zeros(20)], torch.tensor([[9, 0, 0, 2]])),
    "negative index": ([torch.zeros(4)], torch.tensor([[0, -1, 0, 1]])),
    "plan (n, 3)": ([torch.zeros(4)], torch.tensor([[0, 0, 1]])),
    "dtype of a destination": ([torch.zeros(4), torch.zeros(4, dtype=torch.float64)], torch.tensor([[0, 0, 0, 1]])),
    "strided destination": ([torch.zeros(4, 4).t()], torch.tensor([[0, 0, 0, 1]])),
}


@pytest.mark.parametrize("case", list(BAD_SCATTER))
def test_invalid_scatter_plans_raise(ext, case):
    dsts, plan = BAD_SCATTER[case]
    src = torch.zeros(10)
    before = [d.clone() for d in dsts]
    with pytest.raises(ValueError, match="block_scatter"):
        ops.block_scatter(src, dsts, plan)
    with pytest.raises(RuntimeError, match="block_copy"):
        ext.block_scatter(src, dsts, plan)
    assert all(torch.equal(a, b) for a, b in zip(dsts, before, strict=True)), "a refused plan wrote something"


@pytest.mark.parametrize("case", list(BAD))
def test_invalid_plans_raise(ext, case):
    src, dst, plan = BAD[case]
    with pytest.raises(ValueError, match="block_copy"):
        ops.block_copy(src, dst, plan)  # check_plan, before any kernel
    with pytest.raises(RuntimeError, match="block_copy"):
        ext.block_copy(src, dst, plan)  # the extension checks too: a bad plan raises, never writes out of bounds


def test_ops_dispatch(ext, monkeypatch):
    monkeypatch.delenv("HYBRIDRL_NATIVE", raising=False)
    assert ops.native_available(), "a C++ compiler is present, so the native kernel must be in use"

    def no_reference(*args):
        raise AssertionError("hybridrl.ops.block_copy fell back to the reference")

    monkeypatch.setattr(ops, "block_copy_reference", no_reference)
    dst = ops.block_copy(torch.arange(6.0), torch.zeros(6), torch.tensor([[0, 3, 3]]))
    assert dst.tolist() == [0, 0, 0, 0, 1, 2]
    monkeypatch.undo()
    monkeypatch.setenv("HYBRIDRL_NATIVE", "0")
    assert not ops.native_available()
    assert ops.block_copy(torch.arange(6.0), torch.zeros(6), torch.tensor([[0, 3, 3]])).tolist() == [0, 0, 0, 0, 1, 2]
    monkeypatch.setenv("HYBRIDRL_NATIVE", "yes")
    with pytest.raises(ValueError, match="HYBRIDRL_NATIVE"):
        ops.native_available()


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    candidates = [found] if found else sorted(Path("/usr/local").glob("cuda*/bin/nvcc"), reverse=True)
    return str(candidates[0]) if candidates else None


def test_cpu_only_build_is_replaced_or_reported_on_cuda(monkeypatch):
    """An installed extension without CUDA: rebuilt with CUDA where the machine can, else CUDA tensors fall
    back to the reference with a warning, not silently."""
    import types

    from hybridrl.ops import _native

    cpu_only = types.SimpleNamespace(with_cuda=False)
    with_cuda = types.SimpleNamespace(with_cuda=True)
    monkeypatch.setattr(_native.importlib, "import_module", lambda name: cpu_only)
    monkeypatch.setattr(_native, "_jit_build", lambda: with_cuda)
    for buildable, expected in ((True, with_cuda), (False, cpu_only)):
        monkeypatch.setattr(_native, "_cuda_buildable", lambda b=buildable: b)
        _native.load.cache_clear()
        assert _native.load() is expected
    _native.load.cache_clear()
    monkeypatch.undo()
    monkeypatch.setattr(ops, "native_module", lambda: cpu_only)
    ops._warn_no_cuda_kernel.cache_clear()
    fake_cuda_src = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.warns(RuntimeWarning, match="no CUDA build here"):
        assert ops._native_for(fake_cuda_src) is None
    assert ops._native_for(torch.zeros(1)) is cpu_only


def test_cuda_sources_compile(tmp_path):
    """No GPU here: compile reshard_cuda.cu for sm_90 and type-check bindings.cpp's CUDA path (torch headers)."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, /usr/local/cuda*/bin): cannot compile-check csrc/reshard_cuda.cu")
    cmd = [nvcc, "-gencode=arch=compute_90,code=sm_90", "-O3", "-c", str(CSRC / "reshard_cuda.cu")]
    run = {"capture_output": True, "text": True, "timeout": 600}  # nvcc takes minutes on a loaded 2-core machine
    result = subprocess.run([*cmd, "-o", str(tmp_path / "reshard_cuda.o")], **run)
    assert result.returncode == 0, result.stderr
    # bindings.cpp through nvcc (which adds the CUDA include dir) to the host compiler, -fsyntax-only. The CPU wheel
    # of torch lacks one generated c10/cuda header (a CUDA build has it); an empty stub stands in.
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n")
    torch_include = Path(torch.__file__).parent / "include"
    includes = [CSRC, torch_include, torch_include / "torch/csrc/api/include", tmp_path / "stub"]
    check = [nvcc, "-std=c++20", "-c", "-Xcompiler", "-fsyntax-only", "-DHYBRIDRL_WITH_CUDA"]
    check += ["-DTORCH_EXTENSION_NAME=_reshard", *[f"-I{p}" for p in [*includes, sysconfig.get_paths()["include"]]]]
    result = subprocess.run([*check, str(CSRC / "bindings.cpp"), "-o", str(tmp_path / "bindings.o")], **run)
    assert result.returncode == 0, result.stderr[-4000:]
