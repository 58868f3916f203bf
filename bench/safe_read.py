"""Reading checkpoints without an unpickler vs torch's own readers: seconds (wall and CPU), same run, same files.

Three files are written once in a temporary folder and read alternately, ``--repeat`` times each (the minimum is
shown; the files are in the page cache):
- ``.pt``: an AdamW-like state (``--tensors`` parameters, each with ``step``, ``exp_avg``, ``exp_avg_sq`` of
  ``--rows`` x 512 fp32) through ``torch.load(weights_only=True)`` (baseline) and
  ``hybridrl.mcore.torch_file.load_torch_file``;
- DCP: ``--tensors`` fp32 tensors of ``--rows`` x 512 saved by ``torch.distributed.checkpoint``, loaded into
  preallocated tensors through ``FileSystemReader`` (baseline) and ``hybridrl.mcore.safe_dcp.SafeFileSystemReader``;
- its ``.metadata`` alone: ``pickle.load`` (baseline) and ``read_dcp_metadata``.

CPU seconds (``time.process_time``) are the steadier number on a shared machine; wall seconds include waiting.

    python bench/safe_read.py [--tensors 256] [--rows 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridrl.mcore.safe_dcp import SafeFileSystemReader, read_dcp_metadata
from hybridrl.mcore.torch_file import load_torch_file


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=256)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        pt, folder = os.path.join(tmp, "optim.pt"), os.path.join(tmp, "dcp")
        shape = (args.rows, 512)
        state = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(*shape, generator=g),
                     "exp_avg_sq": torch.rand(*shape, generator=g)} for i in range(args.tensors)}  # fmt: skip
        torch.save({"state": state}, pt)
        dcp.save({f"w{i}": torch.randn(*shape, generator=g) for i in range(args.tensors)}, checkpoint_id=folder,
                 no_dist=True)  # fmt: skip
        target = {f"w{i}": torch.empty(*shape) for i in range(args.tensors)}
        meta = os.path.join(folder, ".metadata")
        cases = {
            ".pt": (lambda: torch.load(pt, weights_only=True, map_location="cpu"), lambda: load_torch_file(pt)),
            "DCP": (lambda: dcp.load(target, storage_reader=FileSystemReader(folder), no_dist=True),
                    lambda: dcp.load(target, storage_reader=SafeFileSystemReader(folder), no_dist=True)),
            ".metadata": (lambda: pickle.loads(_read(meta)), lambda: read_dcp_metadata(meta)),
        }  # fmt: skip
        best = {(name, k): (float("inf"), float("inf")) for name in cases for k in (0, 1)}
        for _ in range(args.repeat):
            for name, pair in cases.items():
                for k, fn in enumerate(pair):  # alternate baseline and safe reader
                    wall, cpu = _timed(fn)
                    best[name, k] = (min(best[name, k][0], wall), min(best[name, k][1], cpu))
        mb = args.tensors * args.rows * 512 * 4 / 2**20
        print(f"{args.tensors} tensors of {shape}: .pt {2 * mb:.0f} MiB, DCP {mb:.0f} MiB; min of {args.repeat}")
        print(f"{'file':<10} {'torch wall s':>12} {'safe wall s':>12} {'ratio':>6} {'torch cpu s':>12} "
              f"{'safe cpu s':>11} {'ratio':>6}")  # fmt: skip
        for name in cases:
            (tw, tc), (sw, sc) = best[name, 0], best[name, 1]
            print(
                f"{name:<10} {tw:>12.4f} {sw:>12.4f} {sw / tw:>6.2f} {tc:>12.4f} {sc:>11.4f} {sc / max(tc, 1e-9):>6.2f}"
            )


if __name__ == "__main__":
    main()
