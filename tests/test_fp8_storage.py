"""fp8 storage (``Pipeline(storage="fp8")``: float8 e4m3 records, one float32 scale per token per kv head) as a
storage kind through its extension points: the records within e4m3's bound, the kernels (torch reference, the
fused CPU kernel in test_quantized_cpu.py, Triton interpreted), the transformers host in every mode against the
full-precision press (kept positions) and against a full-precision cache rounded through the scheme (what is
read), the serving layer's pools against the transformers host, bytes held, the command line's choices, and a
kind a user registers reaching both hosts with no other change."""

import pytest
import torch
from conftest import build_model, left_padded_batch, random_surrogate
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quantized_kernels import _cache, _read_back, _records, entries
from test_quantized_storage import _assert_like_rounded, _held_bytes, _model, _run
from torch._dynamo.utils import counters

from kvpress_ada import KVzap, Pipeline, kernels, preset
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.hosts.transformers.quantized_cache import QuantizedRaggedCache, QuantizedRaggedLayer
from kvpress_ada.hosts.transformers.ragged_cache import RaggedLayer
from kvpress_ada.kernels.quantized import scheme as qz
from kvpress_ada.kernels.ragged.reference import CHUNK, ragged_attention_ref
from kvpress_ada.presets import portable_preset_names
from kvpress_ada.scorers import SnapKV
from kvpress_ada.serving.pools import page_pool
from kvpress_ada.storage import STORAGES, Fp8, FullPrecision, RecordStorage, Storage, register_storage

E4M3 = qz.RecordLayout("e4m3", 8, 0, rotate_keys=False)  # what Fp8() declares (residual 0)
# the tiny models' head dim is 16; the rounded oracle rounds every entry it keeps: no residual
STORAGES_NO_RESIDUAL = [Fp8(), Fp8(group_size=16)]
IDS = pytest.mark.parametrize("storage", STORAGES_NO_RESIDUAL, ids=["fp8", "fp8-g16"])
WITH_RESIDUAL = pytest.mark.parametrize("storage", STORAGES_NO_RESIDUAL + [Fp8(residual=4)],
                                        ids=["fp8", "fp8-g16", "fp8-r4"])


