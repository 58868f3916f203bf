"""The integrity manifest of a trainer checkpoint: every file's size and hash, recorded at save, checked at resume.

    global_step_N/manifest.json   {"format": 1, "hash": "blake3" | "blake2b", "files": {path: [bytes, hexdigest]}}

A shard cut short on disk (a full disk, a copy interrupted, a node lost mid-write) otherwise surfaces deep
inside Megatron's reader as an ``EOFError`` naming no file, or loads garbage. With the manifest, resume names
the file and the trainer falls back to an older checkpoint (``hybridrl.trainer.checkpoint``).

Cost: sizes are one ``stat`` per file. The hash is BLAKE3 when the ``blake3`` package is importable (vLLM
brings it), else the standard library's BLAKE2b; one core of a busy 2-core CI box took 0.14-0.20 s per GB
with BLAKE3 and 0.76-1.4 s per GB with BLAKE2b, reading page-cached files (0.04 s per GB of that is the
read; from a cold disk, add its read time). The files are spread over the ranks by size, so each rank
hashes about 1/world of the checkpoint, at save and at resume. A checkpoint saved with BLAKE3 and resumed
where it is missing is checked by sizes only (one note). The manifest guards against accidents, not
attackers: whoever can rewrite a file can rewrite the manifest (``hybridrl.mcore.checkpoint_safety`` is what
stops planted code).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch.distributed as dist

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


def _hash_name() -> str:
    try:
        import blake3  # noqa: F401  (optional: three times faster than BLAKE2b)
    except ImportError:
        return "blake2b"
    return "blake3"


def _digest(path: str, algorithm: str) -> str:
    if algorithm == "blake3":
        import blake3

        h: Any = blake3.blake3()
    else:
        h = hashlib.blake2b()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` hashes: largest first, each to the least-loaded rank (the same on every rank)."""
    load, mine = [0] * world, []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += sizes[name]
        if r == rank:
            mine.append(name)
    return mine


def gather(value: Any) -> list[Any]:
    """``value`` of every rank, indexed by rank (collective)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def write_manifest(folder: str) -> None:
    """Record the size and hash of every file under ``folder`` in ``folder/manifest.json``. Collective: call it
    once every rank's files are written; rank 0 lists and writes, every rank hashes its share."""
    listing: list[Any] = [None]
    if dist.get_rank() == 0:
        files = {}
        for parent, _, names in os.walk(folder):
            for name in names:
                path = os.path.join(parent, name)
                files[os.path.relpath(path, folder)] = os.path.getsize(path)
        listing = [(files, _hash_name())]
    dist.broadcast_object_list(listing, src=0)
    sizes, algorithm = listing[0]
    share = _share(sizes, dist.get_rank(), dist.get_world_size())
    mine = {n: _digest(os.path.join(folder, n), algorithm) for n in share}
    digests = {n: d for part in gather(mine) for n, d in part.items()}
    if dist.get_rank() == 0:
        manifest = {"format": 1, "hash": algorithm, "files": {n: [sizes[n], digests[n]] for n in sorted(sizes)}}
        tmp = os.path.join(folder, MANIFEST + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=0)
        os.replace(tmp, os.path.join(folder, MANIFEST))


def read_manifest(folder: str) -> dict[str, Any] | None:
    """``folder``'s manifest (None when it has none: saved by an earlier hybridrl).

    Raises:
        ValueError: the manifest exists but cannot be parsed (message names the file).
    """
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        files = {str(n): (int(size), str(digest)) for n, (size, digest) in manifest["files"].items()}
        return {"hash": str(manifest["hash"]), "files": files}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} cannot be read ({type(err).__name__}: {err}); the checkpoint is corrupt") from None


def check_files(folder: str, manifest: dict[str, Any], rank: int, world: int) -> str | None:
    """The first problem with this rank's share of ``folder``'s files (None: sizes and hashes match); the
    caller agrees the verdict over the ranks. Hashes are compared only when this machine has the algorithm."""
    files, algorithm = manifest["files"], manifest["hash"]
    hashed = can_hash(manifest)
    for name in _share({n: size for n, (size, _) in files.items()}, rank, world):
        path, (size, digest) = os.path.join(folder, name), files[name]
        if not os.path.isfile(path):
            return f"{path} is missing (it was written at save)"
        found = os.path.getsize(path)
        if found != size:
            return f"{path} is {found} bytes, {size} at save (cut short or overwritten)"
        if hashed and _digest(path, algorithm) != digest:
            return f"{path} does not match its {algorithm} hash at save (its bytes changed on disk)"
    return None


def can_hash(manifest: dict[str, Any]) -> bool:
    """Whether this machine can compute the manifest's hash (else :func:`check_files` compares sizes only)."""
    return manifest["hash"] in ("blake2b", _hash_name())
