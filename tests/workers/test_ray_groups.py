"""Ray worker groups on a local Ray of 2 CPUs: the founding document's snippet as written, futures, a killed actor,
and the inputs refused before any actor is placed.

One Ray for the module (``num_cpus=2``, no dashboard), shut down after it; each pool holds both CPUs, so the
tests that place actors shut their pool down before the next one.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.workers import (
    ClassWithInitArgs,
    MegatronRayWorkerGroup,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourceError,
)
from hybridrl.workers.megatron_workers import ActorRolloutWorker
from hybridrl.workers.ray_group import WorkerClassError, WorkerDiedError
from hybridrl.workers.ray_pool import check_against_cluster, check_pool_request
from tests.workers.ray_test_workers import NotAWorker, RankWorker

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.multirank
def test_founding_snippet(local_ray, tmp_path, monkeypatch):
    """The snippet as written: the pool serves the packaged demo run (tiny_cpu.yaml, its folder under the cwd);
    init_args' "backend" is actor_rollout.backend. The group then generates (an odd batch split over the 2
    vLLM replicas comes back whole and in order) and scores the responses with the actor: after the switch
    pushed the actor's weights, vLLM's log-probs equal the actor's."""
    from hybridrl.data import RLHFDataset
    from hybridrl.data.dataset import collate

    monkeypatch.chdir(tmp_path)
    resource_pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    actor_rollout_cls = RayClassWithInitArgs(cls=ActorRolloutWorker, init_args={"backend": "vllm"})
    actor_rollout_wg = MegatronRayWorkerGroup(resource_pool=resource_pool, ray_cls_with_init=actor_rollout_cls)
    try:
        run = resource_pool.run
        assert run.cfg.rollout.backend == "vllm" and actor_rollout_wg.world_size == 2
        demo = os.path.join(run.cfg.trainer.default_local_dir, "demo", "train.parquet")
        ds = RLHFDataset([demo], run.tokenizer, run.cfg.data)
        prompts = collate([ds[i] for i in range(5)])
        actor_rollout_wg.switch_to_rollout()
        gen = actor_rollout_wg.generate_sequences(prompts, seed=7)
        actor_rollout_wg.switch_to_training()
        assert len(gen) == 5
        width = prompts.batch["input_ids"].shape[1]
        assert torch.equal(gen.batch["input_ids"][:, :width], prompts.batch["input_ids"])
        future = actor_rollout_wg.compute_log_prob.remote(gen)
        out = future.get()
        mask = gen.batch["response_mask"].bool()
        gap = (out.batch["old_log_probs"] - gen.batch["rollout_log_probs"]).abs()[mask].max()
        assert gap < 1e-3, float(gap)
        again = actor_rollout_wg.compute_log_prob(gen)  # synchronous form: the same numbers
        assert torch.equal(again.batch["old_log_probs"], out.batch["old_log_probs"])
    finally:
        resource_pool.shutdown()


@pytest.mark.multirank
def test_split_futures_and_killed_actor(local_ray):
    """A custom worker: DP_COMPUTE chunks go to the ranks in order (padding dropped), rank 0's meta_info comes back;
    a future fed to a method of the same split goes host to host. Then a host is killed while its peer waits
    in a collective: the call fails at once, naming the role, the rank and its node."""
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    try:
        group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=RankWorker, init_args={"scale": 2.0}), name="tagger")
        x = torch.arange(5, dtype=torch.float32)
        out = group.tag(DataProto.from_dict(tensors={"x": x}))
        assert torch.equal(out.batch["y"], 2 * x)
        assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]  # padded to 6, 3 rows per rank, the pad row dropped
        assert out.meta_info == {"rank": 0}
        even = DataProto.from_dict(tensors={"x": torch.arange(4, dtype=torch.float32)})
        fed = group.plus_one.remote(group.tag.remote(even))  # no padding: the chunks stay on the hosts
        assert "rows" not in fed.pending  # not gathered and split again on the driver
        assert torch.equal(fed.get().batch["y"], 2 * torch.arange(4, dtype=torch.float32) + 1)
        pids = ray.get([h.pid.remote() for h in pool.hosts])
        waiting = group.slow_all_reduce.remote(120.0)  # rank 0 waits in the all-reduce for rank 1
        time.sleep(2.0)
        ray.kill(pool.hosts[1])
        start = time.perf_counter()
        with pytest.raises(WorkerDiedError) as err:
            waiting.get()
        assert time.perf_counter() - start < 60
        message = str(err.value)
        assert "tagger" in message and "rank 1" in message and f"pid {pids[1]}" in message, message
        assert "\n" not in message
    finally:
        pool.shutdown()


def test_refused_before_any_actor(local_ray):
    """Pools the cluster cannot hold, colocation counts other than 1, and classes that are not workers: one line
    each, before anything is placed."""
    placed = len(ray.util.placement_group_table())
    with pytest.raises(ResourceError, match=r"max_colocate_count \(2\)"):
        RayResourcePool(process_on_nodes=[2], max_colocate_count=2)
    with pytest.raises(ResourceError, match=r"process_on_nodes \(\[2, 0\]\)"):
        RayResourcePool(process_on_nodes=[2, 0])
    with pytest.raises(ResourceError, match=r"needs a node with 3 CPUs .* nodes have \[2\] CPUs") as err:
        RayResourcePool(process_on_nodes=[3])  # the local Ray has 2 CPUs
    assert "\n" not in str(err.value)
    with pytest.raises(ResourceError, match=r"needs a node with 2 CPUs .*\[2\] CPUs"):
        RayResourcePool(process_on_nodes=[2, 2])  # one node, two placement groups of 2
    with pytest.raises(ResourceError, match=r"set use_gpu=False"):
        RayResourcePool(process_on_nodes=[2], use_gpu=True)
    assert len(ray.util.placement_group_table()) == placed  # nothing placed
    with pytest.raises(WorkerClassError, match=r"NotAWorker.*not a worker class"):
        RayClassWithInitArgs(cls=NotAWorker)
    with pytest.raises(WorkerClassError, match="not a worker class"):
        RayClassWithInitArgs(cls=len)


def test_cluster_match_and_spmd_keyword_form():
    """The matching of placement groups to nodes (no cluster needed); the SPMD ClassWithInitArgs keyword form."""
    nodes = [{"Resources": {"CPU": 8, "GPU": 8}}, {"Resources": {"CPU": 8, "GPU": 4}}, {"Alive": False}]
    check_against_cluster([4, 8], True, nodes)
    with pytest.raises(ResourceError, match=r"needs a node with 8 GPUs .* \[8, 4\] GPUs"):
        check_against_cluster([8, 8], True, nodes)
    assert check_pool_request((8, 8), True, 1) == [8, 8]
    with pytest.raises(ResourceError, match="use_gpu"):
        check_pool_request([1], "yes", 1)
    spec = ClassWithInitArgs(cls=RankWorker, init_args={"scale": 3.0})
    assert spec.build().scale == 3.0
    missing = r"ClassWithInitArgs\(ActorRolloutWorker\): missing a required argument: 'actor'"
    with pytest.raises(TypeError, match=missing) as err:
        ClassWithInitArgs(cls=ActorRolloutWorker, init_args={"backend": "vllm"})
    assert "\n" not in str(err.value)
