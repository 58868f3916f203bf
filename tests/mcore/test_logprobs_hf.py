"""Response log-probs of the Megatron actor equal HF transformers' on a left/right-padded batch.

The batch is what rollout produces: prompts of different lengths LEFT-padded, responses of different
lengths RIGHT-padded. HF is the independent reference: its forward with the attention mask and
``position_ids = cumsum(mask) - 1``, then a full-vocab ``log_softmax``. Megatron runs the vocab-parallel
path (never gathering the vocabulary) at TP2 and at PP2 on 2 gloo ranks.

The batch is padded much wider than its rows (as rollout pads to max_prompt_length + response_length), so
the model runs on trimmed inputs (``compute.trim_padding``): per micro-batch at TP2, one width for the
batch at PP2; at TP2 the untrimmed run is checked too.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import hf_tiny
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank

PROMPT, RESPONSE = 10, 6
PROMPT_LENS, RESPONSE_LENS = (10, 4, 7), (6, 3, 1)


def padded_batch(seed: int = 5, prompt: int = PROMPT, response: int = RESPONSE) -> dict[str, torch.Tensor]:
    """Rows of ``PROMPT_LENS`` / ``RESPONSE_LENS`` tokens, left-padded to ``prompt``, right-padded to ``response``."""
    g = torch.Generator().manual_seed(seed)
    b = len(PROMPT_LENS)
    ids = torch.zeros(b, prompt + response, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        ids[i, prompt - p : prompt + r] = torch.randint(1, hf_tiny.VOCAB, (p + r,), generator=g)
        mask[i, prompt - p : prompt + r] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": position_ids,
        "responses": ids[:, prompt:].clone(),
        "response_mask": mask[:, prompt:].clone(),
    }


def hf_log_probs(path: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model.eval()(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    prompt = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    logp = torch.log_softmax(logits[:, prompt - 1 : -1].double(), dim=-1)
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
            if tp == 2:
                head = compute.LogProbHead(vocab_size=actor.shape.vocab_size)
                full = compute.forward_outputs(actor.chunks, batch, 1, head, trim=False)
                out[(arch, "untrimmed")] = full["log_probs"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    batch = padded_batch(prompt=PROMPT + 21, response=RESPONSE + 13)  # rows of 16, 7, 8 tokens in 50 columns
    paths, refs = {}, {}
    for i, arch in enumerate(("llama", "qwen2")):
        paths[arch] = hf_tiny.make_checkpoint(arch, str(tmp_path_factory.mktemp(arch)), seed=10 + i)
        refs[arch] = hf_log_probs(paths[arch], batch)
    return batch, refs, run_ranks(_body, 2, paths, batch, timeout=600)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), ("untrimmed", None)])
def test_response_log_probs_match_hf(results, arch, tp, pp):
    batch, refs, per_rank = results
    valid = batch["response_mask"].bool()
    for rank, out in enumerate(per_rank):  # every rank holds the result
        diff = (out[(arch, tp, pp) if pp else (arch, tp)] - refs[arch])[valid].abs().max().item()
        assert diff <= 1e-4, (rank, diff)
    # the reference is not trivially close: log-probs of a random model spread over several nats
    assert refs[arch][valid].std() > 0.3
