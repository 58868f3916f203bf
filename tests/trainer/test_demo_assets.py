"""The demo task's assets: a model folder that carries its tokenizer (so `hybridrl export` copies it along)."""

from __future__ import annotations

import os


def test_demo_model_folder_carries_its_tokenizer(tmp_path):
    from hybridrl.config import load_config
    from hybridrl.data import load_tokenizer
    from hybridrl.trainer.demo_assets import make_demo_assets

    cfg = load_config("tiny_cpu_grpo.yaml", world_size=2)
    assets = make_demo_assets(cfg, str(tmp_path), warmup_steps=0, n_train=8, n_val=2)
    assert os.path.isfile(os.path.join(assets.model_path, "tokenizer.model"))
    from_folder, original = load_tokenizer(assets.model_path), load_tokenizer(assets.tokenizer_path)
    text = "Copy: 482"
    assert from_folder.encode(text) == original.encode(text) and from_folder.eos_token_id == original.eos_token_id
