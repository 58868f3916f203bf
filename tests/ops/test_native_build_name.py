"""The JIT build of csrc/ is cached per checkout: two checkouts sharing torch's extension cache do not rebuild each
other's build (torch rebuilds a named build whenever its arguments, the include path among them, change)."""

from __future__ import annotations

from pathlib import Path

from hybridrl.ops import _native


def test_one_cached_build_per_checkout(tmp_path):
    here = _native.build_name(_native.CSRC, with_cuda=False)
    assert here == _native.build_name(Path(str(_native.CSRC) + "/."), with_cuda=False)  # the same folder
    assert here != _native.build_name(tmp_path / "other_checkout" / "csrc", with_cuda=False)
    assert here != _native.build_name(_native.CSRC, with_cuda=True)
    assert here.startswith("hybridrl_reshard_") and here.isidentifier()  # a valid Python module name
