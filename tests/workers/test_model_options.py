"""A role's megatron memory options reach Megatron: activation recompute is on in the built model and its
gradients equal the plain model's (recompute changes memory, not numbers); sequence parallelism reaches the
config and, without TransformerEngine, the local spec's norms; the optimizer follows use_distributed_optimizer."""

from __future__ import annotations

import types

import pytest
import torch

from tests.mcore import hf_tiny
from tests.multirank import run_ranks


def _body(rank: int, world: int, path: str) -> dict:
    from hybridrl.config.schema_roles import MegatronOptionsConfig
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import compute, roles
    from hybridrl.workers.megatron_workers import model_options
    from tests.hybrid_engine.test_rollout_parity import _sequences

    init_model_parallel(ParallelLayout.from_world(world, tp=2))
    seqs = _sequences()
    grads, configs = {}, {}
    for name, m in (
        ("plain", dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)),
        ("full", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    ):
        section = MegatronOptionsConfig(**m)
        actor = roles.build_actor(path, **model_options(section, "actor.megatron"))
        for chunk in actor.chunks:
            chunk.train()
        compute.forward_backward(actor.chunks, dict(seqs), lambda o, mb: (-o["log_probs"], {}), 1,
                                 head=compute.LogProbHead(vocab_size=actor.shape.vocab_size))  # fmt: skip
        grads[name] = {n: p.grad.clone() for n, p in actor.chunks[0].named_parameters()}
        configs[name] = (actor.config.recompute_granularity, actor.config.recompute_method)
    diff = max((grads["full"][n] - grads["plain"][n]).abs().max().item() for n in grads["plain"])
    size = max(g.abs().max().item() for g in grads["plain"].values())
    return {"configs": configs, "diff": diff, "size": size}


@pytest.mark.multirank
def test_recompute_reaches_megatron_and_keeps_gradients(tmp_path):
    path = hf_tiny.make_checkpoint("llama", str(tmp_path / "llama"), seed=3)
    for r in run_ranks(_body, 2, path, timeout=300):
        assert r["configs"] == {"plain": (None, None), "full": ("full", "uniform")}
        assert r["size"] > 1e-3 and r["diff"] <= 1e-6 * r["size"], r


def test_sequence_parallel_reaches_the_config_and_the_local_norms():
    """Without TransformerEngine (CPU) sequence parallelism reaches the TransformerConfig too: the local spec's
    norms are hybridrl's (``LocalNorm``), which mark their parameters for the TP gradient sum
    (tests/mcore/test_grad_norm_hf.py checks the step against HF, tests/distributed/test_shm_allreduce.py the
    collectives)."""
    from hybridrl.config.schema_roles import MegatronOptionsConfig
    from hybridrl.mcore import gpt
    from hybridrl.mcore.local_norm import LocalNorm
    from hybridrl.workers.megatron_workers import model_options, optim_config

    options = model_options(MegatronOptionsConfig(sequence_parallel=True), "critic.megatron")
    assert options == {"sequence_parallel": True}
    shape = gpt.GPTShape(num_layers=1, hidden_size=64, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=96,
                         vocab_size=128, qk_norm=True)  # fmt: skip
    spec = gpt.layer_spec(shape, transformer_engine=False)
    sub = spec.submodules
    norms = [sub.input_layernorm, sub.pre_mlp_layernorm, sub.self_attention.submodules.q_layernorm,
             sub.self_attention.submodules.k_layernorm]  # fmt: skip
    assert all(n is LocalNorm for n in norms), norms
    config = types.SimpleNamespace(sequence_parallel=True, normalization="RMSNorm", layernorm_zero_centered_gamma=False,
                                   memory_efficient_layer_norm=False)  # fmt: skip
    norm = LocalNorm(config, 64, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    config.normalization = "L2Norm"
    with pytest.raises(ValueError, match=r"^normalization 'L2Norm' .* has no local norm under sequence parallelism"):
        LocalNorm(config, 64)
    # a role's batch_p2p_comm reaches its TransformerConfig when set; null leaves the backend's default
    assert model_options(MegatronOptionsConfig(batch_p2p_comm=False), "ref.megatron") == {"batch_p2p_comm": False}
    assert model_options(MegatronOptionsConfig(), "ref.megatron") == {}
    from hybridrl.config.schema_roles import OptimConfig as OptimSection

    optim = OptimSection(lr=1.0)
    chosen = types.SimpleNamespace(use_distributed_optimizer=False)
    assert optim_config(optim, 10, chosen).use_distributed_optimizer is False
    auto = types.SimpleNamespace(use_distributed_optimizer=None)
    assert optim_config(optim, 10, auto).use_distributed_optimizer is torch.cuda.is_available()
