"""The second moment of eviction: pipelines whose layer schedule needs every layer's scores
evict all layers at the end of prefill, inside the same forward call, through every entry point."""

from typing import ClassVar, Literal

import torch

from kvpress_ada import Mask, RaggedCache, UniformLayer, generate, preset
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.runtime import Schedule


class _WaitingUniform(UniformLayer):
    """Test schedule: uniform budgets, but computed at the end of prefill from all layers' scores."""

    name: Literal["uniform"] = "uniform"
    needs_all_layers: ClassVar[bool] = True
    seen: ClassVar[list[int]] = []

    def layer_budgets(self, scores, avg, lengths, comparable=True):
        type(self).seen.append(len(scores))
        return self.budgets(avg, len(scores), lengths)


def _batch():
    ids = torch.randint(5, 100, (2, 90), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 90, dtype=torch.long)
    mask[1, :15] = 0
    ids[1, :15] = 0
    return ids, mask


def test_end_of_prefill_equals_layer_by_layer_for_the_same_budgets(llama):
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_scores=True,
                  return_dict_in_generate=True)
    results = {}
    for label, layers in (("local", UniformLayer()), ("end", _WaitingUniform())):
        press = preset("ada_snapkv", compression_ratio=0.6, layers=layers)
        assert Schedule(press).prompt_waits == (label == "end")
        with press(llama):
            results[label] = llama.generate(ids, **kwargs)
            cache = output_cache(llama(input_ids=ids, attention_mask=mask))
        results[label + "_lengths"] = [cache.head_lengths(i) for i in range(3)]
    assert _WaitingUniform.seen and all(n == 3 for n in _WaitingUniform.seen)
    assert torch.equal(results["local"].sequences, results["end"].sequences)
    for a, b in zip(results["local"].scores, results["end"].scores):
        assert torch.equal(a, b)
    for a, b in zip(results["local_lengths"], results["end_lengths"]):
        assert torch.equal(a, b)


def test_end_of_prefill_ragged_matches_mask_and_fanout(llama, tokenizer):
    ids, mask = _batch()
    outs = {}
    for evictor in ("topk", "mask"):
        extra = {"evictor": Mask()} if evictor == "mask" else {}
        press = preset("snapkv", compression_ratio=0.5, layers=_WaitingUniform(), **extra)
        with press(llama):
            outs[evictor] = llama.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(outs["topk"], outs["mask"])
    press = preset("snapkv", compression_ratio=0.5, layers=_WaitingUniform())
    with press(llama):
        direct = output_cache(llama(input_ids=ids, attention_mask=mask))
    fanned = capture_prefill(llama, ids, mask).compressed_cache(press)
    assert isinstance(direct, RaggedCache) and isinstance(fanned, RaggedCache)
    for i in range(3):
        assert torch.equal(direct.head_lengths(i), fanned.head_lengths(i))
    answers = generate(llama, tokenizer, "The key is 4821. " * 6, ["What is the key?"], press=press, max_new_tokens=3)
    assert len(answers) == 1


def test_ada_layer_spends_the_model_budget_across_layers(llama):
    """Model-scope Ada through the public API: layer budgets differ, the model total is exact,
    ragged equals the Mask reference."""
    from kvpress_ada import AdaLayer

    ids, mask = _batch()
    press = preset("ada_snapkv", compression_ratio=0.5, layers=AdaLayer(alpha=0.2))
    assert Schedule(press).prompt_waits
    with press(llama):
        cache = output_cache(llama(input_ids=ids, attention_mask=mask))
    per_layer = torch.stack([cache.head_lengths(i).sum(-1) for i in range(3)], 1)  # [B, layers]
    valid = mask.sum(-1)
    kept_per_head = torch.round(0.5 * valid.double()).long()
    H = llama.config.num_key_value_heads
    assert torch.equal(per_layer.sum(-1), 3 * H * kept_per_head)
    outs = {}
    for evictor in ("topk", "mask"):
        extra = {"evictor": Mask()} if evictor == "mask" else {}
        p = preset("ada_snapkv", compression_ratio=0.5, layers=AdaLayer(alpha=0.2), **extra)
        with p(llama):
            outs[evictor] = llama.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(outs["topk"], outs["mask"])
