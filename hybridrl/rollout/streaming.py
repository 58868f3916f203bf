"""Batch generation that reports each response the moment vLLM finishes it: :func:`generate_streaming`.

``LLM.generate`` adds a batch's requests, steps the engine until none is left and returns every output at once,
so whatever works on the responses (scoring them, :mod:`hybridrl.rewards.stream`) waits for the slowest one.
:func:`generate_streaming` does what ``LLM.generate`` does, through the same public calls (``LLM.enqueue``: the
same request ids, prompt rendering and sampling parameters; then ``LLMEngine.step`` until nothing is unfinished,
outputs sorted by request id), so its outputs are exactly ``LLM.generate``'s, token for token, with the same seeds.
Between two steps it hands the responses finished in the step to a callback. The agent loop steps the engine
request by request instead (:mod:`hybridrl.rollout.vllm_requests`: requests added while others run); here the
whole batch is added up front, as ``LLM.generate`` does, which is what keeps the schedule, and therefore every
sampled token, the batch path's.

With ``n > 1`` vLLM fans a prompt out into ``n`` child requests and returns the prompt's output once all of them
are done; a child that finished earlier sits, complete, in its parent's output aggregator (vLLM's
``ParentRequest``, which :func:`generate_streaming` reads), so samples are reported one by one, not per prompt.
Where that internal is missing (another vLLM release), a prompt's samples are reported when the whole prompt
finishes: later, never wrong.

Under ``external_launcher`` at rollout TP > 1 every rank of an engine runs this same loop on the same requests
(as with ``LLM.generate``); each rank's callback sees the same responses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Finished = list[tuple[int, list[int]]]
"""The responses one step finished: ``(row, token ids)`` with ``row = prompt * n + sample``."""


class _Progress:
    """Which samples of the enqueued prompts are finished and reported."""

    def __init__(self, engine: Any, request_ids: Sequence[str], n: int) -> None:
        self.n = n
        # internal ids are "<external id>-<random suffix>" (the external one alone when randomisation is off)
        self.prompt_of = {rid.split("-")[0]: i for i, rid in enumerate(request_ids)}
        parents = getattr(getattr(engine, "output_processor", None), "parent_requests", {})
        self.parents = {i: parents[rid] for i, rid in enumerate(request_ids) if n > 1 and rid in parents}
        self.reported: set[int] = set()

    def finished(self, step_outputs: Sequence[Any]) -> Finished:
        out: Finished = []
        for o in step_outputs:  # whole prompts: every sample not reported yet
            if o.finished:
                i = self.prompt_of[str(o.request_id)]
                out += self._report(i, o.outputs)
                self.parents.pop(i, None)
        for i, parent in list(self.parents.items()):  # single samples of prompts still running
            out += self._report(i, [c for c in getattr(parent, "output_aggregator", ()) if c is not None])
        return out

    def _report(self, prompt: int, samples: Sequence[Any]) -> Finished:
        out = []
        for sample in samples:
            row = prompt * self.n + sample.index
            if row not in self.reported:
                self.reported.add(row)
                out.append((row, list(sample.token_ids)))
        return out


def generate_streaming(
    llm: Any, prompts: Sequence[Any], params: Sequence[Any], on_step: Callable[[Finished], None]
) -> list[Any]:
    """``llm.generate(prompts, params, use_tqdm=False)``, calling ``on_step`` after every engine step.

    Args:
        llm: an idle ``vllm.LLM`` (no requests of its own in flight).
        prompts: one ``TokensPrompt`` per prompt.
        params: one ``SamplingParams`` per prompt, all with the same ``n``.
        on_step: called after each step with the responses it finished (:data:`Finished`, possibly empty); the
            last call comes right after the last step, when generation has ended.

    Returns:
        The ``RequestOutput`` of each prompt, in prompt order (what ``LLM.generate`` returns).
    """
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("generate_streaming: the engine still has unfinished requests; finish or abort them first")
    n = {p.n for p in params}
    assert len(n) <= 1, f"generate_streaming: one n for the whole batch, got {sorted(n)}"
    request_ids = llm.enqueue(list(prompts), list(params), use_tqdm=False)
    progress = _Progress(engine, request_ids, n.pop() if n else 1)
    outputs = []
    try:
        while engine.has_unfinished_requests():
            step = engine.step()
            outputs += [o for o in step if o.finished]
            on_step(progress.finished(step))
    except BaseException:  # the next generate must find the engine idle
        engine.abort_request(list(request_ids), internal=True)
        raise
    return sorted(outputs, key=lambda o: int(o.request_id))
