"""Suite-wide setup: multi-rank launches (:func:`hybridrl.distributed.spawn.run_ranks`) fork their ranks from a
server that imported the heavy libraries once, instead of importing them in every rank of every launch.
``HYBRIDRL_TEST_SPAWN=1`` spawns every rank afresh instead (to tell a test's own failure from the fork server's)."""

import os

from hybridrl.distributed import spawn

if os.environ.get("HYBRIDRL_TEST_SPAWN") != "1":
    spawn.preload(["torch", "torch.distributed", "transformers", "megatron.core", "megatron.core.models.gpt",
                   "megatron.core.optimizer", "megatron.core.dist_checkpointing", "vllm.entrypoints.llm"])  # fmt: skip
