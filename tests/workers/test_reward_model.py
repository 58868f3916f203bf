"""RewardModelWorker on 2 gloo ranks (TP 2) vs HF transformers' sequence classifier on the same checkpoint.

The score of each response is the classifier's scalar at the response's last valid token; the batch has
left-padded prompts and right-padded responses of different lengths, and response masks with tokens the policy
did not write (a tool's output) inside and at the end of a response, so a wrong "last token" shows.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import hf_tiny
from tests.mcore.test_logprobs_hf import PROMPT, RESPONSE_LENS, padded_batch
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank


def _body(rank: int, world: int, path: str, batch: dict) -> list[float]:
    from hybridrl.config import load_config, run_layout
    from hybridrl.distributed import init_model_parallel
    from hybridrl.protocol import DataProto
    from hybridrl.trainer.rl_trainer import role_workers
    from hybridrl.workers import ResourcePool, WorkerGroup

    overrides = ["reward.model.enable=true", f"reward.model.path={path}", "reward.model.micro_batch_size_per_gpu=1",
                 "reward.model.param_offload=true"]  # fmt: skip
    cfg = load_config("tiny_cpu.yaml", overrides, world_size=world)
    layout = run_layout(cfg, world)  # tiny_cpu: TP 2
    init_model_parallel(layout)
    rm = WorkerGroup(ResourcePool(process_on_nodes=[world]), role_workers(cfg, layout, path)["rm"])
    return rm.compute_rm_score(DataProto.from_dict(tensors=batch)).batch["rm_scores"].tolist()


def test_rm_scores_equal_hf(tmp_path):
    import transformers

    path = hf_tiny.make_checkpoint("llama", str(tmp_path / "rm"), seed=4, score=True)
    batch = padded_batch()
    batch["response_mask"][0, 2] = 0  # a gap inside row 0's 6 tokens: its last valid token stays the 6th
    batch["response_mask"][1, 2] = 0  # row 1's last token is a tool's (attended, not the policy's): still scored
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).last_hidden_state  # fmt: skip
        per_token = model.score(hidden)[..., 0]
    last = torch.tensor([PROMPT + n - 1 for n in RESPONSE_LENS])
    expected = per_token[torch.arange(len(last)), last]
    assert expected.std() > 1e-3  # distinct scores: picking the wrong token would show
    for got in run_ranks(_body, 2, path, batch, timeout=300):
        assert torch.allclose(torch.tensor(got), expected, atol=1e-4), (got, expected.tolist())
