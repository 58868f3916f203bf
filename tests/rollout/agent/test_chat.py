"""Chat rendering of multi-turn rollouts with HF chat templates, and the one-line errors of a bad agent setup as
``hybridrl validate-config --inputs`` (the preflight ``hybridrl train`` runs before building models) prints them.

The token check is independent of the loop's arithmetic: prompt ids + each turn's ids + the observation ids
:class:`~hybridrl.rollout.agent.chat.ChatFormat` appends equal the tokenizer's encoding of the whole
conversation rendered by ``apply_chat_template`` in one go.
"""

from __future__ import annotations

import pytest

from hybridrl.cli import funnel, main
from hybridrl.data.tokenizers import HFTokenizer
from hybridrl.rollout.agent import AgentError
from hybridrl.rollout.agent.chat import ChatFormat
from hybridrl.rollout.agent.envs.calculator import CalculatorEnvironment, tool_call_text
from hybridrl.rollout.agent.interface import environment_tools
from tests.data.tiny_tokenizers import hf_tokenizer

TOOLS_TEMPLATE = (  # Qwen2.5's layout: tools in the system turn, tool results as <tool_response> in a user turn
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# drops the content of assistant turns that other messages follow (as reasoning templates strip old thoughts)
REWRITING_TEMPLATE = TOOLS_TEMPLATE.replace(
    "{{ m['content'] }}<|im_end|>", "{{ '' if m['role'] == 'assistant' and not loop.last else m['content'] }}<|im_end|>"
)
assert REWRITING_TEMPLATE != TOOLS_TEMPLATE


def _tools():
    return [t.schema() for t in environment_tools(CalculatorEnvironment())]


def test_appended_tokens_equal_the_whole_conversation_rendered():
    hf = hf_tokenizer()
    hf.chat_template = TOOLS_TEMPLATE
    tok = HFTokenizer(hf)
    end = hf.convert_tokens_to_ids("<|im_end|>")
    chat = ChatFormat(tok, _tools())
    messages = [{"role": "user", "content": "What is 12+30?"}]
    call, answer = tool_call_text("calculator", {"expression": "12+30"}), "42"
    ids = chat.prompt_ids(messages)
    ids += [*tok.encode(call), end]  # the policy's turn, ended by its end token
    ids += chat.observation_ids([{"role": "tool", "name": "calculator", "content": "42"}], end)
    ids += [*tok.encode(answer), end]
    convo = [*messages, {"role": "assistant", "content": call}, {"role": "tool", "content": "42"},
             {"role": "assistant", "content": answer}]  # fmt: skip
    whole = hf.apply_chat_template(convo, tools=_tools(), tokenize=False)
    assert ids == tok.encode(whole.removesuffix("\n"))  # what follows the last <|im_end|> is not the policy's
    assert "# Tools" in chat.prompt_text(messages) and '"calculator"' in chat.prompt_text(messages)


def test_templates_the_loop_cannot_extend_are_refused_in_one_line():
    with pytest.raises(AgentError, match="has no tool support") as err:
        ChatFormat(HFTokenizer(hf_tokenizer()), _tools())  # ChatML without a tools block
    assert "\n" not in str(err.value)
    hf = hf_tokenizer()
    hf.chat_template = REWRITING_TEMPLATE
    with pytest.raises(AgentError, match="renders an assistant turn differently"):
        ChatFormat(HFTokenizer(hf), _tools())
    ChatFormat(HFTokenizer(hf_tokenizer()), [])  # no tools: any template that appends cleanly will do


BAD = [
    (["rollout.agent.env=calculator", "rollout.agent.max_turns=0"], "rollout.agent.max_turns (0) must be >= 1"),
    (["rollout.agent.env=calculator", "rollout.agent.tool_timeout_s=0"], "rollout.agent.tool_timeout_s (0"),
    (["rollout.agent.env=calculator", "rollout.agent.max_tokens_per_turn=999"], "max_tokens_per_turn (999)"),
    (["rollout.agent.env=nope"], "rollout.agent.env ('nope') is not a registered environment"),
    (["rollout.agent.path=<tmp>/missing.py"], "does not exist"),
    (["rollout.agent.path=<tmp>/broken.py"], "failed to import (SyntaxError"),
]


@pytest.mark.parametrize(("overrides", "fragment"), BAD)
def test_bad_agent_settings_stop_validate_config_in_one_line(overrides, fragment, tmp_path, capsys):
    (tmp_path / "broken.py").write_text("def f(:\n")
    argv = ["validate-config", "tiny_cpu_agent.yaml", "--inputs", f"trainer.default_local_dir={tmp_path}/run"]
    code = funnel(lambda: main([*argv, *(o.replace("<tmp>", str(tmp_path)) for o in overrides)]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and fragment in err, err
