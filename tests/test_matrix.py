"""One shared matrix: every preset on every supported architecture, through ``generate`` and
``model.generate``, ragged (TopK) against the Mask reference."""

import pytest
import torch
from conftest import left_padded_batch
from test_scorer_registry import scorer_names

from kvpress_ada import Mask, Pipeline, RaggedCache, generate, preset
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.presets import portable_preset_names
from kvpress_ada.scorers import SCORERS

CONTEXT = "In 1947 the pass key was 4821. The garden had seven doors and a blue gate. " * 2
QUESTIONS = ["What is the pass key?", "How many doors?"]


@pytest.mark.parametrize("name", portable_preset_names())  # calibrated: test_calibrated.py
def test_preset_generate_every_arch(arch_model, tokenizer, name):
    press = preset(name, compression_ratio=0.5)
    agnostic = generate(arch_model, tokenizer, CONTEXT, QUESTIONS, press=press, max_new_tokens=3)
    aware = generate(arch_model, tokenizer, CONTEXT, QUESTIONS[:1], press=press, max_new_tokens=3, question_aware=True)
    assert len(agnostic) == 2 and len(aware) == 1
    assert all(isinstance(a, str) for a in agnostic + aware)


@pytest.mark.parametrize("name", portable_preset_names())  # calibrated: test_calibrated.py
def test_preset_model_generate_ragged_matches_mask(arch_model, name):
    """TopK + RaggedCache generates exactly what the Mask reference generates, batch 2, left padding."""
    ids, mask = left_padded_batch()
    outs = {}
    for evictor in ("topk", "mask"):
        press = preset(name, compression_ratio=0.6)
        if evictor == "mask":  # the dense reference of the same evictor options (re-rotation, merging); a reader's
            # budget (1,024 tokens per head) covers these caches: it reads every kept entry, as the reference does
            press = press.replace(evictor=Mask(**press.evictor.model_dump(exclude={"name"})), reader=None)
        with press(arch_model):
            out = arch_model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                      output_scores=True, return_dict_in_generate=True)
        outs[evictor] = out
    assert torch.equal(outs["topk"].sequences, outs["mask"].sequences)
    for a, b in zip(outs["topk"].scores, outs["mask"].scores):
        assert torch.allclose(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", scorer_names())
def test_every_registered_scorer_ragged_matches_mask(llama, name):
    """Every registered scorer (default fields; presets or not), ragged vs the Mask reference."""
    if getattr(SCORERS.get(name), "model_specific", False):
        pytest.skip("tied to one model by its file (KVzap's surrogate): ragged == Mask is in tests/test_kvzap.py")
    ids, mask = left_padded_batch(seed=3)
    outs = {}
    for evictor in ("topk", "mask"):
        press = Pipeline(scorer=SCORERS.get(name)(), evictor=evictor, compression_ratio=0.5)
        with press(llama):
            outs[evictor] = llama.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                           output_scores=True, return_dict_in_generate=True)
    assert torch.equal(outs["topk"].sequences, outs["mask"].sequences)
    for a, b in zip(outs["topk"].scores, outs["mask"].scores):
        assert torch.allclose(a, b, atol=1e-4, rtol=0)


def test_ratio_zero_is_bit_identical(arch_model):
    ids, mask = left_padded_batch(seed=1)
    ref = arch_model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)
    with preset("ada_snapkv", compression_ratio=0.0)(arch_model):
        out = arch_model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores))


def test_padding_never_kept_nor_counted(llama):
    lengths = (100, 64)
    ids, mask = left_padded_batch(seed=2, lengths=lengths)
    with preset("ada_snapkv", compression_ratio=0.5)(llama):
        out = llama(ids, attention_mask=mask, use_cache=True)
    cache = output_cache(out)
    assert isinstance(cache, RaggedCache)
    for layer in range(len(cache.layers)):
        per_row = cache.head_lengths(layer).sum(-1)  # total kept per batch row
        H = cache.head_lengths(layer).shape[1]
        assert per_row.tolist() == [H * round(0.5 * n) for n in lengths]


def test_generate_restores_compressed_cache_between_questions(llama, tokenizer):
    press = preset("ada_snapkv", compression_ratio=0.5)
    together = generate(llama, tokenizer, CONTEXT, QUESTIONS, press=press, max_new_tokens=4)
    alone = [generate(llama, tokenizer, CONTEXT, [q], press=press, max_new_tokens=4)[0] for q in QUESTIONS]
    assert together == alone


@pytest.mark.parametrize("name", [None, "ada_snapkv", "mask"])
@pytest.mark.parametrize("question_aware", [False, True])
def test_generate_batch_of_contexts_equals_one_by_one(llama, tokenizer, name, question_aware):
    """A left-padded batch of documents of different lengths answers like each document alone."""
    press = None if name is None else preset("ada_snapkv", compression_ratio=0.5,
                                             **({"evictor": Mask()} if name == "mask" else {}))
    contexts = [CONTEXT, "A short note: the gate code is 77. " * 3]
    batch = generate(llama, tokenizer, contexts, QUESTIONS, press=press, max_new_tokens=4,
                     question_aware=question_aware)
    alone = [generate(llama, tokenizer, c, QUESTIONS, press=press, max_new_tokens=4, question_aware=question_aware)
             for c in contexts]
    assert batch == alone
