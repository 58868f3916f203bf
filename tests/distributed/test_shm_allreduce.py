"""The shared-memory all-reduce of TP groups on one host (``hybridrl.distributed.shm_allreduce``).

Two launches. Three ranks check the collective itself against an independent sum (every rank's input gathered
with gloo's all-gather and added in rank order), on the 3-rank group and on a 2-rank subgroup (there also
against gloo's own all-reduce, bitwise), across slot-sized pieces of odd sizes, dtypes, back-to-back rounds with
random delays between them (the two alternating slot sets must never be overwritten while a slow peer reads
them), and the cases it must leave to gloo (``HYBRIDRL_SHM_ALLREDUCE=0`` among them). Two ranks run the actor
update as the trainer does, with the default setting (``init_model_parallel`` at TP2, ``roles.build_actor`` from an
HF checkpoint, ``compute.forward_backward`` with ``ActorLoss``): Megatron's all-reduces must go through shared
memory, give bitwise gloo's loss and gradients, and match a TP1 run of the same builders (data parallel over the
two ranks, gradients summed) within fp32 tolerance; with sequence parallelism, its all-gathers and reduce-scatters
too (bitwise gloo's), within fp32 tolerance of plain TP.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank
TOL = 1e-5  # fp32


def _gathered_sum(x: torch.Tensor, group) -> torch.Tensor:
    """The reference: every rank's ``x`` over gloo's all-gather, added in rank order."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    total = parts[0] + parts[1]
    for part in parts[2:]:
        total += part
    return total


def _same_everywhere(x: torch.Tensor, group) -> bool:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return all(torch.equal(p, parts[0]) for p in parts)


def _gather_scatter_checks(comm, g: torch.Generator) -> list[bool]:
    """Sequence parallelism's collectives against independent ones: the all-gather against gloo's (bitwise), the
    reduce-scatter against this rank's block of every rank's input gathered by gloo and added in rank order.
    Odd sizes cross several slot-sized pieces (the slot holds 1024 fp32; a reduce-scatter piece 1024 / world)."""
    import torch.distributed as dist

    world, rank = comm.world, comm.rank
    checks = []
    for rows, cols, dtype in ((1, 1, torch.float32), (7, 129, torch.float32), (3, 1000, torch.float32),
                              (5, 333, torch.bfloat16), (2, 3, torch.float64)):  # fmt: skip
        x = torch.randn(rows, cols, generator=g).to(dtype)
        gathered, expected = torch.empty(world * rows, cols, dtype=dtype), torch.empty(world * rows, cols, dtype=dtype)
        comm.all_gather(gathered, x)
        dist.all_gather_into_tensor(expected, x, group=comm.group)
        checks.append(torch.equal(gathered, expected))
        full = torch.randn(world * rows, cols, generator=g).to(dtype)
        mine = torch.empty(rows, cols, dtype=dtype)
        comm.reduce_scatter(mine, full)
        block = _gathered_sum(full, comm.group).view(world, rows, cols)[rank]
        checks.append(torch.equal(mine, block))
    return checks


