"""Pages in vLLM's own CPU layout, attended by vLLM's own CPU kernel, owned per (request, kv head).

vLLM's CPU attention (``cpu_attention_with_kv_cache``) reads a KV tensor ``[blocks, H_kv, S, D]`` (keys and
values apart) through one block table per request, in an in-page layout chosen per ISA (``vec`` in fp32: keys
transposed ``[D, S]``, values ``[S, D]``; ``amx`` in bf16: tiled) and written by ``cpu_attn_reshape_and_cache``.
Viewing the tensor as ``[blocks * H_kv, 1, S, D]`` makes each (block, head) a page of a one-head "request", so
each (request, kv head) row of a press is one request of vLLM's kernel: its own page table, its own length, its
``G`` query heads; bottom-right causal masking is the kernel's own. :class:`VllmPagePool` is a
:class:`~kvpress_ada.serving.pages.PagePool` whose entries are written and attended that way and read back (for
a press's scorer, and to move kept entries) through the slot offsets :func:`probe_layout` measured by writing
marked entries with vLLM's op: no layout is assumed, and a layout the probe cannot map is refused in one line.
"""

from __future__ import annotations

import warnings

import torch
from vllm import _custom_ops as ops

from ...serving.pages import PagePool


def probe_layout(isa: str, page_size: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_offset, value_offset)`` int64 ``[S, D]``: where vLLM's ``cpu_attn_reshape_and_cache`` puts channel
    ``d`` of the entry in slot ``s`` of a page, in elements from the start of the page's key (value) half.
    Measured by writing entries marked with their slot, then with their channel (small integers: exact in any
    float dtype). Raises ``ValueError`` when the written elements are not a one-to-one map."""
    S, D = page_size, head_dim
    cache = torch.zeros(1, 1, 2 * S, D, dtype=dtype)
    k_cache, v_cache = cache.chunk(2, dim=2)
    slots = torch.arange(S, dtype=torch.long)
    found = []
    for marks in (torch.arange(S)[:, None].expand(S, D), torch.arange(D)[None, :].expand(S, D)):
        entries = (marks + 1).to(dtype)[:, None].contiguous()  # [S, 1, D]: 0 stays "never written"
        cache.zero_()
        ops.cpu_attn_reshape_and_cache(entries, entries, k_cache, v_cache, slots, isa)
        found.append(cache.view(2, S * D).long() - 1)  # per element: the mark written there
    offsets = []
    for half in range(2):
        slot_of, chan_of = found[0][half], found[1][half]
        if bool((slot_of < 0).any()) or bool((chan_of < 0).any()):
            raise ValueError(f"vLLM's CPU layout ({isa}, {dtype}) left elements of a page unwritten: cannot map it")
        where = torch.full((S, D), -1, dtype=torch.long)
        where[slot_of, chan_of] = torch.arange(S * D)
        if bool((where < 0).any()):
            raise ValueError(f"vLLM's CPU layout ({isa}, {dtype}) is not one element per (slot, channel)")
        offsets.append(where)
    return offsets[0], offsets[1]


class VllmPagePool(PagePool):
    """A pool of ``P`` pages of ``S`` entries laid out as vLLM's CPU kernel reads them, over ``pages [P, 2, S, D]``
    (each page's key half then its value half: vLLM's ``[blocks, H_kv, S, 2 * D]`` per layer, viewed so), with
    the ISA vLLM chose for the layer (module docstring)."""

    def __init__(self, pages: torch.Tensor, isa: str):
        super().__init__(pages[:, 0], pages[:, 1])
        P, _, S, D = pages.shape
        self.isa = isa
        self._raw = torch.as_strided(pages, (P, 2 * S * D), (pages.stride(0), 1))  # each page's elements
        self._k_cache = torch.as_strided(pages, (P, 1, S, D), (pages.stride(0), pages.stride(0), D, 1))
        self._v_cache = torch.as_strided(pages, (P, 1, S, D), (pages.stride(0), pages.stride(0), D, 1),
                                         pages.storage_offset() + S * D)
        self._k_offset, self._v_offset = probe_layout(isa, S, D, pages.dtype)
        self._v_offset = self._v_offset + S * D

    def _write_entries(self, flat: torch.Tensor, page: torch.Tensor, slot: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor) -> None:
        dtype = self.k_pages.dtype
        ops.cpu_attn_reshape_and_cache(keys.to(dtype).unsqueeze(1).contiguous(),
                                       values.to(dtype).unsqueeze(1).contiguous(), self._k_cache, self._v_cache,
                                       flat.long(), self.isa)

    def _read(self, page: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        page = page[:, None]  # each entry's D elements, where the layout put them in its page
        return self._raw[page, self._k_offset[slot]], self._raw[page, self._v_offset[slot]]

    def attend(self, query: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, query_start: torch.Tensor,
               scale: float) -> torch.Tensor:
        """vLLM's kernel with one request per (request, kv head) row: its ``G`` query heads, its pages, its length."""
        T, H_q, D = query.shape
        R = table.shape[0]
        N = query_start.shape[0] - 1
        H = R // N
        G = H_q // H
        counts = (query_start[1:] - query_start[:-1]).long()
        row_counts = counts.repeat_interleave(H)  # rows in (request, head) order
        if T == N and bool((counts == 1).all()):  # one token per request: rows are the query's heads in order
            rows_q, index = query.reshape(R, G, D), None
        else:  # request n's tokens for head h, row after row
            start = query_start[:-1].long().repeat_interleave(H)
            first = torch.cumsum(row_counts, 0) - row_counts
            row = torch.repeat_interleave(torch.arange(R, device=query.device), row_counts, output_size=T * H)
            within = torch.arange(T * H, device=query.device) - first[row]
            index = (row % H) * T + start[row] + within  # into the [H, T] order of heads-major queries
            rows_q = query.view(T, H, G, D).transpose(0, 1).reshape(H * T, G, D).index_select(0, index)
        query_rows = torch.zeros(R + 1, dtype=torch.int32, device=query.device)
        torch.cumsum(row_counts, 0, out=query_rows[1:])
        seq_lens = lengths.to(torch.int32)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=R, num_heads=G, num_kv_heads=1, head_dim=D, seq_lens=seq_lens, dtype=query.dtype,
            query_start_loc=query_rows, causal=True, sliding_window_size=-1, isa=self.isa, enable_kv_split=False)
        out = torch.empty_like(rows_q)
        ops.cpu_attention_with_kv_cache(
            query=rows_q.contiguous(), key_cache=self._k_cache, value_cache=self._v_cache, output=out,
            query_start_loc=query_rows, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=table.to(torch.int32), softcap=0.0, scheduler_metadata=metadata,
            s_aux=None)
        if index is None:
            return out.view(T, H_q, D)
        heads_major = torch.empty(H * T, G, D, dtype=out.dtype, device=out.device)
        heads_major[index] = out
        return heads_major.view(H, T, G, D).transpose(0, 1).reshape(T, H_q, D)


def vllm_pool(pages: torch.Tensor, isa: str) -> PagePool:
    """A :class:`VllmPagePool` over ``pages [P, 2, S, D]``; where vLLM's layout cannot be mapped, a plain
    :class:`~kvpress_ada.serving.pages.PagePool` (our own layout and kernels) over the same memory."""
    try:
        return VllmPagePool(pages, isa)
    except ValueError as err:
        warnings.warn(f"{err}; the press attends with its own kernels over plain pages (slower)", stacklevel=2)
        return PagePool(pages[:, 0], pages[:, 1])