def _within_e4m3(got, want, group):
    """``got`` read back from ``want`` ([..., D], float32) through e4m3 records with one scale per ``group``
    channels: within ``2^-4 |x| + 2^-10 scale`` per element (3 mantissa bits; subnormals), plus float32 rounding."""
    *lead, D = want.shape
    g = group or D
    scale = want.reshape(*lead, D // g, g).abs().amax(-1, keepdim=True) / qz.E4M3_MAX
    bound = (want.abs().reshape(*lead, D // g, g) * 2 ** -4 + scale * 2 ** -10) * (1 + 1e-5) + 1e-30
    return bool(((got - want).abs().reshape(*lead, D // g, g) <= bound).all())


# Batch row == row alone, fan-out == running the press, compiled decode: test_quantized_storage.py, fp8 among
# its storages.

# ----------------------------------------------------------------------------- records


def test_fp8_declares_its_layout():
    """The kind's layout: e4m3, 8 bits, one scale per head (group 0) or per group, residual 0 by default, keys
    neither centred nor rotated; a record is ``D`` bytes plus one float32 scale per group."""
    assert Fp8().layout == E4M3 and Fp8().quantized and Fp8().label == "fp8"
    assert Fp8(group_size=32, residual=8).layout == qz.RecordLayout("e4m3", 8, 32, 8, rotate_keys=False)
    assert E4M3.width(64, torch.bfloat16) == 64 + 4 == kernels.record_width(64, E4M3, torch.float32)
    assert Fp8(group_size=16).layout.width(64, torch.float16) == 64 + 4 * 4
    assert FullPrecision().layout is None and not FullPrecision().quantized
    again = Pipeline.model_validate_json(preset("snapkv", compression_ratio=0.5,
                                                storage={"name": "fp8", "group_size": 16}).model_dump_json())
    assert again.storage == Fp8(group_size=16)
    with pytest.raises(ValueError, match=r"group_size=24 is not supported: use None \(one scale per head\)") as err:
        Fp8(group_size=24)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="residual=-1 must be between 0"):
        Fp8(residual=-1)
    with pytest.raises(ValueError, match="bits=4: e4m3 records hold 8-bit elements"):
        qz.RecordLayout("e4m3", 4, 0)
    with pytest.raises(ValueError, match="encoding='nf4': records are encoded as int or e4m3"):
        qz.RecordLayout("nf4", 4, 32)


@settings(max_examples=120, deadline=None)
@given(entries(), st.booleans())
def test_e4m3_round_trip_within_its_bound(case, per_head):
    """Each element reads back within ``2^-4 |x| + 2^-10 scale`` (scale: the group's largest magnitude / 448,
    float32), whatever the dtype, offsets, outliers or constant rows; read back in the entries' dtype: the same
    values up to that dtype's rounding."""
    x, group = case
    n, D = x.shape
    layout = qz.RecordLayout("e4m3", 8, 0 if per_head else group, rotate_keys=False)
    records = kernels.quantize(x, layout)
    assert records.dtype == torch.uint8 and records.shape == (n, kernels.record_width(D, layout, x.dtype))
    elements, scale, zero = qz.record_scales(records, D, layout, x.dtype)
    assert zero is None and scale.dtype == torch.float32
    g = layout.group_size(D)
    torch.testing.assert_close(scale, x.float().view(n, D // g, g).abs().amax(-1) / 448, rtol=0, atol=0)
    assert not (elements.view(torch.float8_e4m3fn).float().isnan().any())
    back = kernels.dequantize(records, D, layout, x.dtype, out_dtype=torch.float32)
    assert _within_e4m3(back, x.float(), layout.group)
    same = kernels.dequantize(records, D, layout, x.dtype)
    assert same.dtype == x.dtype
    torch.testing.assert_close(same.float(), back.to(x.dtype).float(), rtol=0, atol=0)


def test_e4m3_record_bytes():
    """A record is the entries' float8 e4m3 bytes (``x / scale``) followed by their float32 scales; a zero group
    and a free slot (zero bytes) read back as 0."""
    x = torch.tensor([[448.0, -1.0, 0.5, 3.0] * 4 + [0.0] * 16])
    layout = qz.RecordLayout("e4m3", 8, 16, rotate_keys=False)
    rec = kernels.quantize(x, layout)
    assert rec.shape == (1, 32 + 2 * 4)
    assert torch.equal(rec[0, :32], x[0].to(torch.float8_e4m3fn).view(torch.uint8))  # scale 1: x itself
    assert rec[0, 32:].view(torch.float32).tolist() == [1.0, 0.0]
    assert torch.equal(kernels.dequantize(rec, 32, layout, torch.float32), x)
    free = torch.zeros(2, 40, dtype=torch.uint8)
    assert torch.equal(kernels.dequantize(free, 32, layout, torch.float16), torch.zeros(2, 32, dtype=torch.float16))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.sampled_from([0, 16]), st.integers(1, 2),
       st.sampled_from([1, 3]), st.sampled_from([1, 5]), st.lists(st.integers(0, 50), min_size=4, max_size=4),
       st.sampled_from([0, 1, 4]), st.integers(0, 999))
def test_reference_attention_equals_attention_on_read_back(dtype, group, B, G, Q, lens, residual, seed):
    """The torch reference and the op (CPU: the fused kernel for short calls) attend over e4m3 records as over
    what they read back as (each row's anchor and newest ``residual`` entries exact)."""
    D, H_kv = 32, 2
    layout = qz.RecordLayout("e4m3", 8, group, rotate_keys=False)
    k, v, offs, lens_t = _cache(lens[:B * H_kv], D, dtype, seed=seed)
    k = k + torch.linspace(-3, 5, D).to(dtype)
    k_rec, v_rec, side, centres = _records(k, v, offs, lens_t, layout, residual)
    assert not side[2].any()  # no centre: keys are stored as they are
    q = torch.randn(B, H_kv * G, Q, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    deq_k, deq_v = _read_back(k_rec, v_rec, side, centres, offs, lens_t, layout, dtype)
    ref = ragged_attention_ref(q.float(), deq_k, deq_v, offs, lens_t, D ** -0.5)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for out in (qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout),
                kernels.quantized_attention(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout)):
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_ops_compile_fullgraph_and_pass_opcheck():
    """The ops take the layout's fields as plain arguments: a decode step over e4m3 records compiles with
    ``fullgraph=True`` and no graph break; ``opcheck`` accepts the schemas."""
    D = 32
    k, v, offs, lens = _cache([5, 12, 0, 7], D, torch.float32)
    k_rec, v_rec, side, _ = _records(k, v, offs, lens, E4M3)

    def step(q, k_new, v_new, k_rec, v_rec, offs, lens, side):
        kernels.quantized_append(k_new, v_new, k_rec, v_rec, offs, lens, side, E4M3)
        return kernels.quantized_attention(q, k_rec, v_rec, offs, lens, side, 0.2, E4M3)

    counters.clear()
    q, k_new, v_new = torch.randn(2, 4, 1, D), torch.randn(2, 2, 1, D), torch.randn(2, 2, 1, D)
    eager = [k_rec.clone(), v_rec.clone(), offs, lens.clone(), side.clone()]
    expected = step(q, k_new, v_new, *eager)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_new, v_new, k_rec, v_rec, offs, lens, side)
    torch.testing.assert_close(got, expected)
    assert torch.equal(k_rec, eager[0]) and torch.equal(lens, eager[3]) and counters["graph_break"] == {}
    fields = ("e4m3", 8, 0, False, 0)
    torch.library.opcheck(torch.ops.kvpress_ada.quantized_attention,
                          (torch.randn(2, 4, 2, D), k_rec, v_rec, offs, lens, side, 0.5, *fields))
    keys = torch.randn(2, 2, 4, D)
    keep = torch.tensor([True, False, True, True]).expand(2, 2, 4).contiguous()
    torch.library.opcheck(torch.ops.kvpress_ada.quantized_compact,
                          (keys, keys.neg(), keep, offs, k_rec.clone(), v_rec.clone(), side.clone(), *fields))


triton = pytest.importorskip("triton")
needs_interpreter = pytest.mark.skipif(not torch.cuda.is_available() and not kernels.triton_interpret(),
                                       reason="Triton on CPU needs TRITON_INTERPRET=1 (set in conftest.py)")


@needs_interpreter
@settings(max_examples=8, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16]), st.sampled_from([0, 16]), st.sampled_from([16, 64]),
       st.sampled_from([1, 3]), st.lists(st.integers(0, 60), min_size=4, max_size=4), st.sampled_from([16, 32]),
       st.integers(0, 999), st.sampled_from([0, 3]))
def test_triton_matches_reference(dtype, group, D, Q, lens, split, seed, residual):
    """The Triton kernel decodes e4m3 bytes with integer ops (interpreted on CPU; float32 / float16)."""
    from kvpress_ada.kernels.quantized.triton_kernel import quantized_attention_triton

    layout = qz.RecordLayout("e4m3", 8, group if D % max(group, 1) == 0 else 0, rotate_keys=False)
    k, v, offs, lens_t = _cache(lens, D, dtype, seed=seed)
    k = k * torch.linspace(0.01, 4, D).to(dtype)  # magnitudes across e4m3's range, subnormals included
    k_rec, v_rec, side, _ = _records(k, v, offs, lens_t, layout, residual)
    q = torch.randn(2, 6, Q, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    got = quantized_attention_triton(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout, split_size=split)
    ref = qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout)
    assert torch.isfinite(got).all()
    # float16: the kernel casts each dequantized tile to float16 for tl.dot, and e4m3 keys are not centred (larger
    # than the int records' centred ones): a few ulps of the output apart
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- the transformers host


@WITH_RESIDUAL
@pytest.mark.parametrize("name", portable_preset_names())
def test_every_preset_keeps_the_full_precision_positions(storage, name):
    """One-shot presets (model scope and KVzip's model pass included), batch 2 with left padding: the kept
    positions are full precision's, each row's anchor reads back exactly, every other entry within e4m3's bound."""
    model = _model()
    ids, mask = left_padded_batch()
    caches = {}
    for st_ in ("full", storage):
        with torch.no_grad(), preset(name, compression_ratio=0.6, storage=st_)(model):
            caches[st_ == "full"] = output_cache(model(ids, attention_mask=mask, use_cache=True))
    full, fp8 = caches[True], caches[False]
    assert isinstance(fp8, QuantizedRaggedCache) and not isinstance(full, QuantizedRaggedCache)
    for i in range(len(full.layers)):
        assert isinstance(fp8.layers[i], QuantizedRaggedLayer) and fp8.layers[i].layout == storage.layout
        got, ref = fp8.layers[i].view(), full.layers[i].view()
        assert torch.equal(got.positions, ref.positions) and torch.equal(got.valid, ref.valid)
        first = (got.valid & (torch.cumsum(got.valid, -1) == 1))[..., None]
        assert torch.equal(got.keys * first, ref.keys * first) and torch.equal(got.values * first, ref.values * first)
        assert _within_e4m3(got.keys, ref.keys, storage.layout.group)
        assert _within_e4m3(got.values, ref.values, storage.layout.group)
    assert fp8.nbytes() < full.nbytes()


@WITH_RESIDUAL
def test_nbytes_are_the_records_held(storage):
    """``nbytes()`` = bytes of the tensors held: each row's slots x one record of ``D + (D / group) * 4`` bytes,
    keys and values, plus each row's side tensors (``(3 + 2 * residual) * D * 4`` bytes); ``batch_nbytes`` splits
    the same bytes by batch row."""
    model = _model()
    ids, mask = left_padded_batch()
    with torch.no_grad(), preset("ada_snapkv", compression_ratio=0.6, storage=storage)(model):
        cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
    D = model.config.hidden_size // model.config.num_attention_heads
    width = kernels.record_width(D, storage.layout, torch.float32)
    assert width == D + (D // (storage.group_size or D)) * 4
    slots = sum(int((-(-(cache.head_lengths(i) + 8) // CHUNK) * CHUNK).sum()) for i in range(len(cache.layers)))
    rows = sum(cache.head_lengths(i).numel() for i in range(len(cache.layers)))
    assert cache.nbytes() == _held_bytes(cache) == slots * width * 2 + rows * (3 + 2 * storage.residual) * D * 4
    assert sum(cache.batch_nbytes()) == cache.nbytes()


@IDS
@pytest.mark.parametrize("mode", ["one-shot", "model scope", "chunked prefill"])
def test_modes_equal_the_rounded_cache(storage, mode):
    """Whatever a mode reads after compression (attention, the next chunk) is what a full-precision cache whose
    entries were rounded through the scheme holds."""
    press, batch = {
        "one-shot": (preset("ada_snapkv", compression_ratio=0.6), left_padded_batch()),
        "model scope": (preset("kvzip", compression_ratio=0.6), left_padded_batch()),
        "chunked prefill": (preset("ada_snapkv", budget=14, prefill_chunk=12, scorer=SnapKV(window=4, kernel=3)),
                            left_padded_batch(lengths=(60, 41), seed=2)),
    }[mode]
    _assert_like_rounded(_model(), press, storage, *batch)


@IDS
def test_decode_compression_equals_the_rounded_cache(storage):
    press = Pipeline(scorer=SnapKV(window=4, kernel=3), budget=16, decode_budget=10, decode_interval=4)
    cache = _assert_like_rounded(_model(), press, storage, *left_padded_batch(lengths=(30, 24), seed=3),
                                 new_tokens=14)
    assert min(cache.state.compactions) >= 2


@pytest.mark.parametrize("mode", ["one-shot", "chunked prefill", "decode"])
def test_the_kvzap_preset_with_fp8(tmp_path, mode):
    """``preset("kvzap", compression_ratio=0.75, storage="fp8")`` (model scope; a random surrogate for the tiny
    model): one-shot, the positions of full precision; every mode, what the rounded cache reads."""
    from kvpress_ada import surrogate as sur

    model = _model()
    path = tmp_path / "surrogate.safetensors"
    sur.save(random_surrogate(model.config, seed=3), path)
    extra = {"chunked prefill": {"prefill_chunk": 24}, "decode": {"decode_budget": 12, "decode_interval": 4},
             "one-shot": {}}[mode]
    press = preset("kvzap", compression_ratio=0.75, storage="fp8", scorer=KVzap(path=str(path), window=4), **extra)
    assert press.storage == Fp8()
    ids, mask = left_padded_batch(lengths=(60, 44), seed=7)
    if mode == "one-shot":
        caches = []
        for st_ in (FullPrecision(), Fp8()):
            with torch.no_grad(), press.model_copy(update={"storage": st_})(model):
                caches.append(output_cache(model(ids, attention_mask=mask, use_cache=True)))
        for full, fp8 in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(fp8.view().positions, full.view().positions)
    _assert_like_rounded(model, press.model_copy(update={"storage": FullPrecision()}), Fp8(), ids, mask)


def test_bfloat16_model():
    """A bf16 model: fp8 records keep float32 scales (head dim 16: 16 + 4 bytes), attention answers in bf16, the
    same greedy tokens as the rounded full-precision cache."""
    model = build_model("llama").to(torch.bfloat16)
    ids, mask = left_padded_batch(lengths=(80, 66), seed=6)
    cache = _assert_like_rounded(model, preset("snapkv", compression_ratio=0.5), Fp8(), ids, mask, new_tokens=4,
                                 atol=2e-2, appended_atol=0.1)
    assert cache.layers[0].k_flat.shape[1] == 20 and cache.layers[0].view().keys.dtype == torch.bfloat16


def test_a_masking_evictor_is_refused():
    with pytest.raises(ValueError, match="Mask") as err:
        Pipeline(scorer=SnapKV(), compression_ratio=0.5, evictor="mask", storage="fp8")
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the serving layer


@pytest.mark.parametrize("mode", ["one-shot", "chunked"])
def test_served_requests_keep_and_generate_what_the_transformers_host_does(llama, mode):
    """The serving layer's pools (``storage.page_pool``, what the vLLM host builds) keep fp8 records: a request
    beside a partner keeps the positions and generates the tokens it does alone and on the transformers host."""
    from test_serving import _alone, _engine_chunks, _press_chunks, _prompt, _serve_packed, _windowed

    from kvpress_ada.serving.record_pages import QuantizedPagePool

    press = _windowed("ada_snapkv", storage=Fp8(residual=4), **({"prefill_chunk": 40} if mode == "chunked" else {}))
    x = _prompt(100, 21)
    split = _press_chunks(press) if press.prefill_chunk is not None else _engine_chunks(40)
    alone, tokens, _ = _serve_packed(llama, press, {"x": (x, 0, split)}, 10)
    assert isinstance(alone.serving.pools[0], QuantizedPagePool) and alone.serving.pools[0].layout == Fp8(
        residual=4).layout
    beside, tokens2, _ = _serve_packed(llama, press, {"x": (x, 0, split), "p": (_prompt(60, 22), 1,
                                                                                 _engine_chunks(40))}, 10)
    assert beside.kept("x") == alone.kept("x") and tokens2["x"] == tokens["x"]
    host_tokens, host_kept = _alone(llama, press, x, 10)
    assert alone.kept("x") == host_kept and tokens["x"] == host_tokens


# ----------------------------------------------------------------------------- extension points


class _CountingLayer(RaggedLayer):
    """A full-precision ragged layer that counts its appends (a kind with a layer class of its own)."""

    appends = 0

    def _append_entries(self, keys, values):
        type(self).appends += 1
        super()._append_entries(keys, values)


@pytest.fixture
def user_kinds():
    """Two kinds a user registers: records of a layout of its own (e4m3 in groups of 16 with a ring of 2), and a
    kind of a structure of its own, held in a ragged cache class it registers with the host; unregistered
    afterwards."""
    from typing import ClassVar, Literal

    from kvpress_ada.hosts.transformers.ragged_cache import RAGGED_CACHES, RaggedCache, register_ragged_cache

    @register_storage("fp8_g16_ring2")
    class Fp8Grouped(RecordStorage):
        name: Literal["fp8_g16_ring2"] = "fp8_g16_ring2"

        @property
        def layout(self):
            return qz.RecordLayout("e4m3", 8, 16, 2, rotate_keys=False)

    @register_storage("counted")
    class Counted(Storage):
        name: Literal["counted"] = "counted"
        structure: ClassVar[str] = "counted"

    class CountingCache(RaggedCache):
        def _new_layer(self, decode_reserve):
            return _CountingLayer(decode_reserve)

    register_ragged_cache("counted", CountingCache)
    yield Fp8Grouped, Counted
    STORAGES.unregister("fp8_g16_ring2")
    STORAGES.unregister("counted")
    RAGGED_CACHES.pop("counted")


def test_a_registered_kind_reaches_both_hosts(user_kinds):
    """A kind declared only by its layout is served by the transformers host (records of that layout, read
    within e4m3's bound, kept positions of full precision) and the serving layer (a pool of that layout), by
    name; a kind declaring its own layer class gets that class."""
    from kvpress_ada.serving.requests import PagedServing

    grouped, counted = user_kinds
    model = _model()
    ids, mask = left_padded_batch()
    _, _, full = _run(model, preset("snapkv", compression_ratio=0.5), ids, mask)
    _, _, cache = _run(model, preset("snapkv", compression_ratio=0.5, storage="fp8_g16_ring2"), ids, mask)
    assert isinstance(cache, QuantizedRaggedCache) and cache.stores(grouped())
    for mine, theirs in zip(cache.layers, full.layers):
        assert mine.layout == grouped().layout and mine.side.shape[0] == 3 + 2 * 2
        got, ref = mine.view(), theirs.view()
        assert torch.equal(got.positions, ref.positions)
        prompt = (got.positions < ids.shape[1])[..., None]
        assert _within_e4m3(got.keys * prompt, ref.keys * prompt, 16)
    press = preset("snapkv", compression_ratio=0.5, storage={"name": "fp8_g16_ring2"})
    pools = [page_pool(press.storage, torch.zeros(20, 2, 8, 16)) for _ in range(3)]
    serving = PagedServing(press, pools, 2)
    assert all(pool.layout == grouped().layout for pool in serving.pools)
    _CountingLayer.appends = 0
    _, _, counted_cache = _run(model, preset("snapkv", compression_ratio=0.5, storage="counted"), ids, mask,
                               new_tokens=3)
    assert all(type(layer) is _CountingLayer for layer in counted_cache.layers)
    assert _CountingLayer.appends == 2 * len(counted_cache.layers)  # the 2 decode steps after the prefill's token


def test_command_line_choices_come_from_the_registry(user_kinds, capsys):
    """``--storage`` accepts the registered kinds (fp8, and one a user registered) and refuses others in one
    line; the list read without torch names the built-in kinds."""
    from kvpress_ada.harness import choices
    from kvpress_ada.harness.cli import build_parser

    assert "fp8" in choices.STORAGES and set(choices.STORAGES) <= set(STORAGES.names())
    assert choices.storage_names()[0] == "full" and {"fp8", "fp8_g16_ring2", "counted"} <= set(choices.storage_names())
    for kind in ("fp8", "fp8_g16_ring2"):
        assert build_parser().parse_args(["eval", "--storage", kind]).storage == kind
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["eval", "--storage", "fp4"])
    assert exit_.value.code == 2 and "fp8" in capsys.readouterr().err


def test_cli_eval_with_fp8(tmp_path, capsys):
    """``kvpress-ada eval --storage fp8``: the fp8 row records the records' bytes (head dim 32: 32 + 4 bytes a
    record against 128 in float32, each row's anchor and centre beside them) over the same slots."""
    import json

    from conftest import build_tokenizer

    from kvpress_ada.harness.cli import main

    model_dir = tmp_path / "tiny32"
    build_model("llama", hidden_size=128, max_position_embeddings=4096).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    runs = {}
    for storage in ("full", "fp8"):
        out = tmp_path / storage
        assert main(["eval", "--model", str(model_dir), "--presets", "snapkv", "--storage", storage, "--ratios",
                     "0.5", "--tasks", "passkey", "--n", "1", "--context", "200", "--max-new-tokens", "2", "--out",
                     str(out), "--no-progress"]) == 0
        runs[storage] = {(r["label"], r["ratio"]): r["kv_bytes"]
                         for r in json.loads((out / "results.json").read_text())["records"]}
    capsys.readouterr()
    side = 3 * 32 * 4 * 3 * 2  # anchor key, anchor value and centre per row: 3 layers x 2 kv heads
    assert (runs["fp8"][("snapkv", 0.5)] - side) * 128 == runs["full"][("snapkv", 0.5)] * 36
