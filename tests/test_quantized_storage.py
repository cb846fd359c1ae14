"""Quantized storage (``Pipeline(storage=Int8() | Int4())``) in every mode of the transformers host.

Two oracles: the full-precision press (selection never depends on the storage: a one-shot press keeps the
same positions), and a full-precision ragged cache whose entries are rounded through the scheme when kept
or appended (:class:`RoundedCache`: each row's first kept entry exact, keys centred by the row's centre and
rotated, quantized, read back): whatever a mode reads after compression (attention, a decode compaction's
view, the next chunk), the quantized cache must give what that cache gives, since both hold the same
values."""

import pytest
import torch
from conftest import build_model, build_tokenizer, left_padded_batch, two_ranks
from torch._dynamo.utils import counters

from kvpress_ada import Fp8, Int4, Int8, Mask, Pipeline, RaggedCache, generate, preset
from kvpress_ada.hosts.transformers import compiled
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import cache_kwarg, output_cache
from kvpress_ada.hosts.transformers.quantized_cache import QuantizedRaggedCache, QuantizedRaggedLayer
from kvpress_ada.hosts.transformers.ragged_cache import RaggedLayer
from kvpress_ada.kernels import dequantize, quantize, record_width
from kvpress_ada.kernels.quantized.scheme import RecordLayout, decode_keys, encode_keys, rotation, row_side
from kvpress_ada.kernels.ragged.reference import CHUNK
from kvpress_ada.presets import portable_preset_names
from kvpress_ada.scorers import SnapKV

# the tiny models' head dim is 16; the rounded oracle rounds every entry it keeps: no residual
STORAGES = [Int8(group_size=16, residual=0), Int4(group_size=16, residual=0)]
IDS = pytest.mark.parametrize("storage", STORAGES, ids=["int8", "int4"])
# with a residual: each row's newest entries in full precision (small, so that it wraps in these tests)
WITH_RESIDUAL = pytest.mark.parametrize("storage", STORAGES + [Int4(group_size=16, residual=4),
                                                             Int8(group_size=16, residual=32, half_scales=False)],
                                        ids=["int8", "int4", "int4-r4", "int8-r32-f32"])
# every record kind, fp8 too, for the tests whose assertions do not depend on the encoding
EVERY_KIND = pytest.mark.parametrize(
    "storage", STORAGES + [Int4(group_size=16, residual=4), Int8(group_size=16, residual=32), Fp8(), Fp8(group_size=16),
                           Fp8(residual=4)], ids=["int8", "int4", "int4-r4", "int8-r32", "fp8", "fp8-g16", "fp8-r4"])
# a residual longer than any row here: every entry stays in full precision (oracle: full-precision storage)
COVERING = Int4(group_size=16, residual=512)


class RoundedLayer(RaggedLayer):
    """Full-precision ragged layer whose kept and appended entries are rounded through the storage's scheme
    (a row's first entry exact; keys centred by the row's centre, fixed at compression, and rotated); entries
    it already holds are moved as they are (test oracle)."""

    def __init__(self, layout, decode_reserve=8):
        super().__init__(decode_reserve)
        self.layout, self._moving = layout, False

    def _round(self, keys, values, centre):
        D, layout = keys.shape[-1], self.layout
        return (decode_keys(encode_keys(keys, centre, layout), centre, D, layout, keys.dtype),
                dequantize(quantize(values, layout), D, layout, values.dtype))

    def _compact_entries(self, keys, values, keep):
        if not self._moving:
            B, H, _, D = keys.shape
            side = row_side(keys, values, keep, self.layout.rotate_keys).view(3, B, H, 1, D)
            self.centre = side[2]
            first = (keep & (torch.cumsum(keep, -1) == 1))[..., None]
            rounded = self._round(keys, values, self.centre)
            keys, values = torch.where(first, keys, rounded[0]), torch.where(first, values, rounded[1])
        super()._compact_entries(keys, values, keep)

    def _append_entries(self, keys, values):
        B, H = keys.shape[:2]
        first = torch.zeros(keys.shape[:3] + (1,), dtype=torch.bool)
        first[:, :, 0] = (self.row_lengths == 0).view(B, H, 1)  # an empty row's first token is its anchor
        rounded = self._round(keys, values, self.centre)
        super()._append_entries(torch.where(first, keys, rounded[0]), torch.where(first, values, rounded[1]))

    def retain(self, keep, held, spare=None):
        self._moving = self.compressed
        try:
            super().retain(keep, held, spare)
        finally:
            self._moving = False


class RoundedCache(RaggedCache):
    def __init__(self, storage, config):
        self.layout = storage.layout
        super().__init__(config=config)

    def _new_layer(self, decode_reserve):
        return RoundedLayer(self.layout, decode_reserve)


_MODELS = {}


