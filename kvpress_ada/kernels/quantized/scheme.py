"""Quantized entries of the ragged cache: the record layout (:class:`RecordLayout`, what a storage kind
declares), quantize / dequantize, the rows' side tensors (anchor and key centre), and the torch reference of
ragged attention over quantized rows (the CPU path).

Scheme (``docs/design.md``, "Scheme"). Each ragged row (batch ``b``, kv head ``h``) of a layer holds, beside
its records, full-precision vectors in the entries' dtype: ``side [3 + 2R, rows, D]`` = (anchor key, anchor
value, key centre, then ``R`` residual keys and ``R`` residual values: :func:`residual_of`).

* **Anchor**: the row's first entry (its lowest kept position: usually the attention sink) is kept in full
  precision, key and value. Its slot still holds a record (of the same scheme), which is never read: the
  anchor is read in its place. An empty row has no anchor until a token is appended to it (that token
  becomes its anchor); a row whose anchor is evicted takes the read-back value of its new first entry.
* **Keys** (a layout with ``rotate_keys``, the integer ones): centred by the row's centre ``c`` (the mean of the
  row's kept keys, anchor excluded; 0 when the anchor is alone) and rotated by :func:`rotation` ``R`` (a fixed
  random-sign Hadamard matrix, orthogonal): the record holds ``y = (k - c) @ R`` and reads back as
  ``dequant(y) @ R^T + c``. Decode tokens appended later are centred with the same ``c``. Without
  ``rotate_keys`` (e4m3) the centre is 0 and ``R`` the identity: the record holds the key itself.
* **Values**: the record holds ``v`` itself.
* **Residual** (``R`` = the storage's ``residual``, 0: none): each row's newest ``min(R, length)`` entries,
  key and value, in full precision in a ring (rank ``j`` at ``j % R``). Every entry also has its record;
  the newest ``R`` slots of a row read from the ring, older ones from their records (an entry leaving the
  window needs no work). So a record may be written late: :func:`append_side` alone appends to the ring and
  :func:`record_newest` writes the records of each row's newest entries from it, before they leave it.

Integers (:func:`quantize`, encoding ``"int"``): asymmetric per token, in groups of ``group`` channels of what
the record holds.
A group ``x[0..group)`` is stored as ``zero = min(x)`` rounded *down* to the scales' dtype
(:meth:`RecordLayout.scale_dtype`: the entries' dtype, or float16 for float32 entries with ``scale_bits=16``;
exact when ``x`` is in that dtype, as 16-bit values are), ``scale = (max(x) - zero) / (2^bits - 1)`` rounded
*up* (the top of the range stays covered), and integers ``q = round((x - zero) / scale)`` in
``[0, 2^bits - 1]``; it reads back as ``q * scale + zero``. Every element is within ``scale / 2`` of ``x``
(plus float32 rounding) - for keys in the rotated, centred space, where the rotation spreads an outlier channel
over every channel of its Hadamard block; a constant group (``scale = 0``) reads back exactly. float16 scales
of float32 entries round the zero point and the scale by at most 2^-11 relative, widening the step by
``2^-11 (|zero| + range) / (2^bits - 1)`` at most. (A key's ``y`` is at most its distance from the centre,
``|k - c|``, per element: for float16 entries, or float16 scales, that must stay below 65504; beyond it
float16 scales saturate, never inf.)

e4m3 (encoding ``"e4m3"``, 8 bits): symmetric per token, one float32 scale per group (``group`` 0: the whole
head dimension, one scale per token per kv head), ``scale = max|x| / 448`` (float32), elements
``float8_e4m3fn(x / scale)`` (round to nearest, clamped to +-448: never NaN), read back as ``e * scale``. Each
element is within ``2^-4 |x| + 2^-10 scale`` of ``x`` (3 mantissa bits; the second term where ``x / scale``
is subnormal); a zero group reads back as 0.

Record: each token of a key (or value) row is one ``uint8`` row of :func:`record_width` bytes, the
elements followed by that token's scales (and, for integers, zero points; as llama.cpp's ``Q4_1`` block keeps
its ``d`` and ``m`` beside its nibbles)::

    int:  [ integers: head_dim * bits / 8 bytes | scales: groups x dtype | zeros: groups x dtype ]
    e4m3: [ float8 e4m3: head_dim bytes         | scales: groups x float32 ]

int8: one byte per channel; int4: two channels per byte, channel ``j`` in the low nibble of byte
``j`` and channel ``j + head_dim / 2`` in its high nibble (unpacking is two whole-half operations); e4m3:
one byte per channel.
A token is quantized on its own (given its row's centre), so a ragged row appends in place and every
row-level operation of the full-precision cache (compaction, append, re-layout, gather) moves records as
plain bytes. Free slots are zero bytes: they read back as 0 (values) or the row's centre (keys), never NaN.

Attention never adds the centre back: ``q . k = (q @ R) . y + q . c`` and ``q . c`` is the same for every
key of a row, so softmax ignores it - unless the logits are soft-capped or meet a sink logit (Gemma 2,
GPT-OSS), which need ``q . k`` itself: then the kernels add ``q . c`` (:func:`centre_logits`) to each logit
and the reference adds the rotated centre to each key. Both paths rotate the query once and attend over the records'
``y`` (the anchor slot: ``(anchor - c) @ R``; the residual slots: ``(k - c) @ R`` of the ring's keys) and
the values (the anchor slot: the anchor value; the residual slots: the ring's values).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..ragged.reference import ragged_attention_ref

__all__ = [
    "BITS",
    "ENCODINGS",
    "E4M3_MAX",
    "RecordLayout",
    "record_width",
    "check_record",
    "check_side",
    "residual_of",
    "tail_slots",
    "rotation",
    "quantize",
    "dequantize",
    "record_scales",
    "first_kept",
    "row_anchors",
    "row_side",
    "encode_keys",
    "encode_entries",
    "decode_keys",
    "quantize_rows",
    "quantized_append_ref",
    "append_side",
    "record_newest",
    "quantized_compact_ref",
    "quantized_attention_ref",
    "fill_residual",
    "residual_operands",
    "side_slots",
    "side_operands",
    "key_rotation",
    "attention_operands",
    "centre_logits",
]

BITS = (4, 8)
"""Integer widths a record can hold."""
ENCODINGS = {"int": BITS, "e4m3": (8,)}
"""Element encodings of a record and the bits per element each takes."""
E4M3_MAX = 448.0
"""The largest finite ``float8_e4m3fn``: an e4m3 group's largest magnitude is stored as it."""
_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HALF_MAX = torch.finfo(torch.float16).max
SIGN_SEED = 0
"""Seed of the rotation's sign vector (``torch.Generator().manual_seed(SIGN_SEED)``, CPU)."""


