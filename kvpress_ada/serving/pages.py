"""Pages owned per (layer, kv head): the storage a serving host gives each sequence (KV-Compress's
layout, arXiv 2410.00161), written once for every host that pages.

A :class:`PagePool` holds one layer's pages, ``k_pages, v_pages [P, S, D]`` (its own tensors, or views
of an engine's KV tensor, e.g. vLLM's CPU ``[blocks, H_kv, S, 2 * D]`` viewed as ``[blocks * H_kv, S,
2 * D]`` and split in halves), the sequence position of every slot, and the free pages. A
:class:`PagedSequence` is one sequence's entries in one layer: for each kv head its own pages (a page
holds entries of one head only) and its length, so a head that keeps 10 entries holds one page while
its neighbour holds 40. Eviction (:meth:`PagePool.retain`) compacts each head's kept entries into fresh
pages and returns the old ones: pages held are ``sum over heads of ceil(kept / S)``, always.
:meth:`PagePool.table` gives the page table and lengths that
:func:`~kvpress_ada.kernels.paged.ops.paged_attention` reads; :meth:`PagePool.view` the left-padded view
:meth:`Pipeline.keep <kvpress_ada.Pipeline.keep>` selects from.

For a press with a reader (:mod:`kvpress_ada.readers`) the pool keeps each page's Quest summaries
(:meth:`PagePool.summarise`: the channel-wise min and max of the keys it holds, as stored), folded in by every
write and reset when a page returns, so they stay current through appends and compactions;
:func:`selected_table` cuts a page table to the pages a reader selects (what attention then reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.paged.ops import paged_attention
from ..kernels.ragged.sparse import round_outward, summary_dtype


class PoolExhausted(RuntimeError):
    """No free page is left in the pool (the host must preempt a sequence or admit fewer)."""


@dataclass
class PagedSequence:
    """One sequence's entries in one layer: per kv head, the ids of its pages and its length."""

    heads: int
    pages: list[list[int]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.pages:
            self.pages = [[] for _ in range(self.heads)]
            self.lengths = [0] * self.heads

    @property
    def pages_held(self) -> int:
        return sum(len(p) for p in self.pages)


def selected_table(table: torch.Tensor, lengths: torch.Tensor, selected: torch.Tensor,
                   page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table, lengths)`` of rows cut to their selected pages: row ``r``'s pages where ``selected [R, M]`` (in page
    order, ``-1`` after them) and the entries they hold. Only a row's newest page is partial and it comes last, so
    the cut row's entries are contiguous: a paged kernel reading it reads exactly the selected pages' entries."""
    M = table.shape[1]
    sel = selected & (table >= 0)
    order = torch.argsort((~sel).to(torch.uint8), dim=1, stable=True)  # selected pages first, in page order
    j = torch.arange(M, device=table.device)
    cut = torch.where(j < sel.sum(1, keepdim=True), table.gather(1, order), -1).to(table.dtype)
    held = (lengths.long()[:, None] - j * page_size).clamp(0, page_size)  # entries in each page
    return cut, (held * sel).sum(1).to(lengths.dtype)


class PagePool:
    """One layer's pages (see the module docstring): ``k_pages, v_pages [P, S, D]``, the position of the
    entry in each slot (``-1``: none), and the ids of the free pages."""

    kmin: torch.Tensor | None = None  # [P, D] 16-bit page summaries, while summarised (summarise)
    kmax: torch.Tensor | None = None

    def __init__(self, k_pages: torch.Tensor, v_pages: torch.Tensor):
        if k_pages.shape != v_pages.shape or k_pages.dim() != 3:
            raise ValueError(f"k_pages and v_pages must both be [pages, page_size, head_dim], got "
                             f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
        self.k_pages, self.v_pages = k_pages, v_pages
        P, S, _ = k_pages.shape
        self.page_size = S
        self.positions = torch.full((P, S), -1, dtype=torch.int32, device=k_pages.device)
        self.scores = torch.zeros((P, S), dtype=torch.float32, device=k_pages.device)  # hidden-state scores
        self._free = list(range(P - 1, -1, -1))  # a stack: the lowest ids are taken first

    @classmethod
    def allocate(cls, pages: int, page_size: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> "PagePool":
        """A pool with tensors of its own."""
        shape = (pages, page_size, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def grow(self, extra: int) -> None:
        """Add ``extra`` free pages (new tensors, the held pages copied over: their ids stay valid). Only for
        a pool with tensors of its own, never for views of an engine's memory."""
        P, S, D = self.k_pages.shape
        k_pages = self.k_pages.new_zeros(P + extra, S, D)
        v_pages = self.v_pages.new_zeros(P + extra, S, D)
        positions = self.positions.new_full((P + extra, S), -1)
        scores = self.scores.new_zeros((P + extra, S))
        k_pages[:P], v_pages[:P], positions[:P], scores[:P] = self.k_pages, self.v_pages, self.positions, self.scores
        self.k_pages, self.v_pages, self.positions, self.scores = k_pages, v_pages, positions, scores
        if self.kmin is not None and self.kmax is not None:
            self.kmin = torch.cat([self.kmin, self.kmin.new_full((extra, D), float("inf"))])
            self.kmax = torch.cat([self.kmax, self.kmax.new_full((extra, D), float("-inf"))])
        self._free[:0] = range(P + extra - 1, P - 1, -1)  # taken after the pages already free

    # ------------------------------------------------------------------ pages
    @property
    def capacity(self) -> int:
        return self.k_pages.shape[0]

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` free page ids (raises :class:`PoolExhausted`, taking none, when fewer are free)."""
        if n > len(self._free):
            raise PoolExhausted(f"{n} pages needed, {len(self._free)} of {self.capacity} free")
        taken = [self._free.pop() for _ in range(n)]
        return taken

    def give(self, ids: list[int]) -> None:
        """Return pages to the pool."""
        if ids:
            index = torch.tensor(ids, dtype=torch.long, device=self.positions.device)
            self.positions[index] = -1
            if self.kmin is not None and self.kmax is not None:  # an empty page's summaries: min / max identities
                self.kmin[index], self.kmax[index] = float("inf"), float("-inf")
            self._free.extend(reversed(ids))

    def release(self, seq: PagedSequence) -> None:
        """Every page of ``seq`` back to the pool (a finished or aborted sequence)."""
        for h in range(seq.heads):
            self.give(seq.pages[h])
            seq.pages[h], seq.lengths[h] = [], 0

    def pages_needed(self, seq: PagedSequence, tokens: int) -> int:
        """New pages ``seq`` takes to append ``tokens`` entries to every head."""
        S = self.page_size
        return sum(-(-(n + tokens) // S) - len(p) for n, p in zip(seq.lengths, seq.pages))

    # ------------------------------------------------------------------ page summaries
    def summarise(self) -> None:
        """Keep each page's Quest summaries from now on (Tang et al., ICML 2024): ``kmin, kmax [P, D]`` in 16 bits
        (:func:`~kvpress_ada.kernels.ragged.sparse.summary_dtype`: the pages' dtype when 16-bit, float16 rounded
        outward for float32 pages), the channel-wise min (rounded down) and max (rounded up) of the keys the page
        holds as stored (``+inf`` / ``-inf`` for a page holding none), so ``sum_d max(q_d kmin_d, q_d kmax_d)``
        bounds ``q . k`` over the page. Built from what the pages hold now, then folded in by every write and reset
        when a page returns (appends and compactions keep them current)."""
        if self.kmin is not None:
            return
        P, _, D = self.k_pages.shape
        device = self.k_pages.device
        dtype = summary_dtype(self.k_pages.dtype)
        self.kmin = torch.full((P, D), float("inf"), dtype=dtype, device=device)
        self.kmax = torch.full((P, D), float("-inf"), dtype=dtype, device=device)
        page, slot = (self.positions >= 0).nonzero(as_tuple=True)
        if page.numel():
            self._fold(page, self._read(page, slot)[0])

    def summaries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmin, kmax) [pages, D]``: the summaries a reader's bounds read
        (:func:`~kvpress_ada.readers.select_pages`), at the ids :meth:`summary_pages` gives."""
        if self.kmin is None or self.kmax is None:
            raise ValueError("this pool keeps no page summaries: call summarise() first")
        return self.kmin, self.kmax

    def summary_pages(self, seqs: list[PagedSequence], rows: torch.Tensor) -> torch.Tensor:
        """``[len(seqs) * H_kv, W]``: the ids in :meth:`summaries` of the reader's pages of each row of ``seqs``
        (``-1`` after them), ``rows`` being those rows of the step's page table: here the pool's pages are the
        reader's, so ``rows`` itself."""
        return rows

    def read_selected(self, table: torch.Tensor, lengths: torch.Tensor, members: torch.Tensor,
                      selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table, lengths)`` of a step (from :meth:`append`) with the rows of its sequences ``members [n]`` reading
        only their ``selected [n, H_kv, W]`` pages (``W`` of :meth:`summary_pages`): here those rows' page tables cut
        to the selected pages (:func:`selected_table`), which :meth:`attend` then reads."""
        n, H, W = selected.shape
        M = table.shape[1]
        rows = (members.to(table.device)[:, None] * H + torch.arange(H, device=table.device)).reshape(-1)
        picked = torch.zeros(n * H, M, dtype=torch.bool, device=table.device)
        picked[:, :W] = selected.reshape(n * H, W)
        cut_t, cut_l = selected_table(table[rows], lengths[rows], picked, self.page_size)
        table, lengths = table.clone(), lengths.clone()
        table[rows], lengths[rows] = cut_t, cut_l
        return table, lengths

    def _fold(self, page: torch.Tensor, keys: torch.Tensor) -> None:
        """Reduce ``keys [n, D]`` (as stored) into the summaries of their pages ``page [n]``, rounded outward."""
        if self.kmin is None or self.kmax is None:
            return
        index = page.long()[:, None].expand(-1, keys.shape[-1])
        self.kmin.scatter_reduce_(0, index, round_outward(keys, self.kmin.dtype, up=False), "amin", include_self=True)
        self.kmax.scatter_reduce_(0, index, round_outward(keys, self.kmax.dtype, up=True), "amax", include_self=True)

    # ------------------------------------------------------------------ entries
    def append(self, seqs: list[PagedSequence], keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor, counts: list[int],
               scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append packed tokens: sequence ``n`` takes the next ``counts[n]`` of ``keys, values [T, H_kv, D]``,
        ``positions [T]`` (every head of it the same tokens) and, for a scorer reading hidden states, the
        entries' ``scores [T, H_kv]``. Pages are taken before anything is written: on :class:`PoolExhausted`
        nothing changed. Returns :meth:`table` of ``seqs`` after the append (what attention then reads)."""
        needed = sum(self.pages_needed(seq, c) for seq, c in zip(seqs, counts))
        if needed > self.free_pages:
            raise PoolExhausted(f"{needed} pages needed to append, {self.free_pages} of {self.capacity} free")
        S = self.page_size
        before = torch.tensor([seq.lengths for seq in seqs], dtype=torch.long).view(len(seqs), -1)  # [N, H]
        for seq, c in zip(seqs, counts):
            for h in range(seq.heads):
                n = seq.lengths[h]
                seq.pages[h].extend(self.take(-(-(n + c) // S) - len(seq.pages[h])))
                seq.lengths[h] = n + c
        table, lengths = self.table(seqs)
        T, H = sum(counts), before.shape[1]
        if T == 0 or H == 0:
            return table, lengths
        host_table = table.cpu().long()
        per = torch.tensor(counts, dtype=torch.long)
        request = torch.repeat_interleave(torch.arange(len(seqs)), per, output_size=T)  # each token's sequence
        offset = torch.arange(T) - (torch.cumsum(per, 0) - per).index_select(0, request)  # its index in its sequence
        entry = before.index_select(0, request) + offset[:, None]  # [T, H] the entry each (token, head) becomes
        rows = request[:, None] * H + torch.arange(H)
        flat = host_table[rows, entry // S] * S + entry % S  # in (token, head) order, as keys.reshape(-1, D)
        D = keys.shape[-1]
        self._write(flat.reshape(-1).to(self.k_pages.device), keys.reshape(-1, D), values.reshape(-1, D),
                    positions.repeat_interleave(H), None if scores is None else scores.reshape(-1))
        return table, lengths

    def table(self, seqs: list[PagedSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page_table [N * H_kv, M], row_lengths [N * H_kv])`` int32 of ``seqs`` on the pool's device
        (row ``n * H_kv + h``; ``-1`` pads the table)."""
        rows = [p for seq in seqs for p in seq.pages]
        M = max((len(p) for p in rows), default=0) or 1
        table = torch.tensor([p + [-1] * (M - len(p)) for p in rows], dtype=torch.int32).view(len(rows), M)
        lengths = torch.tensor([n for seq in seqs for n in seq.lengths], dtype=torch.int32)
        device = self.k_pages.device
        return table.to(device), lengths.to(device)

    def _slots(self, seqs: list[PagedSequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                         tuple[int, int, int]]:
        """``(page [N*H*W], slot [N*H*W], present [N, H, W], (N, H, W))`` of the left-padded view of ``seqs``."""
        N, H = len(seqs), seqs[0].heads if seqs else 0
        S = self.page_size
        lengths = torch.tensor([n for seq in seqs for n in seq.lengths], dtype=torch.long).view(N, H)
        W = int(lengths.max()) if lengths.numel() else 0
        index = torch.arange(W) - (W - lengths[..., None])  # entry index of each view slot
        present = index >= 0
        table, _ = self.table(seqs)
        table = table.cpu().long().view(N, H, -1)
        entry = index.clamp(min=0)
        flat = table.gather(2, (entry // S).clamp(max=table.shape[-1] - 1)) * S + entry % S
        flat = torch.where(present, flat, 0).to(self.k_pages.device).reshape(-1)
        return flat // S, flat % S, present.to(self.k_pages.device), (N, H, W)

    def view(self, seqs: list[PagedSequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values [N, H_kv, W, D], present [N, H_kv, W], positions [N, H_kv, W])``: each head's entries
        in the order they were stored, at the end of a ``W``-slot row (left padding, ``W`` the longest head;
        zeros and position ``-1`` where absent)."""
        page, slot, present, (N, H, W) = self._slots(seqs)
        D = self.k_pages.shape[-1]
        keys, values = self._read(page, slot)
        keys, values = keys.view(N, H, W, D), values.view(N, H, W, D)
        positions = self.positions[page, slot].view(N, H, W).long()
        zero = torch.zeros((), dtype=keys.dtype, device=keys.device)
        return (torch.where(present[..., None], keys, zero), torch.where(present[..., None], values, zero),
                present, torch.where(present, positions, -1))

    def view_scores(self, seqs: list[PagedSequence]) -> torch.Tensor:
        """``[N, H_kv, W]`` the hidden-state scores of the entries of :meth:`view` (0 where absent)."""
        page, slot, present, shape = self._slots(seqs)
        return torch.where(present, self.scores[page, slot].view(shape), 0.0)

    def retain(self, seqs: list[PagedSequence], keep: torch.Tensor) -> None:
        """Keep the entries of :meth:`view` where ``keep [N, H_kv, W]`` is True (in their order), each head
        in fresh pages; the old pages return to the pool. Never needs more pages than it frees."""
        keys, values, present, positions = self.view(seqs)
        scores = self.view_scores(seqs)
        keep = keep & present
        counts = keep.sum(-1).tolist()
        for seq in seqs:  # the view holds copies: the old pages can go first, so this never runs out
            self.release(seq)
        N, H = keep.shape[:2]
        order = torch.argsort(keep.to(torch.uint8), dim=-1, stable=True, descending=True)  # kept first, in order
        for n, seq in enumerate(seqs):
            for h in range(H):
                c = counts[n][h]
                seq.pages[h] = self.take(-(-c // self.page_size))
            picked = order[n, :, :max(counts[n], default=0)]
            W = picked.shape[-1]
            mask = torch.arange(W, device=keep.device)[None, :] < torch.tensor(counts[n], device=keep.device)[:, None]
            rows_k = keys[n].gather(1, picked[..., None].expand(H, W, keys.shape[-1]))
            rows_v = values[n].gather(1, picked[..., None].expand(H, W, keys.shape[-1]))
            rows_p = positions[n].gather(1, picked)
            seq.lengths = [0] * H
            self.append_heads(seq, rows_k, rows_v, rows_p, mask, scores[n].gather(1, picked))

    def append_heads(self, seq: PagedSequence, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     mask: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        """Write head ``h``'s entries ``keys[h][mask[h]]`` (``[H_kv, W, D]``, positions and hidden-state scores
        ``[H_kv, W]``) after its current length, into pages it already holds."""
        S, D = self.page_size, keys.shape[-1]
        slots: list[int] = []
        picked: list[torch.Tensor] = []
        counts = mask.sum(-1).tolist()
        for h in range(seq.heads):
            n = seq.lengths[h]
            slots.extend(seq.pages[h][j // S] * S + j % S for j in range(n, n + counts[h]))
            picked.append(mask[h].nonzero()[:, 0] + h * keys.shape[1])
            seq.lengths[h] = n + counts[h]
        if not slots:
            return
        source = torch.cat(picked)
        self._write(torch.tensor(slots, dtype=torch.long, device=self.k_pages.device),
                    keys.reshape(-1, D).index_select(0, source), values.reshape(-1, D).index_select(0, source),
                    positions.reshape(-1).index_select(0, source),
                    None if scores is None else scores.reshape(-1).index_select(0, source))

    def _write(self, flat: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               scores: torch.Tensor | None = None) -> None:
        """Entries ``keys, values [n, D]``, ``positions [n]`` (and ``scores [n]``) into the slots ``flat [n]``
        (``page * S + slot``); indexing by (page, slot) serves strided page views of an engine tensor as well as
        pages of our own."""
        page, slot = flat // self.page_size, flat % self.page_size
        self._write_entries(flat, page, slot, keys, values)
        self._fold(page, keys.to(self.k_pages.dtype))
        self.positions[page, slot] = positions.to(torch.int32)
        if scores is not None:
            self.scores[page, slot] = scores.float()

    # ------------------------------------------------------------------ the page format (a subclass may change it)
    def _write_entries(self, flat: torch.Tensor, page: torch.Tensor, slot: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor) -> None:
        """Keys and values ``[n, D]`` into slots ``flat = page * S + slot`` (plain pages: ``k_pages[page, slot]``)."""
        self.k_pages[page, slot] = keys.to(self.k_pages.dtype)
        self.v_pages[page, slot] = values.to(self.v_pages.dtype)

    def _read(self, page: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[n, D]`` of the slots ``(page, slot)``."""
        return self.k_pages[page, slot], self.v_pages[page, slot]

    def attend(self, query: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, query_start: torch.Tensor,
               scale: float) -> torch.Tensor:
        """:func:`~kvpress_ada.kernels.paged.ops.paged_attention` of packed ``query [T, H_q, D]`` over the rows of
        ``table, lengths`` (from :meth:`table`), request ``n``'s tokens at ``query_start[n] : query_start[n + 1]``."""
        return paged_attention(query, self.k_pages, self.v_pages, table, lengths, query_start, scale)

    storage_label = "full precision"
    """What the pool keeps entries as, in words (for messages)."""

    def stores(self, storage: Any) -> bool:
        """Whether this pool keeps entries as ``storage`` (a :class:`~kvpress_ada.storage.Storage`) says: in the
        model's dtype here, a kind without a record layout (:class:`~.quantized_paging.QuantizedPagePool` keeps
        records of one)."""
        return storage.layout is None

    def nbytes(self, seqs: list[PagedSequence]) -> int:
        """Bytes of keys and values the pages of ``seqs`` hold (whole pages: what they keep others from), with their
        summaries while the pool keeps them."""
        per_page = self.page_size * self.k_pages.shape[-1] * (self.k_pages.element_size() + self.v_pages.element_size())
        if self.kmin is not None and self.kmax is not None:  # the page's summaries
            per_page += self.kmin[0].nbytes + self.kmax[0].nbytes
        return sum(seq.pages_held for seq in seqs) * per_page
