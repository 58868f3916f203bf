"""Test driver: ``hybridrl train`` (the CLI's own ``main``) whose rank 1 freezes itself with SIGSTOP right before
the actor update of step ``HYBRIDRL_TEST_STOP_AT_STEP``, so that rank 0's next collective is deterministically
one of Megatron's tensor-parallel all-reduces (the groups that kept a fixed 10-minute timeout).

    torchrun --nproc-per-node 2 -m tests.distributed.stop_rank train CONFIG key=value ...
"""

import os
import signal
import sys

import hybridrl.trainer.rl_trainer as rl_trainer
from hybridrl.cli import main


def _stop_at(step: int) -> None:
    if step == int(os.environ["HYBRIDRL_TEST_STOP_AT_STEP"]) and os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGSTOP)


rl_trainer.crash_for_test = _stop_at  # the loop's test hook, called just before update_actor
sys.exit(main())
