"""SFT and DPO datasets: the loss reads exactly the assistant tokens, the template renders the whole chat, and bad
rows are one-line errors naming the file and row (through the CLI's funnel too, before any model is built)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.config import DataConfig
from hybridrl.config.schema_recipes import DPOConfig, SFTConfig
from hybridrl.data.files import DataError, write_rows
from hybridrl.data.recipe_data import PreferenceDataset, SFTDataset
from hybridrl.data.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DATA = DataConfig(max_prompt_length=64, max_response_length=48)
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Copy: 482"},
    {"role": "assistant", "content": "482"},
    {"role": "user", "content": "Repeat the word hello"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "the quick brown fox"},  # after the last assistant turn: not read
]


def _trained_and_context(ds, row: int, tok):
    b = ds.batch([row]).batch
    ids, mask, attn = b["responses"][0], b["response_mask"][0], b["attention_mask"][0]
    trained = ids[mask.bool()].tolist()
    context = ids[(mask == 0) & attn[-ids.shape[0] :].bool()].tolist()
    return trained, context, b


@pytest.mark.parametrize("which", ["hf", "sp"])
def test_sft_messages_train_on_assistant_turns_only(which, hf_tok, sp_tok, tmp_path):
    tok = load_tokenizer(hf_tok if which == "hf" else sp_tok)
    path = write_rows([{"messages": CHAT}], tmp_path / "chat.jsonl")
    ds = SFTDataset([path], tok, DATA, SFTConfig())
    trained, context, b = _trained_and_context(ds, 0, tok)
    end = "<|im_end|>\n" if which == "hf" else "\n"  # what each template adds after a turn's content
    eos = tok.eos_token_id
    assert trained == [*tok.encode("482" + end), eos, *tok.encode("hello" + end), eos]
    # the rendered chat is the sequence: prompt up to the first assistant turn, EOS after each assistant turn
    p = DATA.max_prompt_length
    prompt = b["input_ids"][0][:p][b["attention_mask"][0][:p].bool()].tolist()
    assert prompt == tok.encode(tok.render_chat(CHAT[:2], add_generation_prompt=True))
    between = tok.render_chat(CHAT[:4], add_generation_prompt=True)[len(tok.render_chat(CHAT[:3], False)) :]
    assert context == tok.encode(between)  # the user turn between: in the sequence, not in the loss
    assert tok.decode(trained, skip_special_tokens=True).replace("<|im_end|>", "").split() == ["482", "hello"]


def test_sft_prompt_response_rows_match_the_rl_layout(hf_tok, tmp_path):
    tok = load_tokenizer(hf_tok)
    rows = [
        {"prompt": "Copy: 482", "response": "482"},
        {"prompt": [{"role": "user", "content": "hi"}], "response": [{"role": "assistant", "content": "hello"}]},
    ]
    ds = SFTDataset([write_rows(rows, tmp_path / "pr.jsonl")], tok, DATA, SFTConfig())
    trained, context, b = _trained_and_context(ds, 0, tok)
    assert trained == [*tok.encode("482"), tok.eos_token_id] and context == []
    p = DATA.max_prompt_length
    prompt = b["input_ids"][0][:p][b["attention_mask"][0][:p].bool()].tolist()
    assert prompt == tok.apply_chat_template([{"role": "user", "content": "Copy: 482"}])  # as RLHFDataset renders
    assert _trained_and_context(ds, 1, tok)[0] == [*tok.encode("hello"), tok.eos_token_id]


def test_preference_batch_is_chosen_then_rejected(hf_tok, tmp_path):
    tok = load_tokenizer(hf_tok)
    rows = [{"prompt": f"Copy: {i}", "chosen": f"{i}", "rejected": f"{i + 1}"} for i in range(3)]
    ds = PreferenceDataset([write_rows(rows, tmp_path / "p.jsonl")], tok, DATA, DPOConfig())
    assert len(ds) == 3
    b = ds.batch([2, 0]).batch
    got = [tok.decode(r[m.bool()].tolist()) for r, m in zip(b["responses"], b["response_mask"], strict=True)]
    assert got == ["2", "0", "3", "1"]
    assert (b["input_ids"][0, : DATA.max_prompt_length] == b["input_ids"][2, : DATA.max_prompt_length]).all()


def test_bad_rows_are_one_line_errors(hf_tok, tmp_path):
    tok = load_tokenizer(hf_tok)
    cases = [
        ("nochosen", lambda p: PreferenceDataset([p], tok, DATA, DPOConfig()), [{"prompt": "a", "answer": "b"}],
         r"needs columns \['prompt', 'chosen', 'rejected'\] and has no \['chosen', 'rejected'\] \(dpo.chosen_key"),
        ("equal", lambda p: PreferenceDataset([p], tok, DATA, DPOConfig()),
         [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "same", "rejected": "same"}],
         r"row 1: 'chosen' equals 'rejected' \('same'\): the pair carries no preference; fix or drop the row"),
        ("noassistant", lambda p: SFTDataset([p], tok, DATA, SFTConfig()),
         [{"messages": [{"role": "user", "content": "hi"}]}],
         r"row 0: the chat has no assistant turn \(roles \['user'\]\); SFT trains on assistant turns only"),
        ("nocolumns", lambda p: SFTDataset([p], tok, DATA, SFTConfig()), [{"text": "hi"}],
         r"an SFT file needs a 'messages' column"),
        ("long", lambda p: SFTDataset([p], tok, DataConfig(max_prompt_length=4), SFTConfig()),
         [{"prompt": "Copy: 1,234 and more words here", "response": "x"}], r"set data.truncation=left"),
    ]  # fmt: skip
    for name, make, rows, message in cases:
        with pytest.raises(DataError, match=message) as info:
            make(write_rows(rows, tmp_path / f"{name}.jsonl"))
        assert "\n" not in str(info.value) and f"{name}.jsonl" in str(info.value)


CLI_CONFIG = """
model: {{path: {model}, dtype: float32}}
actor: {{ppo_mini_batch_size: 2, ppo_micro_batch_size_per_gpu: 2}}
data: {{train_files: [{data}], train_batch_size: 2, max_prompt_length: 16, max_response_length: 8}}
trainer: {{n_gpus_per_node: 1, default_local_dir: {out}, loggers: [jsonl]}}
"""


@pytest.mark.parametrize(("recipe", "rows", "message"), [
    ("dpo", [{"prompt": "Copy: 1", "answer": "1"}] * 4, "data error: .*bad.jsonl: a DPO file needs columns"),
    ("dpo", [{"prompt": "Copy: 1", "chosen": "1", "rejected": "1"}] * 4, "data error: .*row 0: 'chosen' equals"),
    ("sft", [{"messages": [{"role": "user", "content": "hi"}]}] * 4, "data error: .*the chat has no assistant turn"),
])  # fmt: skip
def test_cli_reports_bad_data_before_building_models(recipe, rows, message, hf_tok, tmp_path):
    """`hybridrl dpo` / `sft` on bad rows: exit 2 and one `data error:` line, before any model is built."""
    from tests.mcore import hf_tiny

    model = hf_tiny.make_checkpoint("qwen2", str(tmp_path / "model"), hidden_size=128, vocab_size=320)
    hf_tok.save_pretrained(model)
    config = tmp_path / "run.yaml"
    data = write_rows(rows, tmp_path / "bad.jsonl")
    config.write_text(CLI_CONFIG.format(model=model, data=data, out=tmp_path / "run"))
    done = subprocess.run([sys.executable, "-m", "hybridrl", recipe, str(config)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})  # fmt: skip
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.match(message, lines[-1]), lines[-3:]
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "global_step_1").exists()
