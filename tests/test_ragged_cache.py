"""RaggedCache: memory held, amortised appends, crop/restore, RoPE positions, errors."""

import pytest
import torch

from kvpress_ada import Pipeline, RaggedCache, SnapKV, generate, preset
from kvpress_ada.hosts.transformers import RaggedLayer
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.kernels.ragged.reference import CHUNK


def _cache_of(out):
    return output_cache(out)


@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.9])
@pytest.mark.parametrize("name", ["snapkv", "ada_snapkv", "ada_pyramidkv"])
def test_nbytes_tracks_kept_tokens(llama, name, ratio):
    L = 400
    ids = torch.randint(5, 100, (2, L))
    with preset(name, compression_ratio=ratio)(llama):
        cache = _cache_of(llama(ids, use_cache=True))
    cfg = llama.config
    D = cfg.hidden_size // cfg.num_attention_heads
    per_token = D * 2 * 4  # keys + values, fp32
    rows = 2 * cfg.num_key_value_heads * cfg.num_hidden_layers
    full = rows * L * per_token
    reserve = rows * cache.layers[0].decode_reserve * per_token
    rounding = rows * CHUNK * per_token  # each row's capacity is rounded up to whole chunks
    assert cache.nbytes() <= ((1 - ratio) + 0.03) * full + reserve + rounding
    kept = sum(int(cache.head_lengths(i).sum()) for i in range(cfg.num_hidden_layers))
    assert kept * per_token + reserve <= cache.nbytes() < kept * per_token + reserve + rounding
    for layer in cache.layers:
        assert layer.k_flat.shape[0] % CHUNK == 0 and bool((layer.row_offsets % CHUNK == 0).all())


def test_appends_are_amortised_and_in_place():
    layer = RaggedLayer(decode_reserve=4)
    B, H, L, D = 1, 2, 32, 8
    k = torch.randn(B, H, L, D)
    layer.update(k, k.clone())
    keep = torch.zeros(B, H, L, dtype=torch.bool)
    keep[0, 0, :3] = True
    keep[0, 1, -10:] = True
    layer.compress(keep)
    storages, new = set(), []
    for step in range(300):
        t = torch.full((B, H, 1, D), float(step))
        new.append(t)
        layer.update(t, t.clone())
        storages.add(layer.k_flat.data_ptr())
    # geometric growth (spare = max(4, 0.125 x mean length), capacities rounded up to 32-slot chunks):
    # at most ~25 re-layouts, not 300
    assert len(storages) <= 30
    for h, base in ((0, k[0, 0, :3]), (1, k[0, 1, -10:])):
        start, n = int(layer.row_offsets[h]), int(layer.row_lengths[h])
        row = layer.k_flat[start:start + n]
        assert n == base.shape[0] + 300
        assert torch.equal(row[: base.shape[0]], base)
        assert torch.equal(row[base.shape[0]:, 0], torch.arange(300, dtype=torch.float32))
    assert layer.get_seq_length() == L + 300


def test_crop_restores_compressed_state():
    layer = RaggedLayer(decode_reserve=2)
    k = torch.randn(1, 1, 10, 4)
    layer.update(k, k.clone())
    layer.compress(torch.arange(10)[None, None] % 2 == 0)
    before = (layer.row_lengths.clone(), layer.get_seq_length())
    for _ in range(5):
        layer.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    layer.crop(-5)
    assert torch.equal(layer.row_lengths, before[0]) and layer.get_seq_length() == before[1]
    with pytest.raises(ValueError, match="only 0 were appended"):
        layer.crop(-1)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(3)


def test_cache_errors_name_the_value(llama):
    cache = RaggedCache(config=llama.config)
    with pytest.raises(ValueError, match="layer_idx 99"):
        cache.head_lengths(99)
    layer = cache.layers[0]
    layer.update(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))
    with pytest.raises(ValueError, match=r"keep mask of shape \(1, 2, 9\)"):
        layer.compress(torch.ones(1, 2, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="decode_reserve"):
        RaggedLayer(decode_reserve=0)


def test_keeping_everything_equals_the_full_cache(arch_model, tokenizer):
    """Ragged rows holding every token reproduce the full cache: RoPE positions continue from the
    original length and question tokens appended after compression are causal among themselves."""
    press = Pipeline(scorer=SnapKV(window=4), budget=100_000)
    context = "alpha beta gamma delta epsilon zeta eta theta. " * 3
    questions = ["Which letter comes third?", "Say it twice."]
    assert generate(arch_model, tokenizer, context, questions, press=press, max_new_tokens=6) == \
        generate(arch_model, tokenizer, context, questions, press=None, max_new_tokens=6)
    ids = torch.randint(5, 100, (2, 50))
    ref = arch_model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with press(arch_model):
        out = arch_model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        assert torch.allclose(a, b, atol=1e-4, rtol=0)


def test_different_prompt_lengths_batch_decode(llama):
    """Batch rows with different prompt lengths decode independently of each other."""
    press = preset("ada_snapkv", compression_ratio=0.5)
    a = torch.randint(5, 100, (1, 100))
    b = torch.randint(5, 100, (1, 80))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 20, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    with press(llama):
        both = llama.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        alone_a = llama.generate(a, max_new_tokens=5, do_sample=False)
        alone_b = llama.generate(b, max_new_tokens=5, do_sample=False)
    assert torch.equal(both[0, -5:], alone_a[0, -5:])
    assert torch.equal(both[1, -5:], alone_b[0, -5:])


def test_unsupported_uses_fail_clearly(llama):
    ids = torch.randint(5, 100, (1, 80))
    press = preset("ada_snapkv", compression_ratio=0.5)
    with press(llama):
        with pytest.raises(NotImplementedError, match="beam search"):
            llama.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False)
        with pytest.raises(ValueError, match="use_cache=False"):
            llama(ids, use_cache=False)
