"""A press at the edges of its input: a query window longer than the context, a sliding window
crossed during decode, right padding, NaN or mis-shaped scores, nested presses, constant-score heads
under scale-free Ada, a compressed cache used after its ``with press(model)`` block, and left padding
that never changes a row. Plus two contracts: the evictor builds its cache, and the attention
function's handler protocol. Each test failed on the code before its fix.
"""

from typing import ClassVar, Literal

import pytest
import torch
from conftest import build_model
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpress_ada
from kvpress_ada import (
    AdaHead,
    ExpectedAttention,
    Mask,
    MaskedCache,
    Observation,
    Pipeline,
    RaggedCache,
    Scorer,
    SnapKV,
    TopK,
    preset,
)
from kvpress_ada.hosts.transformers import Handler, HeldEntries, PressCache, RaggedLayer, new_cache
from kvpress_ada.hosts.transformers.attention import layer_view
from kvpress_ada.hosts.transformers.chunked_prefill import ChunkedPrefill
from kvpress_ada.hosts.transformers.decode_compression import DecodeRun
from kvpress_ada.hosts.transformers.fanout import CaptureRun, capture_prefill
from kvpress_ada.hosts.transformers.hf import cache_kwarg, output_cache
from kvpress_ada.hosts.transformers.model_pass import PassRun
from kvpress_ada.hosts.transformers.prefill import PrefillRun
from kvpress_ada.kernels.ragged.reference import CHUNK
from kvpress_ada.presets import portable_preset_names


