"""Quantized records of the ragged cache: quantize -> dequantize within the scheme's bound (keys: in the
rotated, centred space), the rotation, the rows' side tensors (anchor, key centre), the record layout,
append / compact, attention over records against attention over their read-back entries (torch reference,
Triton interpreted on CPU), one-line refusals."""

import pytest
import torch
from attention_oracle import dense_attention
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import kernels
from kvpress_ada.kernels.quantized import scheme as qz
from kvpress_ada.kernels.ragged.reference import CHUNK, ragged_attention_ref


def int_layout(bits, group, residual=0):
    """The layout of ``bits``-bit integer records in groups of ``group`` (what Int8 / Int4 declare)."""
    return qz.RecordLayout("int", bits, group, residual)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# rounding of one value read back in its dtype (relative); float32 arithmetic for float32 entries
READ_BACK = {torch.float32: 2e-6, torch.float16: 2**-11, torch.bfloat16: 2**-8}
SMALLEST = {torch.float32: 1e-45, torch.float16: 2**-24, torch.bfloat16: 2**-133}  # smallest subnormal


@st.composite
def entries(draw):
    """``[n, D]`` entries of one dtype: gaussian rows, constant rows, rows with a few large outliers."""
    dtype = draw(st.sampled_from(DTYPES))
    D = draw(st.sampled_from([16, 32, 64, 96, 128]))  # 96: int4 groups of 32 straddle its two halves
    group = draw(st.sampled_from([g for g in (16, 32, 64, 128) if D % g == 0]))
    n = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=gen) * draw(st.sampled_from([1e-3, 1.0, 30.0]))
    kind = draw(st.sampled_from(["gaussian", "constant", "outliers", "offset"]))
    if kind == "constant":
        x[:] = x[:, :1]
    elif kind == "outliers":
        cols = torch.randint(0, D, (3,), generator=gen)
        x[:, cols] *= draw(st.sampled_from([50.0, 1000.0]))
    elif kind == "offset":
        x += draw(st.sampled_from([-200.0, 5.0, 900.0]))
    half_range = torch.finfo(dtype).max / 2  # finite entries (a model's keys and values are)
    return x.clamp(-half_range, half_range).to(dtype), group


