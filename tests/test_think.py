"""ThinK (key-channel pruning): the channel scores against the paper's formula written out, the kept keys of every
entry point (forward, fan-out, Mask reference) and the modes it refuses in one line; memory is reported as it is."""

import pytest
import torch
from conftest import build_model

from kvpress_ada import LayerView, Pipeline, preset
from kvpress_ada.channels import ThinK
from kvpress_ada.evictors import Mask
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.scorers import KNorm, SnapKV
from kvpress_ada.serving.requests import check_servable


def _view(seed=0, B=2, H=2, G=2, L=10, D=8, w=4):
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(B, H, L, dtype=torch.bool)
    valid[1, :, :7] = False  # row 1: 3 tokens, shorter than the window of 4 queries
    return LayerView(keys=torch.randn(B, H, L, D, generator=g), values=torch.randn(B, H, L, D, generator=g),
                     queries=torch.randn(B, H * G, w, D, generator=g), valid=valid, layer_idx=0, n_layers=1,
                     scaling=D**-0.5)


@pytest.mark.parametrize("ratio, window", [(0.5, 4), (0.25, 2), (0.75, 32)])
def test_channel_scores_match_the_formula_written_out(ratio, window):
    view = _view()
    keep = view.valid.clone()
    keep[0, 0, ::3] = False  # the token selection drops some entries: their keys do not count
    got = ThinK(ratio=ratio, window=window).channel_keep(view, keep)
    B, H, L, D = view.keys.shape
    G, w = view.queries.shape[1] // H, view.queries.shape[2]
    n = int(D * ratio)
    for b in range(B):
        for h in range(H):
            votes = [j for j in range(max(0, w - window), w) if bool(view.valid[b, 0, L - w + j])]
            kept = [i for i in range(L) if bool(keep[b, h, i] and view.valid[b, h, i])]
            scores = []
            for d in range(D):
                q = sum(sum(float(view.queries[b, h * G + g, j, d]) ** 2 for j in votes) / len(votes)
                        for g in range(G)) / G
                k = sum(float(view.keys[b, h, i, d]) ** 2 for i in kept) / len(kept)
                scores.append(q * k)
            pruned = sorted(range(D), key=lambda d: scores[d])[:n]
            assert sorted(d for d in range(D) if not got[b, h, d]) == sorted(pruned), (b, h)
    assert ThinK(ratio=0.0).channel_keep(view, keep).all()


def _kept_keys(cache, layer):
    held = cache.layers[layer].view(cache.state.key_mask)
    return held.keys, held.valid


def test_press_zeroes_the_pruned_channels_of_the_kept_keys_and_frees_nothing():
    model = build_model("llama")
    ids = torch.randint(5, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ids[1, :6] = 0
    press = preset("think", compression_ratio=0.5, scorer=SnapKV(window=8))
    plain = preset("snapkv", compression_ratio=0.5, scorer=SnapKV(window=8))
    with torch.no_grad():
        with press(model):
            cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
        with plain(model):
            reference = output_cache(model(ids, attention_mask=mask, use_cache=True))
    prefill = capture_prefill(model, ids, mask)
    keeps = prefill.keep_masks(press)
    fanned = prefill.compressed_cache(press, keeps)
    D = model.config.hidden_size // model.config.num_attention_heads
    for i in range(3):
        keys, valid = _kept_keys(cache, i)
        ref_keys, _ = _kept_keys(reference, i)
        channels = press.key_channels.channel_keep(prefill.view(press.scorer, i), keeps[i])
        assert (channels.sum(-1) == D - D // 2).all()
        want = ref_keys * channels[:, :, None, :]
        torch.testing.assert_close(torch.where(valid[..., None], keys, 0.0), torch.where(valid[..., None], want, 0.0))
        torch.testing.assert_close(_kept_keys(fanned, i)[0], keys)
        assert torch.equal(cache.head_lengths(i), reference.head_lengths(i))
    assert cache.nbytes() == reference.nbytes()  # full-width keys are stored: pruning frees nothing here


def test_ragged_equals_mask_and_channels_only_at_ratio_zero():
    model = build_model("llama")
    ids = torch.randint(5, 100, (1, 30), generator=torch.Generator().manual_seed(2))
    press = preset("ada_think", compression_ratio=0.5, scorer=SnapKV(window=8))
    outs = []
    for p in (press, press.replace(evictor=Mask())):
        with torch.no_grad(), p(model):
            outs.append(model.generate(ids, do_sample=False, max_new_tokens=5, output_logits=True,
                                       return_dict_in_generate=True))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    torch.testing.assert_close(torch.stack(outs[0].logits), torch.stack(outs[1].logits), atol=1e-4, rtol=0)
    only = preset("think", compression_ratio=0.0, scorer=SnapKV(window=8))
    assert not only.is_noop
    with torch.no_grad(), only(model):
        cache = output_cache(model(ids, use_cache=True))
    keys, valid = _kept_keys(cache, 0)
    assert bool(valid.all()) and int(cache.head_lengths(0).sum()) == 2 * 30  # every token kept
    zero_channels = (keys == 0).all(dim=2).sum(-1)  # [B, H]: channels zero in every kept key
    assert (zero_channels == 8).all()


def test_refused_modes_in_one_line():
    think = ThinK()
    for kwargs, match in [(dict(prefill_chunk=16), "chunked prefill"),
                          (dict(decode_budget=8, decode_interval=4), "decode compression"),
                          (dict(scorer=KNorm()), "reads none")]:
        fields = {**dict(scorer=SnapKV(), compression_ratio=0.5, key_channels=think), **kwargs}
        with pytest.raises(ValueError, match=match) as err:
            Pipeline(**fields)
        assert "\n" not in str(err.value).split(": ", 1)[-1]
    press = preset("think", compression_ratio=0.5)
    with pytest.raises(ValueError, match="serving engine"):
        check_servable(press)
    prefill = capture_prefill(build_model("llama"), torch.randint(5, 100, (1, 70)))
    with pytest.raises(ValueError, match="compressed_cache"):
        prefill.compressed_batch([press], [prefill.keep_masks(press)])
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
