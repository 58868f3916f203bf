"""The FSDP critic and reference against the Megatron ones and HF, built as the trainer builds them (role_workers,
worker groups, tiny_cpu.yaml with ``critic.backend`` / ``ref.backend`` overridden), on 2 gloo ranks: FSDP sharded
over both, Megatron TP 1 x DP 2, so both split each batch alike.

- reference: FSDP log-probs == Megatron log-probs == HF transformers' (left-padded batch, attention mask and
  position ids, at the rollout temperature 0.7), <= 1e-5;
- critic: values before, after one ``update_critic`` (2 optimizer steps, clipped: grad norm ~20 > clip_grad 1)
  and after a second one equal the Megatron critic's from the same HF folder (nonzero value head): <= 1e-5 before,
  |diff| / (1 + |value|) <= 1e-5 after the updates (each Adam step carries fp32 reduction-order noise); the
  losses and grad norms too;
- checkpoint: the FSDP critic saved by the CheckpointManager after the first update and resumed into a fresh
  group, with every unpickler unreachable (``pickle.load``, ``torch.load`` and torch's weights-only unpickler
  raise), makes the same second update bit for bit; the saved folder read by hybridrl's reader equals torch's
  ``FileSystemReader``'s (bitwise); the same checkpoint loaded on ONE rank (DCP reshards model and Adam moments)
  gives the 2-rank values and second update (<= 1e-5); a planted pickle in it is refused;
- export: ``hybridrl export``'s function writes that critic as an HF ``*ForSequenceClassification`` folder whose
  per-token scores (transformers' own class) equal the FSDP critic's values (<= 1e-5).
"""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

from tests.mcore import hf_tiny
from tests.mcore.no_unpickler import assert_same, unpickler_unreachable
from tests.multirank import run_ranks
from tests.workers.test_critic_update import PROMPT, _batch

pytestmark = pytest.mark.multirank
TEMPERATURE = 0.7
BASE = ["actor.megatron.tp_size=1", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_mini_batch_size=1", "critic.optim.lr=1e-2",
        f"rollout.temperature={TEMPERATURE}", "trainer.resume_mode=auto", "trainer.save_freq=1"]  # fmt: skip


def _groups(world: int, lm: str, score: str, backend: str, ckpt: str, roles=("ref", "critic")):
    from hybridrl.config import load_config, run_layout
    from hybridrl.distributed import init_model_parallel
    from hybridrl.trainer.rl_trainer import role_workers
    from hybridrl.workers import ResourcePool, WorkerGroup

    overrides = [f"critic.backend={backend}", f"ref.backend={backend}", f"critic.model_path={score}",
                 f"trainer.default_local_dir={ckpt}", f"trainer.n_gpus_per_node={world}"]  # fmt: skip
    cfg = load_config("tiny_cpu.yaml", BASE + overrides, world_size=world)
    layout = run_layout(cfg, world)
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        init_model_parallel(layout)
    workers = role_workers(cfg, layout, lm)
    pool = ResourcePool(process_on_nodes=[world])
    return cfg, {role: WorkerGroup(pool, workers[role]) for role in roles}


class _Loop:
    """The loop's counters as the trainer's ``trainer`` part keeps them (trainer_state.json's step)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def _update(critic, batch) -> tuple[dict, torch.Tensor]:
    from hybridrl.protocol import DataProto

    data = DataProto.from_dict(tensors=batch)
    old = critic.compute_values(data).batch["values"]
    metrics = critic.update_critic(DataProto.from_dict(tensors={**batch, "values": old})).meta_info["metrics"]
    return metrics, critic.compute_values(data).batch["values"]


def _body(rank: int, world: int, lm: str, score: str, ckpt: str, batch: dict) -> dict:
    from hybridrl.protocol import DataProto
    from hybridrl.trainer.checkpoint import CheckpointManager

    out = {}
    for backend in ("megatron", "fsdp"):
        cfg, g = _groups(world, lm, score, backend, ckpt)
        data = DataProto.from_dict(tensors=batch)
        r = {"log_probs": g["ref"].compute_ref_log_prob(data).batch["ref_log_probs"]}
        r["values0"] = g["critic"].compute_values(data).batch["values"]
        if backend == "fsdp":
            manager = CheckpointManager(cfg.trainer, states={"critic": g["critic"], "trainer": _Loop()})
            manager.states["trainer"].step = 1
        r["metrics1"], r["values1"] = _update(g["critic"], batch)
        if backend == "fsdp":
            manager.save(1)
        r["metrics2"], r["values2"] = _update(g["critic"], batch)
        out[backend] = r
    _, fresh = _groups(world, lm, score, "fsdp", ckpt, roles=("critic",))
    resumed = CheckpointManager(cfg.trainer, states={"critic": fresh["critic"], "trainer": _Loop()})
    with unpickler_unreachable():
        out["resumed"] = resumed.maybe_resume()
    out["resumed_metrics2"], out["resumed_values2"] = _update(fresh["critic"], batch)
    return out


def _one_rank(rank: int, world: int, lm: str, score: str, ckpt: str, batch: dict) -> dict:
    from hybridrl.protocol import DataProto

    _, g = _groups(world, lm, score, "fsdp", ckpt, roles=("critic",))
    folder = os.path.join(ckpt, "global_step_1", "critic")
    g["critic"].check_checkpoint(folder)
    g["critic"].load_checkpoint(folder)
    g["critic"].load_state_dict({"version": 1})
    values1 = g["critic"].compute_values(DataProto.from_dict(tensors=batch)).batch["values"]
    metrics2, values2 = _update(g["critic"], batch)
    return {"values1": values1, "metrics2": metrics2, "values2": values2}


def _hf_log_probs(path: str, batch: dict) -> torch.Tensor:
    """HF transformers on the left-padded batch as it is (mask + position ids), logits / T at position p + t - 1."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits  # fmt: skip
    r = batch["responses"].shape[1]
    logp = (logits[:, PROMPT - 1 : PROMPT - 1 + r].float() / TEMPERATURE).log_softmax(-1)
    return logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask].abs().max())