@dataclass(frozen=True)
class RecordLayout:
    """What a storage kind keeps per kept token and per row (module docstring): ``encoding`` of the elements
    (``"int"``: asymmetric integers, a scale and a zero point per group in the entries' dtype; ``"e4m3"``: float8
    e4m3, one float32 scale per group), ``bits`` per element, ``group`` channels per scale (0: the whole head
    dimension), each row's newest ``residual`` entries also kept in full precision (a ring), whether keys
    are centred by their row's mean and rotated before they are encoded (``rotate_keys``), and ``scale_bits``
    (integers only; 0: scales and zero points in the entries' dtype; 16: float32 entries' in float16, 16-bit
    entries' in their own dtype: :meth:`scale_dtype`). Hosts build their layers from it and pass it to every op of
    :mod:`.quantized_ops`; :meth:`width` is the bytes of a record."""

    encoding: str = "int"
    bits: int = 8
    group: int = 32
    residual: int = 0
    rotate_keys: bool = True
    scale_bits: int = 0

    def __post_init__(self) -> None:
        widths = ENCODINGS.get(self.encoding)
        if widths is None:
            raise ValueError(f"encoding={self.encoding!r}: records are encoded as {' or '.join(ENCODINGS)}")
        if self.bits not in widths:
            raise ValueError(f"bits={self.bits}: {self.encoding} records hold {' or '.join(map(str, widths))}-bit "
                             "elements")
        if self.group < 0 or self.group % 2:
            raise ValueError(f"group={self.group} must be even (0: the whole head dimension)")
        if self.residual < 0:
            raise ValueError(f"residual={self.residual} must be 0 (none) or more entries per row")
        if self.scale_bits not in ((0, 16) if self.encoding == "int" else (0,)):
            raise ValueError(f"scale_bits={self.scale_bits}: {self.encoding} records take "
                             f"{'0 (the entries dtype) or 16' if self.encoding == 'int' else '0 (float32 scales)'}")

    @property
    def label(self) -> str:
        """In words, for messages: ``int4 records (group 32, residual 32)``."""
        kind = f"int{self.bits}" if self.encoding == "int" else self.encoding
        return f"{kind} records (group {self.group or 'per head'}, residual {self.residual})"

    def group_size(self, head_dim: int) -> int:
        """Channels sharing one scale for a head dimension of ``head_dim``."""
        return self.group or head_dim

    def scale_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the scales (and zero points) of records made from entries of ``dtype``: integers' in
        ``dtype`` (float16 for float32 entries with ``scale_bits=16``), e4m3's in float32."""
        if self.encoding != "int":
            return torch.float32
        return torch.float16 if self.scale_bits == 16 and dtype == torch.float32 else dtype

    def element_bytes(self, head_dim: int) -> int:
        """Bytes of a record's elements (before its scales)."""
        return head_dim * self.bits // 8

    def width(self, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one token's record (:func:`record_width`)."""
        return record_width(head_dim, self, dtype)

    def records(self) -> "RecordLayout":
        """This layout without its residual: what a record's bytes depend on (ops rebuild it from their
        arguments; the residual is read from the rows' ``side``)."""
        return replace(self, residual=0)


def record_width(head_dim: int, layout: RecordLayout, dtype: torch.dtype) -> int:
    """Bytes of one token's record: its elements (``head_dim * bits / 8``) then its scales, ``head_dim / group``
    of them (and as many zero points for integers) in :meth:`RecordLayout.scale_dtype`."""
    check_record(head_dim, layout, dtype)
    n_scales = head_dim // layout.group_size(head_dim) * (2 if layout.encoding == "int" else 1)
    return layout.element_bytes(head_dim) + n_scales * layout.scale_dtype(dtype).itemsize


def check_record(head_dim: int, layout: RecordLayout, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` when no record of ``layout`` holds ``head_dim`` channels of ``dtype``."""
    group = layout.group_size(head_dim)
    if group <= 0 or group % 2 or head_dim % group:
        raise ValueError(f"group={layout.group} must be even and divide head_dim={head_dim}")
    if dtype not in _SCALE_DTYPES:
        raise ValueError(f"records quantize float32, float16 or bfloat16 entries, not {dtype}")


def check_side(side: Tensor, rows: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """Raise a one-line ``ValueError`` unless ``side`` is the ``[3 + 2 * residual, rows, head_dim]`` tensor of
    ``dtype`` on ``device`` a layer's rows keep (anchor key, anchor value, key centre, then the rows' residual
    keys and values: :func:`residual_of`)."""
    if side.dim() != 3 or side.shape[0] < 3 or side.shape[0] % 2 == 0 or tuple(side.shape[1:]) != (rows, head_dim) \
            or side.dtype != dtype:
        raise ValueError(f"side must be {dtype} [3 + 2 * residual, {rows}, {head_dim}] (anchor key, anchor value, "
                         f"key centre and residual entries of each row), got {side.dtype} {tuple(side.shape)}")
    if not side.is_contiguous():
        raise ValueError("side must be contiguous")
    if side.device != device:
        raise ValueError(f"side is on {side.device} but the cache is on {device}")


def residual_of(side: Tensor) -> int:
    """The residual ``R`` a layer's ``side [3 + 2R, rows, D]`` holds: ``side[3 : 3 + R]`` are the keys and
    ``side[3 + R :]`` the values of each row's newest ``R`` entries in full precision, entry of rank ``j`` in
    its row (``0 <= j < length``) at ``3 + j % R`` (a ring: an append overwrites the entry ``R`` older)."""
    return (side.shape[0] - 3) // 2


def tail_slots(row_lengths: Tensor, residual: int) -> tuple[Tensor, Tensor]:
    """``(rank [rows, R], valid [rows, R])``: the ranks in their rows of each row's newest ``min(R, length)``
    entries (the ones read from the residual), newest first."""
    rank = row_lengths.to(torch.int64)[:, None] - 1 - torch.arange(residual, device=row_lengths.device)
    return rank, rank >= 0


@functools.lru_cache(maxsize=None)
def _rotation(head_dim: int, device: torch.device) -> Tensor:
    block = head_dim & -head_dim  # the largest power of two dividing head_dim
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    hadamard = torch.block_diag(*[h / block ** 0.5] * (head_dim // block))
    gen = torch.Generator().manual_seed(SIGN_SEED)
    signs = torch.where(torch.rand(head_dim, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
    return (signs[:, None] * hadamard).to(torch.float32).to(device)


def rotation(head_dim: int, device: torch.device | str = "cpu") -> Tensor:
    """``R`` float32 ``[head_dim, head_dim]``, orthogonal: ``diag(s) @ H`` with ``s`` a fixed random sign
    vector (:data:`SIGN_SEED`) and ``H`` the normalised Sylvester-Hadamard matrix of the largest power of two
    ``P`` dividing ``head_dim``, repeated block-diagonally (``head_dim / P`` blocks). Keys are stored as
    ``(k - c) @ R``."""
    return _rotation(int(head_dim), torch.device(device))


def _round_up(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` (float32, >= 0) in ``dtype``, rounded up: the stored value is never below ``x``."""
    stored = x.to(dtype)
    if dtype == torch.float32:
        return stored
    low = stored.float() < x
    bumped = (stored.view(torch.int16) + 1).view(dtype)  # the next representable value above (x >= 0)
    return torch.where(low, bumped, stored)


def _round_down(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` (float32) in ``dtype``, rounded down: the stored value is never above ``x`` (exact when ``x`` is
    representable in ``dtype``)."""
    stored = x.to(dtype)
    if dtype == torch.float32:
        return stored
    high = stored.float() > x
    bits = stored.view(torch.int16)  # sign and magnitude: one step down is -1 above zero, +1 below
    below = torch.where(stored > 0, bits - 1, torch.where(stored == 0, torch.full_like(bits, -32767), bits + 1))
    return torch.where(high, below.view(dtype), stored)


def quantize(x: Tensor, layout: RecordLayout, dtype: torch.dtype | None = None) -> Tensor:
    """Records ``uint8 [..., record_width]`` of ``x [..., D]`` (float32/float16/bfloat16) as ``layout`` encodes
    them, integer scales and zero points in ``dtype`` (default ``x.dtype``). See the module docstring for the
    encodings and their bounds."""
    *lead, D = x.shape
    dtype = x.dtype if dtype is None else dtype
    check_record(D, layout, x.dtype)
    check_record(D, layout, dtype)
    group = layout.group_size(D)
    xf = x.float().reshape(*lead, D // group, group)
    if layout.encoding == "e4m3":
        scale = xf.abs().amax(-1) / E4M3_MAX
        # float32 division may land a hair above 448: clamped (torch's conversion gives NaN from 480 up)
        e = (xf / scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).clamp_(-E4M3_MAX, E4M3_MAX)
        elements = e.to(torch.float8_e4m3fn).view(torch.uint8).reshape(*lead, D)
        return torch.cat([elements, scale.contiguous().view(torch.uint8)], dim=-1)
    levels = (1 << layout.bits) - 1
    low, top = torch.aminmax(xf, dim=-1)
    sdtype = layout.scale_dtype(dtype)
    if sdtype != dtype and sdtype == torch.float16:  # float32 entries, float16 scales: saturate, never inf
        low, top = low.clamp(-_HALF_MAX, _HALF_MAX), top.clamp(-_HALF_MAX, _HALF_MAX)
    zero = _round_down(low, sdtype)  # exact when x is in sdtype: then it is one of the entries
    zf = zero.float()
    scale = _round_up((top - zf) / levels, sdtype)
    sf = scale.float()
    # a constant group (scale 0) has x - zero = 0: any positive divisor gives 0
    q = (xf - zf[..., None]).div_(sf.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round_().clamp_(0, levels)
    q = q.to(torch.uint8).reshape(*lead, D)
    if layout.bits == 4:
        q = q[..., : D // 2] | (q[..., D // 2:] << 4)
    scales = scale.contiguous().view(torch.uint8)
    zeros = zero.contiguous().view(torch.uint8)
    return torch.cat([q, scales, zeros], dim=-1)


def record_scales(records: Tensor, head_dim: int, layout: RecordLayout,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(elements uint8 [..., D * bits / 8], scales [..., groups], zeros [..., groups] or None)`` of ``records``
    made from entries of ``dtype`` (scales and zeros in :meth:`RecordLayout.scale_dtype`; e4m3 records have no
    zero points; views when ``records`` is contiguous)."""
    n_el = layout.element_bytes(head_dim)
    sdtype = layout.scale_dtype(dtype)
    n_scale = head_dim // layout.group_size(head_dim) * sdtype.itemsize
    has_zero = layout.encoding == "int"
    width = n_el + (2 if has_zero else 1) * n_scale
    if records.shape[-1] != width:
        raise ValueError(f"records of width {records.shape[-1]} do not hold head_dim={head_dim} as {layout.label} "
                         f"({dtype}): expected width {width}")
    if records.dtype != torch.uint8:
        raise TypeError(f"records are uint8, got {records.dtype}")

    def floats(lo: int, hi: int) -> Tensor:
        part = records[..., lo:hi]
        return part.view(sdtype) if part.stride(-1) == 1 and records.is_contiguous() else \
            part.contiguous().view(sdtype)

    zeros = floats(n_el + n_scale, n_el + 2 * n_scale) if has_zero else None
    return records[..., :n_el], floats(n_el, n_el + n_scale), zeros


def dequantize(records: Tensor, head_dim: int, layout: RecordLayout, dtype: torch.dtype,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """``[..., head_dim]`` what ``records`` hold (made by :func:`quantize` from entries of ``dtype``), computed
    in float32 and returned in ``out_dtype`` (default ``dtype``). For a key record of a layout that rotates keys
    this is its rotated, centred ``y``: :func:`decode_keys` gives the key."""
    ints, scale, zero = record_scales(records, head_dim, layout, dtype)
    group = layout.group_size(head_dim)
    *lead, _ = records.shape
    out = torch.empty(*lead, head_dim, dtype=torch.float32, device=records.device)
    if layout.encoding == "e4m3":
        out.copy_(ints.view(torch.float8_e4m3fn))
    elif layout.bits == 8:
        out.copy_(ints)
    else:  # the low nibbles are channels [0, D/2), the high ones [D/2, D): convert each half in place
        half = head_dim // 2
        low, high = _nibbles(ints)
        out[..., :half].copy_(low)
        out[..., half:].copy_(high)
    # scale and shift in place, scales and zeros contiguous (broadcasting a strided view is slow on CPU)
    grouped = out.view(*lead, head_dim // group, group)
    grouped.mul_(scale.float().contiguous()[..., None])
    if zero is not None:
        grouped.add_(zero.float().contiguous()[..., None])
    target = dtype if out_dtype is None else out_dtype
    return out if target == torch.float32 else out.to(target)


def _nibbles(ints: Tensor) -> tuple[Tensor, Tensor]:
    """``(low, high)`` uint8 nibbles of int4 ``ints [..., n]``, computed on a contiguous copy (elementwise ops
    on the records' strided slice are several times slower on CPU) and, when ``n`` is a multiple of 4, on
    32-bit words, four bytes at a time (each byte's nibbles stay in that byte)."""
    ints = ints.contiguous()
    if ints.shape[-1] % 4 == 0:
        words = ints.view(torch.int32)
        return (words & 0x0F0F0F0F).view(torch.uint8), (words >> 4).bitwise_and_(0x0F0F0F0F).view(torch.uint8)
    return ints & 15, ints >> 4


# ----------------------------------------------------------------------------- keys and the rows' side tensors


def first_kept(keep: Tensor) -> Tensor:
    """``[B, H, L]`` bool: each row's first kept entry of ``keep`` (none in a row keeping nothing)."""
    return keep & (torch.cumsum(keep, dim=-1) == 1)


def row_anchors(keys: Tensor, values: Tensor, keep: Tensor) -> Tensor:
    """``[2, B * H, D]`` each row's anchor key and value: its first kept entry of ``keys, values [B, H, L, D]``
    (``keep`` bool ``[B, H, L]``), zeros for a row keeping nothing."""
    B, H, L, D = keys.shape
    at = first_kept(keep).to(torch.uint8).argmax(-1)[..., None, None].expand(B, H, 1, D)
    anchor = torch.stack((keys.gather(2, at), values.gather(2, at))).squeeze(3)  # [2, B, H, D]
    anchor = torch.where(keep.any(-1)[..., None], anchor, torch.zeros((), dtype=keys.dtype, device=keys.device))
    return anchor.reshape(2, B * H, D)


def row_side(keys: Tensor, values: Tensor, keep: Tensor, centred: bool = True) -> Tensor:
    """``side [3, B * H, D]`` in ``keys.dtype`` of the kept entries (``keep`` bool ``[B, H, L]``) of
    ``keys, values [B, H, L, D]``: each row's anchor key and value (:func:`row_anchors`) and key centre (the
    mean of its other kept keys, float32 then rounded; 0 if none, or when not ``centred``)."""
    B, H, L, D = keys.shape
    if not centred:
        centre = torch.zeros(1, B * H, D, dtype=keys.dtype, device=keys.device)
        return torch.cat((row_anchors(keys, values, keep), centre))
    rest = (keep & ~first_kept(keep)).to(torch.float32)
    centre = (rest[..., None, :] @ keys.float()).squeeze(-2) / rest.sum(-1).clamp(min=1)[..., None]
    return torch.cat((row_anchors(keys, values, keep), centre.to(keys.dtype).reshape(1, B * H, D)))


def key_rotation(layout: RecordLayout, head_dim: int, device: torch.device | str = "cpu") -> Tensor | None:
    """:func:`rotation` when ``layout`` rotates keys, else ``None`` (keys are stored as they are)."""
    return rotation(head_dim, device) if layout.rotate_keys else None


def _rotated(keys: Tensor, centre: Tensor, layout: RecordLayout) -> Tensor:
    """``(keys - centre) @ R`` in float32 (``keys - centre`` without a rotation): what a key's record holds
    (module docstring, "Keys")."""
    y = keys.float() - centre.float()
    R = key_rotation(layout, keys.shape[-1], keys.device)
    return y if R is None else y @ R


def encode_keys(keys: Tensor, centre: Tensor, layout: RecordLayout) -> Tensor:
    """Records of ``keys [..., D]`` centred by ``centre`` (broadcast against them, in their dtype) and
    rotated: ``quantize((keys - centre) @ R)`` with scales in ``keys.dtype``."""
    return quantize(_rotated(keys, centre, layout), layout, dtype=keys.dtype)


def encode_entries(keys: Tensor, values: Tensor, centre: Tensor, layout: RecordLayout) -> Tensor:
    """``[2, ..., record_width]``: the records of ``keys`` (:func:`encode_keys`) and of ``values`` (of the same
    shape and dtype), quantized in one pass."""
    return quantize(torch.stack((_rotated(keys, centre, layout), values.float())), layout, dtype=keys.dtype)


def decode_keys(records: Tensor, centre: Tensor, head_dim: int, layout: RecordLayout, dtype: torch.dtype,
                out_dtype: torch.dtype | None = None) -> Tensor:
    """Keys ``[..., head_dim]`` of key ``records``: ``dequantize(records) @ R^T + centre`` (float32), in
    ``out_dtype`` (default ``dtype``)."""
    y = dequantize(records, head_dim, layout, dtype, torch.float32)
    R = key_rotation(layout, head_dim, records.device)
    out = (y if R is None else y @ R.T).add_(centre.float())
    target = dtype if out_dtype is None else out_dtype
    return out if target == torch.float32 else out.to(target)


def quantize_rows(k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                  layout: RecordLayout) -> tuple[Tensor, Tensor, Tensor]:
    """``(k_rec, v_rec, side)`` of a full-precision ragged layer ``k_flat, v_flat [N, D]`` (rows at
    ``row_offsets``, ``row_lengths`` long): each row's side tensors from all its entries (its first entry the
    anchor), every slot quantized (gaps and free slots with a zero centre). A helper for tests and
    benchmarks (one host sync per row), not a path of the cache, which quantizes what it keeps."""
    N, D = k_flat.shape
    side = torch.zeros(3, row_offsets.shape[0], D, dtype=k_flat.dtype, device=k_flat.device)
    centres = torch.zeros_like(k_flat)
    for r, (o, n) in enumerate(zip(row_offsets.tolist(), row_lengths.tolist())):
        if n:
            every = torch.ones(1, 1, n, dtype=torch.bool, device=k_flat.device)
            side[:, r] = row_side(k_flat[None, None, o:o + n], v_flat[None, None, o:o + n], every,
                                  layout.rotate_keys)[:, 0]
            centres[o:o + n] = side[2, r]
    return encode_keys(k_flat, centres, layout), quantize(v_flat, layout), side


# ----------------------------------------------------------------------------- ops (torch reference)


def quantized_append_ref(k_new: Tensor, v_new: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor,
                         row_lengths: Tensor, side: Tensor, layout: RecordLayout) -> None:
    """Quantize ``k_new, v_new [B, H_kv, Q, D]`` (keys centred by their row's centre ``side[2]``) and append
    their records at ``row_offsets + row_lengths`` (in place); a row empty so far takes its first new token as
    its anchor (``side[0], side[1]``); then ``row_lengths += Q``. Device-side index ops only (no host sync)."""
    B, H, Q, D = k_new.shape
    rows = B * H
    dst = (row_offsets + row_lengths).to(torch.int64)
    if Q > 1:
        dst = (dst.unsqueeze(1) + torch.arange(Q, device=dst.device)).reshape(-1)
    records = encode_entries(k_new, v_new, side[2].view(B, H, 1, D), layout).view(2, rows * Q, -1)
    k_rec.index_copy_(0, dst, records[0])
    v_rec.index_copy_(0, dst, records[1])
    append_side(k_new, v_new, row_lengths, side)


def append_side(k_new: Tensor, v_new: Tensor, row_lengths: Tensor, side: Tensor, empty_rows: bool = True) -> None:
    """The full-precision half of an append of ``k_new, v_new [B, H_kv, Q, D]``: a row empty so far takes its
    first new token as its anchor (skipped when ``empty_rows`` is False: the caller knows no row is empty),
    the newest ``min(Q, R)`` new tokens go into the residual ring, then ``row_lengths += Q``. Alone (no
    records written) it is a deferred append: the new tokens read from the ring until
    :func:`record_newest` writes their records, which must happen before they leave it (``Q <= R``)."""
    B, H, Q, D = k_new.shape
    rows = B * H
    if empty_rows:
        empty = (row_lengths == 0).view(1, rows, 1)
        side[:2].copy_(torch.where(empty, torch.stack((k_new[:, :, 0], v_new[:, :, 0])).view(2, rows, D), side[:2]))
    residual = residual_of(side)
    if residual:  # the newest min(Q, R) new tokens into the residual ring (distinct ring slots of each row)
        t = min(Q, residual)
        rank = row_lengths.to(torch.int64) + (Q - t) if t == 1 else \
            row_lengths.to(torch.int64)[None, :] + torch.arange(Q - t, Q, device=row_lengths.device)[:, None]
        at = (torch.remainder(rank, residual) + 3).view(t, rows)  # [t, rows]: the ring slots, in side's rows
        new = torch.stack((k_new[:, :, Q - t:], v_new[:, :, Q - t:])).view(2, rows, t, D).transpose(1, 2)
        side.scatter_(0, torch.cat((at, at + residual)).unsqueeze(-1).expand(2 * t, rows, D),
                      new.reshape(2 * t, rows, D).to(side.dtype))
    row_lengths.add_(Q)


def record_newest(k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor, row_lengths: Tensor, side: Tensor, n: int,
                  layout: RecordLayout) -> None:
    """Write the records of each row's newest ``n`` entries (``0 < n <= R``; every row at least ``n`` long)
    from its residual ring: what :func:`quantized_append_ref` writes for them when they are appended (the ring
    holds them as appended, in the entries' dtype, and the row's centre does not change while they are
    kept), so deferred appends (:func:`append_side`) end with the records an immediate append leaves."""
    residual = residual_of(side)
    if not 0 < n <= residual:
        raise ValueError(f"n={n}: the ring holds each row's newest {residual} entries")
    rows, D = side.shape[1], side.shape[2]
    rank = row_lengths.to(torch.int64)[:, None] - n + torch.arange(n, device=row_lengths.device)  # [rows, n]
    ring = torch.remainder(rank, residual) + 3
    index = torch.arange(rows, device=side.device)[:, None]
    records = encode_entries(side[ring, index], side[ring + residual, index], side[2].view(rows, 1, D),
                             layout).view(2, rows * n, -1)
    dst = (row_offsets.to(torch.int64)[:, None] + rank).view(-1)
    k_rec.index_copy_(0, dst, records[0])
    v_rec.index_copy_(0, dst, records[1])


def quantized_compact_ref(keys: Tensor, values: Tensor, keep: Tensor, row_offsets: Tensor, k_rec: Tensor,
                          v_rec: Tensor, side: Tensor, layout: RecordLayout) -> None:
    """Fix each row's side tensors from its kept entries (``side.copy_(row_side(keys, values, keep))``), then
    quantize the kept entries of ``keys, values [B, H_kv, L, D]`` (``keep`` bool ``[B, H_kv, L]``) into row
    ``b * H_kv + h`` of the records, in ascending position order from ``row_offsets``; only kept entries are
    quantized (the anchor's too: its record is never read). The caller sets ``row_lengths`` to the counts."""
    B, H, _, D = keys.shape
    side[:3].copy_(row_side(keys, values, keep, layout.rotate_keys))
    side[3:].zero_()
    b, h, pos = keep.nonzero(as_tuple=True)
    if b.numel() == 0:
        return
    rank = torch.cumsum(keep, dim=-1, dtype=torch.int64)[b, h, pos] - 1
    dst = row_offsets.to(torch.int64)[b * H + h] + rank
    k_rec.index_copy_(0, dst, encode_keys(keys[b, h, pos], side[2][b * H + h], layout))
    v_rec.index_copy_(0, dst, quantize(values[b, h, pos], layout))
    fill_residual(side, keys, values, keep)


def fill_residual(side: Tensor, keys: Tensor, values: Tensor, keep: Tensor) -> None:
    """Write each row's newest ``min(R, kept)`` kept entries of ``keys, values [B, H, L, D]`` (``keep`` bool
    ``[B, H, L]``, ranks in ascending position order) into the residual ring of ``side`` (:func:`residual_of`)."""
    residual = residual_of(side)
    if not residual:
        return
    B, H = keep.shape[:2]
    rank = torch.cumsum(keep, dim=-1, dtype=torch.int64) - 1
    newest = keep & (rank >= keep.sum(-1, keepdim=True) - residual)
    b, h, pos = newest.nonzero(as_tuple=True)
    ring, rows = rank[b, h, pos] % residual, b * H + h
    side.index_put_((3 + ring, rows), keys[b, h, pos].to(side.dtype))
    side.index_put_((3 + residual + ring, rows), values[b, h, pos].to(side.dtype))


def _rotate(x: Tensor, R: Tensor | None) -> Tensor:
    return x if R is None else x @ R


def attention_operands(q: Tensor, side: Tensor, layout: RecordLayout) -> tuple[Tensor, Tensor]:
    """``(q @ R, (anchor key - centre) @ R)`` in float32: the rotated query and each row's anchor in the space
    its records hold (what both attention paths attend with; see the module docstring)."""
    R = key_rotation(layout, q.shape[-1], q.device)
    return _rotate(q.float(), R), _rotate(side[0].float() - side[2].float(), R)


def residual_operands(side: Tensor, layout: RecordLayout) -> tuple[Tensor, Tensor]:
    """``(keys, values)`` float32 ``[R, rows, D]`` of the rows' residual rings: the keys in the records' space
    (``(k - c) @ R``), the values as they are."""
    residual = residual_of(side)
    R = key_rotation(layout, side.shape[-1], side.device)
    return _rotate(side[3:3 + residual].float() - side[2].float(), R), side[3 + residual:].float()


@functools.lru_cache(maxsize=None)
def _side_rows(residual: int, device: torch.device) -> Tensor:
    """The indices into ``side`` of what a row reads in full precision: its anchor key, its ``residual`` ring
    keys, then the same values."""
    ring = torch.arange(3, 3 + residual)
    return torch.cat((torch.tensor([0]), ring, torch.tensor([1]), ring + residual)).to(device)


@functools.lru_cache(maxsize=None)
def _ring_slots(residual: int, device: torch.device) -> Tensor:
    """``int64 [R, 1]``: ``0, 1, ..., residual - 1``, the ring slots of :func:`side_slots`."""
    return torch.arange(residual, device=device)[:, None]


def side_slots(row_offsets: Tensor, row_lengths: Tensor, residual: int, free: int) -> Tensor:
    """``int64 [1 + R, rows]``: the layer slot each row's anchor (index 0) and each of its ring slots ``j``
    (index ``1 + j``) stands for, or ``free`` where it stands for none. Ring slot ``j`` holds the row's newest
    entry of rank ``k = j (mod R)``, ``k < length``; rank 0 reads as the anchor instead."""
    n = row_lengths.to(torch.int64)
    offs = row_offsets.to(torch.int64)
    anchor = torch.where(n > 0, offs, free)[None]
    if not residual:
        return anchor
    last = n - 1
    rank = last - torch.remainder(last - _ring_slots(residual, n.device), residual)
    return torch.cat((anchor, torch.where(rank >= 1, offs + rank, free)))


def side_operands(side: Tensor, layout: RecordLayout) -> Tensor:
    """float32 ``[2 (1 + R), rows, D]``: the keys then the values each row reads in full precision, each in
    the order of :func:`side_slots` (its anchor, then its ring slots), keys in the records' space
    (``(k - c) @ R``)."""
    residual = residual_of(side)
    out = side.index_select(0, _side_rows(residual, side.device)).float()
    keys = out[:1 + residual]
    R = key_rotation(layout, side.shape[-1], side.device)
    if R is None:
        keys.sub_(side[2].float())
    else:
        torch.matmul(keys - side[2].float(), R, out=keys)
    return out


def centre_logits(q: Tensor, side: Tensor) -> Tensor:
    """float32 ``[B, H_q, Q]``: ``q . c`` of each query with its row's key centre ``c = side[2]`` (unscaled), what a
    logit over the records' ``y = (k - c) @ R`` lacks of ``q . k``; contiguous, so that ``[rows, G * Q]`` views
    it row by row."""
    B, H_q, Q, D = q.shape
    rows = side.shape[1]
    centre = side[2].float().view(B, rows // B, D, 1)
    return torch.matmul(q.float().reshape(B, rows // B, (H_q * B // rows) * Q, D), centre).view(B, H_q, Q)


def _add_centres(keys: Tensor, side: Tensor, row_offsets: Tensor, row_lengths: Tensor, layout: RecordLayout) -> None:
    """Add each row's key centre in the records' space (``c @ R``) to the keys ``[N, D]`` of its slots, in place:
    keys read in the records' space then give the logits ``q . k`` themselves."""
    n = row_lengths.to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(n.shape[0], device=n.device), n)
    rank = torch.arange(rows.shape[0], device=n.device) - (torch.cumsum(n, 0) - n).index_select(0, rows)
    centre = _rotate(side[2].float(), key_rotation(layout, side.shape[-1], side.device))
    keys.index_add_(0, row_offsets.to(torch.int64).index_select(0, rows) + rank, centre.index_select(0, rows))


def quantized_attention_ref(q: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                            side: Tensor, scale: float, layout: RecordLayout, *, softcap: float | None = None,
                            sinks: Tensor | None = None) -> Tensor:
    """Ragged attention (contract of :func:`~.reference.ragged_attention_ref`) over quantized records made
    from entries of ``q.dtype``, with the rows' ``side`` tensors. The CPU path: the layer's records are
    dequantized to float32 in one vectorised pass (transient, one layer at a time), the slots read in full
    precision (each non-empty row's anchor and newest ``R`` entries: :func:`side_slots`) overwritten by
    them in one scatter, and the rotated query attends with the full-precision reference, whose row-layout
    paths (batched, per row, loop-free split-K) apply unchanged. ``softcap`` and ``sinks [H_q]`` (off by default):
    as :func:`~..ragged.reference.ragged_attention_ref`, over the logits ``q . k`` (the rows' centres added back
    to the keys)."""
    D, N = q.shape[-1], k_rec.shape[0]
    pad = torch.zeros(1, k_rec.shape[1], dtype=torch.uint8, device=k_rec.device)
    # keys at [0, N), values at [N + 1, 2N + 1); slot N (and 2N + 1) takes what stands for no slot
    kv = dequantize(torch.cat((k_rec, pad, v_rec, pad)), D, layout, q.dtype, torch.float32)
    slots = side_slots(row_offsets, row_lengths, residual_of(side), N)
    kv.index_copy_(0, torch.cat((slots, slots + (N + 1))).view(-1), side_operands(side, layout).view(-1, D))
    if softcap or sinks is not None:  # both need q . k itself, not q . (k - c)
        _add_centres(kv[:N], side, row_offsets, row_lengths, layout)
    q_rot = _rotate(q.float(), key_rotation(layout, D, q.device))
    out = ragged_attention_ref(q_rot, kv[:N], kv[N + 1:2 * N + 1], row_offsets, row_lengths, scale, softcap=softcap,
                               sinks=sinks)
    return out if q.dtype == torch.float32 else out.to(q.dtype)
