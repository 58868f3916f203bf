"""LoRA on Megatron equals PEFT on the HF model: forward, adapter gradients, grad norm, merged weights, exports.

PEFT (the installed ``peft`` on transformers' Llama) is the independent reference. Its adapter gets random
factors, with one ``lora_A`` shared by the projections of each fused Megatron layer (q/k/v in ``linear_qkv``,
gate/up in ``linear_fc1``: the form a fused layer has) and targets that adapt only some of them
(``q_proj, v_proj`` without ``k_proj``, ``gate_proj`` without ``up_proj``, plus ``o_proj`` and ``down_proj``).
One 2-rank gloo launch builds the actor as the worker does (``roles.build_actor`` + ``lora.apply_config``), loads
PEFT's folder through :func:`~hybridrl.mcore.lora_peft.load_peft_adapter` and, at TP1 (dp 2), TP2 and PP2:

- logits == PEFT's (adapters on), == the base HF model's (:func:`lora.disabled`: the reference policy), and the
  merged model's (:func:`lora.merged`) == PEFT's;
- gradients of a cross-entropy loss w.r.t. the factors == PEFT's (a shared ``A``'s gradient is the sum of its
  projections'), the optimizer holds only the factors and its grad norm == the norm of PEFT's gradients (TP2, PP2);
- the hybrid engine's push inside ``lora.merged`` (HF layout) == PEFT's ``merge_and_unload`` weights;
- the memory report's adapter count (:mod:`hybridrl.config.memory_lora`) == what this rank allocated;
- exports at TP2: the merged HF folder and the PEFT folder (loaded back by ``peft.PeftModel``) give PEFT's logits
  (trainer checkpoints of an adapted actor: tests/trainer/test_lora_e2e.py).

A sabotaged TP rule (no all-reduce of the column-parallel adapter's input gradient) must miss PEFT's gradients.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.mcore import hf_tiny
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank
R, ALPHA = 4, 8.0
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
LAYOUTS = {"tp1": {"tp": 1}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}
TOL = 1e-5


def _peft(path: str, adapter: str | None = None):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        return peft.PeftModel.from_pretrained(base, adapter).eval()
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    return peft.get_peft_model(base, config)


def _fused_groups(layer) -> list[list]:
    a, m = layer.self_attn, layer.mlp
    groups = [[a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]]
    return [[x for x in g if hasattr(x, "lora_A")] for g in groups]


def _randomize(model, seed: int = 5) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            for group in _fused_groups(layer):
                a = torch.randn(group[0].lora_A["default"].weight.shape, generator=g) * 0.3
                for x in group:
                    x.lora_A["default"].weight.copy_(a)
                    x.lora_B["default"].weight.normal_(0, 0.3, generator=g)


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    labels = torch.roll(ids, -1, dims=1)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _peft_grads(model, ids) -> dict[str, torch.Tensor]:
    """PEFT's factor gradients in PEFT's names; a fused group's lora_A gradient summed over its projections."""
    model.zero_grad()
    _ce(model(input_ids=ids).logits, ids).backward()
    out = {}
    for i, layer in enumerate(model.base_model.model.model.layers):
        for group in _fused_groups(layer):
            a_grad = sum(x.lora_A["default"].weight.grad for x in group)
            for x in group:
                name = next(n for n, mod in layer.named_modules() if mod is x)
                key = f"base_model.model.model.layers.{i}.{name}"
                out[f"{key}.lora_A.weight"] = a_grad
                out[f"{key}.lora_B.weight"] = x.lora_B["default"].weight.grad.clone()
    return out


def _megatron_grads(chunks, shape, ids):
    from hybridrl.mcore import gpt, lora_peft

    for p in (p for c in chunks for p in c.parameters()):
        p.grad = None
    batch = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).expand_as(ids).contiguous(),
             "labels": torch.roll(ids, -1, dims=1)}  # fmt: skip
    gpt.forward_backward(chunks, [batch], lambda out, _: (out.mean(), {}))
    return lora_peft.adapter_tensors(chunks, shape, tensor_of=lambda p: p.grad)