def _max_scaled_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """max |a - b| / (1 + |b|): 1e-5 here is allclose's rtol = atol = 1e-5.

    Values after Adam updates at lr 1e-2 carry the fp32 reduction-order noise of every step (FSDP reduce-scatters,
    Megatron all-reduces): measured 4e-6 after one update, 7e-6 to 1.1e-5 after two, on values of magnitude ~2.
    A wrong gradient or optimizer state moves them by 1e-2 or more."""
    return float(((a - b).abs() / (1 + b.abs()))[mask].max())


def test_fsdp_roles_match_megatron_and_hf(tmp_path):
    lm = hf_tiny.make_checkpoint("llama", str(tmp_path / "lm"), seed=4)
    score = hf_tiny.make_checkpoint("llama", str(tmp_path / "score"), seed=5, score=True)  # a nonzero value head
    batch, ckpt = _batch(), str(tmp_path / "ckpt")
    mask = batch["attention_mask"][:, PROMPT:].bool()
    got = run_ranks(_body, 2, lm, score, ckpt, batch, timeout=900)
    assert torch.equal(got[0]["fsdp"]["values2"], got[1]["fsdp"]["values2"])  # every rank holds the full result
    meg, fsdp = got[0]["megatron"], got[0]["fsdp"]

    hf = _hf_log_probs(lm, batch)
    diffs = {
        "ref fsdp-hf": _max_diff(fsdp["log_probs"], hf, mask),
        "ref megatron-hf": _max_diff(meg["log_probs"], hf, mask),
        **{f"{k} fsdp-megatron": _max_diff(fsdp[k], meg[k], mask) for k in ("values0", "values1", "values2")},
        **{f"{k} fsdp-megatron scaled": _max_scaled_diff(fsdp[k], meg[k], mask) for k in ("values1", "values2")},
    }
    print("max differences:", {k: f"{v:.1e}" for k, v in diffs.items()})  # shown with pytest -s
    assert _max_diff(fsdp["log_probs"], hf, mask) <= 1e-5
    assert _max_diff(meg["log_probs"], hf, mask) <= 1e-5
    assert _max_diff(fsdp["log_probs"], meg["log_probs"], mask) <= 1e-5
    assert _max_diff(fsdp["values0"], meg["values0"], mask) <= 1e-5
    for key in ("values1", "values2"):
        assert _max_scaled_diff(fsdp[key], meg[key], mask) <= 1e-5, key
    assert _max_diff(fsdp["values2"], fsdp["values0"], mask) > 0.1  # the updates moved the values
    for key in ("metrics1", "metrics2"):
        for name in ("critic/loss", "critic/grad_norm", "critic/lr", "critic/vf_clipfrac"):
            assert fsdp[key][name] == pytest.approx(meg[key][name], rel=1e-5, abs=1e-7), (key, name)
    assert meg["metrics1"]["critic/grad_norm"] > 1.0  # clip_grad 1.0 was active

    assert got[0]["resumed"]
    assert got[0]["resumed_metrics2"] == fsdp["metrics2"]
    assert torch.equal(got[0]["resumed_values2"], fsdp["values2"])

    one = run_ranks(_one_rank, 1, lm, score, ckpt, batch, timeout=600)[0]
    assert _max_diff(one["values1"], fsdp["values1"], mask) <= 1e-5  # the same saved weights, one forward
    assert _max_scaled_diff(one["values2"], fsdp["values2"], mask) <= 1e-5
    assert one["metrics2"]["critic/loss"] == pytest.approx(fsdp["metrics2"]["critic/loss"], rel=1e-5)

    _check_same_as_torch_reader(os.path.join(ckpt, "global_step_1", "critic", "state"))
    _check_planted_pickle(os.path.join(ckpt, "global_step_1", "critic"), str(tmp_path / "planted"))
    _check_export(os.path.join(ckpt, "global_step_1"), str(tmp_path / "hf_critic"), batch, fsdp["values1"], mask)


def _check_export(step: str, out: str, batch: dict, values: torch.Tensor, mask: torch.Tensor) -> None:
    import transformers

    from hybridrl.trainer.main import export

    export(step, out, role="critic")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).last_hidden_state  # fmt: skip
        scores = model.score(hidden).squeeze(-1)[:, PROMPT - 1 : PROMPT - 1 + values.shape[1]]
    assert _max_diff(scores, values, mask) <= 1e-5


def _check_same_as_torch_reader(folder: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from hybridrl.mcore.safe_dcp import load_full_state

    want: dict = {}
    _load_state_dict(want, FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert {"model", "optim"} <= set(want) and want["optim"]["state"]  # weights and Adam moments
    assert_same(load_full_state(folder), want)


class _Planted:
    def __reduce__(self):
        return (os.system, ("echo planted",))


def _check_planted_pickle(folder: str, copy: str) -> None:
    from hybridrl.fsdp.checkpoint import check_role
    from hybridrl.mcore.checkpoint_safety import UnsafeCheckpointError

    shutil.copytree(folder, copy)
    check_role(copy)  # the saved folder passes
    with open(os.path.join(copy, "state", ".metadata"), "wb") as f:
        pickle.dump(_Planted(), f)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        check_role(copy)
