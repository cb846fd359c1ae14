"""Pages per (layer, kv head) whose kept entries are records of a storage kind's layout (int8, int4, fp8, ...): the
paged layer of a record storage (:meth:`~kvpress_ada.storage.Storage.page_pool`), for every host that pages, with
the scheme of the transformers host's quantized ragged cache
(:mod:`kvpress_ada.kernels.quantized.scheme`, ``docs/design.md`` "Scheme"), through the same functions.

A :class:`QuantizedPagePool` is a :class:`~.pages.PagePool` over ``pages uint8 [P, bytes]``: each page the bytes
of a full-precision page of ``S`` entries (``[2, S, D]`` of the entries' dtype, e.g. one (block, kv head) of an
engine's KV tensor). A sequence holds full-precision pages until its first eviction (selection reads full
precision, as the ragged cache's dense prefill); :meth:`~QuantizedPagePool.retain` then stores its kept entries
as records, and every later entry is quantized when appended. A compressed page holds ``records_per_page``
key records then as many value records (more entries than ``S``), and each (sequence, kv head) row keeps its side
tensors (anchor, key centre, residual ring: :func:`~kvpress_ada.kernels.quantized.scheme.residual_of`) in its own first
``side_slots`` record slots, so its pages hold everything it keeps: ``pages held * bytes`` is its memory.
A step builds one page table; :meth:`~QuantizedPagePool.append` reads the rows' side tensors once (their first
pages, whole) and writes back only the vectors it changed (anchors, the new tokens' ring slots); attention reads
each compressed row's pages whole and picks its records out of them into the ragged layout, then runs
:func:`~kvpress_ada.kernels.quantized_attention`; eviction moves kept records as bytes (never quantized twice).

Under a press with a ``reader`` (:meth:`~QuantizedPagePool.summarise`) a compressed row is cut, for the reader, into
pages of ``S`` consecutive entries (page ``j``: entries ``j * S ..``; not the pool's pages, which hold records of more
entries after the row's side tensors) whose Quest summaries (:class:`RowSummaries`) are kept as the transformers
host's quantized ragged layer keeps them: over what each entry reads back as (its record, the anchor, and while it
is in its row's residual ring its full-precision copy); a single-query step of a row the reader does not read whole
gathers only the selected pages' records and attends with
:func:`~kvpress_ada.kernels.ragged.sparse.sparse_quantized_attention`.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import kernels
from ..kernels.paged.ops import paged_attention
from ..kernels.quantized.scheme import (
    RecordLayout,
    decode_keys,
    dequantize,
    fill_residual,
    record_width,
    row_anchors,
    side_slots,
)
from ..kernels.ragged.sparse import round_outward, sparse_quantized_attention, summary_dtype
from .pages import PagedSequence, PagePool, PoolExhausted


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RowSummaries:
    """Quest's page summaries (Tang et al., ICML 2024) of compressed rows, as the reader pages them: page ``j`` of a
    (sequence, kv head) row holds its entries ``j * page_size .. j * page_size + page_size - 1``, and its ``kmin,
    kmax [D]`` (float16: keys read back from records in float32, rounded outward, as the transformers host's
    quantized layer keeps them) lie at the page's id in a store of their own, grown as rows grow; ``+inf`` /
    ``-inf`` while a page holds nothing. ``unrecorded``: per sequence, its rows' newest entries whose records are
    not folded in yet (see :meth:`QuantizedPagePool.append`)."""

    def __init__(self, page_size: int, head_dim: int, device: torch.device):
        self.page_size = page_size
        dtype = summary_dtype(torch.float32)
        with torch.inference_mode(False):  # normal tensors: an engine's forward (inference mode) and a release
            self.kmin = torch.empty(0, head_dim, dtype=dtype, device=device)  # outside it both update them
            self.kmax = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.rows: dict[int, list[list[int]]] = {}  # id(sequence) -> each kv head's page ids, in page order
        self.unrecorded: dict[int, int] = {}
        self._free: list[int] = []

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):  # grow the store (at least double it): its pages are ours, not the engine's
            P, D = self.kmin.shape
            extra = max(n - len(self._free), P, 64)
            with torch.inference_mode(False):
                self.kmin = torch.cat([self.kmin, self.kmin.new_full((extra, D), float("inf"))])
                self.kmax = torch.cat([self.kmax, self.kmax.new_full((extra, D), float("-inf"))])
            self._free[:0] = range(P + extra - 1, P - 1, -1)
        return [self._free.pop() for _ in range(n)]

    def fit(self, seq: PagedSequence) -> None:
        """Give each row of ``seq`` the pages its length needs (new pages hold nothing yet)."""
        rows = self.rows.setdefault(id(seq), [[] for _ in range(seq.heads)])
        for ids, n in zip(rows, seq.lengths):
            ids.extend(self._take(_cdiv(n, self.page_size) - len(ids)))

    def drop(self, seq: PagedSequence) -> None:
        """Return the pages of ``seq``'s rows (their summaries back to the identities)."""
        self.unrecorded.pop(id(seq), None)
        ids = [i for row in self.rows.pop(id(seq), []) for i in row]
        if ids:
            index = torch.tensor(ids, dtype=torch.long, device=self.kmin.device)
            self.kmin[index], self.kmax[index] = float("inf"), float("-inf")
            self._free.extend(reversed(ids))

    def table(self, seqs: list[PagedSequence]) -> torch.Tensor:
        """``int64 [N * H_kv, W]``: the page ids of each row of ``seqs`` (row ``n * H_kv + h``), ``-1`` after them."""
        rows = [ids for seq in seqs for ids in self.rows.get(id(seq), [[]] * seq.heads)]
        W = max((len(ids) for ids in rows), default=0) or 1
        table = torch.tensor([ids + [-1] * (W - len(ids)) for ids in rows], dtype=torch.long).view(len(rows), W)
        return table.to(self.kmin.device)

    def fold(self, table: torch.Tensor, row: torch.Tensor, rank: torch.Tensor, keys: torch.Tensor) -> None:
        """Reduce ``keys [n, D]``, entries of rank ``rank [n]`` in rows ``row [n]`` of ``table``, into their pages'
        summaries, rounded outward."""
        if not row.numel():
            return
        page = table[row, rank // self.page_size][:, None].expand(-1, keys.shape[-1])
        self.kmin.scatter_reduce_(0, page, round_outward(keys, self.kmin.dtype, up=False), "amin", include_self=True)
        self.kmax.scatter_reduce_(0, page, round_outward(keys, self.kmax.dtype, up=True), "amax", include_self=True)

    def nbytes(self, seqs: list[PagedSequence]) -> int:
        pages = sum(len(ids) for seq in seqs for ids in self.rows.get(id(seq), []))
        return pages * (self.kmin[0].nbytes + self.kmax[0].nbytes) if pages else 0


class QuantizedPagePool(PagePool):
    """One layer's pages (module docstring): ``pages uint8 [P, 2 * S * D * itemsize]`` (contiguous), entries of
    ``head_dim`` channels of ``dtype`` stored as records of ``layout`` (with its residual of entries per row) once
    a sequence is compressed."""

    def __init__(self, pages: torch.Tensor, page_size: int, head_dim: int, dtype: torch.dtype, layout: RecordLayout):
        if not isinstance(layout, RecordLayout):
            raise TypeError(f"layout must be a RecordLayout (a storage kind's layout), got {layout!r}")
        P = pages.shape[0]
        size = 2 * page_size * head_dim * dtype.itemsize
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != size or not pages.is_contiguous():
            raise ValueError(f"pages must be contiguous uint8 [pages, {size}] (a {dtype} page of {page_size} "
                             f"entries of {head_dim} channels), got {pages.dtype} {tuple(pages.shape)}")
        full = pages.view(dtype).view(P, 2, page_size, head_dim)
        super().__init__(full[:, 0], full[:, 1])
        self.pages, self.dtype, self.head_dim = pages, dtype, head_dim
        self.layout, self.residual = layout, layout.residual
        self.width = record_width(head_dim, layout, dtype)
        if self.width % 4:
            raise ValueError(f"records of {self.width} bytes (head_dim={head_dim}, {layout.label}, {dtype}) are not "
                             "whole 32-bit words: use a head dim and group of multiples of 8")
        self.records_per_page, self.side_slots = self.geometry(page_size, head_dim, dtype, layout)
        records = pages[:, :2 * self.records_per_page * self.width].view(P, 2, self.records_per_page, self.width)
        self.k_rec, self.v_rec = records[:, 0], records[:, 1]
        # the same records as 32-bit words (a record's width is a multiple of 4 bytes): page-wise gathers move and
        # mask a quarter of the elements
        words = pages.view(torch.int32)[:, :2 * self.records_per_page * self.width // 4]
        self._words = words.view(P, 2, self.records_per_page, self.width // 4)
        self.positions = torch.full((P, self.records_per_page), -1, dtype=torch.int32, device=pages.device)
        self.scores = torch.zeros((P, self.records_per_page), dtype=torch.float32, device=pages.device)
        self._compressed: dict[int, PagedSequence] = {}  # id -> sequence (kept alive, so ids stay unique)
        self._side_layout: torch.Tensor | None = None  # where the side's words lie in a row's first pages
        # the table append returned last, its sequences, which of them are compressed, and their side tensors
        self._last: tuple[torch.Tensor, list[PagedSequence], list[int], torch.Tensor | None] | None = None
        self.row_summaries: RowSummaries | None = None  # the reader's pages of compressed rows (summarise)
        self._selected: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None  # read_selected's, for attend

    @staticmethod
    def geometry(page_size: int, head_dim: int, dtype: torch.dtype, layout: RecordLayout) -> tuple[int, int]:
        """``(records_per_page, side_slots)``: the records of ``layout`` a page of ``page_size`` full-precision
        entries holds, and the record slots a row's side tensors take (``3 + 2 * residual`` vectors)."""
        width = record_width(head_dim, layout, dtype)
        side = (3 + 2 * layout.residual) * head_dim * dtype.itemsize
        return 2 * page_size * head_dim * dtype.itemsize // (2 * width), _cdiv(side, 2 * width)

    @staticmethod
    def reserve_pages(page_size: int, head_dim: int, dtype: torch.dtype, layout: RecordLayout) -> int:
        """Pages per row a first eviction may take beyond the full-precision pages it frees (its side tensors)."""
        per_page, side = QuantizedPagePool.geometry(page_size, head_dim, dtype, layout)
        return _cdiv(side, per_page)

    @property
    def storage_label(self) -> str:  # type: ignore[override]
        return self.layout.label

    def stores(self, storage: Any) -> bool:
        return storage.layout == self.layout

    def grow(self, extra: int) -> None:
        raise NotImplementedError("a quantized pool is a view of fixed pages: it cannot grow")

    def compressed(self, seq: PagedSequence) -> bool:
        """Whether ``seq`` holds records (it was evicted from), not full-precision pages."""
        return id(seq) in self._compressed

    # ------------------------------------------------------------------ pages
    def release(self, seq: PagedSequence) -> None:
        self._compressed.pop(id(seq), None)
        if self.row_summaries is not None:
            self.row_summaries.drop(seq)
        super().release(seq)

    def pages_needed(self, seq: PagedSequence, tokens: int) -> int:
        if not self.compressed(seq):
            return super().pages_needed(seq, tokens)
        per = self.records_per_page
        return sum(_cdiv(self.side_slots + n + tokens, per) - len(p) for n, p in zip(seq.lengths, seq.pages))

    def nbytes(self, seqs: list[PagedSequence]) -> int:
        """Bytes of the pages ``seqs`` hold (records, scales, zero points and side tensors all live in them), with
        their rows' page summaries while the pool keeps them."""
        summaries = 0 if self.row_summaries is None else self.row_summaries.nbytes(seqs)
        return sum(seq.pages_held for seq in seqs) * self.pages.shape[1] + summaries

    # ------------------------------------------------------------------ page summaries (a reader's pages)
    def summarise(self) -> None:
        """Keep the Quest summaries of compressed rows' reader pages from now on (:class:`RowSummaries`), as the
        transformers host's quantized ragged layer keeps its pages': rebuilt by every :meth:`retain` over what each
        kept entry reads back as (its record's key, the anchor for a row's first entry, and, for its newest
        ``residual`` entries, also their ring copies: an entry reads from the ring now and from its record once it
        leaves), folded in by every :meth:`append`. Full-precision sequences (not yet evicted from) are read
        densely and keep none."""
        if self.row_summaries is None:
            self.row_summaries = RowSummaries(self.page_size, self.head_dim, self.pages.device)
            self._summarise_rows(list(self._compressed.values()))

    def summaries(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.row_summaries is None:
            raise ValueError("this pool keeps no page summaries: call summarise() first")
        return self.row_summaries.kmin, self.row_summaries.kmax

    def summary_pages(self, seqs: list[PagedSequence], rows: torch.Tensor) -> torch.Tensor:
        """As :meth:`PagePool.summary_pages`: the ids of the reader's pages of compressed ``seqs``' rows in
        :meth:`summaries` (``rows``, their pool pages, are not the reader's pages here)."""
        if self.row_summaries is None:
            raise ValueError("this pool keeps no page summaries: call summarise() first")
        if not all(self.compressed(seq) for seq in seqs):
            raise ValueError("a quantized pool reads selected pages of compressed sequences only (a sequence not yet "
                             "evicted from is read densely)")
        return self.row_summaries.table(seqs)

    def _page_keys(self, k_rec: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                   side: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[n, D]`` twice, in ragged order: each entry's key read back from its record (a row's first
        entry: its anchor), then the same with each row's newest ``residual`` entries read from its ring (the
        transformers host's quantized layer's ``_page_keys``)."""
        D, n = self.head_dim, k_rec.shape[0]
        centre = side[2].repeat_interleave(lengths.long(), dim=0, output_size=n)
        recorded = torch.empty(n + 1, D, dtype=torch.float32, device=k_rec.device)  # slot n: where "no slot" goes
        recorded[:n] = decode_keys(k_rec, centre, D, self.layout, self.dtype, torch.float32)
        R = self.residual
        at = side_slots(offsets, lengths, R, n)
        recorded.index_copy_(0, at[0], side[0].float())
        ringed = recorded.clone()
        if R:
            ringed.index_copy_(0, at[1:].reshape(-1), side[3:3 + R].float().reshape(-1, D))
        return recorded[:n], ringed[:n]

    def _summarise_rows(self, seqs: list[PagedSequence]) -> None:
        """Rebuild the summaries of compressed ``seqs``' rows from what they hold now (no record left to fold)."""
        summaries = self.row_summaries
        if summaries is None or not seqs:
            return
        for seq in seqs:
            summaries.drop(seq)
            summaries.fit(seq)
            summaries.unrecorded[id(seq)] = 0
        rows, lengths = self._rows(seqs), self._lengths(seqs)
        k_rec, _, offsets = self._gathered(rows, lengths)
        recorded, ringed = self._page_keys(k_rec, offsets, lengths, self._read_side(rows))
        n = lengths.long()
        row = torch.repeat_interleave(torch.arange(n.shape[0], device=n.device), n, output_size=k_rec.shape[0])
        rank = torch.arange(k_rec.shape[0], device=n.device) - offsets.long()[row]
        table = summaries.table(seqs)
        summaries.fold(table, row, rank, recorded)
        summaries.fold(table, row, rank, ringed)

    def _summarise_appended(self, seqs: list[PagedSequence], rows: torch.Tensor, side: torch.Tensor,
                            keys: torch.Tensor, c: int) -> None:
        """Fold ``c`` tokens just appended to each of compressed ``seqs`` (``keys [B * c, H_kv, D]``, their page
        table ``rows``, ``side``) into their rows' summaries as the transformers host's quantized layer does over
        its eager decode: the keys as appended (they read from the ring now); their records when that layer writes
        them, it deferring an append of at most ``residual`` tokens until the next would push one out of the ring
        (then every pending record at once), and folding a longer append's records at once."""
        summaries = self.row_summaries
        assert summaries is not None
        B, H, D = len(seqs), seqs[0].heads, self.head_dim
        for seq in seqs:
            summaries.fit(seq)
        table = summaries.table(seqs)
        after = self._lengths(seqs).long()
        before = after - c
        device = after.device
        row = torch.arange(B * H, device=device).repeat_interleave(c)
        rank = (before[:, None] + torch.arange(c, device=device)).reshape(-1)
        summaries.fold(table, row, rank, keys.to(self.dtype).view(B, c, H, D).transpose(1, 2).reshape(-1, D))
        recorded_rows: list[torch.Tensor] = []
        recorded_ranks: list[torch.Tensor] = []
        for b, seq in enumerate(seqs):
            pending = summaries.unrecorded.get(id(seq), 0)
            first, count = [], []
            if pending + c > self.residual:  # the pending records are written before this append
                first.append(-pending)
                count.append(pending)
                pending = 0
            if c <= self.residual:
                pending += c
            else:  # quantized at once
                first.append(0)
                count.append(c)
            summaries.unrecorded[id(seq)] = pending
            for f, k in zip(first, count):
                if k:
                    span = torch.arange(f, f + k, device=device)
                    heads = torch.arange(b * H, b * H + H, device=device)
                    recorded_rows.append(heads.repeat_interleave(k))
                    recorded_ranks.append((before[heads][:, None] + span).reshape(-1))
        if not recorded_rows:
            return
        row, rank = torch.cat(recorded_rows), torch.cat(recorded_ranks)
        entry = rank + self.side_slots
        per = self.records_per_page
        records = self.k_rec[rows[row, entry // per], entry % per]
        summaries.fold(table, row, rank, decode_keys(records, side[2][row], D, self.layout, self.dtype,
                                                     torch.float32))

    # ------------------------------------------------------------------ slots
    def _slots(self, seqs: list[PagedSequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                         tuple[int, int, int]]:
        N, H = len(seqs), seqs[0].heads if seqs else 0
        lengths = torch.tensor([n for seq in seqs for n in seq.lengths], dtype=torch.long).view(N, H)
        W = int(lengths.max()) if lengths.numel() else 0
        index = torch.arange(W) - (W - lengths[..., None])
        present = index >= 0
        quantized = torch.tensor([self.compressed(seq) for seq in seqs], dtype=torch.bool).view(N, 1, 1)
        size = torch.where(quantized, self.records_per_page, self.page_size)
        entry = index.clamp(min=0) + torch.where(quantized, self.side_slots, 0)
        table = self.table(seqs)[0].cpu().long().view(N, H, -1)
        page = table.gather(2, (entry // size).clamp(max=table.shape[-1] - 1))
        page, slot = torch.where(present, page, 0), torch.where(present, entry % size, 0)
        device = self.pages.device
        return page.reshape(-1).to(device), slot.reshape(-1).to(device), present.to(device), (N, H, W)

    def _rows(self, seqs: list[PagedSequence]) -> torch.Tensor:
        """``int64 [N * H_kv, M]``: the page table of ``seqs`` (row ``n * H_kv + h``) on the pool's device."""
        return self.table(seqs)[0].long()

    def _side_words(self, rows: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
        """``int64 [rows, k, D * itemsize / 4]``: where in the pages (as flat 32-bit words) side vectors
        ``vectors [k]`` or ``[rows, k]`` (0, 1 anchor, 2 centre, ``3 ...`` the ring) of the compressed rows whose
        page table is ``rows`` lie. A row's side tensors are one byte stream, vector after vector, over its first
        ``side_slots`` key record slots then as many value record slots."""
        per, V, w = self.records_per_page, self.head_dim * self.dtype.itemsize // 4, self.width // 4
        half, n = self.side_slots * w, rows.shape[0]
        vectors = vectors.expand(n, -1)
        word = vectors[..., None] * V + torch.arange(V, device=rows.device)  # [rows, k, V] in the row's stream
        record, at = (word % half).div(w, rounding_mode="floor"), word % w
        within = (word // half) * per * w + (record % per) * w + at  # in the page: key records, then value records
        page = rows.gather(1, (record // per).view(n, -1)).view_as(word)
        return page * (self.pages.shape[1] // 4) + within

    def _read_side(self, rows: torch.Tensor) -> torch.Tensor:
        """``side [3 + 2R, rows, D]`` of the compressed rows whose page table is ``rows``: their first pages read
        whole, then the side's words picked from them (the same places in every row)."""
        if self._side_layout is None:
            first = torch.zeros(1, _cdiv(self.side_slots, self.records_per_page), dtype=torch.long,
                                device=rows.device)
            first[0] = torch.arange(first.shape[1])  # a row whose pages are 0, 1, ...: its words are where they lie
            self._side_layout = self._side_words(first, torch.arange(3 + 2 * self.residual, device=rows.device)[None])
        layout = self._side_layout
        pages = self.pages.view(torch.int32)[rows[:, :_cdiv(self.side_slots, self.records_per_page)]]
        words = pages.view(rows.shape[0], -1)[:, layout.view(-1)]
        return words.view(self.dtype).view(rows.shape[0], -1, self.head_dim).transpose(0, 1).contiguous()

    def _write_side(self, rows: torch.Tensor, side: torch.Tensor, vectors: torch.Tensor | None = None) -> None:
        """Write ``side [3 + 2R, rows, D]`` (only ``vectors [rows, k]`` of it when given) of the compressed rows
        whose page table is ``rows``."""
        by_row = side.transpose(0, 1)
        if vectors is None:
            vectors, picked = torch.arange(side.shape[0], device=rows.device)[None], by_row.contiguous()
        else:
            picked = by_row.gather(1, vectors[..., None].expand(-1, -1, side.shape[-1]))
        self.pages.view(torch.int32).view(-1)[self._side_words(rows, vectors)] = picked.view(torch.int32)

    def _entries(self, rows: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page, slot) [sum(lengths)]``: the record slots of the entries of the compressed rows whose page table
        is ``rows`` and lengths ``lengths``, row after row, each row's entries in order (after its side slots)."""
        per = self.records_per_page
        n = lengths.to(torch.int64, copy=False)
        total = int(n.sum())
        row = torch.repeat_interleave(torch.arange(n.shape[0], device=rows.device), n, output_size=total)
        index = torch.arange(total, device=rows.device) - (torch.cumsum(n, 0) - n)[row] + self.side_slots
        return rows[row, index // per], index % per

    def _gathered(self, rows: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_rec, v_rec [sum(lengths), width], row_offsets [rows] int32)``: the records of the compressed rows
        whose page table is ``rows`` (lengths ``lengths``) in the ragged layout (row after row, entries in order),
        read page by page: each row's pages whole, then its entries picked out of them."""
        per, m = self.records_per_page, self.side_slots
        n = lengths.to(torch.int64, copy=False)
        R = rows.shape[0]
        W = int(n.max()) if R else 0
        need = _cdiv(m + W, per)
        table = rows[:, :need].clamp(min=0)  # -1 pads read page 0: never picked
        if table.shape[1] < need:
            table = torch.cat((table, table.new_zeros(R, need - table.shape[1])), dim=1)
        words = self._words[table].transpose(1, 2).reshape(R, 2, need * per, -1)[:, :, m:m + W]  # [R, 2, W, w]
        valid = torch.arange(W, device=n.device) < n[:, None]
        k_rec, v_rec = (words[:, i][valid].view(torch.uint8) for i in range(2))
        return k_rec, v_rec, (torch.cumsum(lengths, 0) - lengths).to(torch.int32)

    def _lengths(self, seqs: list[PagedSequence]) -> torch.Tensor:
        return torch.tensor([n for seq in seqs for n in seq.lengths], dtype=torch.int32, device=self.pages.device)

    def _ragged(self, seqs: list[PagedSequence]) -> tuple[torch.Tensor, ...]:
        """``(k_rec, v_rec [n, width], row_offsets, row_lengths [rows] int32, side)``: compressed ``seqs``' records
        gathered into the ragged layout (row ``n * H_kv + h``, entries in order) as attention reads them."""
        rows, lengths = self._rows(seqs), self._lengths(seqs)
        return (*self._gathered(rows, lengths), lengths, self._read_side(rows))

    def _read_back(self, seqs: list[PagedSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[n, D]`` compressed ``seqs``' entries read back as, in ragged order (each row's anchor
        and newest ``residual`` entries from its side tensors, the others dequantized; as the ragged layer reads)."""
        k_rec, v_rec, offsets, lengths, side = self._ragged(seqs)
        D, n = self.head_dim, k_rec.shape[0]
        centre = side[2].repeat_interleave(lengths.long(), dim=0, output_size=n)
        keys = torch.empty(n + 1, D, dtype=self.dtype, device=k_rec.device)
        values = torch.empty_like(keys)
        keys[:n] = decode_keys(k_rec, centre, D, self.layout, self.dtype)
        values[:n] = dequantize(v_rec, D, self.layout, self.dtype)
        R = self.residual
        at = side_slots(offsets, lengths, R, n).reshape(-1)  # anchor, then ring slots; n: stands for no slot
        keys.index_copy_(0, at, torch.cat((side[:1], side[3:3 + R])).reshape(-1, D))
        values.index_copy_(0, at, torch.cat((side[1:2], side[3 + R:])).reshape(-1, D))
        return keys[:n], values[:n]

    # ------------------------------------------------------------------ entries
    def append(self, seqs: list[PagedSequence], keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor, counts: list[int],
               scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`PagePool.append`; a compressed sequence's tokens are quantized with their rows' centres
        (:func:`~kvpress_ada.kernels.quantized_append`: a row empty so far takes its first as anchor; the newest
        enter the residual ring). :meth:`attend` reads the table this returns (and the side tensors it read)."""
        needed = sum(self.pages_needed(seq, c) for seq, c in zip(seqs, counts))
        if needed > self.free_pages:
            raise PoolExhausted(f"{needed} pages needed to append, {self.free_pages} of {self.capacity} free")
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        full = [n for n, seq in enumerate(seqs) if not self.compressed(seq)]
        if full:
            tokens = self._tokens(full, starts, keys.device)
            super().append([seqs[n] for n in full], keys[tokens], values[tokens], positions[tokens],
                           [counts[n] for n in full], None if scores is None else scores[tokens])
        per, m = self.records_per_page, self.side_slots
        compressed = [n for n, seq in enumerate(seqs) if self.compressed(seq)]
        for n in compressed:  # pages first: the step's one page table is built after
            seq = seqs[n]
            for h in range(seq.heads):
                seq.pages[h].extend(self.take(_cdiv(m + seq.lengths[h] + counts[n], per) - len(seq.pages[h])))
        table, _ = self.table(seqs)
        H = seqs[0].heads if seqs else 0
        side = None
        if compressed:
            by_row = table.long().view(len(seqs), H, -1)
            side = self._read_side(by_row[compressed].flatten(0, 1))
            groups = self._by_count(seqs, counts)
            for c, members in groups.items():
                tokens = self._tokens(members, starts, keys.device)
                pick = self._side_rows(compressed, members, H)
                part = side if pick is None else side[:, pick]
                self._append_records([seqs[n] for n in members], by_row[members].flatten(0, 1), part, keys[tokens],
                                     values[tokens], positions[tokens], c, None if scores is None else scores[tokens])
                if self.row_summaries is not None:
                    self._summarise_appended([seqs[n] for n in members], by_row[members].flatten(0, 1), part,
                                             keys[tokens], c)
                if pick is not None:
                    side[:, pick] = part
        self._last = (table, list(seqs), compressed, side)
        self._selected = None
        return table, self._lengths(seqs)

    @staticmethod
    def _side_rows(compressed: list[int], members: list[int], H: int) -> torch.Tensor | None:
        """Rows of the step's side tensors (those of the ``compressed`` sequences) that ``members`` own; ``None``
        when they are all of them, in order."""
        if members == compressed:
            return None
        at = {n: i for i, n in enumerate(compressed)}
        return torch.tensor([at[n] * H + h for n in members for h in range(H)], dtype=torch.long)

    def _by_count(self, seqs: list[PagedSequence], counts: list[int]) -> dict[int, list[int]]:
        """Indices of the compressed ``seqs`` with tokens this step, grouped by their token count (each group is
        one batched quantized op)."""
        groups: dict[int, list[int]] = {}
        for n, seq in enumerate(seqs):
            if self.compressed(seq) and counts[n]:
                groups.setdefault(counts[n], []).append(n)
        return groups

    @staticmethod
    def _tokens(members: list[int], starts: list[int], device: torch.device) -> torch.Tensor:
        return torch.cat([torch.arange(starts[n], starts[n + 1]) for n in members]).to(device)

    def _append_records(self, seqs: list[PagedSequence], rows: torch.Tensor, side: torch.Tensor, keys: torch.Tensor,
                        values: torch.Tensor, positions: torch.Tensor, c: int, scores: torch.Tensor | None) -> None:
        """``c`` tokens for each of the compressed ``seqs`` (``keys [B * c, H_kv, D]``, sequence by sequence) whose
        page table ``rows`` already holds the pages they need; updates their ``side`` tensors in place and writes
        what changed of them back to the pages."""
        B, H, D = len(seqs), seqs[0].heads, self.head_dim
        per, m = self.records_per_page, self.side_slots
        before = self._lengths(seqs).long()
        k_new = keys.to(self.dtype).view(B, c, H, D).transpose(1, 2).contiguous()
        v_new = values.to(self.dtype).view(B, c, H, D).transpose(1, 2).contiguous()
        k_out = torch.zeros(B * H * c, self.width, dtype=torch.uint8, device=self.pages.device)
        v_out = torch.zeros_like(k_out)
        # the offsets put row r's new records at r * c .. r * c + c - 1 of k_out (its length stays its own: the ring)
        offsets = torch.arange(B * H, device=before.device) * c - before
        kernels.quantized_append(k_new, v_new, k_out, v_out, offsets, before.clone(), side, self.layout)
        # the side vectors the append may change: the anchors (a row empty so far) and the new tokens' ring slots
        R, t = self.residual, min(c, self.residual)
        ring = (before[:, None] + torch.arange(c - t, c, device=before.device)) % max(R, 1)
        anchors = torch.tensor([0, 1], device=before.device).expand(B * H, 2)
        self._write_side(rows, side, torch.cat((anchors, 3 + ring, 3 + R + ring), dim=1))
        for seq in seqs:
            seq.lengths = [n + c for n in seq.lengths]
        entry = (before[:, None] + torch.arange(c, device=before.device)).reshape(-1) + m  # [rows * c] row slots
        row = torch.arange(B * H, device=before.device).repeat_interleave(c)
        page, slot = rows[row, entry // per], entry % per
        self.k_rec[page, slot] = k_out
        self.v_rec[page, slot] = v_out
        def by_row(x: torch.Tensor) -> torch.Tensor:  # [B * c, H] token after token -> row after row, as entry
            return x.reshape(B, c, H).transpose(1, 2).reshape(-1)

        self.positions[page, slot] = by_row(positions.to(torch.int32)[:, None].expand(B * c, H))
        if scores is not None:
            self.scores[page, slot] = by_row(scores.float())

    def read_selected(self, table: torch.Tensor, lengths: torch.Tensor, members: torch.Tensor,
                      selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`PagePool.read_selected`: ``table, lengths`` unchanged (the table :meth:`append` returned last),
        and :meth:`attend` then runs each single-query compressed sequence of ``members`` over the records of its
        ``selected`` pages only (:func:`~kvpress_ada.kernels.ragged.sparse.sparse_quantized_attention`)."""
        if self._last is None or self._last[0] is not table:
            raise ValueError("a quantized pool reads selected pages of the table its last append returned")
        seqs = self._last[1]
        picked = {}
        for i, n in enumerate(members.tolist()):
            if not self.compressed(seqs[n]):
                raise ValueError("a quantized pool reads selected pages of compressed sequences only")
            picked[n] = selected[i]
        self._selected = (table, picked)
        return table, lengths

    def attend(self, query: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, query_start: torch.Tensor,
               scale: float) -> torch.Tensor:
        """As :meth:`PagePool.attend`, over the rows of the table :meth:`append` returned last: full-precision
        sequences through :func:`~kvpress_ada.kernels.paged.ops.paged_attention`, compressed ones (grouped by their
        token counts) through :func:`~kvpress_ada.kernels.quantized_attention` over their records, those whose
        pages :meth:`read_selected` gave (a single query each) over the records of those pages only
        (:func:`~kvpress_ada.kernels.ragged.sparse.sparse_quantized_attention`)."""
        if self._last is None or self._last[0] is not table:
            raise ValueError("a quantized pool attends over the table its last append returned")
        _, seqs, compressed, side = self._last
        picked = self._selected[1] if self._selected is not None and self._selected[0] is table else {}
        H = seqs[0].heads if seqs else 0
        counts = (query_start[1:] - query_start[:-1]).tolist()
        starts = query_start.tolist()
        out = torch.zeros_like(query)
        full = [n for n, seq in enumerate(seqs) if not self.compressed(seq) and counts[n]]
        if full:
            tokens = self._tokens(full, starts, query.device)
            rows = torch.tensor([n * H + h for n in full for h in range(H)], device=table.device)
            start = torch.tensor([0] + [counts[n] for n in full], device=query.device).cumsum(0).to(torch.int32)
            out[tokens] = paged_attention(query[tokens], self.k_pages, self.v_pages, table[rows], lengths[rows],
                                          start, scale)
        T, H_q, D = query.shape
        groups = self._by_count(seqs, counts)
        by_row = table.long().view(len(seqs), H, -1) if groups else table
        for c, group in groups.items():
            assert side is not None
            sparse = [n for n in group if n in picked]
            if sparse:
                if c != 1:
                    raise ValueError(f"a step of {c} tokens reads selected pages: the reader reads single-query "
                                     "steps")
                tokens = self._tokens(sparse, starts, query.device)
                pick = self._side_rows(compressed, sparse, H)
                out[tokens] = self._attend_pages(query[tokens], by_row[sparse].flatten(0, 1),
                                                 self._lengths([seqs[n] for n in sparse]),
                                                 side if pick is None else side[:, pick],
                                                 torch.cat([picked[n] for n in sparse]), scale)
            members = [n for n in group if n not in picked]
            if not members:
                continue
            tokens = self._tokens(members, starts, query.device)
            pick = self._side_rows(compressed, members, H)
            row_lengths = self._lengths([seqs[n] for n in members])
            k_rec, v_rec, offsets = self._gathered(by_row[members].flatten(0, 1), row_lengths)
            part = side if pick is None else side[:, pick]
            q = query[tokens].view(len(members), c, H_q, D).transpose(1, 2)
            o = kernels.quantized_attention(q, k_rec, v_rec, offsets, row_lengths, part, scale, self.layout)
            out[tokens] = o.transpose(1, 2).reshape(len(members) * c, H_q, D)
        return out

    def _attend_pages(self, query: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, side: torch.Tensor,
                      selected: torch.Tensor, scale: float) -> torch.Tensor:
        """``[n, H_q, D]``: the single queries ``query [n, H_q, D]`` of ``n`` compressed sequences over the
        ``selected [n * H_kv, W]`` reader pages of their rows (page table ``rows``, ``lengths``, ``side``): only
        those pages' records are gathered (each page's ``S`` record slots, zeros past the row's end) and read by
        :func:`~kvpress_ada.kernels.ragged.sparse.sparse_quantized_attention`."""
        S, per, m = self.page_size, self.records_per_page, self.side_slots
        n, H_q, D = query.shape
        R, W = selected.shape
        n_len = lengths.long()
        chosen = selected & (torch.arange(W, device=selected.device) < (n_len[:, None] + S - 1) // S)
        row, j = chosen.nonzero(as_tuple=True)  # row after row, pages in order
        entry = j[:, None] * S + torch.arange(S, device=j.device)  # [pages, S] each page's entries
        valid = entry < n_len[row][:, None]
        slot = torch.where(valid, entry, 0) + m
        words = self._words[rows[row[:, None], slot // per], :, slot % per]  # [pages, S, 2, width / 4]
        words = torch.where(valid[..., None, None], words, 0)  # past the row's end: zero records (never read)
        k_rec = words[:, :, 0].reshape(-1, self.width // 4).view(torch.uint8)
        v_rec = words[:, :, 1].reshape(-1, self.width // 4).view(torch.uint8)
        table = torch.full((R, W), -1, dtype=torch.long, device=rows.device)
        table[row, j] = torch.arange(row.shape[0], device=rows.device)
        counts = chosen.sum(-1)
        offsets = ((torch.cumsum(counts, 0) - counts) * S).to(torch.int32)  # where each row's first page lies
        out = sparse_quantized_attention(query.view(n, 1, H_q, D).transpose(1, 2), k_rec, v_rec, offsets,
                                         lengths.to(torch.int32), side, table, chosen, S, scale, self.layout)
        return out.transpose(1, 2).reshape(n, H_q, D)

    def view(self, seqs: list[PagedSequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """As :meth:`PagePool.view`; a compressed sequence's entries as they read back (its rows' anchors and
        newest ``residual`` entries exactly, the others dequantized: what the ragged layer's ``view`` gives)."""
        page, slot, present, (N, H, W) = self._slots(seqs)
        D = self.head_dim
        full_slot = slot.clamp(max=self.page_size - 1)
        keys = self.k_pages[page, full_slot].view(N, H, W, D)  # copies (advanced indexing)
        values = self.v_pages[page, full_slot].view(N, H, W, D)
        positions = self.positions[page, slot].view(N, H, W).long()
        quantized = [n for n, seq in enumerate(seqs) if self.compressed(seq)]
        if quantized:
            at = torch.zeros(N, dtype=torch.bool, device=present.device)
            at[quantized] = True
            mask = present & at[:, None, None]
            keys[mask], values[mask] = self._read_back([seqs[n] for n in quantized])
        zero = torch.zeros((), dtype=keys.dtype, device=keys.device)
        return (torch.where(present[..., None], keys, zero), torch.where(present[..., None], values, zero),
                present, torch.where(present, positions, -1))

    def retain(self, seqs: list[PagedSequence], keep: torch.Tensor) -> None:
        """As :meth:`PagePool.retain`, each row's kept entries then held as records after its side tensors: a
        full-precision sequence is compressed (:func:`~kvpress_ada.kernels.quantized_compact`: side tensors from
        its kept entries, which are quantized); a compressed one moves its kept records unchanged, keeps its
        centres, takes as anchor what its first kept entry reads back as and refills its ring from what its
        newest kept entries read back as (as the ragged layer's ``retain``)."""
        keys, values, present, positions = self.view(seqs)
        scores = self.view_scores(seqs)
        keep = keep & present
        page, slot, _, (N, H, W) = self._slots(seqs)
        was = [self.compressed(seq) for seq in seqs]
        old_k = self.k_rec[page, slot].view(N, H, W, -1)  # copies, read before the pages go back
        old_v = self.v_rec[page, slot].view(N, H, W, -1)
        sides = {n: self._read_side(self._rows([seqs[n]])) for n in range(N) if was[n]}
        counts = keep.sum(-1).tolist()
        for seq in seqs:
            self.release(seq)
        for n, seq in enumerate(seqs):
            seq.pages = [self.take(_cdiv(self.side_slots + c, self.records_per_page)) for c in counts[n]]
            seq.lengths = list(counts[n])
            self._compressed[id(seq)] = seq
        for n, seq in enumerate(seqs):
            kept = keep[n:n + 1]
            if was[n]:
                side = sides[n]
                anchors = row_anchors(keys[n:n + 1], values[n:n + 1], kept)
                side[:2] = torch.where(kept.any(-1).view(1, H, 1), anchors.to(self.dtype), side[:2])
                side[3:].zero_()
                fill_residual(side, keys[n:n + 1], values[n:n + 1], kept)
                k_rec, v_rec = old_k[n][kept[0]], old_v[n][kept[0]]
            else:
                side = torch.zeros(3 + 2 * self.residual, H, self.head_dim, dtype=self.dtype, device=keys.device)
                total = int(kept.sum())
                k_rec = torch.zeros(total, self.width, dtype=torch.uint8, device=keys.device)
                v_rec = torch.zeros_like(k_rec)
                c = torch.tensor(counts[n], dtype=torch.int32, device=keys.device)
                kernels.quantized_compact(keys[n:n + 1].to(self.dtype), values[n:n + 1].to(self.dtype), kept,
                                          (torch.cumsum(c, 0) - c).to(torch.int32), k_rec, v_rec, side, self.layout)
            self._write_side(self._rows([seq]), side)
            self._place(seq, k_rec, v_rec, positions[n][kept[0]], scores[n][kept[0]])
        self._summarise_rows(seqs)

    def _place(self, seq: PagedSequence, k_rec: torch.Tensor, v_rec: torch.Tensor, positions: torch.Tensor,
               scores: torch.Tensor) -> None:
        """Records (and positions, scores) of ``seq``'s entries, row after row, into its row slots after the side."""
        page, slot = self._entries(self._rows([seq]), self._lengths([seq]))
        self.k_rec[page, slot] = k_rec
        self.v_rec[page, slot] = v_rec
        self.positions[page, slot] = positions.to(torch.int32)
        self.scores[page, slot] = scores.float()
