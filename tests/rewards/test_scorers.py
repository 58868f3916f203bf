"""Tests of hybridrl.rewards: GSM8K / boxed-math / demo scorers on hand cases, the data_source registry,
custom scorers from files, and the RewardManager's error / timeout accounting and token-level placement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrl.config.schema import CustomRewardConfig, RewardConfig
from hybridrl.data import PromptLoader, RLHFDataset, write_rows
from hybridrl.protocol import DataProto
from hybridrl.rewards import (
    RewardManager,
    demo,
    get_scorer,
    gsm8k,
    known_sources,
    last_token_rewards,
    load_custom_scorer,
    make_demo_task,
    math_boxed,
    register_scorer,
    run_with_timeouts,
    score_batch,
)
from tests.data import tiny_tokenizers


def test_gsm8k_strict_and_flexible():
    score = gsm8k.compute_score
    assert score("so 6 * 7 = 42\n#### 42", "42") == 1.0
    assert score("#### 1,234", "1234") == 1.0 and score("#### $1,234.", "1,234") == 1.0
    assert score("#### 72.00", "Natalia sold 48 + 24 = 72 clips.\n#### 72") == 1.0
    assert score("#### -3", "-3") == 1.0 and score("#### 3", "-3") == 0.0
    assert score("the answer is 42", "42") == 0.0  # strict needs ####
    assert score("the answer is 42", "42", method="flexible") == 1.0
    assert score("first 10, then 1,234.", "1234", method="flexible") == 1.0
    assert score("#### 41", "42", format_score=0.1) == 0.1 and score("no number", "42", format_score=0.1) == 0.0
    assert gsm8k.extract_answer("#### 5 then #### 6") == "6"
    with pytest.raises(ValueError, match="gsm8k method 'loose' is unknown"):
        gsm8k.extract_answer("1", "loose")


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so \\boxed{42}", "42", 1.0),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "1/2", 1.0),  # the last box counts
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),  # nested braces
        ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
        ("\\boxed{ 2.0 }", "2", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{10\\%}", "10", 1.0),
        ("\\boxed{\\text{(A)}}", "(A)", 1.0),
        ("$\\boxed 7$", "7", 1.0),
        ("\\fbox{3}", "\\boxed{3}", 1.0),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
        ("\\boxed{\\$18.90}", "18.90", 1.0),  # MATH's dollar answers, with or without the sign on either side
        ("\\boxed{18.90}", "\\$18.90", 1.0),
        ("\\boxed{\\text{\\$}5}", "5", 1.0),
        ("\\boxed{32,348}", "32348", 1.0),  # a thousands separator
        ("\\boxed{-1,234.5}", "-1234.5", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("\\boxed{12}", "1,2", 0.0),  # two roots are not the number 12
        ("\\boxed{35}", "3,5", 0.0),
        ("\\boxed{1_0}", "10", 0.0),  # Python's float() reads 1_0 as 10; an answer does not
        ("no box 42", "42", 0.0),
        ("\\boxed{unbalanced", "unbalanced", 0.0),
    ],
)
def test_boxed_math(response, truth, expected):
    assert math_boxed.compute_score(response, truth) == expected


def test_last_boxed_keeps_nested_content():
    assert math_boxed.last_boxed("a \\boxed{\\frac{a}{b^{2}}} b") == "\\frac{a}{b^{2}}"
    assert math_boxed.last_boxed("nothing") is None


def test_demo_task_rows_and_scorer():
    rows = make_demo_task(5, seed=3, num_digits=4)
    assert rows == make_demo_task(5, seed=3, num_digits=4) and rows != make_demo_task(5, seed=4, num_digits=4)
    truth = rows[0]["reward_model"]["ground_truth"]
    assert rows[0]["prompt"] == [{"role": "user", "content": f"Copy: {truth}"}] and len(truth) == 4
    assert rows[0]["data_source"] == demo.DATA_SOURCE and get_scorer(demo.DATA_SOURCE) is demo.compute_score
    assert demo.compute_score(" 4821\n", "4821") == 1.0
    assert demo.compute_score("4820", "4821") == 0.5 * 3 / 4
    assert demo.compute_score("48210000", "4821") == 0.5 * 4 / 8  # too long: partial, below the exact score
    assert demo.compute_score("", "4821") == 0.0
    with pytest.raises(ValueError, match="make_demo_task needs n >= 1"):
        make_demo_task(0)


def test_registry_errors_and_custom_scorer(tmp_path):
    with pytest.raises(ValueError, match=r"no reward scorer for data_source 'nope'; known: \[.*'gsm8k'.*\]; set"):
        get_scorer("nope")
    assert {"gsm8k", "openai/gsm8k", "math", "hybridrl/demo_copy"} <= set(known_sources())
    with pytest.raises(ValueError, match="scorer name 'gsm8k' is already registered"):
        register_scorer(lambda s, g: 0.0, "gsm8k")
    file = tmp_path / "my_reward.py"
    file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(solution_str == ground_truth) + extra_info['bonus']\n")  # fmt: skip
    fn = load_custom_scorer(file)
    assert fn("x", "a", "a", {"bonus": 0.5}) == 1.5
    with pytest.raises(FileNotFoundError, match=r"reward\.custom\.path '.*missing\.py' does not exist"):
        load_custom_scorer(tmp_path / "missing.py")
    with pytest.raises(ValueError, match=r"reward.custom.name 'score' is not a function in .* \['compute_score'\]"):
        load_custom_scorer(file, "score")
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(ValueError, match=r"failed to import \(SyntaxError: .*\); fix the file"):
        load_custom_scorer(broken)


def _batch(truths, source="demo_copy", response_mask=None):
    tensors = {"response_mask": response_mask} if response_mask is not None else {}
    n = len(truths)
    return DataProto(tensors, {"data_source": [source] * n, "ground_truth": truths, "extra_info": [{}] * n})


def test_manager_counts_errors_and_timeouts_without_crashing(tmp_path):
    import threading

    release, slept = threading.Event(), []

    def score(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "raise":
            raise RuntimeError("scorer bug")
        if solution_str == "sleep":
            release.wait(60.0)
            slept.append(True)
        if solution_str == "nan":
            return float("nan")
        if solution_str == "dict":
            return {"score": np.float32(0.25)}
        return float(solution_str == ground_truth)

    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 0], [1, 1, 1]])
    manager = RewardManager(score, timeout_s=0.2, max_workers=2)
    result = manager(_batch(["a"] * 6, response_mask=mask), ["a", "raise", "sleep", "a", "nan", "dict"])
    assert not slept  # did not wait for the hung scorer
    release.set()
    assert result.scores.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.25]
    assert result.metrics["reward/errors"] == 2 and result.metrics["reward/timeouts"] == 1
    assert [(row, status) for row, status, _ in result.failures] == [(1, "error"), (2, "timeout"), (4, "error")]
    assert "RuntimeError: scorer bug" in result.failures[0][2]
    expected = torch.tensor([[0, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0.25]])
    assert torch.equal(result.token_level_scores, expected)  # row 3 has no response token: no reward
    manager(_batch(["a"]), ["raise"])
    assert manager.totals == {"samples": 7, "errors": 3, "timeouts": 1}
    with pytest.raises(ValueError, match="score_batch: 1 responses for a batch of 6 rows"):
        manager(_batch(["a"] * 6), ["a"])


def test_run_with_timeouts_order_and_inline():
    outcomes = run_with_timeouts([lambda i=i: i * i for i in range(20)], timeout_s=5.0, max_workers=3)
    assert outcomes == [("ok", i * i) for i in range(20)]
    status, err = run_with_timeouts([lambda: 1 / 0], timeout_s=None)[0]
    assert status == "error" and isinstance(err, ZeroDivisionError)


def test_run_with_timeouts_reuses_its_threads_and_replaces_stuck_ones():
    """A few threads take all the calls; two calls that hang are abandoned and the rest still run, on threads that
    replace them (at most max_workers + timeouts threads for 20 calls)."""
    import threading

    threads, finished, release = set(), set(), threading.Event()

    def call(i):
        threads.add(threading.current_thread())  # the objects, kept: an OS thread id can be reused
        if i in (3, 4):
            release.wait(60.0)
        finished.add(i)
        return i

    outcomes = run_with_timeouts([lambda i=i: call(i) for i in range(20)], timeout_s=0.3, max_workers=2)
    stuck_still_running = not finished & {3, 4}  # returned without waiting for the hung calls
    release.set()
    assert stuck_still_running
    assert outcomes == [("timeout", None) if i in (3, 4) else ("ok", i) for i in range(20)]
    assert len(threads) <= 4, len(threads)


def test_last_token_rewards_with_left_and_right_gaps():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 0]])
    out = last_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert out.tolist() == [[0, 0, 1, 0], [0, 0, 0, 2], [0, 0, 3, 0]]


def test_manager_from_config(tmp_path):
    assert RewardManager.from_config(RewardConfig(scorer=None)) is None
    gsm = RewardManager.from_config(RewardConfig(scorer="gsm8k", timeout_s=1.0))
    assert gsm(_batch(["42"], source="anything"), ["#### 42"]).scores.tolist() == [1.0]
    auto = RewardManager.from_config(RewardConfig())
    auto.check_data_sources(["gsm8k", "math"])
    with pytest.raises(ValueError, match="no reward scorer for data_source 'mystery'"):
        auto.check_data_sources(["gsm8k", "mystery"])
    file = tmp_path / "r.py"
    file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    custom = RewardManager.from_config(RewardConfig(custom=CustomRewardConfig(path=str(file))))
    assert custom(_batch(["x"], source="mystery"), ["y"]).scores.tolist() == [0.5]
    with pytest.raises(ValueError, match=r"reward.scorer \('math'\) and reward.custom.path .* are both set"):
        RewardManager.from_config(RewardConfig(scorer="math", custom=CustomRewardConfig(path=str(file))))
    # rows without reward_model.ground_truth: refused where a built-in scorer would score them, else fine
    missing = {"gsm8k": (2, "f.parquet: row 4 (reward_model keys ['answer'])"), "mystery": (1, "f.parquet: row 9")}
    with pytest.raises(ValueError, match=r"^f.parquet: row 4 .* and 1 more rows: .* built-in scorer 'gsm8k' would"):
        auto.check_data_sources(["gsm8k"], {"gsm8k": missing["gsm8k"]})
    with pytest.raises(ValueError, match=r"^f.parquet: row 9: .* built-in scorer 'gsm8k' would"):
        gsm.check_data_sources(["mystery"], {"mystery": missing["mystery"]})  # the fixed scorer scores it
    custom.check_data_sources(["gsm8k", "mystery"], missing)  # a custom function may not need one
    register_scorer(lambda solution_str, ground_truth: 1.0, "test/no_ground_truth_needed")
    auto.check_data_sources(["test/no_ground_truth_needed"], {"test/no_ground_truth_needed": (3, "f.parquet: row 0")})


def test_demo_end_to_end_dataset_loader_and_scores(tmp_path):
    rows = make_demo_task(12, seed=0)
    tok = tiny_tokenizers.sp_tokenizer(tmp_path, texts=demo.demo_texts(rows), vocab_size=64)
    ds = RLHFDataset([write_rows(rows, tmp_path / "demo.parquet")], tok, {"max_prompt_length": 16})
    batch = next(iter(PromptLoader(ds, batch_size=4, seed=0)))
    truths = list(batch.non_tensor_batch["ground_truth"])
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    prompts = [tok.decode(ids[i][mask[i]].tolist()) for i in range(len(batch))]
    assert all(p == f"<|user|>\nCopy: {t}\n<|assistant|>\n" for p, t in zip(prompts, truths, strict=True))
    answers = [[*tok.encode(t), tok.eos_token_id] for t in truths]  # what a perfect policy would sample
    responses = torch.full((4, 6), tok.pad_token_id)
    for i, a in enumerate(answers):
        responses[i, : len(a)] = torch.tensor(a)
    text = [tok.decode(r.tolist()) for r in responses]
    result = score_batch(batch, text, timeout_s=5.0, response_mask=(responses != tok.pad_token_id).long())
    assert result.scores.tolist() == [1.0] * 4 and result.token_level_scores.sum().item() == 4.0
    assert np.array_equal(result.token_level_scores.argmax(-1).numpy(), [len(a) - 1 for a in answers])


def test_out_of_range_and_exiting_scorers_score_zero_and_are_named(tmp_path, caplog):
    """A bad score counts as 0 with a warning, as the manager promises: 1e39 (past float32, used to crash the
    step with 'value cannot be converted to type float without overflow'), inf, NaN; a scorer calling os._exit
    (used to end the rank with its exit code, naming nothing) or sys.exit, in the threaded and the inline path."""
    import logging
    import os

    file = tmp_path / "exits.py"
    file.write_text(  # `from os import _exit` binds at import: the guard is in place before the file runs
        "import os, sys\nfrom os import _exit\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'big':\n        return 1e39\n"
        "    if solution_str == 'inf':\n        return float('-inf')\n"
        "    if solution_str == 'os_exit':\n        os._exit(7)\n"
        "    if solution_str == 'bound_exit':\n        _exit(3)\n"
        "    if solution_str == 'sys_exit':\n        sys.exit(3)\n"
        "    return 3e38\n"
    )
    texts = ["big", "inf", "os_exit", "bound_exit", "sys_exit", "fine"]
    for timeout_s in (5.0, None):
        config = RewardConfig(custom=CustomRewardConfig(path=str(file)), timeout_s=timeout_s or 5.0)
        manager = RewardManager.from_config(config)
        manager.timeout_s = timeout_s
        with caplog.at_level(logging.WARNING, logger="hybridrl.rewards.manager"):
            result = manager(_batch(["x"] * 6, response_mask=torch.ones(6, 2, dtype=torch.long)), texts)
        assert result.scores.tolist() == [0.0] * 5 + [pytest.approx(3e38)], timeout_s  # float32's range is fine
        assert result.metrics["reward/errors"] == 5
        messages = [message for _, _, message in result.failures]
        assert "beyond float32's range" in messages[0] and "scorer returned -inf" in messages[1]
        assert "the scorer called os._exit(7), which would have ended this rank" in messages[2]
        assert "os._exit(3)" in messages[3] and "SystemExit: 3" in messages[4]
        assert f"scorer reward.custom 'compute_score' of '{file}'" in caplog.text  # the warning names the scorer
        caplog.clear()
    assert os.getpid() > 0  # still alive; os._exit outside a scorer call still exits (the funnel relies on it)
    from hybridrl.rewards.manager import _guarded_exit, _real_exit

    assert os._exit is _guarded_exit and _real_exit.__module__ in ("posix", "nt")


def test_scorer_that_cannot_be_called_with_four_arguments_is_refused(tmp_path):
    from hybridrl.rewards.manager import ScorerError

    file = tmp_path / "two.py"
    file.write_text("def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    with pytest.raises(ScorerError, match=r"has the signature \(solution_str, ground_truth\); a scorer is called"):
        RewardManager.from_config(RewardConfig(custom=CustomRewardConfig(path=str(file))))
    file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, *, k=1):\n    pass\n")
    RewardManager.from_config(RewardConfig(custom=CustomRewardConfig(path=str(file))))  # extra defaults are fine