@settings(max_examples=120, deadline=None)
@given(entries(), st.sampled_from([4, 8]))
def test_round_trip_within_half_a_scale(case, bits):
    x, group = case
    n, D = x.shape
    records = kernels.quantize(x, int_layout(bits, group))
    assert records.dtype == torch.uint8
    assert records.shape == (n, kernels.record_width(D, int_layout(bits, group), x.dtype))
    _, scale, zero = qz.record_scales(records, D, int_layout(bits, group), x.dtype)
    back = kernels.dequantize(records, D, int_layout(bits, group), x.dtype, out_dtype=torch.float32)
    err = (back - x.float()).abs().view(n, D // group, group)
    bound = scale.float()[..., None] / 2 + 1e-6 * x.float().abs().view(n, D // group, group).amax(-1, keepdim=True)
    assert (err <= bound * (1 + 1e-5)).all(), float((err - bound).max())
    # the group's range is covered and no wider than one step of the dtype's rounding of the scale
    lo, hi = x.float().view(n, D // group, group).aminmax(dim=-1)
    assert torch.equal(zero.float(), lo)
    levels = (1 << bits) - 1
    assert (scale.float() * levels >= (hi - lo) * (1 - 1e-6)).all()
    step = torch.clamp(2 * READ_BACK[x.dtype] * (hi - lo) / levels, min=SMALLEST[x.dtype])  # one rounding step
    assert (scale.float() - (hi - lo) / levels <= step).all()
    # read back in the entries' dtype: the same values up to that dtype's rounding
    same = kernels.dequantize(records, D, int_layout(bits, group), x.dtype)
    assert same.dtype == x.dtype
    assert ((same.float() - back).abs() <= READ_BACK[x.dtype] * back.abs() + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_constant_groups_and_zeros_read_back_exactly(dtype, bits):
    x = torch.tensor([[3.25] * 16 + [-7.0] * 16, [0.0] * 32]).to(dtype)
    layout = int_layout(bits, 16)
    back = kernels.dequantize(kernels.quantize(x, layout), 32, layout, dtype)
    assert torch.equal(back, x)
    free = torch.zeros(3, kernels.record_width(32, layout, dtype), dtype=torch.uint8)  # a free slot
    assert torch.equal(kernels.dequantize(free, 32, layout, dtype), torch.zeros(3, 32, dtype=dtype))


@settings(max_examples=60, deadline=None)
@given(entries(), st.sampled_from([4, 8]), st.sampled_from([torch.float16, torch.bfloat16]))
def test_float32_input_with_16_bit_scales_stays_within_half_a_scale(case, bits, dtype):
    """What a key record holds (``(k - c) @ R``, float32) is quantized with scales and zero points in the
    entries' 16-bit dtype: the zero point is rounded down and the scale up, so the range stays covered."""
    x, group = case
    x = x.float() * 1.37  # not representable in the 16-bit dtype
    x = x.clamp(-torch.finfo(dtype).max / 4, torch.finfo(dtype).max / 4)
    n, D = x.shape
    records = kernels.quantize(x, int_layout(bits, group), dtype=dtype)
    assert records.shape == (n, kernels.record_width(D, int_layout(bits, group), dtype))
    _, scale, zero = qz.record_scales(records, D, int_layout(bits, group), dtype)
    lo, hi = x.view(n, D // group, group).aminmax(dim=-1)
    assert (zero.float() <= lo).all()
    assert (((1 << bits) - 1) * scale.float() + zero.float() >= hi - 1e-6 * hi.abs()).all()
    back = kernels.dequantize(records, D, int_layout(bits, group), dtype, out_dtype=torch.float32)
    err = (back - x).abs().view(n, D // group, group)
    bound = scale.float()[..., None] / 2 + 1e-6 * x.abs().view(n, D // group, group).amax(-1, keepdim=True)
    assert (err <= bound * (1 + 1e-5)).all(), float((err - bound).max())


@settings(max_examples=60, deadline=None)
@given(entries(), st.sampled_from([4, 8]))
def test_float16_scales_of_float32_entries_stay_within_half_a_scale(case, bits):
    """``scale_bits=16`` (what Int8 / Int4 declare by default): float32 entries' records carry float16 scales and
    zero points (``D * bits / 8 + 2 * (D / group) * 2`` bytes), the zero point rounded down and the scale up, so
    the range stays covered and every element reads back within half a scale."""
    x, group = case
    x = x.float().clamp(-30000, 30000)
    n, D = x.shape
    layout = qz.RecordLayout("int", bits, group, scale_bits=16)
    records = kernels.quantize(x, layout)
    assert records.shape == (n, D * bits // 8 + 2 * (D // group) * 2) == (n, kernels.record_width(D, layout, x.dtype))
    _, scale, zero = qz.record_scales(records, D, layout, torch.float32)
    assert scale.dtype == zero.dtype == torch.float16
    lo, hi = x.view(n, D // group, group).aminmax(dim=-1)
    assert (zero.float() <= lo).all()
    assert (((1 << bits) - 1) * scale.float() + zero.float() >= hi - 1e-6 * hi.abs()).all()
    back = kernels.dequantize(records, D, layout, torch.float32)
    err = (back - x).abs().view(n, D // group, group)
    bound = scale.float()[..., None] / 2 + 1e-6 * x.abs().view(n, D // group, group).amax(-1, keepdim=True)
    assert (err <= bound * (1 + 1e-5)).all(), float((err - bound).max())


def test_float16_scales_saturate_and_only_integers_take_them():
    """Beyond float16's range a float32 entry's scales saturate (finite read-back, never inf or NaN); e4m3
    records keep float32 scales: ``scale_bits=16`` is refused for them in one line."""
    layout = qz.RecordLayout("int", 4, 16, scale_bits=16)
    x = torch.tensor([[1e6, -1e6] + [0.0] * 14])
    back = kernels.dequantize(kernels.quantize(x, layout), 16, layout, torch.float32)
    assert torch.isfinite(back).all() and back.abs().max() <= torch.finfo(torch.float16).max * 2
    with pytest.raises(ValueError, match="scale_bits=16: e4m3 records take 0") as err:
        qz.RecordLayout("e4m3", 8, 0, scale_bits=16)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("D", [16, 64, 80, 96, 128])
def test_rotation_is_a_fixed_orthogonal_random_sign_hadamard(D):
    R = qz.rotation(D)
    assert R.dtype == torch.float32 and R.shape == (D, D)
    torch.testing.assert_close(R @ R.T, torch.eye(D), atol=1e-6, rtol=0)
    block = D & -D  # the largest power of two dividing D: block-diagonal Hadamard (96 -> 3 blocks of 32)
    assert torch.allclose(R.abs(), torch.block_diag(*[torch.ones(block, block)] * (D // block)) * block ** -0.5)
    assert torch.equal(R, qz.rotation(D))  # deterministic
    assert (R[:, 0] < 0).any() and (R[:, 0] > 0).any()  # column 0 of a Hadamard block is all +1: the signs


def test_row_side_is_the_first_kept_entry_and_the_mean_of_the_other_keys():
    keys, values = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 16)
    keep = torch.rand(2, 3, 7, generator=torch.Generator().manual_seed(3)) < 0.6
    keep[0, 0] = False  # keeps nothing
    keep[0, 1] = torch.tensor([False, False, True] + [False] * 4)  # the anchor alone
    side = qz.row_side(keys, values, keep).view(3, 2, 3, 16)
    for b in range(2):
        for h in range(3):
            pos = keep[b, h].nonzero().flatten()
            if pos.numel() == 0:
                assert not side[:, b, h].any()
                continue
            assert torch.equal(side[0, b, h], keys[b, h, pos[0]]) and torch.equal(side[1, b, h], values[b, h, pos[0]])
            centre = keys[b, h, pos[1:]].mean(0) if pos.numel() > 1 else torch.zeros(16)
            torch.testing.assert_close(side[2, b, h], centre, atol=1e-6, rtol=0)


@settings(max_examples=60, deadline=None)
@given(entries(), st.sampled_from([4, 8]))
def test_keys_round_trip_within_half_a_scale_in_the_rotated_centred_space(case, bits):
    """A key record holds ``y = (k - c) @ R``: what it reads back is within half a scale of ``y`` per element
    (the bound of :func:`quantize`, in that space), and :func:`decode_keys` un-rotates and adds the centre."""
    x, group = case
    x = x.clamp(-1e3, 1e3)  # the rotation sums D entries: keep 16-bit sums finite
    n, D = x.shape
    centre = x.float().mean(0).to(x.dtype)
    records = qz.encode_keys(x, centre, int_layout(bits, group))
    y = (x.float() - centre.float()) @ qz.rotation(D)
    _, scale, _ = qz.record_scales(records, D, int_layout(bits, group), x.dtype)
    got = kernels.dequantize(records, D, int_layout(bits, group), x.dtype, torch.float32)
    err = (got - y).abs().view(n, D // group, group)
    bound = scale.float()[..., None] / 2 + 1e-5 * y.abs().view(n, D // group, group).amax(-1, keepdim=True)
    assert (err <= bound * (1 + 1e-5) + 1e-30).all(), float((err - bound).max())
    keys = qz.decode_keys(records, centre, D, int_layout(bits, group), x.dtype, torch.float32)
    torch.testing.assert_close(keys, got @ qz.rotation(D).T + centre.float(), atol=1e-5, rtol=1e-5)


def test_record_layout():
    """int4: channel j in the low nibble of byte j, channel j + D/2 in the high one; then the scales and
    the zero points, in the entries' dtype; width = D * bits / 8 + 2 * (D / group) * itemsize."""
    D, group = 32, 16
    x = torch.arange(D, dtype=torch.float32)[None]  # group 0: 0..15, group 1: 16..31, scale 1, 15/15
    rec = kernels.quantize(x, int_layout(4, group))
    assert rec.shape[-1] == 16 + 2 * 2 * 4 == kernels.record_width(D, int_layout(4, group), torch.float32)
    low, high = rec[0, :16] & 15, rec[0, :16] >> 4
    assert low.tolist() == list(range(16)) and high.tolist() == list(range(16))
    assert rec[0, 16:24].view(torch.float32).tolist() == [1.0, 1.0]
    assert rec[0, 24:32].view(torch.float32).tolist() == [0.0, 16.0]
    rec8 = kernels.quantize(x.half(), int_layout(8, group))
    assert rec8.shape[-1] == 32 + 2 * 2 * 2 == kernels.record_width(D, int_layout(8, group), torch.float16)


@pytest.mark.parametrize("D, group", [(96, 32), (80, 16), (64, 64)])
def test_int4_groups_across_the_nibble_halves(D, group):
    """Groups that straddle the low- and high-nibble halves of an int4 record (or span both) read back
    within half a scale."""
    x = torch.randn(20, D, generator=torch.Generator().manual_seed(D)) * torch.linspace(0.1, 10, D)
    rec = kernels.quantize(x, int_layout(4, group))
    _, scale, _ = qz.record_scales(rec, D, int_layout(4, group), torch.float32)
    back = kernels.dequantize(rec, D, int_layout(4, group), torch.float32)
    err = (back - x).abs().view(20, D // group, group).amax(-1)
    assert (err <= scale / 2 * (1 + 1e-5)).all()


def test_scale_rounds_up_in_16_bit_dtypes():
    """A scale rounded to the nearest bfloat16 could fall below (max - min) / levels and clip the top of
    the group; it is rounded up instead."""
    x = torch.tensor([[0.0] * 15 + [1.0]], dtype=torch.bfloat16)  # (1 - 0) / 15 is not a bfloat16
    _, scale, _ = qz.record_scales(kernels.quantize(x, int_layout(4, 16)), 16, int_layout(4, 16), torch.bfloat16)
    assert scale.float().item() * 15 >= 1.0


def _cache(lens, D, dtype, gap=3, seed=0):
    """Rows of ``lens`` entries in a flat buffer (rows out of order, gaps between them)."""
    g = torch.Generator().manual_seed(seed)
    offs, at = [], 0
    for n in lens:
        offs.append(at)
        at += n + gap
    order = list(range(len(lens)))[::-1]
    offsets = torch.tensor([offs[i] for i in order], dtype=torch.int32)
    k = (torch.randn(at, D, generator=g) * 2).to(dtype)
    v = torch.randn(at, D, generator=g).to(dtype)
    return k, v, offsets, torch.tensor([lens[i] for i in order], dtype=torch.int32)


def _records(k, v, offs, lens, layout, residual=0):
    """``(k_rec, v_rec, side, centres)`` of a flat cache under the scheme: each row's side tensors from its
    entries (first entry: anchor; centre: the mean of the other keys; its newest ``residual`` entries in the
    ring, entry ``j`` at ``3 + j % residual``), keys centred by their row's centre (``centres [N, D]``: each
    slot's; 0 in gaps) and rotated (as ``layout`` says: an e4m3 layout neither centres nor rotates)."""
    D = k.shape[1]
    side = torch.zeros(3 + 2 * residual, len(offs), D, dtype=k.dtype)
    centres = torch.zeros_like(k)
    for r, (o, n) in enumerate(zip(offs.tolist(), lens.tolist())):
        if n:
            ones = torch.ones(1, 1, n, dtype=torch.bool)
            side[:3, r] = qz.row_side(k[None, None, o:o + n], v[None, None, o:o + n], ones, layout.rotate_keys)[:, 0]
            centres[o:o + n] = side[2, r]
            for j in range(max(n - residual, 0), n):
                side[3 + j % residual, r], side[3 + residual + j % residual, r] = k[o + j], v[o + j]
    return qz.encode_keys(k, centres, layout), kernels.quantize(v, layout), side, centres


def _read_back(k_rec, v_rec, side, centres, offs, lens, layout, dtype):
    """Float32 keys and values the records of :func:`_records` read back as (a row's first slot: its anchor;
    its newest ``residual`` slots: the full-precision entries of its ring)."""
    D = centres.shape[1]
    keys = qz.decode_keys(k_rec, centres, D, layout, dtype, torch.float32)
    values = kernels.dequantize(v_rec, D, layout, dtype, torch.float32)
    residual = qz.residual_of(side)
    for r, (o, n) in enumerate(zip(offs.tolist(), lens.tolist())):
        for j in range(max(n - residual, 0), n):
            keys[o + j], values[o + j] = side[3 + j % residual, r].float(), side[3 + residual + j % residual, r].float()
        if n:
            keys[o], values[o] = side[0, r].float(), side[1, r].float()
    return keys, values


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.sampled_from([4, 8]),
       st.integers(1, 2), st.integers(1, 3), st.sampled_from([1, 3]), st.sampled_from([1, 4]),
       st.lists(st.integers(0, 70), min_size=6, max_size=6), st.integers(0, 999), st.sampled_from([0, 1, 5, 32]))
def test_reference_attention_equals_attention_on_dequantized(dtype, bits, B, H_kv, G, Q, lens, seed, residual):
    D, group = 32, 16
    R = B * H_kv
    k, v, offs, lens_t = _cache(lens[:R], D, dtype, seed=seed)
    k = k + torch.linspace(-3, 5, D).to(dtype)  # an offset per channel (what the centre takes out)
    k_rec, v_rec, side, centres = _records(k, v, offs, lens_t, int_layout(bits, group), residual)
    q = torch.randn(B, H_kv * G, Q, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    deq_k, deq_v = _read_back(k_rec, v_rec, side, centres, offs, lens_t, int_layout(bits, group), dtype)
    ref = ragged_attention_ref(q.float(), deq_k, deq_v, offs, lens_t, D ** -0.5)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    # the torch reference, and the op (on CPU: the fused kernel for these short calls)
    for out in (qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, int_layout(bits, group)),
                kernels.quantized_attention(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, int_layout(bits, group))):
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_reference_attention_loop_free_layout(monkeypatch):
    """Many short rows in a chunk-aligned layout (the layer's own): the loop-free split-K path over the
    dequantized records gives the per-row loop's answer."""
    from kvpress_ada.kernels.ragged import reference

    D, group, bits = 16, 16, 4
    lens = torch.tensor([3, 17, 0, 40, 9, 30, 1, 25], dtype=torch.int32)
    offs = torch.arange(8, dtype=torch.int32) * 2 * CHUNK
    k = torch.randn(8 * 2 * CHUNK, D)
    k_rec, v_rec, side, _ = _records(k, k.flip(0), offs, lens, int_layout(bits, group))
    q = torch.randn(2, 8, 1, D)
    calls = []
    chunked = reference.ragged_attention_chunked
    monkeypatch.setattr(reference, "ragged_attention_chunked", lambda *a, **k: calls.append(1) or chunked(*a, **k))
    out = qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens, side, 0.25, int_layout(bits, group))
    monkeypatch.setattr(reference, "LOOP_FREE", False)
    loop = qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens, side, 0.25, int_layout(bits, group))
    assert calls == [1]
    torch.testing.assert_close(out, loop, atol=1e-5, rtol=1e-5)


def _same_key_records(got, want, D, layout):
    """Key records equal up to float32 rounding of the rotation, whose matmul may round differently for another
    batch shape (BLAS): read back within one integer step (plus rounding) of each other."""
    step = qz.record_scales(want, D, layout, torch.float32)[1].repeat_interleave(layout.group_size(D), -1)
    a, b = (qz.dequantize(x, D, layout, torch.float32) for x in (got, want))
    assert bool(((a - b).abs() <= step * 1.001 + 1e-5).all())
    assert int(((a - b).abs() > 1e-5).sum()) <= max(2, a.numel() // 100)  # a rare boundary case, not a shift


def test_append_and_compact_write_records_in_place():
    """Compaction fixes each row's side tensors and writes its kept entries' records (keys centred by the
    row's centre, rotated); an append centres new keys the same way, and a row that was empty takes its first
    appended token as its anchor."""
    D, group, bits = 32, 16, 8
    B, H, L = 2, 2, 9
    torch.manual_seed(0)
    keys, values = torch.randn(B, H, L, D) + 2, torch.randn(B, H, L, D)
    keep = torch.rand(B, H, L, generator=torch.Generator().manual_seed(1)) < 0.5
    keep[1, 1] = False  # an empty row
    width = kernels.record_width(D, int_layout(bits, group), torch.float32)
    offs = torch.tensor([0, 16, 32, 48], dtype=torch.int32)
    k_rec, v_rec = torch.zeros(64, width, dtype=torch.uint8), torch.zeros(64, width, dtype=torch.uint8)
    side = torch.full((3, B * H, D), float("nan"))
    kernels.quantized_compact(keys, values, keep, offs, k_rec, v_rec, side, int_layout(bits, group))
    assert torch.equal(side, qz.row_side(keys, values, keep))
    with_residual = torch.full((3 + 2 * 4, B * H, D), float("nan"))
    kernels.quantized_compact(keys, values, keep, offs, k_rec.clone(), v_rec.clone(), with_residual,
                              int_layout(bits, group))
    assert torch.equal(with_residual[:3], side)
    lengths = keep.sum(-1).reshape(-1).to(torch.int32)
    for r in range(B * H):
        b, h = divmod(r, H)
        n = int(lengths[r])
        _same_key_records(k_rec[16 * r:16 * r + n],
                          qz.encode_keys(keys[b, h][keep[b, h]], side[2, r], int_layout(bits, group)), D,
                          int_layout(bits, group))
        want = kernels.quantize(values[b, h][keep[b, h]], int_layout(bits, group))
        assert torch.equal(v_rec[16 * r:16 * r + n], want)
        assert not k_rec[16 * r + n:16 * (r + 1)].any()
    new_k, new_v = torch.randn(B, H, 2, D), torch.randn(B, H, 2, D)
    before, side_before = lengths.clone(), side.clone()
    kernels.quantized_append(new_k, new_v, k_rec, v_rec, offs, lengths, side, int_layout(bits, group))
    assert torch.equal(lengths, before + 2)
    for r in range(B * H):
        b, h = divmod(r, H)
        at = 16 * r + int(before[r])
        _same_key_records(k_rec[at:at + 2], qz.encode_keys(new_k[b, h], side[2, r], int_layout(bits, group)), D,
                          int_layout(bits, group))
        assert torch.equal(v_rec[at:at + 2], kernels.quantize(new_v[b, h], int_layout(bits, group)))
        if before[r]:
            assert torch.equal(side[:, r], side_before[:, r])
        else:  # the empty row's first appended token is its anchor; its centre stays
            assert torch.equal(side[0, r], new_k[b, h, 0]) and torch.equal(side[1, r], new_v[b, h, 0])
            assert torch.equal(side[2, r], side_before[2, r])


def test_ops_compile_fullgraph():
    """The quantized ops trace as custom ops: ``fullgraph=True``, no graph break."""
    from torch._dynamo.utils import counters

    D, group, bits = 32, 16, 4
    k, v, offs, lens = _cache([5, 12, 0, 7], D, torch.float32)
    k_rec, v_rec, side, _ = _records(k, v, offs, lens, int_layout(bits, group))

    def step(q, k_new, v_new, k_rec, v_rec, offs, lens, side):
        kernels.quantized_append(k_new, v_new, k_rec, v_rec, offs, lens, side, int_layout(bits, group))
        return kernels.quantized_attention(q, k_rec, v_rec, offs, lens, side, 0.2, int_layout(bits, group))

    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    q, k_new, v_new = torch.randn(2, 4, 1, D), torch.randn(2, 2, 1, D), torch.randn(2, 2, 1, D)
    eager_args = [k_rec.clone(), v_rec.clone(), offs, lens.clone(), side.clone()]
    expected = step(q, k_new, v_new, *eager_args)
    got_lens = lens.clone()
    got = compiled(q, k_new, v_new, k_rec, v_rec, offs, got_lens, side)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got_lens, eager_args[3]) and torch.equal(k_rec, eager_args[0])
    assert torch.equal(side, eager_args[4])  # the empty row's anchor, written inside the graph
    assert counters["graph_break"] == {}


def test_raw_ops_opcheck():
    """``torch.library.opcheck`` accepts the quantized ops' schemas, fake kernels and mutation claims."""
    D, group, bits = 32, 16, 4
    k, v, offs, lens = _cache([5, 0, 7], D, torch.float32)
    k_rec, v_rec, side, _ = _records(k, v, offs, lens, int_layout(bits, group))
    q = torch.randn(3, 2, 2, D)
    torch.library.opcheck(torch.ops.kvpress_ada.quantized_attention,
                          (q, k_rec, v_rec, offs, lens, side, 0.5, "int", bits, group, True, 0))
    new = torch.randn(3, 1, 1, D)
    torch.library.opcheck(torch.ops.kvpress_ada.quantized_append,
                          (new, new.flip(-1), k_rec.clone(), v_rec.clone(), offs, lens.clone(), side.clone(), "int",
                           bits, group, True, 0))
    _, _, ring, _ = _records(k, v, offs, lens, int_layout(bits, group), residual=3)
    torch.library.opcheck(torch.ops.kvpress_ada.quantized_append_side, (new, new.flip(-1), lens.clone(), ring.clone()))
    keys = torch.randn(3, 1, 4, D)
    keep = torch.tensor([True, False, True, True]).expand(3, 1, 4).contiguous()
    torch.library.opcheck(torch.ops.kvpress_ada.quantized_compact,
                          (keys, keys.neg(), keep, offs, k_rec.clone(), v_rec.clone(), side.clone(), "int", bits,
                           group, True, 0))


def test_one_line_refusals():
    with pytest.raises(ValueError, match="group=24 must be even and divide head_dim=64"):
        kernels.quantize(torch.randn(2, 64), int_layout(4, 24))
    with pytest.raises(ValueError, match="bits=2"):
        int_layout(2, 32)
    with pytest.raises(ValueError, match="not torch.float64"):
        kernels.quantize(torch.randn(2, 64, dtype=torch.float64), int_layout(8, 32))
    rec = kernels.quantize(torch.randn(4, 32), int_layout(8, 16))
    offs, lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32)
    side = torch.zeros(3, 2, 32)
    with pytest.raises(ValueError, match=r"rows are 48 bytes; int4 records \(group 16, residual 0\) of head_dim=32 "
                                         r"\(torch.float32\) are 32"):
        kernels.quantized_attention(torch.randn(1, 2, 1, 32), rec, rec, offs, lens, side, 1.0, int_layout(4, 16))
    for bad in (torch.zeros(2, 2, 32), torch.zeros(3, 2, 32, dtype=torch.float16), torch.zeros(3, 3, 32)):
        with pytest.raises(ValueError, match=r"side must be torch.float32 \[3 \+ 2 \* residual, 2, 32\]") as err:
            kernels.quantized_attention(torch.randn(1, 2, 1, 32), rec, rec, offs, lens, bad, 1.0, int_layout(8, 16))
        assert "\n" not in str(err.value)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.lists(st.integers(0, 12), min_size=1, max_size=8), st.sampled_from([4, 8]),
       st.integers(0, 999))
def test_residual_holds_each_rows_newest_entries(residual, steps, bits, seed):
    """Compaction then appends of 0 to 12 tokens at a time: each row's ring holds exactly its newest
    ``min(residual, length)`` entries in full precision (entry ``j`` at ``j % residual``), the records are the
    same as without a residual, and attention reads the records (older entries) plus the ring (newest)."""
    g = torch.Generator().manual_seed(seed)
    D, group, B, H, L = 32, 16, 2, 2, 11
    keys, values = torch.randn(B, H, L, D, generator=g) + 1, torch.randn(B, H, L, D, generator=g)
    keep = torch.rand(B, H, L, generator=g) < 0.6
    keep[1, 0] = False  # an empty row: its first appended token becomes its anchor
    width = kernels.record_width(D, int_layout(bits, group), torch.float32)
    cap = L + sum(steps)
    offs = torch.arange(B * H, dtype=torch.int32) * cap
    recs = [torch.zeros(B * H * cap, width, dtype=torch.uint8) for _ in range(4)]
    sides = [torch.zeros(3, B * H, D), torch.zeros(3 + 2 * residual, B * H, D)]
    lens = [keep.sum(-1).reshape(-1).to(torch.int32) for _ in range(2)]
    full_k = [list(keys[b, h][keep[b, h]]) for b in range(B) for h in range(H)]
    full_v = [list(values[b, h][keep[b, h]]) for b in range(B) for h in range(H)]
    for i in range(2):
        kernels.quantized_compact(keys, values, keep, offs, recs[2 * i], recs[2 * i + 1], sides[i],
                                  int_layout(bits, group))
    for q_len in steps:
        nk, nv = torch.randn(B, H, q_len, D, generator=g), torch.randn(B, H, q_len, D, generator=g)
        for i in range(2):
            kernels.quantized_append(nk, nv, recs[2 * i], recs[2 * i + 1], offs, lens[i], sides[i],
                                     int_layout(bits, group))
        for r in range(B * H):
            full_k[r] += list(nk[r // H, r % H])
            full_v[r] += list(nv[r // H, r % H])
    assert torch.equal(lens[0], lens[1]) and torch.equal(recs[0], recs[2]) and torch.equal(recs[1], recs[3])
    assert torch.equal(sides[0], sides[1][:3])
    side = sides[1]
    for r in range(B * H):
        n = len(full_k[r])
        for j in range(max(n - residual, 0), n):
            assert torch.equal(side[3 + j % residual, r], full_k[r][j])
            assert torch.equal(side[3 + residual + j % residual, r], full_v[r][j])
    centres = side[2].repeat_interleave(cap, 0)
    deq_k, deq_v = _read_back(recs[0], recs[1], side, centres, offs, lens[1], int_layout(bits, group), torch.float32)
    q = torch.randn(B, 2 * H, 3, D, generator=g)
    out = kernels.quantized_attention(q, recs[0], recs[1], offs, lens[1], side, D ** -0.5, int_layout(bits, group))
    ref = ragged_attention_ref(q, deq_k, deq_v, offs, lens[1], D ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if residual >= max(len(row) for row in full_k):  # every entry in the ring: exactly full precision
        exact_k = torch.zeros_like(deq_k)
        exact_v = torch.zeros_like(deq_v)
        for r in range(B * H):
            if full_k[r]:
                exact_k[r * cap:r * cap + len(full_k[r])] = torch.stack(full_k[r])
                exact_v[r * cap:r * cap + len(full_v[r])] = torch.stack(full_v[r])
        ref = ragged_attention_ref(q, exact_k, exact_v, offs, lens[1], D ** -0.5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_side_with_an_even_number_of_vectors_is_refused():
    rec = kernels.quantize(torch.randn(4, 32), int_layout(8, 16))
    offs, lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"side must be .*\[3 \+ 2 \* residual, 2, 32\]"):
        kernels.quantized_attention(torch.randn(1, 2, 1, 32), rec, rec, offs, lens, torch.zeros(4, 2, 32), 1.0,
                                    int_layout(8, 16))


# ----------------------------------------------------------------------------- soft-capping and sinks
# Both need the logits q . k themselves, where the records' logits are q . (k - c): the kernels add q . c back.

EXTRAS = [pytest.param(softcap, with_sinks, id=f"softcap={softcap}-sinks={with_sinks}")
          for softcap in (None, 2.0) for with_sinks in (False, True)]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _sinks(H_q, seed, dtype=torch.float32):
    """One logit per query head, some large enough to take most of a softmax's mass."""
    return (torch.randn(H_q, generator=torch.Generator().manual_seed(seed)) * 2 + 1).to(dtype)


@pytest.mark.parametrize("softcap, with_sinks", EXTRAS)
@settings(max_examples=20, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.sampled_from([4, 8]),
       st.integers(1, 2), st.integers(1, 3), st.sampled_from([1, 3]), st.sampled_from([1, 4, 6]),
       st.lists(st.integers(0, 70), min_size=6, max_size=6), st.integers(0, 999), st.sampled_from([0, 1, 5, 32]))
def test_extras_reference_and_op_match_dense_over_read_back(softcap, with_sinks, dtype, bits, B, H_kv, G, Q, lens,
                                                           seed, residual):
    """The torch reference and the op (on CPU: the fused kernel up to 4 queries, the reference beyond) equal the
    dense formula over what the records read back as (keys with their row's centre), for rows empty, shorter
    than the queries and longer than the ring."""
    D, group = 32, 16
    layout = int_layout(bits, group)
    k, v, offs, lens_t = _cache(lens[:B * H_kv], D, dtype, seed=seed)
    k = k + torch.linspace(-3, 5, D).to(dtype)  # an offset per channel: a centre far from 0
    k_rec, v_rec, side, centres = _records(k, v, offs, lens_t, layout, residual)
    q = torch.randn(B, H_kv * G, Q, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    sinks = _sinks(H_kv * G, seed) if with_sinks else None
    deq_k, deq_v = _read_back(k_rec, v_rec, side, centres, offs, lens_t, layout, dtype)
    want = dense_attention(q, deq_k, deq_v, offs, lens_t, D ** -0.5, softcap=softcap, sinks=sinks)
    for out in (qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout, softcap=softcap,
                                           sinks=sinks),
                kernels.quantized_attention(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout, softcap=softcap,
                                            sinks=sinks)):
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
        for r, n in enumerate(lens_t.tolist()):  # an empty row, or a query that sees nothing: exact zeros
            b, h = divmod(r, H_kv)
            assert not out[b, h * G:(h + 1) * G, :max(Q - n, 0)].any()


@pytest.mark.parametrize("softcap, with_sinks", [(2.0, False), (None, True)])
def test_extras_need_the_key_centre(softcap, with_sinks):
    """Without a logit term the centre cancels in the softmax (the default path leaves it out); with one, the
    answer over the centred keys is wrong and the ops' answer is the one over the keys themselves."""
    D, layout = 32, int_layout(8, 16)
    k, v, offs, lens = _cache([12, 30, 7, 19], D, torch.float32, seed=4)
    k = k + torch.linspace(-3, 5, D)
    k_rec, v_rec, side, centres = _records(k, v, offs, lens, layout)
    q = torch.randn(2, 4, 2, D, generator=torch.Generator().manual_seed(5))
    sinks = _sinks(4, 6) if with_sinks else None
    deq_k, deq_v = _read_back(k_rec, v_rec, side, centres, offs, lens, layout, torch.float32)
    want = dense_attention(q, deq_k, deq_v, offs, lens, D ** -0.5, softcap=softcap, sinks=sinks)
    centred = dense_attention(q, deq_k - centres, deq_v, offs, lens, D ** -0.5, softcap=softcap, sinks=sinks)
    assert (centred - want).abs().max() > 1e-2  # the test can tell them apart
    plain = dense_attention(q, deq_k - centres, deq_v, offs, lens, D ** -0.5)
    torch.testing.assert_close(plain, dense_attention(q, deq_k, deq_v, offs, lens, D ** -0.5), atol=1e-6, rtol=1e-6)
    for out in (qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens, side, D ** -0.5, layout, softcap=softcap,
                                           sinks=sinks),
                kernels.quantized_attention(q, k_rec, v_rec, offs, lens, side, D ** -0.5, layout, softcap=softcap,
                                            sinks=sinks)):
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_extras_off_is_the_default_refusals_opcheck_and_compile():
    """``softcap`` None / 0 and no sinks give the default bit for bit; bad values are refused in one line; the
    op's schema carries both (opcheck) and a step calling it with both compiles with ``fullgraph=True``."""
    from torch._dynamo.utils import counters

    D, layout = 32, int_layout(4, 16)
    k, v, offs, lens = _cache([5, 12, 0, 7], D, torch.float32)
    k_rec, v_rec, side, _ = _records(k, v, offs, lens, layout)
    q = torch.randn(2, 4, 1, D)
    default = kernels.quantized_attention(q, k_rec, v_rec, offs, lens, side, 0.2, layout)
    assert torch.equal(kernels.quantized_attention(q, k_rec, v_rec, offs, lens, side, 0.2, layout, softcap=0,
                                                   sinks=None), default)
    for extras, pattern in ((dict(softcap=-0.5), r"softcap=-0.5 must be a finite positive number"),
                            (dict(sinks=torch.zeros(2)), r"sinks must be a float tensor \[H_q=4\]"),
                            (dict(sinks=torch.zeros(4, dtype=torch.int32)), r"sinks must be a float tensor")):
        with pytest.raises(ValueError, match=pattern) as err:
            kernels.quantized_attention(q, k_rec, v_rec, offs, lens, side, 0.2, layout, **extras)
        assert "\n" not in str(err.value)
    sinks = _sinks(4, 8)
    torch.library.opcheck(torch.ops.kvpress_ada.quantized_attention,
                          (q, k_rec, v_rec, offs, lens, side, 0.5, "int", 4, 16, True, 0, 0, 2.0, sinks))

    def step(q, k_rec, v_rec, offs, lens, side, sinks):
        return kernels.quantized_attention(q * 2, k_rec, v_rec, offs, lens, side, 0.2, layout, softcap=2.0,
                                           sinks=sinks)

    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k_rec, v_rec, offs, lens, side, sinks),
                               step(q, k_rec, v_rec, offs, lens, side, sinks))
    assert counters["graph_break"] == {}


# ----------------------------------------------------------------------------- triton

triton = pytest.importorskip("triton")
needs_interpreter = pytest.mark.skipif(not torch.cuda.is_available() and not kernels.triton_interpret(),
                                       reason="Triton on CPU needs TRITON_INTERPRET=1 (set in conftest.py)")


@needs_interpreter
@settings(max_examples=12, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16]), st.sampled_from([4, 8]), st.sampled_from([16, 32]),
       st.sampled_from([16, 64]), st.sampled_from([1, 3]),
       st.lists(st.integers(0, 60), min_size=4, max_size=4), st.sampled_from([16, 32]), st.integers(0, 999),
       st.sampled_from([0, 3, 32]), st.sampled_from([0, 16]))
def test_triton_matches_reference(dtype, bits, group, D, Q, lens, split, seed, residual, scale_bits):
    """Interpreted on CPU (float32 / float16 only: the interpreter's bfloat16 ``tl.dot`` is wrong); float16
    scales of float32 entries too."""
    from kvpress_ada.kernels.quantized.triton_kernel import quantized_attention_triton

    if D % group:
        group = D
    layout = qz.RecordLayout("int", bits, group, scale_bits=scale_bits)
    k, v, offs, lens_t = _cache(lens, D, dtype, seed=seed)
    k = k + torch.linspace(-3, 5, D).to(dtype)
    k_rec, v_rec, side, _ = _records(k, v, offs, lens_t, layout, residual)
    q = torch.randn(2, 6, Q, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    got = quantized_attention_triton(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout, split_size=split)
    ref = qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout)
    assert torch.isfinite(got).all()
    # float16: the kernel rounds the dequantized keys (|k| up to ~5 here) and the softmax weights to float16
    # before its dots, as flash attention does, where the reference keeps float32: up to ~10 float16 ulps of an
    # output near 0.25 (2.6e-3 seen). A wrong scale, group or row is off by far more.
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@needs_interpreter
def test_triton_backend_through_the_op():
    k, v, offs, lens = _cache([0, 9, 33], 16, torch.float32)
    k_rec, v_rec, side, _ = _records(k, v, offs, lens, int_layout(4, 16))
    q = torch.randn(3, 2, 1, 16)
    with kernels.use_backend("triton"):
        got = kernels.quantized_attention(q, k_rec, v_rec, offs, lens, side, 0.25, int_layout(4, 16))
    ref = kernels.quantized_attention(q, k_rec, v_rec, offs, lens, side, 0.25, int_layout(4, 16))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert lens[2] == 0 and torch.equal(got[2], torch.zeros_like(got[2]))  # an empty row attends to nothing: 0, not NaN


def test_deferred_append_compiles_and_matches_eager():
    """The deferred append (ring only) traces as a custom op (``fullgraph=True``) and writes what the eager
    ``append_side`` writes, the empty row's anchor included; a ring shorter than the append is refused."""
    from torch._dynamo.utils import counters

    D, group, bits = 32, 16, 4
    k, v, offs, lens = _cache([5, 12, 0, 7], D, torch.float32)
    _, _, side, _ = _records(k, v, offs, lens, int_layout(bits, group), residual=4)
    new = torch.randn(2, 2, 1, D), torch.randn(2, 2, 1, D)
    empty = int((lens == 0).nonzero())
    want_side, want_lens = side.clone(), lens.clone()
    qz.append_side(*new, want_lens, want_side)
    counters.clear()
    torch.compile(kernels.quantized_append_side, fullgraph=True, backend="aot_eager")(*new, lens, side)
    assert torch.equal(lens, want_lens) and torch.equal(side, want_side)
    b, h = divmod(empty, 2)
    assert torch.equal(side[0, empty], new[0][b, h, 0])  # the empty row's first token is its anchor
    assert counters["graph_break"] == {}
    with pytest.raises(ValueError, match="a deferred append of 5 tokens needs a residual ring of at least 5, got 4"):
        kernels.quantized_append_side(torch.randn(2, 2, 5, D), torch.randn(2, 2, 5, D), lens, side)


@needs_interpreter
@pytest.mark.parametrize("softcap, with_sinks", EXTRAS)
@settings(max_examples=6, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16]), st.sampled_from(["int4", "int8", "e4m3"]),
       st.sampled_from([1, 3]), st.lists(st.integers(0, 60), min_size=4, max_size=4), st.sampled_from([16, 32]),
       st.integers(0, 999), st.sampled_from([0, 3]))
def test_extras_triton_matches_dense_over_read_back(softcap, with_sinks, dtype, encoding, Q, lens, split, seed,
                                                    residual):
    """The Triton kernel adds each query's ``q . c`` to its logits (``SHIFT``) before the soft-cap, and the merge
    takes the sinks: equal to the dense formula over the read-back keys; an empty row gives zeros."""
    from kvpress_ada.kernels.quantized.triton_kernel import quantized_attention_triton

    D = 32
    if encoding == "e4m3":
        layout = qz.RecordLayout("e4m3", 8, 0, rotate_keys=False)
    else:
        layout = int_layout(int(encoding[3:]), 16)
    k, v, offs, lens_t = _cache(lens, D, dtype, seed=seed)
    k = k + torch.linspace(-3, 5, D).to(dtype)
    k_rec, v_rec, side, centres = _records(k, v, offs, lens_t, layout, residual)
    q = torch.randn(2, 6, Q, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    sinks = _sinks(6, seed) if with_sinks else None
    got = quantized_attention_triton(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout, split_size=split,
                                     softcap=softcap or 0.0, sinks=sinks)
    deq_k, deq_v = _read_back(k_rec, v_rec, side, centres, offs, lens_t, layout, dtype)
    want = dense_attention(q, deq_k, deq_v, offs, lens_t, D ** -0.5, softcap=softcap, sinks=sinks)
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    for r, n in enumerate(lens_t.tolist()):
        if n == 0:
            b, h = divmod(r, 2)
            assert not got[b, 3 * h:3 * h + 3].any()
