"""vLLM's request-level API on an in-process :class:`~hybridrl.rollout.vllm_engine.VLLMRolloutEngine`: requests
added one by one while others generate, finished ones collected after every engine step.

``LLM.generate`` takes a whole batch and returns when its slowest request is done; a multi-turn loop needs more:
a trajectory whose tool answered must go back to vLLM at once, joining the running batch (continuous batching
across turns). vLLM's v1 ``LLMEngine`` offers exactly that in-process: ``add_request`` (a rendered token prompt
and its ``SamplingParams``) and ``step`` (one scheduler iteration: prefill of new requests and one decode token of
the running ones, returning the requests that finished). With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the engine core
runs in this process, so ``step`` is a plain call: no asyncio, no engine-core process, and the weight switch keeps
writing into the same model. :class:`VLLMRequests` wraps it; requests are seeded one by one exactly as
:meth:`VLLMRolloutEngine.generate` seeds them, and ``output_kind=FINAL_ONLY`` returns each request once, whole.

Under ``external_launcher`` at rollout TP > 1 every rank of an engine runs the same scheduler: the ranks must add
the same requests between the same steps (the agent loop broadcasts them from the engine's first rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Finished:
    """A request vLLM completed."""

    request_id: str
    token_ids: list[int]
    """The generated tokens (an end token it stopped on included)."""
    log_probs: list[float]
    """The engine's log-prob of each generated token (``logprobs_mode`` of the engine)."""
    finish_reason: str
    """"stop" (an end token) or "length" (``max_tokens``)."""


class VLLMRequests:
    """Add token-id requests to a live engine and step it; see the module docstring.

    Args:
        engine: an awake :class:`~hybridrl.rollout.vllm_engine.VLLMRolloutEngine` with its weights pushed.

    Raises:
        RuntimeError: the engine sleeps or lost its weights.
    """

    def __init__(self, engine: Any) -> None:
        engine._check_ready("the agent loop")
        self.engine = engine
        self.llm_engine = engine.llm.llm_engine
        self.max_model_len = engine.max_model_len

    def add(self, request_id: str, prompt_ids: Sequence[int], settings: Mapping[str, Any]) -> None:
        """Queue one request: ``prompt_ids`` and sampling ``settings`` (the engine's keys; ``seed`` is this
        request's own, ``n`` must be 1).

        Raises:
            ValueError: ``n`` > 1, an unknown sampling key, or a prompt + ``max_tokens`` past ``max_model_len``.
        """
        from vllm.inputs import TokensPrompt
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind

        settings = {**self.engine.sampling, **self.engine._check_sampling(settings), "n": 1}
        if len(prompt_ids) + int(settings["max_tokens"]) > self.max_model_len:
            raise ValueError(
                f"request {request_id}: {len(prompt_ids)} prompt tokens + max_tokens {settings['max_tokens']} > "
                f"max_model_len ({self.max_model_len}); raise rollout.max_model_len"
            )
        params = self.engine._sampling_params(settings, 0, 1)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it is complete
        prompt = parse_model_prompt(self.llm_engine.model_config, TokensPrompt(prompt_token_ids=list(prompt_ids)))
        (engine_input,) = self.llm_engine.renderer.render_cmpl([prompt])
        self.llm_engine.add_request(request_id, engine_input, params)

    def step(self) -> list[Finished]:
        """One engine iteration; the requests it finished."""
        done = []
        for out in self.llm_engine.step():
            if not out.finished:
                continue
            sample = out.outputs[0]
            tokens = list(sample.token_ids)
            log_probs = [lp[t].logprob for t, lp in zip(tokens, sample.logprobs, strict=True)]
            done.append(Finished(out.request_id, tokens, log_probs, str(sample.finish_reason)))
        return done

    def has_unfinished(self) -> bool:
        """Requests are queued or running."""
        return self.llm_engine.has_unfinished_requests()

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop queued or running requests (their KV blocks are freed)."""
        if request_ids:
            self.llm_engine.abort_request(list(request_ids))