def _model(arch="llama", **overrides):
    key = (arch, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        _MODELS[key] = build_model(arch, **overrides)
    return _MODELS[key]


def _run(model, press, ids, mask=None, cache=None, new_tokens=5):
    """Greedy generation under ``press`` (into ``cache`` when given): (sequences, logits, cache)."""
    kwargs = {} if cache is None else {cache_kwarg(model): cache}
    with torch.no_grad(), press(model):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1), output_cache(out)


def _assert_like_rounded(model, press, storage, ids, mask=None, new_tokens=5, atol=1e-4, appended_atol=1e-6):
    """``press`` with ``storage`` against the same full-precision press decoding into a RoundedCache (logits
    within ``atol``: the quantized path attends in float32, the rounded cache in the model's dtype; entries
    appended while decoding within ``appended_atol``)."""
    tokens, logits, cache = _run(model, press.model_copy(update={"storage": storage}), ids, mask,
                                 new_tokens=new_tokens)
    ref_tokens, ref_logits, ref = _run(model, press, ids, mask, RoundedCache(storage, model.config), new_tokens)
    assert isinstance(cache, QuantizedRaggedCache) and type(ref) is RoundedCache
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=atol, rtol=0)
    for i in range(len(cache.layers)):
        assert torch.equal(cache.head_lengths(i), ref.head_lengths(i))
        mine, theirs = cache.layers[i].view(), ref.layers[i].view()
        assert torch.equal(mine.positions, theirs.positions)
        # the prompt's entries are the same records; appended ones come from hidden states within ``atol``
        prompt = (mine.positions < ids.shape[1])[..., None]
        torch.testing.assert_close(mine.keys * prompt, theirs.keys * prompt, atol=1e-6, rtol=0)
        torch.testing.assert_close(mine.keys, theirs.keys, atol=appended_atol, rtol=0)
    return cache


def _held_bytes(cache):
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k_flat, layer.v_flat,
                                                                                  layer.side))


# ----------------------------------------------------------------------------- selection and bytes


@WITH_RESIDUAL
@pytest.mark.parametrize("name", portable_preset_names())
def test_every_preset_keeps_the_full_precision_positions(storage, name):
    """One-shot presets (KVzip's model pass included), batch 2 with left padding: selection reads the
    full-precision prefill, so the kept positions are those of full-precision storage."""
    model = _model()
    ids, mask = left_padded_batch()
    caches = {}
    for st in ("full", storage):
        with torch.no_grad(), preset(name, compression_ratio=0.6, storage=st)(model):
            caches[st if st == "full" else "quantized"] = output_cache(model(ids, attention_mask=mask,
                                                                             use_cache=True))
    full, quantized = caches["full"], caches["quantized"]
    assert isinstance(quantized, QuantizedRaggedCache) and not isinstance(full, QuantizedRaggedCache)
    step = 1 / 15 if storage.layout.bits == 4 else 1 / 255
    for i in range(len(full.layers)):
        assert torch.equal(quantized.head_lengths(i), full.head_lengths(i))
        layer = quantized.layers[i]
        got, ref = layer.view(), full.layers[i].view()
        assert torch.equal(got.positions, ref.positions) and torch.equal(got.valid, ref.valid)
        # each row's first entry (its anchor) reads back exactly, key and value
        first = (got.valid & (torch.cumsum(got.valid, -1) == 1))[..., None]
        assert torch.equal(got.keys * first, ref.keys * first) and torch.equal(got.values * first, ref.values * first)
        # keys: within half a step of their group's range in the rotated, centred space (one group: D = 16)
        B, H, _, D = got.keys.shape
        centre, R = layer.side[2].view(B, H, 1, D), rotation(D)
        y_got, y_ref = (got.keys - centre) @ R, (ref.keys - centre) @ R
        # float16 scales of float32 entries: the zero point rounded down and the scale up by 2^-11 relative each
        half = 2 ** -11 * step if storage.layout.scale_bits else 0
        spread = y_ref.amax(-1, keepdim=True) - y_ref.amin(-1, keepdim=True)
        widen = half * y_ref.abs().amax(-1, keepdim=True)
        assert ((y_got - y_ref).abs() * got.valid[..., None] <= spread * step / 2 + widen + 1e-5).all()
        spread = ref.values.amax(-1, keepdim=True) - ref.values.amin(-1, keepdim=True)  # values: per token
        widen = half * ref.values.abs().amax(-1, keepdim=True)
        assert ((got.values - ref.values).abs() <= spread * step / 2 + widen + 1e-6).all()
    assert quantized.nbytes() < full.nbytes()


