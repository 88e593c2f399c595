"""The one prompt check, as the engine, the scheduler and the server see it."""

import pytest

from jaxserve.core.tokenizer import ByteTokenizer
from jaxserve.core.validation import PromptError, check_token_ids, encode_prompt, resolve_max_tokens


def test_ids_outside_the_vocabulary_are_named():
    assert check_token_ids([0, 5, 9], vocab_size=10) == [0, 5, 9]
    with pytest.raises(PromptError, match=r"Token id 10 is out of vocabulary \(size 10\)") as e:
        check_token_ids([3, 10, -1], vocab_size=10)
    assert e.value.code == "invalid_value"
    with pytest.raises(PromptError, match="Token id -1"):
        check_token_ids([-1], vocab_size=10)


def test_text_needs_a_tokenizer_and_a_prompt_must_not_be_empty():
    tok = ByteTokenizer()
    assert encode_prompt("hi", tok, 512) == tok.encode("hi")
    with pytest.raises(PromptError, match="no tokenizer"):
        encode_prompt("hi", None, 512)
    with pytest.raises(PromptError, match="The prompt is empty"):
        encode_prompt([], tok, 512)


def test_the_completion_budget_is_the_rest_of_the_context_unless_asked():
    assert resolve_max_tokens(100, None, max_model_len=1024) == 924
    assert resolve_max_tokens(100, 24, max_model_len=1024) == 24
    with pytest.raises(PromptError, match="maximum context length is 1024 tokens. However, you requested 1025") as e:
        resolve_max_tokens(1000, 25, max_model_len=1024)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(PromptError, match="max_tokens must be at least 1, got 0"):
        resolve_max_tokens(10, 0, max_model_len=1024)
    with pytest.raises(PromptError, match="context length"):
        resolve_max_tokens(1024, None, max_model_len=1024)  # no room left for even one token