def _collective_body(rank: int, world: int, barrier: str) -> dict:
    import os
    import random
    import time

    import torch.distributed as dist

    from hybridrl.distributed import shm_allreduce
    from hybridrl.distributed.env import LaunchError
    from hybridrl.mcore import cpu_compat

    if barrier == "gloo":
        os.environ["HYBRIDRL_NATIVE"] = "0"  # no native code: the slots' rounds are ordered by gloo's barrier
    groups = {"world3": None, "pair": dist.new_group([0, 1]), "single": dist.new_group([2])}
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    out: dict = {"created": {}, "native": []}
    for name, group in groups.items():
        in_group = group is None or dist.get_rank(group) >= 0
        comm = shm_allreduce.create(group or dist.group.WORLD, slot_bytes=4096) if in_group else None
        out["created"][name] = comm is not None
        if comm is None:
            continue
        out["native"].append(comm._native is not None)
        g = torch.Generator().manual_seed(rank)
        checks = []
        for numel, dtype in ((1, torch.float32), (1023, torch.float32), (5 * 1024 + 3, torch.float32),
                             (3000, torch.bfloat16), (700, torch.float64), (0, torch.float32)):  # fmt: skip
            x = torch.randn(numel, generator=g).to(dtype)
            expected = _gathered_sum(x, comm.group)
            comm(x)
            same = _same_everywhere(x, comm.group)  # a collective: on every rank, whatever the comparison gives
            checks.append(torch.equal(x, expected) and same)
        # back to back, peers at different speeds: a round must not overwrite a slot a slow peer still reads
        xs = [torch.randn(2500, generator=g) for _ in range(40)]
        expected = [_gathered_sum(x, comm.group) for x in xs]
        rng = random.Random(rank)
        for x in xs:
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.003)
            comm(x)
        checks += [torch.equal(x, e) for x, e in zip(xs, expected, strict=True)]
        out[name] = checks
        if name == "pair":
            x = torch.randn(3, 1031, generator=g)
            y = x.clone()
            comm(x)
            dist.all_reduce(y, group=comm.group)
            out["pair_equals_gloo"] = torch.equal(x, y)
        out["refused"] = [comm.accepts(torch.ones(4, dtype=torch.int64)),
                          comm.accepts(torch.ones(4), dist.ReduceOp.MAX),
                          comm.accepts(torch.ones(4, 4).t())]  # fmt: skip
        out["stats"] = (comm.stats.calls, comm.stats.bytes)
        out[name + "_gather_scatter"] = _gather_scatter_checks(comm, g)
    ours = f"hybridrl_allreduce_{pids[0]}_"  # rank 0 creates every file of this launch
    out["files_left"] = [f for f in os.listdir(shm_allreduce.SHM_DIR) if f.startswith(ours)]
    shm_allreduce_dir = shm_allreduce.SHM_DIR
    shm_allreduce.SHM_DIR = "/nonexistent-shm-dir"  # rank 0 cannot create the file: every rank falls back
    out["no_shm_dir"] = shm_allreduce.create(dist.group.WORLD) is None
    shm_allreduce.SHM_DIR = shm_allreduce_dir
    os.environ[cpu_compat.SHM_ENV] = "0"  # the opt-out
    out["env_off"] = cpu_compat.route_tp_all_reduce(dist.group.WORLD)
    del os.environ[cpu_compat.SHM_ENV]  # unset: shared memory, the default
    out["env_default"] = cpu_compat.route_tp_all_reduce(dist.group.WORLD)
    cpu_compat.unroute_tp_all_reduce()
    os.environ[cpu_compat.SHM_ENV] = "yes"
    try:
        cpu_compat.route_tp_all_reduce(dist.group.WORLD)
    except LaunchError as e:
        out["env_bad"] = str(e)
    del os.environ[cpu_compat.SHM_ENV]
    return out


@pytest.fixture(scope="module", params=["native", "gloo"])
def collective(request):
    """One 3-rank launch per barrier between a round's copies and reads: ``csrc/shm_barrier.cpp`` (the default
    where the extension builds) and gloo's (``HYBRIDRL_NATIVE=0``)."""
    out = run_ranks(_collective_body, 3, request.param, timeout=300)
    for r in out:
        assert r["native"] and all(n == (request.param == "native") for n in r["native"]), r["native"]
    return out


def test_sum_equals_the_gathered_sum_on_every_rank(collective):
    for rank, r in enumerate(collective):
        assert r["created"]["world3"] and r["world3"] and all(r["world3"]), (rank, r["world3"])
    for rank in (0, 1):
        assert collective[rank]["created"]["pair"] and all(collective[rank]["pair"]), collective[rank]["pair"]


def test_all_gather_and_reduce_scatter_equal_independent_collectives(collective):
    for rank, r in enumerate(collective):
        assert r["world3_gather_scatter"] and all(r["world3_gather_scatter"]), (rank, r["world3_gather_scatter"])
    for rank in (0, 1):
        assert all(collective[rank]["pair_gather_scatter"]), collective[rank]["pair_gather_scatter"]


def test_two_ranks_give_gloo_bits_and_refuse_what_they_cannot_sum(collective):
    for rank in (0, 1):
        r = collective[rank]
        assert r["pair_equals_gloo"]
        assert r["refused"] == [False, False, False]
        assert r["stats"][0] == 6 + 40 + 1


def test_falls_back_where_shared_memory_cannot_serve(collective):
    assert collective[2]["created"]["single"] is False  # a group of one: nothing to reduce
    for r in collective:
        assert r["no_shm_dir"] is True
        assert r["env_off"] is False and r["env_default"] is True
        assert r["env_bad"].startswith("environment variable HYBRIDRL_SHM_ALLREDUCE='yes' must be 1")
        assert r["files_left"] == [], "the mapped file must be unlinked once every rank holds it"