def _ids(n, batch=1, seed=0):
    return torch.randint(5, 100, (batch, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------ query window
def test_window_longer_than_context_takes_every_query(llama):
    L, D = 100, 16
    query = torch.randn(1, 4, L, D)
    key = torch.randn(1, 2, L, D)
    held = HeldEntries(key, key, torch.ones(1, 2, L, dtype=torch.bool), torch.arange(L).expand(1, 2, L))
    module = llama.model.layers[0].self_attn
    obs = layer_view(ExpectedAttention(window=128), llama, module, 3, held, query, 0.25)
    assert torch.equal(obs.queries, query)  # all 100 (the negative slice gave the last 28)
    obs = layer_view(SnapKV(window=8), llama, module, 3, held, query, 0.25)
    assert torch.equal(obs.queries, query[:, :, -8:])


def test_expected_attention_window_beyond_context_equals_all_queries(llama):
    """window=128 on a 100-token context must read what window=None (every query) reads."""
    ids = _ids(100)
    prefill = capture_prefill(llama, ids)
    for layer in range(3):
        a = preset("expected_attention", compression_ratio=0.5, scorer=ExpectedAttention(window=128))
        b = preset("expected_attention", compression_ratio=0.5, scorer=ExpectedAttention(window=None))
        sa = a.scorer.score(prefill.view(a.scorer, layer).observations()[0])
        sb = b.scorer.score(prefill.view(b.scorer, layer).observations()[0])
        assert torch.allclose(sa, sb, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------- sliding window in decode
def test_decoding_past_the_sliding_window_is_refused():
    model = build_model("mistral", sliding_window=32)
    ids = _ids(24)
    press = preset("streamingllm", compression_ratio=0.5)
    with press(model):
        inside = model.generate(ids, max_new_tokens=8, do_sample=False)  # 24 + 8 = 32: inside the window
    assert inside.shape[1] == 32
    with press(model), pytest.raises(ValueError, match=r"sliding window \(32\)"):
        model.generate(ids, max_new_tokens=12, do_sample=False)
    assert model.config._attn_implementation != kvpress_ada.hosts.transformers.ATTENTION_NAME


# ----------------------------------------------------------------------- right padding
@pytest.mark.parametrize("evictor", [TopK(), Mask()])
def test_right_padding_is_refused(llama, evictor):
    ids = _ids(80, batch=2)
    mask = torch.ones(2, 80, dtype=torch.long)
    mask[1, -10:] = 0
    press = preset("snapkv", compression_ratio=0.5, evictor=evictor)
    with press(llama), pytest.raises(ValueError, match="left padding"):
        llama(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="left padding"):
        capture_prefill(llama, ids, mask)


def test_left_padding_still_accepted(llama):
    ids = _ids(80, batch=2)
    mask = torch.ones(2, 80, dtype=torch.long)
    mask[1, :10] = 0
    with preset("snapkv", compression_ratio=0.5)(llama):
        out = llama(input_ids=ids, attention_mask=mask)
    assert torch.isfinite(out.logits).all()


# ----------------------------------------------------------------------- scorer output
class _Broken(Scorer):
    """Test scorer returning whatever ``mode`` asks for."""

    name: Literal["broken_test"] = "broken_test"
    mode: str = "nan"

    def query_window(self) -> int:
        return 0

    def score(self, obs: Observation) -> torch.Tensor:
        B, H, L = obs.keys.shape[:3]
        if self.mode == "nan":
            scores = torch.rand(B, H, L)
            scores[:, 0, 3] = float("nan")
            return scores
        if self.mode == "batch_only":
            return torch.rand(B, L)
        return torch.rand(B, H, L - 5)


@pytest.mark.parametrize("mode, match", [
    ("nan", "_Broken returned NaN scores in layer 0"),
    ("batch_only", r"_Broken returned scores of shape \(2, 40\) in layer 0"),
    ("short", r"_Broken returned scores of shape \(2, 2, 35\) in layer 0"),
])
@pytest.mark.parametrize("allocator", ["uniform", "ada"])
def test_bad_scores_name_the_scorer_and_layer(llama, mode, match, allocator):
    press = Pipeline(scorer=_Broken(mode=mode), allocator=allocator, compression_ratio=0.5)
    with press(llama), pytest.raises(ValueError, match=match):
        llama(input_ids=_ids(40, batch=2))  # B == H_kv == 2: a [B, L] tensor would broadcast


# ---------------------------------------------------------------------- nested presses
def test_nested_presses_are_refused_and_outer_survives(llama):
    ids = _ids(80)
    outer = preset("snapkv", compression_ratio=0.5)
    previous = llama.config._attn_implementation
    with outer(llama):
        with pytest.raises(RuntimeError, match="do not nest"):
            with preset("ada_snapkv", compression_ratio=0.9)(llama):
                pass
        with pytest.raises(RuntimeError, match="do not nest"):
            with preset("snapkv", compression_ratio=0.0)(llama):
                pass
        out = llama(input_ids=ids)
    cache = output_cache(out)
    assert isinstance(cache, RaggedCache)
    assert int(cache.head_lengths(0).sum()) == 2 * 40  # the outer press (r = 0.5), not the inner one
    assert llama.config._attn_implementation == previous


# ---------------------------------------------------------- constant-score heads under Ada
@settings(max_examples=60, deadline=None)
@given(data=st.data(), B=st.integers(1, 3), H=st.integers(2, 6), L=st.integers(4, 40))
def test_constant_head_keeps_its_uniform_share(data, B, H, L):
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, H, L, generator=g) * torch.rand(B, H, 1, generator=g) * 10
    flat = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B * H, max_size=B * H))).view(B, H)
    level = data.draw(st.floats(-5, 5))
    scores = torch.where(flat[..., None], torch.full_like(scores, level), scores)
    budget = torch.tensor(data.draw(st.lists(st.integers(1, L), min_size=B, max_size=B)))
    counts = AdaHead(alpha=0.0).allocate(scores, budget, comparable=False)
    assert torch.equal(counts.sum(-1), H * budget)
    assert (counts <= L).all()
    assert torch.equal(counts[flat], budget[:, None].expand(B, H)[flat])


def test_constant_head_with_protected_tokens_gets_uniform_share():
    scores = torch.rand(1, 3, 30, generator=torch.Generator().manual_seed(0))
    scores[:, 1] = 0.0  # e.g. KNorm on identical keys
    scores[:, 1, -4:] = float("inf")
    counts = AdaHead(alpha=0.0).allocate(scores, torch.tensor([10]), comparable=False)
    assert counts[0, 1] == 10 and counts.sum() == 30


