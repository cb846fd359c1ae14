"""KVzip's model pass prompts the model with text: its tokenizer is checked when the press meets the
model (``with press(model)``, fan-out), with one line, before any prefill runs."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, build_tokenizer

from kvpress_ada import preset, use_tokenizer
from kvpress_ada.hosts.transformers import model_pass
from kvpress_ada.hosts.transformers.fanout import capture_prefill


def _count_forwards(model):
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_missing_tokenizer_is_refused_before_the_prefill():
    model = build_model("llama", seed=3)
    model_pass._TOKENIZERS.pop(model, None)
    calls = _count_forwards(model)
    with pytest.raises(ValueError, match="use_tokenizer") as err:
        with preset("kvzip", compression_ratio=0.5)(model):
            model(input_ids=torch.randint(5, 100, (1, 20)))
    assert calls == [] and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="use_tokenizer"):
        capture_prefill(model, torch.randint(5, 100, (1, 20))).keep_masks(preset("kvzip", compression_ratio=0.5))


def test_tokenizer_beyond_the_vocabulary_is_one_line_naming_both_sizes():
    model = build_model("llama", vocab_size=60)  # the char tokenizer has 104 tokens: the prompt's letters lie beyond
    use_tokenizer(model, build_tokenizer())
    calls = _count_forwards(model)
    with pytest.raises(ValueError) as err:
        with preset("kvzip", compression_ratio=0.5)(model):
            model(input_ids=torch.randint(5, 60, (1, 20)))
    message = str(err.value)
    assert calls == [] and "\n" not in message
    assert "104 tokens" in message and "vocabulary of 60" in message and "use_tokenizer" in message


def test_a_fitting_tokenizer_passes_the_check():
    model = build_model("llama")
    with preset("kvzip", compression_ratio=0.5)(model):
        model(input_ids=torch.randint(5, 100, (1, 20)))