@WITH_RESIDUAL
def test_nbytes_are_the_records_held(storage):
    """``nbytes()`` = bytes of the tensors held, scales and zero points included: each row's slots (kept
    entries + the decode reserve, whole chunks) x one record of ``D * bits / 8 + 2 * (D / group) * s`` bytes
    (``s``: 2 with float16 scales, the default, 4 with ``half_scales=False``), for keys and values, plus each
    row's side tensors (anchor key and value, key centre and the residual's keys and values:
    ``(3 + 2 * residual) * D * 4`` bytes); ``batch_nbytes`` splits the same bytes by batch row."""
    model = _model()
    ids, mask = left_padded_batch()
    with torch.no_grad(), preset("ada_snapkv", compression_ratio=0.6, storage=storage)(model):
        cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
    D = model.config.hidden_size // model.config.num_attention_heads
    width = record_width(D, storage.layout, torch.float32)
    assert width == D * storage.layout.bits // 8 + 2 * (D // 16) * (2 if storage.half_scales else 4)
    slots = sum(int((-(-(cache.head_lengths(i) + 8) // CHUNK) * CHUNK).sum()) for i in range(len(cache.layers)))
    rows = sum(cache.head_lengths(i).numel() for i in range(len(cache.layers)))
    assert cache.nbytes() == _held_bytes(cache) == slots * width * 2 + rows * (3 + 2 * storage.residual) * D * 4
    assert sum(cache.batch_nbytes()) == cache.nbytes()
    assert all(layer.k_flat.dtype == torch.uint8 for layer in cache.layers)


def _short_context_layer(storage, L=1025, ratio=0.75, seed=0):
    """One layer of the default model's geometry (3 kv heads, head dim 64, float32) over an ``L``-token context,
    each row keeping its ``ratio``-evicted share (its best random scores): what ``kvzap`` keeps at 1k tokens."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, 3, L, 64, generator=gen), torch.randn(1, 3, L, 64, generator=gen)
    kept = round(L * (1 - ratio))
    keep = torch.zeros(1, 3, L, dtype=torch.bool)
    keep.scatter_(-1, torch.rand(1, 3, L, generator=gen).topk(kept, -1).indices, True)
    layer = QuantizedRaggedLayer(storage.layout)
    layer.update(keys, values)
    layer.compress(keep)
    return layer, keys, values, keep


def _layer_bytes(layer, layout):
    """The bytes a layer must hold by the formula: each row's slots (whole chunks) x two records, plus its side
    tensors ``(3 + 2 * residual)`` float32 vectors."""
    rows, D = layer.row_offsets.shape[0], layer.head_dim
    return 2 * layer.k_flat.shape[0] * layout.width(D, torch.float32) + rows * (3 + 2 * layout.residual) * D * 4


def test_int4_at_short_contexts_holds_at_most_five_percent_of_the_full_cache():
    """int4 at r = 0.75 over 1,025 tokens (the default model's geometry, float32): the default (float16 scales,
    4-entry residual) holds 40-byte records (32 + 2 groups x scale and zero x 2 bytes) of 280 slots a row on average
    and 11 side vectors, <= 5% of the full float32 cache; the old default (float32 scales, 32-entry residual: 48-byte
    records, 67 side vectors) held over 8%. Decode appends keep the totals exact: rows grow by one per token,
    the bytes follow the formula through a re-layout, the newest ``residual`` entries read back exactly."""
    full = 3 * 1025 * 64 * 2 * 4
    old = _short_context_layer(Int4(residual=32, half_scales=False))[0]
    assert old.nbytes() == _layer_bytes(old, old.layout) and old.layout.width(64, torch.float32) == 48
    assert old.nbytes() / full > 0.08
    storage = Int4()
    layer, keys, values, keep = _short_context_layer(storage)
    layout = storage.layout
    assert layout.width(64, torch.float32) == 32 + 2 * 2 * 2 and layout.residual == 4
    assert layer.nbytes() == _layer_bytes(layer, layout) <= 0.05 * full < old.nbytes() * 0.6
    counts = keep.sum(-1).view(-1)
    gen = torch.Generator().manual_seed(1)
    appended = []
    for t in range(40):  # past the decode reserve: the layer is re-laid out once
        k, v = torch.randn(1, 3, 1, 64, generator=gen), torch.randn(1, 3, 1, 64, generator=gen)
        layer.reserve(1)
        layer.update(k, v)
        appended.append((k, v))
        assert torch.equal(layer.row_lengths.long(), counts + t + 1)
        assert layer.nbytes() == _layer_bytes(layer, layout)
    held = layer.view()
    assert torch.equal(held.valid.sum(-1).view(-1), counts + 40)
    newest_k = torch.cat([k for k, _ in appended[-layout.residual:]], 2)
    newest_v = torch.cat([v for _, v in appended[-layout.residual:]], 2)
    n = int(counts[0]) + 40
    assert torch.equal(held.keys[0, 0, n - layout.residual:n], newest_k[0, 0])
    assert torch.equal(held.values[0, 0, n - layout.residual:n], newest_v[0, 0])
    older = torch.cat([v for _, v in appended[:-layout.residual]], 2)[0, 0]
    got = held.values[0, 0, n - 40:n - layout.residual]
    spread = older.amax(-1, keepdim=True) - older.amin(-1, keepdim=True)
    assert ((got - older).abs() <= spread / 15 / 2 * (1 + 2 ** -10) + 2 ** -10 * older.abs().amax()).all()


# ----------------------------------------------------------------------------- modes


@IDS
def test_one_shot_left_padded_batch_equals_rounded_cache(storage):
    _assert_like_rounded(_model(), preset("ada_snapkv", compression_ratio=0.6), storage, *left_padded_batch())


@EVERY_KIND
def test_batch_row_equals_row_alone(storage):
    model = _model()
    ids, mask = left_padded_batch(lengths=(90, 71), seed=4)
    press = preset("ada_pyramidkv", compression_ratio=0.5, storage=storage)
    tokens, logits, cache = _run(model, press, ids, mask, new_tokens=6)
    for b in range(2):
        n = int(mask[b].sum())
        alone_tokens, alone_logits, alone = _run(model, press, ids[b:b + 1, -n:], new_tokens=6)
        assert torch.equal(tokens[b], alone_tokens[0])
        torch.testing.assert_close(logits[b], alone_logits[0], atol=1e-4, rtol=0)
        assert cache.batch_nbytes()[b] == alone.nbytes()
        for i in range(len(cache.layers)):
            assert torch.equal(cache.head_lengths(i)[b], alone.head_lengths(i)[0])


@IDS
def test_chunked_prefill_equals_rounded_cache(storage):
    """Each chunk attends to (and the next selection reads) the dequantized entries kept so far."""
    press = preset("ada_snapkv", budget=14, prefill_chunk=12, scorer=SnapKV(window=4, kernel=3))
    _assert_like_rounded(_model(), press, storage, *left_padded_batch(lengths=(60, 41), seed=2))


@IDS
def test_decode_compression_equals_rounded_cache_and_moves_records(storage):
    """Decode compactions read the dequantized view and keep the records unchanged (never re-quantized)."""
    press = Pipeline(scorer=SnapKV(window=4, kernel=3), budget=16, decode_budget=10, decode_interval=4)
    cache = _assert_like_rounded(_model(), press, storage, *left_padded_batch(lengths=(30, 24), seed=3), new_tokens=14)
    assert min(cache.state.compactions) >= 2
    layer = cache.layers[0]
    before = layer.view()
    keep = before.valid & (torch.rand(before.valid.shape, generator=torch.Generator().manual_seed(0)) < 0.6)
    keep[0] &= ~(before.valid[0] & (torch.cumsum(before.valid[0], -1) == 1))  # batch row 0 drops its anchors
    records, offsets = layer.k_flat.clone(), layer.row_offsets.clone()
    layer.retain(keep, before)
    after = layer.view()
    assert torch.equal(after.valid.sum(-1), keep.sum(-1))
    for x, y in ((before.keys, after.keys), (before.values, after.values)):
        kept_before = [x[b, h][keep[b, h]] for b in range(2) for h in range(2)]
        kept_after = [y[b, h][after.valid[b, h]] for b in range(2) for h in range(2)]
        assert all(torch.equal(u, v) for u, v in zip(kept_before, kept_after))  # the new anchors: their read-back
    assert torch.equal(layer.side[0, :2], torch.stack([before.keys[0, h][keep[0, h]][0] for h in range(2)]))
    # records move unchanged: row 0's new first slot holds the record its entry had (now read as the anchor)
    rank = int(keep[0, 0].int().argmax()) - int((~before.valid[0, 0]).sum())  # within the row (view: left-padded)
    assert torch.equal(layer.k_flat[int(layer.row_offsets[0])], records[int(offsets[0]) + rank])


@WITH_RESIDUAL
def test_relayout_and_crop_keep_the_records(storage):
    """Appends past the decode reserve re-lay the layer out (records copied as bytes); crop drops appended ones."""
    model = _model()
    ids, _ = left_padded_batch(lengths=(80,))
    _, _, cache = _run(model, preset("snapkv", compression_ratio=0.5, storage=storage), ids, new_tokens=30)
    layer = cache.layers[0]
    assert isinstance(layer, QuantizedRaggedLayer) and layer._appended == 29
    held = layer.view()  # every row holds as many entries here (a uniform press): no left padding
    assert held.valid.all() and layer.k_flat.shape[0] > (-(-(40 + 8) // CHUNK) * CHUNK) * 2  # re-laid out
    layer.crop(-3)
    assert torch.equal(layer.view().keys, held.keys[..., :-3, :])
    assert torch.equal(layer.head_lengths(), cache.head_lengths(0))


def _assert_like_full_precision(model, press, ids, mask=None, new_tokens=5):
    """``press`` with :data:`COVERING` (every entry in its row's residual) against full-precision storage:
    same tokens, logits and views (the anchors, the ring after compaction, appends and decode compactions)."""
    tokens, logits, cache = _run(model, press.model_copy(update={"storage": COVERING}), ids, mask,
                                 new_tokens=new_tokens)
    ref_tokens, ref_logits, ref = _run(model, press, ids, mask, new_tokens=new_tokens)
    assert isinstance(cache, QuantizedRaggedCache) and not isinstance(ref, QuantizedRaggedCache)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    for i in range(len(cache.layers)):
        mine, theirs = cache.layers[i].view(), ref.layers[i].view()
        assert torch.equal(mine.positions, theirs.positions)
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-6, rtol=0)
    return cache


def test_covering_residual_is_full_precision_one_shot():
    _assert_like_full_precision(_model(), preset("ada_snapkv", compression_ratio=0.6), *left_padded_batch())


def test_covering_residual_is_full_precision_chunked_prefill():
    press = preset("ada_snapkv", budget=14, prefill_chunk=12, scorer=SnapKV(window=4, kernel=3))
    _assert_like_full_precision(_model(), press, *left_padded_batch(lengths=(60, 41), seed=2))


def test_covering_residual_is_full_precision_decode_compression():
    press = Pipeline(scorer=SnapKV(window=4, kernel=3), budget=16, decode_budget=10, decode_interval=4)
    cache = _assert_like_full_precision(_model(), press, *left_padded_batch(lengths=(30, 24), seed=3),
                                        new_tokens=14)
    assert min(cache.state.compactions) >= 2


@pytest.mark.parametrize("residual", [1, 4, 32])
def test_residual_decode_compaction_keeps_what_the_view_reads(residual):
    """With a residual that wraps: a decode compaction (including rows dropping their anchor) changes no kept
    entry's read-back value, the records move unchanged, and the ring holds each row's newest entries."""
    storage = Int4(group_size=16, residual=residual)
    press = Pipeline(scorer=SnapKV(window=4, kernel=3), budget=16, decode_budget=10, decode_interval=4,
                     storage=storage)
    _, _, cache = _run(_model(), press, *left_padded_batch(lengths=(30, 24), seed=3), new_tokens=14)
    assert min(cache.state.compactions) >= 2
    for layer in cache.layers:
        before = layer.view()
        keep = before.valid & (torch.rand(before.valid.shape, generator=torch.Generator().manual_seed(0)) < 0.6)
        keep[0] &= ~(before.valid[0] & (torch.cumsum(before.valid[0], -1) == 1))
        layer.retain(keep, before)
        after = layer.view()
        assert torch.equal(after.valid.sum(-1), keep.sum(-1))
        for x, y in ((before.keys, after.keys), (before.values, after.values)):
            for b in range(2):
                for h in range(2):
                    assert torch.equal(x[b, h][keep[b, h]], y[b, h][after.valid[b, h]])
        B, H, D = layer.shape
        for b in range(B):
            for h in range(H):
                row = after.keys[b, h][after.valid[b, h]]
                for j in range(max(len(row) - residual, 0), len(row)):
                    assert torch.equal(layer.side[3 + j % residual, b * H + h], row[j])


class ImmediateLayer(QuantizedRaggedLayer):
    """Quantizes every appended token at once: the oracle of deferred appends."""

    defer_appends = False


@pytest.mark.parametrize("scale_bits", [0, 16])
@pytest.mark.parametrize("bits", [4, 8])
def test_deferred_appends_write_the_records_of_immediate_ones(bits, scale_bits):
    """Eager single-token appends go to the residual ring and are quantized in batches before they leave it:
    at every step the layer reads what immediate appends read (an empty row takes its first token as anchor),
    the records stay unwritten until a batch is due, and the batch writes the records an immediate append
    writes (values exactly; keys up to the rotation's float32 rounding)."""
    residual, B, H, L, D = 4, 2, 2, 12, 16
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(B, H, L, D, generator=gen), torch.randn(B, H, L, D, generator=gen)
    keep = torch.rand(B, H, L, generator=gen) < 0.5
    keep[1, 1] = False  # an empty row: its first appended token becomes its anchor
    layout = RecordLayout("int", bits, 16, residual, scale_bits=scale_bits)
    layers = [cls(layout, decode_reserve=32) for cls in (QuantizedRaggedLayer, ImmediateLayer)]
    for layer in layers:
        layer.update(keys, values)
        layer.compress(keep)
    deferred, immediate = layers
    query = torch.randn(B, 2 * H, 1, D, generator=gen)
    for step in range(11):
        k, v = torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen)
        for layer in layers:
            layer.update(k, v)
        assert deferred._unrecorded == step % residual + 1 <= residual
        pending = (deferred.row_offsets + deferred.row_lengths - 1).long()  # each row's newest slot
        assert not deferred.k_flat[pending].any() and immediate.k_flat[pending].any()
        mine, theirs = deferred.view(), immediate.view()
        assert torch.equal(mine.valid, theirs.valid) and torch.equal(mine.positions, theirs.positions)
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-6, rtol=0)
        assert torch.equal(mine.values, theirs.values)
        torch.testing.assert_close(deferred._attention(query, 0.25), immediate._attention(query, 0.25),
                                   atol=1e-5, rtol=0)
    assert torch.equal(deferred.side, immediate.side)
    deferred._record_pending()
    assert deferred._unrecorded == 0 and torch.equal(deferred.v_flat, immediate.v_flat)
    got, want = (dequantize(layer.k_flat, D, layout, torch.float32) for layer in layers)
    step_size = (want.abs().amax() * 2 / (2**bits - 1)).item()
    assert ((got - want).abs() <= step_size).all() and ((got - want).abs() > 1e-6).float().mean() < 0.01


def test_residual_spares_the_newest_entries():
    """Through the cache at ratio 0 (the context's entries kept, then the rest of the prompt appended in two
    steps): with a residual, each row's newest entries read back exactly (layer 0: its keys depend only on the
    tokens) and older ones as records; the logits are closer to full precision than without one."""
    model = _model()
    ids, _ = left_padded_batch(lengths=(100,), seed=6)
    with torch.no_grad():
        ref = model(ids, use_cache=True)
    errors = {}
    for residual in (0, 16):
        press = preset("snapkv", compression_ratio=0.0, storage=Int4(group_size=16, residual=residual))
        with torch.no_grad(), press(model):
            cache = output_cache(model(ids[:, :70], use_cache=True))
            first = model(ids[:, 70:80], past_key_values=cache, use_cache=True).logits
            second = model(ids[:, 80:], past_key_values=cache, use_cache=True).logits
        errors[residual] = (torch.cat((first, second), 1) - ref.logits[:, 70:]).abs().max().item()
        got, full = cache.layers[0].view().keys, ref.past_key_values.layers[0].keys
        L = full.shape[-2]
        assert got.shape == full.shape and L > residual
        torch.testing.assert_close(got[..., L - residual:, :], full[..., L - residual:, :], atol=1e-6, rtol=0)
        torch.testing.assert_close(got[..., :1, :], full[..., :1, :], atol=1e-6, rtol=0)  # the anchors
        assert ((got[..., 1:L - residual, :] - full[..., 1:L - residual, :]).abs().amax(-1) > 1e-6).all()
    assert errors[16] < errors[0]


def test_generate_questions_and_contexts_batch(tokenizer=None):
    """``kvpress_ada.generate``: a left-padded batch of contexts and two questions (crop between them)
    answers like each context alone."""
    model, tok = _model(), build_tokenizer()
    press = preset("ada_snapkv", compression_ratio=0.5, storage=Int4(group_size=16))
    contexts = ["In 1947 the pass key was 4821. The garden had seven doors. " * 2, "The gate code is 77. " * 3]
    questions = ["What is the pass key?", "How many doors?"]
    batch = generate(model, tok, contexts, questions, press=press, max_new_tokens=4)
    alone = [generate(model, tok, c, questions, press=press, max_new_tokens=4) for c in contexts]
    assert batch == alone


@pytest.mark.parametrize("storage", STORAGES + [Fp8()], ids=["int8", "int4", "fp8"])
def test_fanout_equals_running_the_press(storage):
    model = _model()
    ids, _ = left_padded_batch(lengths=(80,), seed=5)
    presses = [preset(name, compression_ratio=0.6, storage=storage) for name in ("ada_snapkv", "kvzip")]
    prefill = capture_prefill(model, ids)
    for press in presses:
        derived = prefill.compressed_cache(press)
        with torch.no_grad(), press(model):
            ran = output_cache(model(ids, use_cache=True))
        assert isinstance(derived, QuantizedRaggedCache)
        for a, b in zip(derived.layers, ran.layers):
            assert torch.equal(a.k_flat, b.k_flat) and torch.equal(a.v_flat, b.v_flat)
            assert torch.equal(a.row_lengths, b.row_lengths)
    masks = [prefill.keep_masks(p) for p in presses]
    batch = prefill.compressed_batch(presses, masks)
    assert isinstance(batch, QuantizedRaggedCache)
    for e, press in enumerate(presses):
        alone = prefill.compressed_cache(press, masks[e])
        assert batch.batch_nbytes()[e] == alone.nbytes()
        for i in range(len(batch.layers)):
            got, ref = batch.layers[i].view(), alone.layers[i].view()
            assert torch.equal(got.keys[e][got.valid[e]], ref.keys[0][ref.valid[0]])
    with pytest.raises(ValueError, match="one storage"):
        prefill.compressed_batch([presses[0], preset("ada_snapkv", compression_ratio=0.6)], masks)


@pytest.mark.parametrize("storage", [Int4(group_size=16), Fp8()], ids=["int4", "fp8"])
def test_compiled_decode_step_has_no_graph_break(monkeypatch, storage):
    """Record decode steps through the shared compiled forward (``fullgraph=True``; fp8 without a residual: each
    token's records written inside the graph): same tokens as eager, no graph break, one graph over re-layouts."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.delenv(compiled.ENV_VAR, raising=False)
    model = build_model("llama", num_hidden_layers=2)
    press = preset("ada_snapkv", compression_ratio=0.5, storage=storage)
    ids = torch.randint(5, 100, (1, 70), generator=torch.Generator().manual_seed(7))
    counters.clear()
    outs = []
    for compile in (False, True):
        with torch.no_grad(), press(model, compile=compile):
            step = model.__dict__.get("forward")
            outs.append(model.generate(ids, max_new_tokens=41, min_new_tokens=41, do_sample=False))
        if compile:
            assert isinstance(step, compiled.DecodeForward) and step.calls == 40
    assert torch.equal(outs[0], outs[1])
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


# ----------------------------------------------------------------------------- refusals


def test_one_line_refusals():
    with pytest.raises(ValueError, match="group_size=24 is not supported"):
        Int4(group_size=24)
    with pytest.raises(ValueError, match=r"residual=-1 must be between 0 \(off\) and 1024") as err:
        Int8(residual=-1)
    assert "\n" not in str(err.value).splitlines()[-1] and len(err.value.errors()) == 1
    with pytest.raises(ValueError, match="Mask"):
        Pipeline(scorer=SnapKV(), compression_ratio=0.5, evictor=Mask(), storage="int4")
    model = _model()
    press = preset("snapkv", compression_ratio=0.5, storage="int4")  # group 32 > the tiny head dim 16
    with pytest.raises(ValueError, match=r"Int4\(group_size=32\) needs a head dimension divisible by it") as err:
        with press(model):
            pass
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="'native', which RaggedCache holds, not QuantizedRaggedCache"):
        QuantizedRaggedCache(storage=preset("snapkv", compression_ratio=0.5).storage, num_layers=2)


# ----------------------------------------------------------------------------- presets and the command line


def test_ratio_zero_keeps_every_entry_quantized():
    """No eviction with a quantized storage is not a no-op: every real entry is kept, as a record."""
    model = _model()
    ids, mask = left_padded_batch()
    press = preset("ada_snapkv", compression_ratio=0.0, storage=Int4(group_size=16))
    assert not press.is_noop and press.compresses_prefill
    with torch.no_grad(), press(model):
        cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
    assert isinstance(cache, QuantizedRaggedCache)
    assert cache.head_lengths(0).tolist() == [[90, 90], [70, 70]]
    assert preset("ada_snapkv", compression_ratio=0.0).is_noop


@pytest.fixture(scope="module")
def head_dim_32_model_dir(tmp_path_factory):
    """A tiny Llama whose head dim (32) the default group size divides."""
    path = tmp_path_factory.mktemp("tiny32")
    build_model("llama", hidden_size=128, max_position_embeddings=4096).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def test_cli_storage(head_dim_32_model_dir, tmp_path, capsys):
    import json

    from kvpress_ada.harness.cli import main

    runs = {}
    for storage in ("full", "int4"):
        out = tmp_path / storage
        assert main(["eval", "--model", head_dim_32_model_dir, "--presets", "snapkv", "--storage", storage,
                     "--ratios", "0,0.5", "--tasks", "passkey", "--n", "1", "--context", "200",
                     "--max-new-tokens", "2", "--out", str(out), "--no-progress"]) == 0
        runs[storage] = json.loads((out / "results.json").read_text())
    capsys.readouterr()
    rows = {s: {(r["label"], r["ratio"]): r["kv_bytes"] for r in run["records"]} for s, run in runs.items()}
    assert rows["int4"][("full", 0.0)] == rows["full"][("full", 0.0)]  # the reference row stays full precision
    # int4 records of head dim 32, groups of 32, float16 scale and zero point: 16 + 4 bytes against 128, plus
    # each row's side tensors (anchor key and value, key centre and the default residual's 4 keys and values:
    # (3 + 2 * 4) * 32 * 4 bytes; 3 layers x 2 kv heads)
    side = (3 + 2 * 4) * 32 * 4 * 3 * 2
    assert (rows["int4"][("snapkv", 0.5)] - side) * 128 == rows["full"][("snapkv", 0.5)] * 20  # same slots
    # every entry, quantized (the records under a fifth; with the side tensors, on a 200-token context, still
    # under a quarter)
    assert rows["int4"][("snapkv", 0.0)] - side < 0.2 * rows["full"][("full", 0.0)]
    assert rows["int4"][("snapkv", 0.0)] < 0.25 * rows["full"][("full", 0.0)]
    assert main(["demo", "--model", head_dim_32_model_dir, "--context", "200", "--max-new-tokens", "2",
                 "--storage", "int8", "--preset", "snapkv"]) == 0
    assert "snapkv" in capsys.readouterr().out
    config = tmp_path / "masked.yaml"
    config.write_text("scorer: snapkv\nevictor: mask\ncompression_ratio: 0.5\n")
    assert main(["eval", "--model", head_dim_32_model_dir, "--presets", "", "--config", str(config),
                 "--storage", "int4", "--out", str(tmp_path / "masked")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--storage int4" in err and "Mask" in err and len(err.splitlines()) == 1


def test_tensor_parallel_two_ranks_equal_one_process(tmp_path):
    """int4 storage under ``torchrun --nproc-per-node 2`` (gloo): each rank keeps its kv heads' rows as records;
    tokens, kept positions and bytes match the single process (tests/tp_quantized_worker.py)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    model_dir = tmp_path / "llama4kv"
    build_model("llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=128).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    report = tmp_path / "report.json"
    code, stderr, data = two_ranks("tp_quantized_worker.py", [str(model_dir), str(report)], report)
    assert data is not None, stderr[-4000:]
    failed = {name: r["problems"] for ranked in data["ranks"] for name, r in ranked.items() if not r["ok"]}
    assert data["world_size"] == 2 and not failed and code == 0, (failed, stderr[-2000:])


def test_fanout_evaluation_mixes_storages():
    """The evaluator batches fan-out entries per storage: a grid of full / int8 / int4 presses answers as
    separate runs do, and each quantized row records fewer bytes than its full-precision one."""
    from kvpress_ada.harness.eval import Sample
    from kvpress_ada.harness.eval.runner import Entry, evaluate, evaluate_separately

    model, tok = _model("llama", hidden_size=128), build_tokenizer()
    samples = [Sample(context="The pass key is 4821. " + "Blue doors and seven gates. " * 4,
                      question="What is the pass key?", answers=["4821"], task="passkey", metric="string_match_all")]
    entries = [Entry(f"{name}/{st}", r, preset(name, compression_ratio=r, storage=st))
               for name in ("snapkv", "ada_snapkv") for st in ("full", "int8", "int4") for r in (0.0, 0.5)]
    result = evaluate(model, tok, samples, entries, max_new_tokens=4, progress=False)
    separate = evaluate_separately(model, tok, samples, entries, max_new_tokens=4, progress=False)
    assert [r.answer for r in result.records if r.label != "full"] == separate[0]
    kv = {(r.label, r.ratio): r.kv_bytes for r in result.records}
    for name in ("snapkv", "ada_snapkv"):
        assert kv[(f"{name}/int4", 0.5)] < kv[(f"{name}/int8", 0.5)] < kv[(f"{name}/full", 0.5)]
        assert kv[(f"{name}/int4", 0.0)] < kv[(f"{name}/int8", 0.0)] < kv[("full", 0.0)]


def test_bfloat16_model_keeps_16_bit_scales():
    """A bf16 model: records carry bf16 scales and zero points (int4, head dim 16, groups of 16: 8 + 2 * 2 bytes),
    attention runs over them and answers in bf16; the same greedy tokens as the rounded full-precision cache."""
    model = build_model("llama").to(torch.bfloat16)
    ids, mask = left_padded_batch(lengths=(80, 66), seed=6)
    storage = Int4(group_size=16, residual=0)  # (the rounded oracle rounds every entry)
    cache = _assert_like_rounded(model, preset("snapkv", compression_ratio=0.5), storage, ids, mask, new_tokens=4,
                                 atol=2e-2, appended_atol=0.1)
    layer = cache.layers[0]
    assert layer.k_flat.shape[1] == record_width(16, storage.layout, torch.bfloat16) == 12
    assert layer.view().keys.dtype == torch.bfloat16


@pytest.mark.parametrize("storage", [{"name": "int4", "residual": 8}, {"name": "int8", "residual": 0}, "int4"])
def test_residual_round_trips_through_json(storage):
    press = Pipeline(scorer=SnapKV(), compression_ratio=0.5, storage=storage)
    again = Pipeline.model_validate_json(press.model_dump_json())
    assert again == press and again.storage.residual == (storage["residual"] if isinstance(storage, dict) else 4)


def test_unsupported_dtype_refused_in_one_line():
    model = build_model("llama").to(torch.float64)
    press = preset("snapkv", compression_ratio=0.5, storage=Int8(group_size=16))
    with pytest.raises(ValueError, match="Int8 quantizes float32, float16 or bfloat16 keys and values, not "
                                         "torch.float64") as err:
        with press(model):
            pass
    assert "\n" not in str(err.value)
