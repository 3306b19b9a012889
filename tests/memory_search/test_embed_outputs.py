"""MiniLMProvider finds the token states among an ONNX model's outputs, whatever their order."""

import numpy as np
import pytest

from hutch._core.errors import SearchIndexError
from hutch.memory._index._embed import token_states


def test_the_token_states_are_found_after_a_pooled_output():
    pooled, tokens = np.ones((2, 384), np.float32), np.zeros((2, 7, 384), np.float32)
    assert token_states([pooled, tokens], 384, "m.onnx") is tokens
    assert token_states([tokens, pooled], 384, "m.onnx") is tokens


def test_a_model_without_token_states_or_of_another_width_is_named_with_the_fix():
    with pytest.raises(SearchIndexError, match="no per-token output.*provider of its own"):
        token_states([np.ones((2, 384), np.float32)], 384, "m.onnx")
    with pytest.raises(SearchIndexError, match="768-dimensional token states, not 384"):
        token_states([np.zeros((2, 7, 768), np.float32)], 384, "m.onnx")
