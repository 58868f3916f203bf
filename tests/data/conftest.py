"""Session-wide tiny tokenizers for the data tests."""

from __future__ import annotations

import pytest

from tests.data import tiny_tokenizers


@pytest.fixture(scope="session")
def hf_tok():
    return tiny_tokenizers.hf_tokenizer()


@pytest.fixture(scope="session")
def sp_tok(tmp_path_factory):
    return tiny_tokenizers.sp_tokenizer(tmp_path_factory.mktemp("sp"))
