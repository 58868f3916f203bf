"""Malformed configs, data files and checkpoints, each with its expected one-line error (issue 6, item 7).

Every case builds its broken input under ``tmp_path`` and feeds it to the public entry point a user hits
(``load_config``, ``RLHFDataset``, ``load_custom_scorer`` / ``get_scorer``, ``load_hf_config`` +
``shape_from_hf`` + ``bridge.validate`` on an ``HFCheckpoint``, ``CheckpointManager.resume_path``). The test
asserts the exact exception type, a message of one line, and the fragments that name the offending
key / file / row / tensor and the fix. ``<tmp>`` in a fragment stands for the case's ``tmp_path``.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

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

        tok = assets.tokenizer if tokenizer is None else str(tmp / tokenizer)
        return lambda: RLHFDataset([path] if files is None else files, tok, config)

    return build


def _scorer(source: str | None, name="compute_score", unknown_source=None):
    def build(tmp, assets):
        from hybridrl.rewards import get_scorer, load_custom_scorer

        if unknown_source is not None:
            return lambda: get_scorer(unknown_source)
        path = tmp / "my_reward.py"
        if source is not None:
            path.write_text(source)
        return lambda: load_custom_scorer(path, name)

    return build


def _val_source(source: str = "gsm8k", **columns):
    """A training file the registry scores, a validation file whose row is ``_row(data_source=source, **columns)``
    (a data_source the registry does not know, a reward_model without a ground truth)."""

    def build(tmp, assets):
        import pyarrow as pa
        import pyarrow.parquet as pq

        from hybridrl.config.schema import RewardConfig
        from hybridrl.data import RLHFDataset
        from hybridrl.rewards import RewardManager
        from hybridrl.trainer.main import check_reward_sources

        for name, row in (("train", _row()), ("val", _row(data_source=source, **columns))):
            pq.write_table(pa.Table.from_pylist([row]), tmp / f"{name}.parquet")
        train, val = (RLHFDataset([tmp / f"{n}.parquet"], assets.tokenizer) for n in ("train", "val"))
        return lambda: check_reward_sources(RewardManager.from_config(RewardConfig()), train, val)

    return build


def _hf(config=None, weights=None, files=None, tp=1, head="lm", folder=None):
    """The good tiny qwen2 checkpoint, copied and broken: ``config(dict)``, ``weights(dict)``, ``files(path)``."""

    def build(tmp, assets):
        from safetensors.torch import load_file, save_file

        from hybridrl.mcore import bridge, hf_config

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

        def call():
            shape = hf_config.shape_from_hf(hf_config.load_hf_config(target), tp=1)
            bridge.validate(bridge.HFCheckpoint(target), shape, tp, head=head)

        return call

    return build


def _write(name: str, text: str):
    return lambda path: (path / name).write_text(text)


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
          ConfigError, "rollout.tp_size (3) must divide the world size (4)"),
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
    # ---- data files (RLHFDataset) and reward functions ------------------------------------------------
    _case("data-missing-prompt-column",
          _data([{"question": "hi", "data_source": "gsm8k", "reward_model": {"ground_truth": "1"}}]), DataError,
          "<tmp>/train.parquet: missing column 'prompt' (has ['data_source', 'question', 'reward_model'])"),
    _case("data-missing-data-source", _data([{"prompt": "hi", "reward_model": {"ground_truth": "1"}}]),
          DataError, "<tmp>/train.parquet: missing column 'data_source'", "add the column to the file"),
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
    _case("data-unknown-config-key", _data([_row()], {"max_prompt_length": 32, "trunction": "left"}), ValueError,
          "data config key 'trunction' is unknown; known keys:", "'truncation'"),
    _case("data-bad-truncation", _data([_row()], {"truncation": "middle"}), ValueError,
          "data.truncation ('middle') must be one of ['error', 'left', 'right']"),
    _case("data-missing-tokenizer", _data([_row()], tokenizer="no_tokenizer"), FileNotFoundError,
          "tokenizer path '<tmp>/no_tokenizer' does not exist; check model.tokenizer_path"),
    _case("data-scorer-unknown-source", _scorer(None, unknown_source="unknown/source"), ValueError,
          "no reward scorer for data_source 'unknown/source'; known: [", "set reward.scorer, reward.custom.path"),
    _case("data-scorer-unknown-val-source", _val_source("val/only"), DataError,
          "no reward scorer for data_source 'val/only'; known: [", "set reward.scorer, reward.custom.path"),
    _case("data-val-without-ground-truth", _val_source(reward_model={"answer": "42"}), DataError,
          "<tmp>/val.parquet: row 0 (reward_model keys ['answer']): reward_model.ground_truth is missing or null",
          "so the built-in scorer 'gsm8k' would give 0 to every response; add it to each row"),
    _case("data-scorer-missing-function", _scorer("def score(a, b, c, d):\n    return 1.0\n"), ValueError,
          "reward.custom.name 'compute_score' is not a function in '<tmp>/my_reward.py' (it defines ['score'])"),
    _case("data-scorer-syntax-error", _scorer("def compute_score(:\n"), ValueError,
          "reward.custom.path '<tmp>/my_reward.py' failed to import (SyntaxError", "fix the file"),
    _case("data-scorer-missing-file", _scorer(None), FileNotFoundError,
          "reward.custom.path '<tmp>/my_reward.py' does not exist; point it at a .py file"),
    # ---- HF checkpoints (load_hf_config / shape_from_hf / HFCheckpoint / bridge.validate) -----------------
    _case("ckpt-no-config-json", _hf(files=lambda p: (p / "config.json").unlink()), "HFConfigError",
          "no config.json in '<tmp>/ckpt'; pass a local Hugging Face model folder"),
    _case("ckpt-missing-folder", _hf(folder="nowhere"), "HFConfigError", "no config.json in '<tmp>/nowhere'"),
    _case("ckpt-config-not-json", _hf(files=_write("config.json", "{not json")), "HFConfigError",
          "cannot read <tmp>/ckpt/config.json", "fix or re-save it"),
    _case("ckpt-config-without-model-type", _hf(config=lambda c: c.pop("model_type")), "HFConfigError",
          "cannot read <tmp>/ckpt/config.json (ValueError: Unrecognized model", "`model_type` key"),
    _case("ckpt-unknown-model-type", _hf(config=lambda c: c.update(model_type="foo_bar")), "HFConfigError",
          "cannot read <tmp>/ckpt/config.json", "model type `foo_bar`", "fix or re-save it"),
    _case("ckpt-unsupported-architecture", _hf(config=lambda c: c.update(architectures=["GPT2LMHeadModel"])),
          "HFConfigError", "unsupported architecture ['GPT2LMHeadModel'] (model_type 'qwen2'); supported:"),
    _case("ckpt-unsupported-activation", _hf(config=lambda c: c.update(hidden_act="gelu")), "HFConfigError",
          "hidden_act ('gelu') is not supported; only 'silu'"),
    _case("ckpt-kv-heads-not-divisible-by-tp", _hf(tp=4), "HFConfigError",
          "num_key_value_heads (2) is not divisible by tp (4); choose a tp that divides 2"),
    _case("ckpt-only-bin-file",
          _hf(files=lambda p: (p / "model.safetensors").rename(p / "pytorch_model.bin")), "CheckpointError",
          "no safetensors weights in <tmp>/ckpt (found:", "pytorch_model.bin", "safe_serialization=True"),
    _case("ckpt-corrupt-safetensors",
          _hf(files=lambda p: (p / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{garbage")),
          "CheckpointError", "cannot read <tmp>/ckpt/model.safetensors (", "the file is corrupt or not safetensors"),
    _case("ckpt-index-missing-shard", _hf(files=_index({"lm_head.weight": "model-00002-of-00002.safetensors"})),
          "CheckpointError", "<tmp>/ckpt/model-00002-of-00002.safetensors is listed in model.safetensors.index.json"
          " but missing"),
    _case("ckpt-index-names-absent-tensor", _hf(files=_index({"model.extra.weight": "model.safetensors"})),
          "CheckpointError", "model.safetensors.index.json maps model.extra.weight to model.safetensors",
          "which lacks it; re-save"),
    _case("ckpt-index-without-weight-map", _hf(files=_write("model.safetensors.index.json", "{}")),
          "CheckpointError", "cannot read <tmp>/ckpt/model.safetensors.index.json", "'weight_map'",
          "re-save the checkpoint"),
    _case("ckpt-missing-tensor", _hf(weights=lambda w: w.pop(W)), "CheckpointError",
          f"tensor {W} is missing from <tmp>/ckpt", "num_hidden_layers=1"),
    _case("ckpt-extra-tensor",
          _hf(weights=lambda w: w.update({W.replace(".0.", ".1."): w[W].clone()})), "CheckpointError",
          f"unexpected tensor {W.replace('.0.', '.1.')} in <tmp>/ckpt (shape [96, 64])",
          "does not describe these weights"),
    _case("ckpt-wrong-shape-tensor", _hf(weights=lambda w: w.update({W: w[W][:95].clone()})), "CheckpointError",
          f"tensor {W} has shape [95, 64] but config.json implies [96, 64]"),
    _case("ckpt-causal-lm-as-reward-model", _hf(head="score"), "CheckpointError",
          "tensor score.weight is missing from <tmp>/ckpt", "*ForSequenceClassification checkpoint with num_labels=1"),
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
}


def _exception(exc):
    """Exception classes of hybridrl.mcore are named by string so that collection does not import Megatron."""
    if isinstance(exc, str):
        import importlib

        module, name = _EXCEPTIONS[exc]
        return getattr(importlib.import_module(module), name)
    return exc


@pytest.mark.parametrize(("build", "exc", "fragments"), CASES)
def test_malformed_input_fails_with_one_line(build, exc, fragments, tmp_path, assets):
    call = build(tmp_path, assets)
    exc = _exception(exc)
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {message}"
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment.replace("<tmp>", str(tmp_path)) in message, message


def test_suite_covers_configs_data_and_checkpoints():
    kinds = [case.id.split("-")[0] for case in CASES]
    assert len(CASES) >= 24
    assert all(kinds.count(kind) >= 8 for kind in ("config", "data", "ckpt")), kinds