def _batch(vocab: int, prompts: int = 4, n: int = 2, prompt: int = 6, response: int = 5) -> dict:
    """GRPO-shaped rows: ``prompts`` prompts (left-padded, lengths differ) x ``n`` responses (right-padded)."""
    g = torch.Generator().manual_seed(11)
    b = prompts * n
    ids = torch.zeros(b, prompt + response, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(prompts):
        p = torch.randint(1, vocab, (prompt - i % 3,), generator=g)
        for j in range(i * n, (i + 1) * n):
            r = response - j % 2
            ids[j, prompt - len(p) : prompt] = p
            ids[j, prompt : prompt + r] = torch.randint(1, vocab, (r,), generator=g)
            mask[j, prompt - len(p) : prompt + r] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, prompt:].clone(), "response_mask": mask[:, prompt:].float(),
            "advantages": torch.randn(b, response, generator=g), "old_log_probs": -5 + torch.randn(b, response),
            "ref_log_probs": -5 + torch.randn(b, response)}  # fmt: skip


def _update_body(rank: int, world: int, path: str, batch: dict) -> dict:
    import os

    import torch.distributed as dist

    from hybridrl.algos.objectives import ActorLoss
    from hybridrl.config.schema_roles import ActorConfig
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import compute, cpu_compat, roles
    from tests.mcore.shards import gather_full

    objective = ActorLoss(ActorConfig(use_kl_loss=True, kl_loss_coef=0.04, kl_loss_type="low_var_kl"))

    def update(actor, rows):
        head = compute.LogProbHead(with_entropy=True, vocab_size=actor.shape.vocab_size)
        out = compute.forward_backward(actor.chunks, rows, objective, len(rows["input_ids"]), head=head,
                                       share_prefix=None)  # fmt: skip
        return out.loss, actor

    os.environ.pop(cpu_compat.SHM_ENV, None)  # the default
    init_model_parallel(ParallelLayout.from_world(world, tp=2), seed=1)
    stats = cpu_compat.tp_all_reduce_stats()
    actor = roles.build_actor(path)
    loss_shm, _ = update(actor, batch)
    grads_shm = gather_full(actor.chunks, "grad")
    calls = stats[0].calls if stats else 0
    for p in actor.parameters():
        p.grad = None
    with cpu_compat.tp_all_reduce_on_gloo():
        loss_gloo, _ = update(actor, batch)
    grads_gloo = gather_full(actor.chunks, "grad")
    bitwise = loss_shm == loss_gloo and all(torch.equal(grads_shm[k], grads_gloo[k]) for k in grads_shm)
    out = {"routed": len(stats), "calls": calls, "gloo_calls_after": stats[0].calls - calls if stats else -1,
           "bitwise": bitwise}  # fmt: skip
    # sequence parallelism: the norms see half the tokens each (their gradients summed over TP, as the optimizer
    # does), the all-gathers and reduce-scatters along the sequence go through shared memory too
    sp_actor = roles.build_actor(path, sequence_parallel=True)
    before = stats[0].calls if stats else 0
    loss_sp, _ = update(sp_actor, batch)
    out["sp_calls"] = (stats[0].calls if stats else 0) - before
    sp_params = [p for p in sp_actor.parameters() if getattr(p, "sequence_parallel", False)]
    out["sp_norms"] = len(sp_params)
    for p in sp_params:
        dist.all_reduce(p.grad)
    grads_sp = gather_full(sp_actor.chunks, "grad")
    for p in sp_actor.parameters():
        p.grad = None
    with cpu_compat.tp_all_reduce_on_gloo():
        loss_sp_gloo, _ = update(sp_actor, batch)
    for p in sp_params:
        dist.all_reduce(p.grad)
    grads_sp_gloo = gather_full(sp_actor.chunks, "grad")
    out["sp_bitwise"] = loss_sp == loss_sp_gloo and all(torch.equal(grads_sp[k], grads_sp_gloo[k]) for k in grads_sp)
    out["sp_loss_diff"] = abs(loss_sp - loss_shm)
    out["sp_grad_diff"] = max((grads_sp[k] - grads_shm[k]).abs().max().item() for k in grads_shm)
    init_model_parallel(ParallelLayout.from_world(world, tp=1), seed=1)  # DP2: half the rows on each rank
    out["routed_tp1"] = len(cpu_compat.tp_all_reduce_stats())
    half = len(batch["input_ids"]) // world
    rows = {k: v[rank * half : (rank + 1) * half] for k, v in batch.items()}
    loss_tp1, single = update(roles.build_actor(path), rows)
    for p in single.parameters():  # what the optimizer does: sum over data-parallel ranks
        dist.all_reduce(p.grad)
    grads_tp1 = gather_full(single.chunks, "grad")
    out["loss_diff"] = abs(loss_shm - loss_tp1)
    out["grad_diff"] = max((grads_shm[k] - grads_tp1[k]).abs().max().item() for k in grads_tp1)
    out["grad_scale"] = max(g.abs().max().item() for g in grads_tp1.values())
    out["same_keys"] = sorted(grads_shm) == sorted(grads_tp1)
    return out


