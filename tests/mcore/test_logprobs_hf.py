"""Response log-probs of the Megatron actor equal HF transformers' on a left/right-padded batch.

The batch is what rollout produces: prompts of different lengths LEFT-padded, responses of different
lengths RIGHT-padded. HF is the independent reference: its forward with the attention mask and
``position_ids = cumsum(mask) - 1``, then a full-vocab ``log_softmax``. Megatron runs the vocab-parallel
path (never gathering the vocabulary) at TP2 and at PP2 on 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import hf_tiny
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank

PROMPT, RESPONSE = 10, 6
PROMPT_LENS, RESPONSE_LENS = (10, 4, 7), (6, 3, 1)


def padded_batch(seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b = len(PROMPT_LENS)
    ids = torch.zeros(b, PROMPT + RESPONSE, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        ids[i, PROMPT - p : PROMPT + r] = torch.randint(1, hf_tiny.VOCAB, (p + r,), generator=g)
        mask[i, PROMPT - p : PROMPT + r] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": position_ids,
        "responses": ids[:, PROMPT:].clone(),
        "response_mask": mask[:, PROMPT:].clone(),
    }


def hf_log_probs(path: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model.eval()(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    logp = torch.log_softmax(logits[:, PROMPT - 1 : -1].double(), dim=-1)
    return logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1).float()


def _body(rank: int, world_size: int, paths: dict[str, str], batch: dict) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import compute, roles

    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        init_model_parallel(ParallelLayout.from_world(world_size, tp=tp, pp=pp))
        for arch, path in paths.items():
            actor = roles.build_actor(path)
            res = compute.compute_log_probs(actor.chunks, batch, 1, vocab_size=actor.shape.vocab_size)
            out[(arch, tp, pp)] = res["log_probs"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    batch = padded_batch()
    paths, refs = {}, {}
    for i, arch in enumerate(("llama", "qwen2")):
        paths[arch] = hf_tiny.make_checkpoint(arch, str(tmp_path_factory.mktemp(arch)), seed=10 + i)
        refs[arch] = hf_log_probs(paths[arch], batch)
    return batch, refs, run_ranks(_body, 2, paths, batch, timeout=600)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_response_log_probs_match_hf(results, arch, tp, pp):
    batch, refs, per_rank = results
    valid = batch["response_mask"].bool()
    for rank, out in enumerate(per_rank):  # every rank holds the result
        diff = (out[(arch, tp, pp)] - refs[arch])[valid].abs().max().item()
        assert diff <= 1e-4, (rank, diff)
    # the reference is not trivially close: log-probs of a random model spread over several nats
    assert refs[arch][valid].std() > 0.3
