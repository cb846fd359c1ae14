"""RaggedCache: a transformers ``Cache`` whose rows are (batch, kv head) pairs of different lengths.

Evicted entries really leave memory: a compressed layer holds one flat ``[N, D]`` buffer for keys
and one for values, with int32 ``row_offsets``/``row_lengths`` on the device, every row starting on
a :data:`~kvpress_ada.kernels.ragged.reference.CHUNK` boundary. Reserve: each row gets at least
``decode_reserve`` free slots (default 8) after compression; when rows run out the layer is re-laid
out once with a spare of ``max(decode_reserve, ceil(growth * mean row length))`` (amortised O(1)
appends, never a copy per token). Right after compression ``kept bytes + rows * decode_reserve * D
* 2 * itemsize <= nbytes() < kept bytes + rows * (decode_reserve + CHUNK) * D * 2 * itemsize``.

Compiled decoding: the host-side half of an append (room, re-layout, counters) runs in
:meth:`RaggedCache.reserve`, eagerly, before the compiled forward; inside it ``update`` is one
in-place append op and attention one ragged attention op. Design notes: ``docs/design.md``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ... import kernels
from ...kernels.ragged.reference import CHUNK
from .attention import logit_extras
from .entries import gather_slots, left_pad_index, ragged_index, real_entries
from .page_summaries import PageSummaries, check_page_size
from .press_cache import DenseAttention, DenseUntilKept, HeldEntries, PressCache, uncroppable
from .window_layer import WindowLayer, press_layers

if TYPE_CHECKING:
    from ...storage import Storage


class RaggedLayer(DenseUntilKept):
    """One layer: dense while prefill is in flight, ragged once :meth:`compress` ran. Stored tensors
    are detached: with grad mode on, the cache holds ``nbytes()`` and no autograd graph."""

    is_compileable = True
    rewrites_kept_keys = True  # retain() re-lays the kept entries out from the view's keys (re-rotated ones too)

    def __init__(self, decode_reserve: int = 8, growth: float = 0.125):
        super().__init__()
        if decode_reserve < 1:
            raise ValueError(f"decode_reserve must be >= 1 token per row, got {decode_reserve}")
        self.decode_reserve = decode_reserve
        self.growth = growth
        self.reader: Any = None  # a press's read policy (kvpress_ada.readers): decode steps read selected pages
        self.layer_idx = 0  # the reader's layer index
        self.counts_reads = False  # whether decode steps add what they read to :attr:`reads` (RaggedCache.count_reads)
        self._clear()

    def _clear(self) -> None:
        self._reset_dense()
        self.k_flat = self.v_flat = torch.empty(0)
        self.row_offsets = self.row_lengths = torch.empty(0, dtype=torch.int32)
        self._base: list[int] = []  # host copy of each row's length right after compression
        self._appended = 0  # tokens appended to every row since compression
        self._spare = 0  # free slots left in the fullest row
        self._reserved = 0  # tokens :meth:`reserve` made room for (and counted) ahead of the next update
        self._kept_positions = torch.empty(0, dtype=torch.int32)  # sequence index of each compressed entry, row order
        self._compressed_at = 0  # tokens seen when the layer was last compressed (appended ones follow)
        self.shape = (0, 0, 0)  # (B, H_kv, D)
        self.head_dim = 0  # D of the entries (set by the first update)
        self.pages: PageSummaries | None = None  # page summaries while compressed under a reader
        # [B + 1]: bytes each batch row's decode steps read, then steps (counted only while counts_reads)
        self.reads = torch.zeros(0, dtype=torch.int64)

    # ------------------------------------------------------------------ HF API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.head_dim = key_states.shape[-1]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if not self.compressed:
            return self._update_dense(key_states, value_states)
        if not torch.compiler.is_compiling() and self._reserved != q:
            self.reserve(q)  # eager callers need not reserve; a compiled step was reserved by its caller
        self._reserved = 0
        self._append_entries(key_states.detach(), value_states.detach())
        if self.pages is not None:
            self.pages.append(key_states.detach(), self.row_offsets, self.row_lengths)
        return self.k_flat, self.v_flat

    def reserve(self, q: int) -> None:
        """Make room for ``q`` more tokens in every row and count them (eager, before the forward that
        appends them): the host-side half of an append, kept out of the compiled step."""
        if q > self._spare:
            self._grow(q)
        self.seen += q
        self._appended += q
        self._spare -= q
        self._reserved = q

    def reset(self) -> None:
        self._clear()

    def _crop_kept(self, n: int) -> None:
        if n > self._appended:
            raise uncroppable(n, self._appended)
        self._appended -= n
        self._spare += n
        self.row_lengths.sub_(n)  # in place: the compiled step may hold its address
        self._rebuild_pages()

    # --------------------------------------------------------------- ragged API
    def compress(self, keep: torch.Tensor, spare: int | None = None, positions: torch.Tensor | None = None) -> None:
        """Compact the dense cache to the entries where ``keep [B, H_kv, L]`` is True, leaving ``spare``
        free slots per row (default ``decode_reserve``). ``positions [B, H_kv, L]``: each dense entry's
        index in the sequence (default: its index in the dense cache)."""
        keys, values = self._dense()
        B, H, L, _ = keys.shape
        if keep.shape != (B, H, L):
            raise ValueError(f"keep mask of shape {tuple(keep.shape)} does not match the layer's cache {(B, H, L)}")
        counts = keep.sum(-1).reshape(-1).to(torch.int32)
        self._base = counts.tolist()  # one host sync per layer, at compression time only
        self.shape = (B, H, self.head_dim)
        self._appended = 0
        if positions is None:
            positions = torch.arange(L, device=keys.device).expand(B, H, L)
        self._kept_positions = positions.expand(B, H, L)[keep].to(torch.int32)
        self._compressed_at = self.seen
        self._layout(self.decode_reserve if spare is None else spare, counts)
        self._compact_entries(keys, values, keep)
        if self.reads.shape[0] != B + 1:  # kept through decode compactions (retain): they count on
            self._new_reads(B)
        self.keys = self.values = None
        self.compressed = True
        self._rebuild_pages()

    def _layout(self, spare: int, lengths: torch.Tensor) -> None:
        """Allocate flat storage with at least ``spare`` free slots per row after ``lengths`` tokens,
        every row's capacity a multiple of ``CHUNK``."""
        host = [n + self._appended for n in self._base]
        caps = [-(-(n + spare) // CHUNK) * CHUNK for n in host]
        offsets = [0] * len(caps)
        for r in range(1, len(caps)):
            offsets[r] = offsets[r - 1] + caps[r - 1]
        total = offsets[-1] + caps[-1] if caps else 0
        # Always normal tensors, even when re-laid out inside torch.inference_mode(): a compiled step
        # guards on each buffer's dispatch keys, and a cache built outside inference mode but grown
        # inside it would otherwise recompile for every mix of the two kinds across layers.
        with torch.inference_mode(False):
            # zeros, not empty: kernels mask the free slots' scores, but 0 * NaN garbage would still be NaN
            self.k_flat, self.v_flat = self._empty_slots(total), self._empty_slots(total)
            self.row_offsets = torch.tensor(offsets, dtype=torch.int32, device=self.device)
            self.row_lengths = torch.zeros(len(caps), dtype=torch.int32, device=self.device)
        self.row_lengths.copy_(lengths.reshape(-1))
        self._spare = min((c - n for c, n in zip(caps, host)), default=spare)
        _mark_for_compile(self.k_flat, self.v_flat, self.row_offsets, self.row_lengths)

    def _new_reads(self, batch: int) -> None:
        """Zeroed read counters for ``batch`` rows (normal tensors, a static address on CUDA: see :meth:`_layout`)."""
        with torch.inference_mode(False):
            self.reads = torch.zeros(batch + 1, dtype=torch.int64, device=self.device)
        if self.reads.device.type == "cuda" and not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.reads)

    def _count_read(self, query: torch.Tensor, selected: torch.Tensor | None = None) -> None:
        """Add what this decode step's attention call reads (a single query per row; other calls are not decode
        steps) to :attr:`reads`, while :attr:`counts_reads` (off by default: a measurement, not free): per batch
        row, the entries it attends over (every kept entry, or those of the ``selected [R, W]`` pages) times
        :meth:`_entry_bytes`, each row's :meth:`_row_bytes`, and the page summaries scored; then one step. Device
        ops, no host sync (a compiled step runs it)."""
        if not self.counts_reads or query.shape[2] != 1:
            return
        B, H, _ = self.shape
        if selected is None or self.pages is None:
            entries, summaries = self.row_lengths.long(), torch.zeros((), dtype=torch.int64, device=self.reads.device)
        else:
            entries, summaries = self.pages.read(selected, self.row_lengths)
        per_row = entries * self._entry_bytes() + summaries + self._row_bytes()
        step = torch.ones(1, dtype=torch.int64, device=self.reads.device)
        self.reads.add_(torch.cat([per_row.view(B, H).sum(-1), step]))

    def _entry_bytes(self) -> int:
        """Bytes attention reads per entry: its key and its value as stored."""
        return self.k_flat.shape[1] * self.k_flat.element_size() + self.v_flat.shape[1] * self.v_flat.element_size()

    def _row_bytes(self) -> int:
        """Bytes attention reads per row besides its entries (none here; a quantized layer's side tensors)."""
        return 0

    def _grow(self, needed: int) -> None:
        """Re-lay the layer out with a geometric spare (amortised O(1) appends)."""
        old_k, old_v, old_offsets, lengths = self.k_flat, self.v_flat, self.row_offsets, self.row_lengths
        host_lengths = [n + self._appended for n in self._base]
        mean = sum(host_lengths) / max(len(host_lengths), 1)
        spare = max(self.decode_reserve, needed, math.ceil(self.growth * mean))
        self._layout(spare, lengths)
        src = _row_token_index(old_offsets, host_lengths)
        dst = _row_token_index(self.row_offsets, host_lengths)
        self.k_flat[dst] = old_k[src]
        self.v_flat[dst] = old_v[src]
        if self.pages is not None:  # the entries moved unchanged: so do their pages' summaries
            self.pages.move(old_offsets, self.row_offsets, self.row_lengths, self.k_flat.shape[0])

    # ------------------------------------------------------------ sparse reads
    def read_with(self, reader: Any, layer_idx: int = 0) -> None:
        """Read decode steps through ``reader`` (``None``: every kept entry): the layer keeps page summaries
        (:mod:`.page_summaries`) while compressed, and a single-query step attends over the pages it selects."""
        if reader is not None:
            check_page_size(reader)
        self.reader, self.layer_idx = reader, layer_idx
        self.pages = None
        self._rebuild_pages()

    def _rebuild_pages(self) -> None:
        if self.reader is not None and self.compressed:
            if self.pages is None:
                self.pages = PageSummaries(self.reader)
            self.pages.rebuild(self._page_keys(), self.row_offsets, self.row_lengths)

    def _page_keys(self) -> tuple[torch.Tensor, ...]:
        """What each slot's key reads as, ``[N, D]`` (several tensors: each slot may read as any of them; the page
        summaries cover their union)."""
        return (self.k_flat,)

    def _reads_pages(self, query: torch.Tensor) -> bool:
        """Whether this attention call reads the pages the reader selects (a decode step under a reader that does
        not read every page)."""
        return self.pages is not None and query.shape[2] == 1 and not self._reads_every_page()

    def _reads_every_page(self) -> bool:
        """Eagerly, whether the reader reads every page of every row (then attention reads them densely, exactly
        as without a reader); a compiled step always goes through the selection."""
        return not torch.compiler.is_compiling() and bool(self.reader.reads_every_page(
            max(self._base, default=0) + self._appended))

    def view(self, key_mask: torch.Tensor | None = None) -> HeldEntries:
        """What each row holds, left-padded (the dense prefill itself before compression, ``key_mask``
        its real tokens). One host sync (the longest row)."""
        if not self.compressed:
            return self._dense_view(key_mask)
        B, H, _ = self.shape
        index, present = ragged_index(self.row_offsets, self.row_lengths, (B, H))
        positions = torch.where(present, self._view_positions(present.shape[-1]), -1)
        return HeldEntries(*self._read_slots(index, present), present & real_entries(key_mask, positions), positions)

    def _view_positions(self, width: int) -> torch.Tensor:
        """``[B, H, width]`` sequence index of each slot of :meth:`view`: the compressed entries' recorded
        positions, then the tokens appended since (``_compressed_at``, ``_compressed_at + 1``, ...)."""
        B, H, _ = self.shape
        device = self.row_lengths.device
        base = torch.tensor(self._base, dtype=torch.long, device=device).view(B, H)
        index, _ = left_pad_index(base + self._appended, width)  # rank of each slot within its row
        first = (torch.cumsum(base.reshape(-1), 0) - base.reshape(-1)).view(B, H, 1)
        kept = self._kept_positions.to(device).long()
        from_kept = kept[(first + index.clamp(max=(base - 1).clamp(min=0)[..., None])).clamp(
            max=max(kept.numel() - 1, 0))] if kept.numel() else torch.zeros_like(index)
        return torch.where(index < base[..., None], from_kept, self._compressed_at + index - base[..., None])

    def retain(self, keep: torch.Tensor, held: HeldEntries, spare: int | None = None) -> None:
        """Keep the entries of ``held`` (this layer's :meth:`view`) where ``keep`` is True, re-laying the
        layer out with ``spare`` free slots per row (default ``decode_reserve``); padding is never kept."""
        if keep.shape != held.valid.shape:
            raise ValueError(f"keep mask of shape {tuple(keep.shape)} does not match the layer's view "
                             f"{tuple(held.valid.shape)}")
        self.keys, self.values = held.keys, held.values
        self.compressed = False
        self.compress(keep & held.valid, spare=spare, positions=held.positions)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float, dense_fn: DenseAttention, module: torch.nn.Module,
               **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Ragged attention over the kept rows (dense attention before compression).

        Inference only: the ragged kernels have no autograd, so the output carries no gradient
        (a forward outside ``torch.no_grad()`` still works)."""
        if not self.compressed:
            return dense_fn(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        with torch.no_grad():
            out = self._attention(query, scaling, *logit_extras(kwargs))
        return out.transpose(1, 2).contiguous(), None

    # ------------------------------------------------ storage of a slot (a subclass stores it otherwise)
    def _empty_slots(self, total: int) -> torch.Tensor:
        """A zeroed buffer of ``total`` slots (zeros, not empty: kernels mask the free slots' scores, but
        ``0 * NaN`` garbage would still be NaN)."""
        return torch.zeros(total, self.head_dim, dtype=self.dtype, device=self.device)

    def _compact_entries(self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> None:
        """Write each row's kept entries of ``keys, values [B, H_kv, L, ...]`` from its offset."""
        kernels.compact(keys, values, keep, self.row_offsets, self.k_flat, self.v_flat)

    def _append_entries(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys, values [B, H_kv, Q, D]`` to every row in place (``row_lengths += Q``)."""
        kernels.append(keys, values, self.k_flat, self.v_flat, self.row_offsets, self.row_lengths)

    def _read_slots(self, index: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H_kv, W, D]`` at flat ``index`` (zeros where not ``present``)."""
        return gather_slots(self.k_flat, index, present), gather_slots(self.v_flat, index, present)

    def _attention(self, query: torch.Tensor, scaling: float, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H_q, Q, D]`` attention of ``query`` over the rows (with the family's ``softcap`` and ``sinks``);
        a decode step under a reader attends over the pages it selects."""
        if self.pages is not None and self._reads_pages(query):
            selected = self.pages.select(query, self.row_lengths, scaling, self.layer_idx, softcap)
            self._count_read(query, selected)
            return self.pages.attention(query, selected, self.k_flat, self.v_flat, self.row_offsets, self.row_lengths,
                                        scaling, softcap, sinks)
        self._count_read(query)
        return kernels.ragged_attention(query, self.k_flat, self.v_flat, self.row_offsets, self.row_lengths, scaling,
                                        softcap=softcap, sinks=sinks)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported with RaggedCache (rows are ragged per head); "
                                  "use num_beams=1, or the Mask evictor for a dense cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            raise NotImplementedError("expanding a filled RaggedCache along the batch is not supported; "
                                      "expand the inputs before prefill instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            raise NotImplementedError("selecting batch rows of a filled RaggedCache is not supported")

    # ------------------------------------------------------------ inspection
    def nbytes(self) -> int:
        tensors = (self.k_flat, self.v_flat) if self.compressed else (self.keys, self.values)
        pages = self.pages.nbytes() if self.pages is not None and self.compressed else 0
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + pages

    def batch_nbytes(self) -> list[int]:
        """Bytes each batch row holds (its kv heads' slots, free room included): what the row would
        hold as a cache of its own, since every row is laid out on its own."""
        if not self.compressed:
            if self.keys is None or self.values is None:
                return []
            per_row = self.keys[0].numel() * self.keys.element_size() * 2  # keys and values alike
            return [per_row] * self.keys.shape[0]
        B, H, D = self.shape
        offsets = self.row_offsets.tolist() + [self.k_flat.shape[0]]
        caps = [b - a for a, b in zip(offsets, offsets[1:])]
        per_slot = self.k_flat[0].nbytes + self.v_flat[0].nbytes if self.k_flat.shape[0] else 0
        pages = self.pages.batch_nbytes(B) if self.pages is not None else [0] * B
        return [sum(caps[b * H:(b + 1) * H]) * per_slot + pages[b] for b in range(B)]

    def head_lengths(self) -> torch.Tensor:
        if not self.compressed:
            return self._dense_head_lengths()
        B, H, _ = self.shape
        return self.row_lengths.view(B, H).long()

    def reset_reads(self) -> None:
        """Zero :attr:`reads` (in place: a compiled step may hold its address)."""
        self.reads.zero_()


def _mark_for_compile(k_flat: torch.Tensor, v_flat: torch.Tensor, *index: torch.Tensor) -> None:
    """The buffers' length changes at each re-layout: mark it dynamic so a compiled step does not
    specialise on it. On CUDA also mark every buffer a static address (they are mutated in place),
    so CUDA graphs (``mode="reduce-overhead"``) neither copy them nor skip the graph; a re-layout
    gives new addresses, which re-records the graph (a coarse, rare event)."""
    if torch.compiler.is_compiling():
        return
    for t in (k_flat, v_flat):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    if k_flat.device.type == "cuda":
        for t in (k_flat, v_flat, *index):
            torch._dynamo.mark_static_address(t)


def _row_token_index(offsets: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Flat positions of every valid token, row by row."""
    counts = torch.tensor(lengths, dtype=torch.long, device=offsets.device)
    starts = offsets.long().repeat_interleave(counts)
    first = torch.cumsum(counts, 0) - counts
    within = torch.arange(int(counts.sum()), device=offsets.device) - first.repeat_interleave(counts)
    return starts + within


#: the ragged cache class this host holds each storage structure in (``Storage.structure`` -> class; a class's
#: ``_new_layer`` builds its layers)
RAGGED_CACHES: dict[str, type["RaggedCache"]] = {}


def register_ragged_cache(structure: str, cls: type["RaggedCache"], override: bool = False) -> None:
    """Hold storage kinds of ``structure`` (:attr:`~kvpress_ada.storage.Storage.structure`) in ragged caches of
    class ``cls``."""
    if structure in RAGGED_CACHES and not override:
        raise ValueError(f"the storage structure {structure!r} already has a ragged cache; pass override=True")
    RAGGED_CACHES[structure] = cls


def ragged_cache_class(storage: Any) -> type["RaggedCache"]:
    """The ragged cache class holding ``storage``'s entries; a structure with none is refused in one line."""
    structure = type(storage).structure
    cls = RAGGED_CACHES.get(structure)
    if cls is None:
        raise ValueError(f"storage={storage.label!r} keeps entries as {structure!r}, which the transformers host holds "
                         f"in no cache class (known: {', '.join(sorted(RAGGED_CACHES))}): register one with "
                         "register_ragged_cache")
    return cls


class RaggedCache(PressCache):
    """Per-(batch, kv head) ragged KV cache; see the module docstring for the reserve policy.

    ``nbytes()`` reports bytes held for keys and values of all layers; ``head_lengths(layer)``
    returns ``LongTensor[B, H_kv]``. Compatible with ``model.generate`` (pass it as the cache, or
    let ``with press(model)`` create it). Its layers hold entries as ``storage`` says (default full
    precision; a kind of another structure: the class :func:`ragged_cache_class` names).
    """

    def __init__(self, config: Any = None, num_layers: int | None = None, decode_reserve: int = 8,
                 storage: Storage | None = None):
        if storage is None:
            from ...storage import FullPrecision

            storage = FullPrecision()
        self.storage = storage
        holder = ragged_cache_class(storage)
        holds = next((name for cls in type(self).__mro__ for name, registered in RAGGED_CACHES.items()
                      if registered is cls), None)
        if holds != type(storage).structure:
            raise ValueError(f"storage={storage.label!r} keeps entries as {type(storage).structure!r}, which "
                             f"{holder.__name__} holds, not {type(self).__name__}: build the cache with "
                             "kvpress_ada.hosts.transformers.caches.ragged_cache(storage, config)")
        super().__init__(layers=press_layers(config, num_layers, lambda: self._new_layer(decode_reserve)))

    def _new_layer(self, decode_reserve: int) -> RaggedLayer:
        """One empty layer holding the storage kind's entries (in the model's dtype here)."""
        return RaggedLayer(decode_reserve)

    def stores(self, storage: Any) -> bool:
        """Whether this cache keeps entries as ``storage`` says: the storage it was built for."""
        return storage == self.storage

    @property
    def compressed(self) -> bool:
        """Every layer the press compresses holds ragged rows (the state a compiled decode step expects; a
        hybrid model's sliding-window layers hold their window)."""
        return all(isinstance(layer, WindowLayer) or (isinstance(layer, RaggedLayer) and layer.compressed)
                   for layer in self.layers)

    def batch_nbytes(self) -> list[int]:
        """Bytes held per batch row over all layers (see :meth:`RaggedLayer.batch_nbytes`)."""
        per_layer = [layer.batch_nbytes() for layer in self.layers if isinstance(layer, (RaggedLayer, WindowLayer))]
        return [sum(row) for row in zip(*per_layer)]

    def read_with(self, reader: Any) -> None:
        """Decode steps of every ragged layer read the pages ``reader`` selects (``None``: every kept entry; see
        :meth:`RaggedLayer.read_with`)."""
        for i, layer in enumerate(self.layers):
            if isinstance(layer, RaggedLayer):
                layer.read_with(reader, i)

    def count_reads(self, enabled: bool = True) -> None:
        """Count (``enabled``) or stop counting what each decode step reads (:meth:`bytes_read`), from zero. Off by
        default: the count is a few device ops per layer and step that only a measurement needs (``kvpress-ada
        eval`` turns it on for its records' ``read_bytes_per_step``). Eager, before the decode steps it counts (a
        compiled step guards on it)."""
        for layer in self.layers:
            if isinstance(layer, RaggedLayer):
                layer.counts_reads = bool(enabled)
        self.reset_reads()

    def bytes_read(self) -> tuple[list[int], int]:
        """``(bytes per batch row, decode steps)`` read by the decode steps since :meth:`count_reads` or
        :meth:`reset_reads` (``([], 0)``: not counted, the default): what each step's attention call over a ragged
        layer read (measured where it attends or where the reader selects, :attr:`RaggedLayer.reads`), summed over
        the layers, and the most steps a layer counted. A step reads the keys and values of the entries it attends
        over as stored (under a reader: those of the selected pages; records with their scales and zero points, and
        a quantized layer's side tensors: anchor, key centre, residual ring) and the summaries of the pages it
        scores. A hybrid model's sliding-window layers are not counted. One host sync."""
        counts = [layer.reads for layer in self.layers
                  if isinstance(layer, RaggedLayer) and layer.counts_reads and layer.reads.numel()]
        if not counts or any(c.shape != counts[0].shape for c in counts):
            return [], 0
        totals = torch.stack(counts).cpu()  # [layers, B + 1]
        per_row, steps = totals[:, :-1].sum(0).tolist(), int(totals[:, -1].max())
        return per_row, steps

    def reset_reads(self) -> None:
        """Zero every ragged layer's read counters (:meth:`bytes_read` counts from here)."""
        for layer in self.layers:
            if isinstance(layer, RaggedLayer):
                layer.reset_reads()

    def reserve(self, q: int) -> None:
        """Room for ``q`` more tokens per row in every compressed layer, counted now (see
        :meth:`RaggedLayer.reserve`); the eager half of a compiled decode step."""
        for layer in self.layers:
            if isinstance(layer, RaggedLayer) and layer.compressed:
                layer.reserve(q)


register_ragged_cache("native", RaggedCache)


def read_with(cache: Any, reader: Any) -> None:
    """Decode steps over ``cache`` read the pages ``reader`` selects (:meth:`RaggedCache.read_with`); ``None``: every
    kept entry. Another cache kind takes no reader (refused in one line)."""
    if isinstance(cache, RaggedCache):
        cache.read_with(reader)
    elif reader is not None:
        raise ValueError(f"reader {type(reader).__name__} reads pages of a RaggedCache, not of a "
                         f"{type(cache).__name__}: pass no cache (the press builds one) or a RaggedCache")
