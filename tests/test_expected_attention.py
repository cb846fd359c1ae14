"""ExpectedAttention (Devoto et al., 2025): the future-rotation shortcut and the query statistics."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import ExpectedAttention, Observation, Pipeline
from kvpress_ada.scorers.expected_attention import rotate_to_future


def _inv_freq(D, base=10000.0):
    return 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))


def _rope(x, angles):
    half = x.shape[-1] // 2
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(1, 300), st.sampled_from([8, 16, 32]), st.integers(0, 10_000))
def test_future_rotation_equals_explicit_average(w, n_future, D, seed):
    """mean_k R(w - j + k) q_j, computed one rotation at a time, equals the O((w + n) D) shortcut."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, w, D, generator=g, dtype=torch.float64)
    inv = _inv_freq(D).double()
    explicit = torch.zeros_like(q)
    for k in range(n_future):
        shift = torch.arange(w, 0, -1, dtype=torch.float64) + k  # query j is w - j positions before the future
        explicit += _rope(q, shift[:, None] * inv[None, :])
    explicit /= n_future
    fast = rotate_to_future(q.float(), inv.float(), n_future).double()
    assert torch.allclose(fast, explicit, atol=2e-4 * (1 + explicit.abs().max().item()))


def _obs(L, pad, seed, D=16, Hkv=2, G=2):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, Hkv, L, D, generator=g)
    values = torch.randn(1, Hkv, L, D, generator=g)
    queries = torch.randn(1, Hkv * G, L, D, generator=g)
    key_mask = torch.ones(1, L, dtype=torch.bool)
    key_mask[0, :pad] = False
    return Observation(keys=keys, values=values, queries=queries, key_mask=key_mask, layer_idx=0, n_layers=1,
                       scaling=D**-0.5, rope_inv_freq=_inv_freq(D))


@settings(max_examples=25, deadline=None)
@given(st.integers(8, 40), st.integers(1, 6), st.integers(0, 10_000))
def test_all_query_statistics_ignore_padding(L, pad, seed):
    """With ``window=None``, left padding (whatever its queries hold) does not change the valid keys' scores."""
    obs = _obs(L + pad, pad, seed)
    clean = Observation(keys=obs.keys[:, :, pad:], values=obs.values[:, :, pad:], queries=obs.queries[:, :, pad:],
                        key_mask=obs.key_mask[:, pad:], layer_idx=0, n_layers=1, scaling=obs.scaling,
                        rope_inv_freq=obs.rope_inv_freq)
    scorer = ExpectedAttention(window=None, sinks=0)
    padded, unpadded = scorer.score(obs), scorer.score(clean)
    assert torch.allclose(padded[..., pad:], unpadded, rtol=1e-4, atol=1e-6)


def test_window_none_is_every_query_and_round_trips():
    obs = _obs(24, 0, 1)
    every = ExpectedAttention(window=None).score(obs)
    assert torch.allclose(every, ExpectedAttention(window=24).score(obs))  # the context is 24 tokens
    assert not torch.allclose(every, ExpectedAttention(window=8).score(
        Observation(keys=obs.keys, values=obs.values, queries=obs.queries[:, :, -8:], key_mask=obs.key_mask,
                    layer_idx=0, n_layers=1, scaling=obs.scaling, rope_inv_freq=obs.rope_inv_freq)))
    press = Pipeline(scorer=ExpectedAttention(window=None), compression_ratio=0.5)
    again = Pipeline.model_validate_json(press.model_dump_json())
    assert again == press and again.scorer.query_window() is None