def _untied_adapter(adapter: str, out: str) -> str:
    """A copy of ``adapter`` whose layer-0 v_proj has its own lora_A: no rank-r fused form."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, out, dirs_exist_ok=True)
    weights = os.path.join(out, "adapter_model.safetensors")
    tensors = load_file(weights)
    key = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"
    tensors[key] = tensors[key] + 1.0
    save_file(tensors, weights)
    return out


def _body(rank: int, world: int, path: str, adapter: str, out_dir: str, ids: torch.Tensor) -> dict:
    import os

    from megatron.core import tensor_parallel

    from hybridrl.config.schema_roles import ActorConfig, LoRAConfig
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.hybrid_engine import HybridEngine
    from hybridrl.mcore import lora, lora_peft, roles
    from hybridrl.mcore.optimizer import build_optimizer
    from hybridrl.workers.megatron_workers import optim_config

    cfg = LoRAConfig(enable=True, rank=R, alpha=ALPHA, target_modules=TARGETS)

    def build():
        actor = roles.build_actor(path)
        lora.apply_config(actor, cfg)
        return actor

    out: dict = {}
    for name, sizes in LAYOUTS.items():
        layout = ParallelLayout.from_world(world, **sizes)
        init_model_parallel(layout)
        actor = build()
        lora_peft.load_peft_adapter(actor.chunks, actor.shape, adapter)
        res = {"logits": hf_tiny.megatron_outputs(actor.chunks, hf_tiny.VOCAB, ids)}
        with lora.disabled(actor.chunks):
            res["base"] = hf_tiny.megatron_outputs(actor.chunks, hf_tiny.VOCAB, ids)
        with lora.merged(actor.chunks):
            res["merged"] = hf_tiny.megatron_outputs(actor.chunks, hf_tiny.VOCAB, ids)
            push = HybridEngine.from_role(actor, layout.with_rollout_tp(1), pad_vocab=False).to_rollout()
            res["push"] = {k: v.clone() for k, v in push.items()}
        res["grads"] = _megatron_grads(actor.chunks, actor.shape, ids)
        section = ActorConfig().optim
        section.backend = "torch"
        opt = build_optimizer(actor.chunks, optim_config(section, 1))
        res["trained"] = (len(opt.params), len(list(lora.adapter_parameters(actor.chunks))))
        res["adapter_numel"] = sum(p.numel() for _, p in lora.adapter_parameters(actor.chunks))
        res["grad_norm"] = opt.step().grad_norm
        if name == "tp1":
            try:
                lora_peft.load_peft_adapter(
                    actor.chunks, actor.shape, _untied_adapter(adapter, f"{out_dir}/untied{rank}")
                )
            except lora.LoRAError as err:
                res["untied_error"] = str(err)
        if name == "tp2":
            actor = build()
            lora_peft.load_peft_adapter(actor.chunks, actor.shape, adapter)
            actor.export(os.path.join(out_dir, "merged"))
            lora_peft.export_role(actor, os.path.join(out_dir, "peft"))
            original = tensor_parallel.copy_to_tensor_model_parallel_region
            tensor_parallel.copy_to_tensor_model_parallel_region = lambda x, group=None: x
            try:
                res["sabotaged_grads"] = _megatron_grads(actor.chunks, actor.shape, ids)
            finally:
                tensor_parallel.copy_to_tensor_model_parallel_region = original
        out[name] = res
    return hf_tiny.portable(out) if rank == 0 else {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    hf_tiny.make_checkpoint("llama", path, seed=2)
    ids = hf_tiny.input_ids()
    model = _peft(path)
    _randomize(model)
    adapter = str(tmp_path_factory.mktemp("adapter"))
    model.save_pretrained(adapter)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    ref = {"logits": logits, "base": base, "grads": _peft_grads(model, ids)}
    ref["merged_state"] = {k: v.detach().clone() for k, v in model.merge_and_unload().state_dict().items()}
    out_dir = str(tmp_path_factory.mktemp("out"))
    got = hf_tiny.tensors(run_ranks(_body, 2, path, adapter, out_dir, ids, timeout=600)[0])
    return types.SimpleNamespace(ref=ref, got=got, path=path, adapter=adapter, out=out_dir, ids=ids)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_equals_peft_and_base(runs, layout):
    got = runs.got[layout]
    assert _max_diff(got["logits"], runs.ref["logits"]) <= TOL
    assert _max_diff(got["merged"], runs.ref["logits"]) <= TOL
    assert _max_diff(got["base"], runs.ref["base"]) <= TOL
    assert _max_diff(runs.ref["logits"], runs.ref["base"]) > 0.1  # the adapter matters


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adapter_gradients_equal_peft(runs, layout):
    got, want = runs.got[layout]["grads"], runs.ref["grads"]
    assert sorted(got) == sorted(want)
    for key in want:
        scale = float(want[key].abs().max())
        assert _max_diff(got[key], want[key]) <= TOL * max(1.0, scale), key


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_only_adapters_train_and_grad_norm_counts_them(runs, layout):
    got = runs.got[layout]
    trained, adapters = got["trained"]
    assert trained == adapters > 0
    # the shared A of a fused group is one parameter: count it once
    shared = ("k_proj.lora_A.weight", "v_proj.lora_A.weight", "up_proj.lora_A.weight")  # q's / gate's A
    unique = {k: v for k, v in runs.ref["grads"].items() if not k.endswith(shared)}
    want = float(torch.stack([g.norm() for g in unique.values()]).norm())
    assert abs(got["grad_norm"] - want) <= 1e-5 * want


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_memory_report_counts_the_adapters_megatron_allocates(runs, layout):
    from hybridrl.config.memory import Arch
    from hybridrl.config.memory_lora import adapter_params

    c = hf_tiny._COMMON
    arch = Arch(vocab=c["vocab_size"], hidden=c["hidden_size"], ffn=c["intermediate_size"],
                layers=c["num_hidden_layers"], heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"],
                head_dim=c["hidden_size"] // c["num_attention_heads"], tied=False)  # fmt: skip
    sizes = {"tp": 1, "pp": 1, **LAYOUTS[layout]}
    want = adapter_params(arch, types.SimpleNamespace(rank=R, target_modules=TARGETS), sizes["tp"], sizes["pp"])
    assert runs.got[layout]["adapter_numel"] == want


def test_adapter_without_a_fused_form_is_refused(runs):
    err = runs.got["tp1"]["untied_error"]
    want = ": the projections of decoder.layers.0.self_attention.linear_qkv have different lora_A; a fused Megatron "
    assert err.endswith(want + "linear shares one A (adapters saved by hybridrl have it)")


def test_unknown_target_names_no_layer():
    from hybridrl.mcore.lora import LoRAError, resolve_targets

    assert resolve_targets(["q_proj", "linear_fc1"]) == {"linear_qkv": ("q",), "linear_fc1": ("gate", "up")}
    with pytest.raises(LoRAError, match=r"^actor.lora.target_modules: 'qkv' matches no layer; choose from"):
        resolve_targets(["qkv"])


def test_sabotaged_tensor_parallel_rule_is_caught(runs):
    got, want = runs.got["tp2"]["sabotaged_grads"], runs.ref["grads"]
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert _max_diff(got[key], want[key]) > 1e-3


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rollout_push_is_the_merged_model(runs, layout):
    push, hf = runs.got[layout]["push"], runs.ref["merged_state"]
    for i in range(hf_tiny._COMMON["num_hidden_layers"]):
        p, h = f"model.layers.{i}.", f"model.layers.{i}."
        qkv = torch.cat([hf[f"{h}self_attn.{x}_proj.weight"] for x in "qkv"])
        gate_up = torch.cat([hf[f"{h}mlp.{x}_proj.weight"] for x in ("gate", "up")])
        assert _max_diff(push[f"{p}self_attn.qkv_proj.weight"], qkv) <= TOL
        assert _max_diff(push[f"{p}mlp.gate_up_proj.weight"], gate_up) <= TOL
        assert _max_diff(push[f"{p}self_attn.o_proj.weight"], hf[f"{h}self_attn.o_proj.weight"]) <= TOL
        assert _max_diff(push[f"{p}mlp.down_proj.weight"], hf[f"{h}mlp.down_proj.weight"]) <= TOL


def test_exports_load_in_transformers_and_peft(runs):
    import os

    import transformers
    from safetensors.torch import load_file

    merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(runs.out, "merged"), dtype=torch.float32,
                                                               attn_implementation="eager").eval()  # fmt: skip
    peft_model = _peft(runs.path, os.path.join(runs.out, "peft"))
    with torch.no_grad():
        assert _max_diff(merged(input_ids=runs.ids).logits, runs.ref["logits"]) <= TOL
        assert _max_diff(peft_model(input_ids=runs.ids).logits, runs.ref["logits"]) <= TOL
    ours = load_file(os.path.join(runs.out, "peft", "adapter_model.safetensors"))
    theirs = load_file(os.path.join(runs.adapter, "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert max(_max_diff(ours[k], theirs[k]) for k in theirs) == 0.0