def _lost_peer_body(rank: int, world: int) -> dict:
    """Rank 0 calls the all-reduce while rank 1 (a) sleeps past the group's 2 s timeout, (b) has exited."""
    import datetime
    import os
    import time

    import psutil
    import torch.distributed as dist

    from hybridrl.distributed import shm_allreduce
    from hybridrl.errors import is_peer_failure
    from hybridrl.ops import _native

    _native.native_module()  # loaded (or built) before any collective runs under the 2 s timeout
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    stopped, gone = shm_allreduce.create(group, slot_bytes=4096), shm_allreduce.create(group, slot_bytes=4096)
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    out: dict = {"native": stopped._native is not None and gone._native is not None, "pid1": pids[1]}
    if rank == 1:
        time.sleep(3.5)
        stopped(torch.ones(8))  # rank 0 has arrived (and given up): this round passes
        dist.barrier()
        return out

    def attempt(comm) -> tuple:
        start = time.monotonic()
        try:
            comm(torch.ones(8))
        except Exception as err:  # the test looks at what it is
            return type(err).__name__, str(err), is_peer_failure(err), time.monotonic() - start
        return ("no error",)

    out["timeout"] = attempt(stopped)
    out["after_timeout"] = attempt(stopped)  # a failed group never goes on: its slots may still be read
    dist.barrier()  # rank 1 is done with its round: it returns, and its process exits
    deadline = time.monotonic() + 60
    with contextlib.suppress(psutil.NoSuchProcess):  # reaped already (the launcher's forkserver reaps at once)
        peer = psutil.Process(pids[1])
        while time.monotonic() < deadline and peer.is_running() and peer.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
    out["gone"] = attempt(gone)
    return out


def test_a_lost_peer_ends_the_wait_with_a_peer_failure():
    """The native barrier's two ways out, as a gloo collective's: the group's timeout (a stopped peer) and a peer
    whose process has exited (checked every 50 ms: without that check the wait would last the 2 s timeout and say
    so); both raise what ``hybridrl.errors`` reports as a peer that stopped answering. A group whose barrier failed
    raises again at its next call instead of writing slots a peer may still read."""
    r0, r1 = run_ranks(_lost_peer_body, 2, timeout=120)
    assert r0["native"] and r1["native"], "the native barrier was not used (the extension did not build here)"
    name, message, peer_failure, took = r0["timeout"]
    assert name == "DistError" and peer_failure, message
    assert message == f"shared-memory all-reduce: Timed out waiting 2000ms for rank 1 (pid {r0['pid1']})"
    assert took >= 2.0, took
    assert r0["after_timeout"][:3] == ("DistError", message, True)
    name, message, peer_failure, _ = r0["gone"]
    assert name == "DistError" and peer_failure, message
    assert message == f"shared-memory all-reduce: Connection closed by peer: rank 1 (pid {r0['pid1']}) has exited"


@pytest.fixture(scope="module")
def update(tmp_path_factory):
    from tests.mcore import hf_tiny

    path = hf_tiny.make_checkpoint("llama", str(tmp_path_factory.mktemp("shm_llama")))
    return run_ranks(_update_body, 2, path, _batch(hf_tiny.VOCAB), timeout=600)


def test_actor_update_at_tp2_goes_through_shared_memory(update):
    for r in update:
        assert r["routed"] == 1 and r["routed_tp1"] == 0, r
        assert r["calls"] >= 4 * 4, r  # per layer: two forward all-reduces, two input-gradient ones
        assert r["gloo_calls_after"] == 0, r  # tp_all_reduce_on_gloo really sent them to gloo


def test_sequence_parallel_update_goes_through_shared_memory_and_equals_plain_tp(update):
    for r in update:
        assert r["sp_norms"] == 2 * 4 + 1, r  # two norms per layer (hf_tiny: 4 layers) and the final one
        assert r["sp_calls"] > r["calls"], r  # all-gathers and reduce-scatters, more calls than plain TP's
        assert r["sp_bitwise"], r
        assert r["sp_loss_diff"] <= TOL, r
        assert r["sp_grad_diff"] <= TOL * max(1.0, r["grad_scale"]), r


def test_actor_update_equals_gloo_bitwise_and_tp1_within_fp32(update):
    for r in update:
        assert r["bitwise"], r
        assert r["same_keys"]
        assert r["loss_diff"] <= TOL, r
        assert r["grad_diff"] <= TOL * max(1.0, r["grad_scale"]), r
