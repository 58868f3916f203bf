"""The checkpoint check reads a pickle's globals from its opcodes, building nothing: what it finds is what an
unpickler would import, and a pickle that hides its names from that reading is refused."""

from __future__ import annotations

import pickle
from collections import OrderedDict

import pytest

from hybridrl.mcore.checkpoint_safety import UnsafeCheckpointError, pickle_globals


class _Payload:
    def __reduce__(self):
        return (exec, ("raise SystemExit('ran')",))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_globals_are_read_without_running_anything(protocol):
    assert pickle_globals(pickle.dumps(OrderedDict(a=1), protocol=protocol), "f") == {("collections", "OrderedDict")}
    assert pickle_globals(pickle.dumps(_Payload(), protocol=protocol), "f") == {("builtins", "exec")}
    both = pickle.dumps([OrderedDict(), OrderedDict(), _Payload()], protocol=protocol)  # memo gets of the names
    assert pickle_globals(both, "f") == {("collections", "OrderedDict"), ("builtins", "exec")}


def test_a_stack_global_whose_names_were_swapped_under_it_is_refused():
    # pushes "os", "system", then two allowed-looking names it pops again: the unpickler would import os.system
    names = b"".join(b"\x8c" + bytes([len(n)]) + n for n in (b"os", b"system", b"collections", b"OrderedDict"))
    trick = b"\x80\x04" + names + b"00\x93."
    with pytest.raises(UnsafeCheckpointError, match="STACK_GLOBAL whose module and name are not literal strings"):
        pickle_globals(trick, "f")
