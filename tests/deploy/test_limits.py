"""The tokenizer-free prompt bound: a text of c characters has at least c / max_chars_per_token
tokens, for any text, with the tiny checkpoint's tokenizer and the default model's; so the
ingress never refuses a prompt that would fit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.limits import max_chars_per_token
from workers.default_model import SHIPPED_DIR

TEXTS = st.one_of(
    st.text(max_size=300),
    st.text(alphabet=" \n\tabcdefghijklmnopqrstuvwxyz_()=:.", max_size=2000),
    st.builds(lambda n: " " * n, st.integers(0, 3000)),  # long runs tokenizers merge
)


@pytest.fixture(scope="module", params=["tiny", "default"])
def tokenizer(request, tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir if request.param == "tiny" else SHIPPED_DIR)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_characters_per_token_bound_holds(tokenizer, text):
    text = text.encode("utf-8", "ignore").decode("utf-8")  # ingress texts are valid Unicode
    bound = max_chars_per_token(tokenizer)
    num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert num_tokens * bound >= len(text)
