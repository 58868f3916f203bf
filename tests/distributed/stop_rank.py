"""Test driver: ``hybridrl train`` (the CLI's own ``main``) whose rank 1 freezes itself with SIGSTOP right before
the actor update of step ``HYBRIDRL_TEST_STOP_AT_STEP``, so that rank 0's next collective is deterministically
one of Megatron's tensor-parallel all-reduces (the groups that kept a fixed 10-minute timeout).

    torchrun --nproc-per-node 2 -m tests.distributed.stop_rank train CONFIG key=value ...
"""

import functools
import os
import signal
import sys

from hybridrl.cli import main
from hybridrl.workers.megatron_workers import ActorRolloutWorker

_update_actor = ActorRolloutWorker.update_actor


@functools.wraps(_update_actor)  # keeps the method's dispatch registration
def _stop_then_update(self, data):
    # the actor's version counts its updates: step N's update starts at version N - 1
    if self.version == int(os.environ["HYBRIDRL_TEST_STOP_AT_STEP"]) - 1 and os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    return _update_actor(self, data)


ActorRolloutWorker.update_actor = _stop_then_update
sys.exit(main())
