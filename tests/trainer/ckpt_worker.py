"""torchrun worker of test_export.py (2 ranks): save a trained actor at TP2; reload at TP2, TP1 x DP2, PP2 x VPP2.

    torchrun --nproc-per-node 2 -m tests.trainer.ckpt_worker HF_MODEL CKPT_DIR RESULT_FILE

Rank 0 writes RESULT_FILE (torch.save): the TP2 Megatron logits of ``hf_tiny.input_ids()`` and the checks.
The ``__main__`` guard matters: dist_checkpointing.save starts a spawn-context manager that re-imports it.
"""

from __future__ import annotations

import os
import sys

import torch


def _snapshot(model) -> dict[str, torch.Tensor]:
    from hybridrl.mcore.bridge import global_parameters

    return {n: p.detach().clone() for n, p in global_parameters(model.chunks)}


def main(model_path: str, ckpt: str, result_file: str) -> None:
    import torch.distributed as dist

    from hybridrl.distributed import ParallelLayout, init_distributed, init_model_parallel
    from hybridrl.mcore import checkpoint as mckpt
    from hybridrl.mcore import roles
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer
    from tests.mcore import hf_tiny

    init_distributed()
    init_model_parallel(ParallelLayout.from_world(2, tp=2))
    config = OptimConfig(lr=1e-2, backend="torch")
    actor = roles.build_actor(model_path)
    opt = build_optimizer(actor.chunks, config)
    for p in actor.parameters():  # one update: the weights leave the HF start and Adam gets moments
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    role_dir = os.path.join(ckpt, "actor")
    mckpt.save_role(actor, opt, role_dir)
    ids = hf_tiny.input_ids()
    r = {"logits_tp2": hf_tiny.megatron_outputs(actor.chunks, hf_tiny.VOCAB, ids)}

    same = roles.build_actor(model_path)  # the same layout: weights and Adam moments come back exactly
    same_opt = build_optimizer(same.chunks, config)
    r["same_restored"] = mckpt.load_role(same, same_opt, role_dir)
    before, after = _snapshot(actor), _snapshot(same)
    r["same_weights"] = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    mine, theirs = opt.optimizer.state_dict()["state"], same_opt.optimizer.state_dict()["state"]
    r["same_moments"] = all(torch.equal(mine[k]["exp_avg"], theirs[k]["exp_avg"]) for k in mine)

    init_model_parallel(ParallelLayout.from_world(2, tp=1))  # TP1 x DP2: weights exact, optimizer restarts
    other = roles.build_actor(model_path)
    other_opt = build_optimizer(other.chunks, config)
    r["tp1_restored"] = mckpt.load_role(other, other_opt, role_dir)
    r["tp1_num_steps"] = other_opt.num_steps
    r["logits_tp1"] = hf_tiny.megatron_outputs(other.chunks, hf_tiny.VOCAB, ids)

    init_model_parallel(ParallelLayout.from_world(2, tp=1, pp=2, vpp=2))  # 2 chunks per rank, layers interleaved
    chunked = mckpt.build_from_checkpoint(role_dir)
    r["vpp_chunks"] = len(chunked.chunks)
    r["logits_pp2_vpp2"] = hf_tiny.megatron_outputs(chunked.chunks, hf_tiny.VOCAB, ids, n_micro=2)
    if dist.get_rank() == 0:
        torch.save(r, result_file)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])
