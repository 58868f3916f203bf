"""A scripted policy for agent-loop tests: a real Llama whose next token is a fixed function of the current one.

All attention and MLP outputs are zeroed (``o_proj`` and ``down_proj``), so the last hidden state is the current
token's embedding; with one-hot embeddings and an ``lm_head`` row ``c / sqrt(hidden)`` at the successor, the logits
are ``c`` on ``successor[token]`` and 0 elsewhere. Greedy decoding then follows a chain written in the test (for
instance "\\n" -> a tool call -> EOS), so each path of the loop happens for sure, while vLLM's log-probs stay real
numbers (``c - log(exp(c) + V - 1)``) that an HF forward checks. The tokenizer is a real sentencepiece model whose
user-defined pieces are the texts the policy writes.
"""

from __future__ import annotations

import itertools
import math

import torch

from hybridrl.data.tokenizers import train_sentencepiece
from tests.mcore import hf_tiny

CALL = '<tool_call>{"name":"echo","arguments":{"text":"hi"}}</tool_call>'
"""One piece: a well-formed call of the ``echo`` tool (no spaces: sentencepiece matches no piece across one)."""
OPEN = '<tool_call>{"name":"echo"'
"""One piece: a call without its closing tag (malformed)."""
ANSWER, FILLER = "forty-two", "la"
PIECES = (CALL, OPEN, ANSWER, FILLER, "<|tool|>")
HIDDEN, SHARPNESS = 128, 4.0


def make_tokenizer(texts: list[str], out_prefix: str):
    """A character-level sentencepiece model over ``texts`` with :data:`PIECES` as single tokens."""
    return train_sentencepiece(texts, vocab_size=120, out_prefix=out_prefix, model_type="char", extra_symbols=PIECES)


def hf_config(tok):
    assert tok.vocab_size <= HIDDEN, tok.vocab_size  # one-hot embeddings
    return hf_tiny.tiny_config(
        "llama", vocab_size=tok.vocab_size, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=192, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        bos_token_id=2, tie_word_embeddings=False, max_position_embeddings=512,
    )  # fmt: skip


def chain_model(tok, chain: list[str], seed: int = 0):
    """The HF Llama that writes ``chain`` (pieces, "EOS" for the end token) after "\\n"; every other token's
    successor is "\\n"'s first piece's own successor in the chain, or EOS."""
    import transformers

    ids = [tok.eos_token_id if p == "EOS" else _piece(tok, p) for p in ["\n", *chain]]
    successor = torch.full((tok.vocab_size,), tok.eos_token_id)
    for a, b in itertools.pairwise(ids):
        successor[a] = b
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM._from_config(hf_config(tok), attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(tok.vocab_size, HIDDEN))
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(tok.vocab_size, HIDDEN)
        head[successor, torch.arange(tok.vocab_size)] = SHARPNESS / math.sqrt(HIDDEN)
        model.lm_head.weight.copy_(head)
    return model.eval()


def _piece(tok, text: str) -> int:
    (i,) = tok.encode(text)
    return i


# ---- a scripted environment (loaded by path, as a user's file is) --------------------------------------------
import time  # noqa: E402

from hybridrl.rollout.agent import Environment, Step, Turn, tool  # noqa: E402


class Scripted(Environment):
    """``extra_info["echo"]`` picks what the ``echo`` tool does ("ok", "hang", "raise", "long");
    ``extra_info["done_at"]`` ends the trajectory with reward 1 at that turn (else the default step)."""

    mode = "ok"

    def reset(self, extra_info):
        super().reset(extra_info)
        self.mode = extra_info.get("echo", "ok")

    @tool
    def echo(self, text: str) -> str:
        """Say text back.

        Args:
            text: what to say.
        """
        if self.mode == "hang":
            time.sleep(3)
        if self.mode == "raise":
            raise RuntimeError("kaput")
        return " ".join([text] * 80) if self.mode == "long" else text

    def step(self, turn: Turn) -> Step:
        if turn.index == self.extra_info.get("done_at"):
            return Step(reward=1.0, done=True)
        return super().step(turn)
