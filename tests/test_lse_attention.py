"""Attention with log-sum-exp (KVzip's reconstruction pass): the fused CPU path equals the plain
torch reference, and both equal softmax attention written out, masks and grouped heads included."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada.kernels.model_pass.lse_attention import attention_with_lse, attention_with_lse_ref


def _written_out(query, key, value, allowed, scaling):
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    logits = (query.double() @ key.double().transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    return probs @ value.double(), lse


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), Hkv=st.integers(1, 3), group=st.sampled_from([1, 2, 3]), T=st.integers(1, 20),
       L=st.integers(0, 30), blank=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_and_reference_equal_the_formula(B, Hkv, group, T, L, blank, seed):
    g = torch.Generator().manual_seed(seed)
    D = 8
    query = torch.randn(B, Hkv * group, T, D, generator=g)
    key, value = torch.randn(2, B, Hkv, L + T, D, generator=g)
    allowed = torch.rand(B, 1, T, L + T, generator=g) > 0.4
    allowed[..., L:] |= torch.eye(T, dtype=torch.bool)  # every query sees itself ...
    if blank:
        allowed[0, 0, 0] = False  # ... except one that sees nothing (a padded query)
    want_out, want_lse = _written_out(query, key, value, allowed, 0.3)
    for fn in (attention_with_lse, attention_with_lse_ref):
        out, lse = fn(query, key, value, allowed, 0.3)
        assert out.shape == query.shape and lse.shape == query.shape[:3] and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
        seen = allowed.any(-1).expand_as(lse)
        torch.testing.assert_close(lse.double()[seen], want_lse[seen], atol=1e-5, rtol=1e-5)
        assert torch.isneginf(lse[~seen]).all() and (out[~seen] == 0).all()


def test_cpu_uses_the_fused_kernel(monkeypatch):
    from kvpress_ada.kernels.model_pass import lse_attention

    def refuse(*args, **kwargs):
        raise AssertionError("fell back to the reference")

    monkeypatch.setattr(lse_attention, "attention_with_lse_ref", refuse)
    query, key, value = torch.randn(3, 1, 4, 6, 16)
    allowed = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    out, lse = lse_attention.attention_with_lse(query, key, value, allowed, 0.25)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                                                     scale=0.25))
    torch.testing.assert_close(lse, torch.logsumexp((query @ key.transpose(-1, -2) * 0.25).masked_fill(
        ~allowed[0], float("-inf")), -1))


def _prefix_then_causal(T, P, B=1):
    return torch.cat([torch.ones(T, P, dtype=torch.bool), torch.ones(T, T, dtype=torch.bool).tril()], 1).expand(
        B, 1, T, P + T)


def test_the_prefix_then_causal_mask_is_recognised_and_nothing_else():
    from kvpress_ada.kernels.model_pass.lse_attention import full_prefix_then_causal

    assert full_prefix_then_causal(_prefix_then_causal(5, 7, B=2)) == 7
    padded = _prefix_then_causal(5, 7, B=2).clone()
    padded[1, :, :, 0] = False  # row 1's first context entry is padding
    assert full_prefix_then_causal(padded) is None
    unpadded_pass = _prefix_then_causal(5, 7).clone()
    unpadded_pass[..., 7] = False  # the pass's first token is padding
    assert full_prefix_then_causal(unpadded_pass) is None
    assert full_prefix_then_causal(torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()) is None  # no prefix


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 2), Hkv=st.integers(1, 3), group=st.sampled_from([1, 2, 3]), T=st.integers(1, 20),
       P=st.integers(1, 30), seed=st.integers(0, 2**16))
def test_prefix_then_causal_parts_equal_the_formula(B, Hkv, group, T, P, seed):
    from kvpress_ada.kernels.model_pass.lse_attention import prefix_then_causal_parts

    g = torch.Generator().manual_seed(seed)
    D = 8
    query = torch.randn(B, Hkv * group, T, D, generator=g)
    key, value = torch.randn(2, B, Hkv, P + T, D, generator=g)
    allowed = _prefix_then_causal(T, P, B)
    want_out, want_lse = _written_out(query, key, value, allowed, 0.3)
    own_allowed = torch.zeros_like(allowed)
    own_allowed[..., P:] = allowed[..., P:]
    want_own = _written_out(query, key, value, own_allowed, 0.3)[1]
    out, lse, lse_own = prefix_then_causal_parts(query, key, value, P, 0.3)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_own.double(), want_own, atol=1e-5, rtol=1e-5)