# ------------------------------------------------------------ the cache after the with block
@pytest.mark.parametrize("evictor", [TopK(), Mask()])
def test_compressed_cache_after_the_block(llama, evictor):
    ids, nxt = _ids(80), _ids(1, seed=1)
    key = cache_kwarg(llama)
    press = preset("ada_snapkv", compression_ratio=0.5, evictor=evictor)
    with press(llama):
        out = llama(input_ids=ids)
        cache = output_cache(out)
    with press(llama):
        ref = llama(input_ids=nxt, **{key: output_cache(llama(input_ids=ids))}).logits
    with pytest.raises(RuntimeError, match=r"kvpress_ada.attach\(model\)"):
        llama(input_ids=nxt, **{key: cache})
    assert cache.get_seq_length() == 80  # the refused call left the cache as it was
    kvpress_ada.attach(llama)
    try:
        after = llama(input_ids=nxt, **{key: cache}).logits
        assert torch.allclose(after, ref, atol=1e-5, rtol=0)
        prompt = torch.cat([ids, nxt, _ids(1, seed=2)], 1)  # the cache holds all but the last token
        more = llama.generate(prompt, **{key: cache}, max_new_tokens=3, do_sample=False)
        assert more.shape[1] == 85 and cache.get_seq_length() == 84
        dense = llama(input_ids=ids)  # other caches run as before
        assert type(output_cache(dense)).__name__ == "DynamicCache"
        with press(llama):  # a press still applies inside an attached model
            assert isinstance(output_cache(llama(input_ids=ids)), PressCache)
    finally:
        kvpress_ada.detach(llama)
    assert llama.config._attn_implementation != kvpress_ada.hosts.transformers.ATTENTION_NAME


# ------------------------------------------------------------------- the contracts
def test_the_host_picks_the_cache(llama):
    assert isinstance(new_cache(preset("snapkv", compression_ratio=0.5), llama.config), RaggedCache)
    assert isinstance(new_cache(preset("snapkv", compression_ratio=0.5, evictor=Mask()), llama.config), MaskedCache)

    class Hiding(TopK):  # a user's evictor that keeps the dense cache gets the host's masked one
        frees_memory: ClassVar[bool] = False

    assert isinstance(new_cache(preset("snapkv", compression_ratio=0.5, evictor=Hiding()), llama.config), MaskedCache)


def test_a_cache_given_by_the_caller_is_used(llama):
    """A fresh press cache passed to the forward (here with a bigger decode reserve) is the one compressed into."""
    ids = _ids(80)
    key = cache_kwarg(llama)
    sizes = {}
    for reserve in (RaggedLayer().decode_reserve, 40):
        with preset("snapkv", compression_ratio=0.5)(llama):
            cache = RaggedCache(config=llama.config, decode_reserve=reserve)
            assert output_cache(llama(input_ids=ids, **{key: cache})) is cache
            sizes[reserve] = cache.nbytes()
    D = llama.config.hidden_size // llama.config.num_attention_heads
    def room(n):  # a row's slots: kept entries + reserve, rounded up to whole chunks (compile-first layout)
        return -(-n // CHUNK) * CHUNK

    kept = 40  # snapkv at r = 0.5 of 80 tokens, per kv head
    default = RaggedLayer().decode_reserve
    slots = 3 * 1 * 2 * (room(kept + 40) - room(kept + default))  # layers x batch x kv heads x reserve difference
    assert slots > 0 and sizes[40] - sizes[default] == slots * D * 2 * 4


def test_every_handler_implements_the_whole_protocol():
    """The routing and the compiled step call every Handler method on whatever handler a forward carries:
    each handler is a declared Handler and overrides each of them (no inherited stub, no duck typing)."""
    methods = {"handles_prefill", "after_prefill", "attend", "record_hidden", "after_forward", "traceable"}
    assert methods <= set(dir(Handler))
    for cls in (PrefillRun, ChunkedPrefill, DecodeRun, CaptureRun, PassRun):
        assert Handler in cls.__mro__, cls
        for name in methods:
            assert getattr(cls, name) is not getattr(Handler, name), (cls.__name__, name)


# ------------------------------------------------------------ padding never changes a row
@pytest.mark.parametrize("name", portable_preset_names())  # calibrated: test_calibrated.py
def test_padded_batch_row_equals_the_row_alone(llama, name):
    """A row's kept set and logits do not depend on how much left padding the batch gave it."""
    lengths = (90, 66, 78)
    L = max(lengths)
    rows = [_ids(n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, L - row.numel():], mask[b, L - row.numel():] = row, 1
    press = preset(name, compression_ratio=0.5)
    kwargs = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with press(llama):
        batch = llama.generate(ids, attention_mask=mask, **kwargs)
    for b, row in enumerate(rows):
        with press(llama):
            alone = llama.generate(row[None], **kwargs)
        assert torch.equal(batch.sequences[b, L:], alone.sequences[0, row.numel():]), (name, b)
        for step, (x, y) in enumerate(zip(batch.scores, alone.scores)):
            assert torch.allclose(x[b], y[0], atol=1e-4, rtol=0), (name, b, step, (x[b] - y[0]).abs().max())
