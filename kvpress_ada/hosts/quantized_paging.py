"""Pages per (layer, kv head) whose kept entries are int8 / int4 records: the paged layer of a quantized storage,
for every host that pages, with the scheme of the transformers host's quantized ragged cache
(:mod:`kvpress_ada.kernels.quantized`, ``docs/design.md`` "Scheme"), through the same functions.

A :class:`QuantizedPagePool` is a :class:`~.paging.PagePool` over ``pages uint8 [P, bytes]``: each page the bytes
of a full-precision page of ``S`` entries (``[2, S, D]`` of the entries' dtype, e.g. one (block, kv head) of an
engine's KV tensor). A sequence holds full-precision pages until its first eviction (selection reads full
precision, as the ragged cache's dense prefill); :meth:`~QuantizedPagePool.retain` then stores its kept entries
as records, and every later entry is quantized when appended. A compressed page holds ``records_per_page``
key records then as many value records (more entries than ``S``), and each (sequence, kv head) row keeps its side
tensors (anchor, key centre, residual ring: :func:`~kvpress_ada.kernels.quantized.residual_of`) in its own first
``side_slots`` record slots, so its pages hold everything it keeps: ``pages held * bytes`` is its memory.
Attention gathers each compressed row's records into the ragged layout and runs
:func:`~kvpress_ada.kernels.quantized_attention`; eviction moves kept records as bytes (never quantized twice).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import kernels
from ..kernels.paged import paged_attention
from ..kernels.quantized import decode_keys, dequantize, fill_residual, record_width, row_anchors, side_slots
from .paging import PagedSequence, PagePool, PoolExhausted


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class QuantizedPagePool(PagePool):
    """One layer's pages (module docstring): ``pages uint8 [P, 2 * S * D * itemsize]`` (contiguous), entries of
    ``head_dim`` channels of ``dtype`` stored as ``bits``-bit records in groups of ``group`` with a residual of
    ``residual`` entries per row once a sequence is compressed."""

    def __init__(self, pages: torch.Tensor, page_size: int, head_dim: int, dtype: torch.dtype, bits: int,
                 group: int, residual: int = 0):
        P = pages.shape[0]
        size = 2 * page_size * head_dim * dtype.itemsize
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != size or not pages.is_contiguous():
            raise ValueError(f"pages must be contiguous uint8 [pages, {size}] (a {dtype} page of {page_size} "
                             f"entries of {head_dim} channels), got {pages.dtype} {tuple(pages.shape)}")
        full = pages.view(dtype).view(P, 2, page_size, head_dim)
        super().__init__(full[:, 0], full[:, 1])
        self.pages, self.dtype, self.head_dim = pages, dtype, head_dim
        self.bits, self.group, self.residual = bits, group, residual
        self.width = record_width(head_dim, bits, group, dtype)
        self.records_per_page, self.side_slots = self.geometry(page_size, head_dim, dtype, bits, group, residual)
        records = pages[:, :2 * self.records_per_page * self.width].view(P, 2, self.records_per_page, self.width)
        self.k_rec, self.v_rec = records[:, 0], records[:, 1]
        self.positions = torch.full((P, self.records_per_page), -1, dtype=torch.int32, device=pages.device)
        self.scores = torch.zeros((P, self.records_per_page), dtype=torch.float32, device=pages.device)
        self._compressed: dict[int, PagedSequence] = {}  # id -> sequence (kept alive, so ids stay unique)
        self._last: tuple[torch.Tensor, list[PagedSequence]] | None = None  # the table append returned, its rows

    @staticmethod
    def geometry(page_size: int, head_dim: int, dtype: torch.dtype, bits: int, group: int,
                 residual: int) -> tuple[int, int]:
        """``(records_per_page, side_slots)``: the records a page of ``page_size`` full-precision entries holds,
        and the record slots a row's side tensors take (``3 + 2 * residual`` vectors)."""
        width = record_width(head_dim, bits, group, dtype)
        side = (3 + 2 * residual) * head_dim * dtype.itemsize
        return 2 * page_size * head_dim * dtype.itemsize // (2 * width), _cdiv(side, 2 * width)

    @staticmethod
    def reserve_pages(page_size: int, head_dim: int, dtype: torch.dtype, bits: int, group: int, residual: int) -> int:
        """Pages per row a first eviction may take beyond the full-precision pages it frees (its side tensors)."""
        per_page, side = QuantizedPagePool.geometry(page_size, head_dim, dtype, bits, group, residual)
        return _cdiv(side, per_page)

    @property
    def storage_label(self) -> str:  # type: ignore[override]
        return f"int{self.bits} records (group {self.group}, residual {self.residual})"

    def stores(self, storage: Any) -> bool:
        return storage.record_scheme() == (self.bits, self.group, self.residual)

    def grow(self, extra: int) -> None:
        raise NotImplementedError("a quantized pool is a view of fixed pages: it cannot grow")

    def compressed(self, seq: PagedSequence) -> bool:
        """Whether ``seq`` holds records (it was evicted from), not full-precision pages."""
        return id(seq) in self._compressed

    # ------------------------------------------------------------------ pages
    def release(self, seq: PagedSequence) -> None:
        self._compressed.pop(id(seq), None)
        super().release(seq)

    def pages_needed(self, seq: PagedSequence, tokens: int) -> int:
        if not self.compressed(seq):
            return super().pages_needed(seq, tokens)
        per = self.records_per_page
        return sum(_cdiv(self.side_slots + n + tokens, per) - len(p) for n, p in zip(seq.lengths, seq.pages))

    def nbytes(self, seqs: list[PagedSequence]) -> int:
        """Bytes of the pages ``seqs`` hold (records, scales, zero points and side tensors all live in them)."""
        return sum(seq.pages_held for seq in seqs) * self.pages.shape[1]

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

    def _side_index(self, seqs: list[PagedSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page, slot) [rows, side_slots]`` of the record slots holding each row's side tensors."""
        per, m = self.records_per_page, self.side_slots
        page = torch.tensor([[p[s // per] for s in range(m)] for seq in seqs for p in seq.pages], dtype=torch.long)
        slot = (torch.arange(m) % per).expand_as(page)
        return page.to(self.pages.device), slot.to(self.pages.device)

    def _read_side(self, seqs: list[PagedSequence]) -> torch.Tensor:
        """``side [3 + 2R, rows, D]`` of compressed ``seqs`` (rows ``n * H_kv + h``)."""
        page, slot = self._side_index(seqs)
        rows, D = page.shape[0], self.head_dim
        n = (3 + 2 * self.residual) * D * self.dtype.itemsize
        raw = torch.cat((self.k_rec[page, slot], self.v_rec[page, slot]), dim=1).reshape(rows, -1)[:, :n]
        return raw.contiguous().view(self.dtype).view(rows, -1, D).transpose(0, 1).contiguous()

    def _write_side(self, seqs: list[PagedSequence], side: torch.Tensor) -> None:
        page, slot = self._side_index(seqs)
        rows, m = page.shape
        raw = side.transpose(0, 1).contiguous().view(torch.uint8).reshape(rows, -1)
        padded = raw.new_zeros(rows, 2 * m * self.width)
        padded[:, :raw.shape[1]] = raw
        padded = padded.view(rows, 2 * m, self.width)
        self.k_rec[page, slot] = padded[:, :m]
        self.v_rec[page, slot] = padded[:, m:]

    def _ragged(self, seqs: list[PagedSequence]) -> tuple[torch.Tensor, ...]:
        """``(k_rec, v_rec [n, width], row_offsets, row_lengths [rows] int32, side)``: compressed ``seqs``' records
        gathered into the ragged layout (row ``n * H_kv + h``, entries in order)."""
        page, slot, present, _ = self._slots(seqs)
        flat = present.reshape(-1)
        page, slot = page[flat], slot[flat]
        lengths = torch.tensor([n for seq in seqs for n in seq.lengths], dtype=torch.int32, device=self.pages.device)
        offsets = (torch.cumsum(lengths, 0) - lengths).to(torch.int32)
        return (self.k_rec[page, slot].contiguous(), self.v_rec[page, slot].contiguous(), offsets, lengths,
                self._read_side(seqs))

    def _read_back(self, seqs: list[PagedSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[n, D]`` compressed ``seqs``' entries read back as, in ragged order (each row's anchor
        and newest ``residual`` entries from its side tensors, the others dequantized; as the ragged layer reads)."""
        k_rec, v_rec, offsets, lengths, side = self._ragged(seqs)
        D, n = self.head_dim, k_rec.shape[0]
        centre = side[2].repeat_interleave(lengths.long(), dim=0, output_size=n)
        keys = torch.empty(n + 1, D, dtype=self.dtype, device=k_rec.device)
        values = torch.empty_like(keys)
        keys[:n] = decode_keys(k_rec, centre, D, self.bits, self.group, self.dtype)
        values[:n] = dequantize(v_rec, D, self.bits, self.group, self.dtype)
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
        enter the residual ring). :meth:`attend` reads the table this returns."""
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
        for c, members in self._by_count(seqs, counts).items():
            tokens = self._tokens(members, starts, keys.device)
            self._append_records([seqs[n] for n in members], keys[tokens], values[tokens], positions[tokens], c,
                                 None if scores is None else scores[tokens])
        table, lengths = self.table(seqs)
        self._last = (table, list(seqs))
        return table, lengths

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

    def _append_records(self, seqs: list[PagedSequence], keys: torch.Tensor, values: torch.Tensor,
                        positions: torch.Tensor, c: int, scores: torch.Tensor | None) -> None:
        """``c`` tokens for each of the compressed ``seqs`` (``keys [B * c, H_kv, D]``, sequence by sequence)."""
        B, H, D = len(seqs), seqs[0].heads, self.head_dim
        per, m = self.records_per_page, self.side_slots
        before = torch.tensor([n for seq in seqs for n in seq.lengths], dtype=torch.int64, device=self.pages.device)
        for seq in seqs:
            for h in range(H):
                seq.pages[h].extend(self.take(_cdiv(m + seq.lengths[h] + c, per) - len(seq.pages[h])))
        side = self._read_side(seqs)
        k_new = keys.to(self.dtype).view(B, c, H, D).transpose(1, 2).contiguous()
        v_new = values.to(self.dtype).view(B, c, H, D).transpose(1, 2).contiguous()
        k_out = torch.zeros(B * H * c, self.width, dtype=torch.uint8, device=self.pages.device)
        v_out = torch.zeros_like(k_out)
        # the offsets put row r's new records at r * c .. r * c + c - 1 of k_out (its length stays its own: the ring)
        offsets = torch.arange(B * H, device=before.device) * c - before
        kernels.quantized_append(k_new, v_new, k_out, v_out, offsets, before.clone(), side, self.bits, self.group)
        self._write_side(seqs, side)
        for seq in seqs:
            seq.lengths = [n + c for n in seq.lengths]
        entry = (before[:, None] + torch.arange(c, device=before.device)).reshape(-1) + m  # [rows * c] row slots
        table = self.table(seqs)[0].long()
        row = torch.arange(B * H, device=before.device).repeat_interleave(c)
        page, slot = table[row, entry // per], entry % per
        self.k_rec[page, slot] = k_out
        self.v_rec[page, slot] = v_out
        def rows(x: torch.Tensor) -> torch.Tensor:  # [B * c, H] token after token -> row after row, as entry
            return x.reshape(B, c, H).transpose(1, 2).reshape(-1)

        self.positions[page, slot] = rows(positions.to(torch.int32)[:, None].expand(B * c, H))
        if scores is not None:
            self.scores[page, slot] = rows(scores.float())

    def attend(self, query: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, query_start: torch.Tensor,
               scale: float) -> torch.Tensor:
        """As :meth:`PagePool.attend`, over the rows of the table :meth:`append` returned last: full-precision
        sequences through :func:`~kvpress_ada.kernels.paged.paged_attention`, compressed ones (grouped by their
        token counts) through :func:`~kvpress_ada.kernels.quantized_attention` over their records."""
        if self._last is None or self._last[0] is not table:
            raise ValueError("a quantized pool attends over the table its last append returned")
        seqs = self._last[1]
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
        for c, members in self._by_count(seqs, counts).items():
            tokens = self._tokens(members, starts, query.device)
            k_rec, v_rec, offsets, row_lengths, side = self._ragged([seqs[n] for n in members])
            q = query[tokens].view(len(members), c, H_q, D).transpose(1, 2)
            o = kernels.quantized_attention(q, k_rec, v_rec, offsets, row_lengths, side, scale, self.bits, self.group)
            out[tokens] = o.transpose(1, 2).reshape(len(members) * c, H_q, D)
        return out

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
        sides = {n: self._read_side([seqs[n]]) for n in range(N) if was[n]}
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
                                          (torch.cumsum(c, 0) - c).to(torch.int32), k_rec, v_rec, side, self.bits,
                                          self.group)
            self._write_side([seq], side)
            self._place(seq, k_rec, v_rec, positions[n][kept[0]], scores[n][kept[0]])

    def _place(self, seq: PagedSequence, k_rec: torch.Tensor, v_rec: torch.Tensor, positions: torch.Tensor,
               scores: torch.Tensor) -> None:
        """Records (and positions, scores) of ``seq``'s entries, row after row, into its row slots after the side."""
        page, slot, present, _ = self._slots([seq])
        flat = present.reshape(-1)
        page, slot = page[flat], slot[flat]
        self.k_rec[page, slot] = k_rec
        self.v_rec[page, slot] = v_rec
        self.positions[page, slot] = positions.to(torch.int32)
        self.scores[page, slot] = scores.float()
