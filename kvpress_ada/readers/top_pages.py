"""TopPages: Quest's query-aware page selection over the kept cache, with the read budget split across kv heads
by a head allocator (uniform, or Ada-KV's)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, SerializeAsAny, field_validator, model_validator

from ..allocators.heads import ALLOCATORS, AdaHead, HeadAllocator, UniformHead, fit_to_valid
from ..kernels.ragged.sparse_cpu_kernel import select_pages_cpu
from ..ranking import TIE_RTOL, top_k
from .base import Reader, register_reader

MAX_READ = 2**31 - 1  # tokens per kv head (the ragged cache's offsets are int32)


def row_pages(lengths: torch.Tensor, page_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exists, always) [B, H, width]`` bool for rows holding ``lengths [B, H]`` entries: the pages that hold an
    entry, and those read at every step: each row's first page (its oldest entries: the attention sinks when kept)
    and its newest (the current token's)."""
    j = torch.arange(width, device=lengths.device)
    n = (lengths.long() + page_size - 1) // page_size
    exists = j < n[..., None]
    return exists, exists & ((j == 0) | (j == n[..., None] - 1))


@register_reader("top_pages")
class TopPages(Reader):
    """Quest (Tang et al., ICML 2024, arXiv 2406.10774) over the kept entries, with head-wise read budgets.

    Each kv head reads on average ``ceil(budget / page_size)`` pages (``budget`` rounded up to whole pages): the
    layer's ``H_kv`` times that, split across its kv heads by ``allocator`` as a memory budget is (``uniform``, or
    ``ada``: Ada-KV's top-k over the pages of every head, mixed with the uniform share by ``alpha``), over each
    page's estimated share of its head's attention: ``softmax`` over the head's pages of the page bounds, the
    largest over the query heads of the group (normalised per head, so comparable across heads as Ada-KV's
    attention weights are). Each row's first page and newest page are always read (a head's floor: both, or
    the pages it holds), then its best pages by bound. A head with fewer pages than its share reads them all and
    its excess goes to the best unread pages of the row's other heads, so each batch row of a layer reads exactly
    ``min(H_kv * ceil(budget / page_size), pages held)`` pages.

    ``fraction`` (optional): a read budget that grows with the cache: each row of a layer reads on average at least
    ``ceil(fraction * its heads' mean pages held)`` pages per kv head (``budget`` stays the floor), so a long
    generation keeps reading the same share of what its heads hold.
    """

    name: Literal["top_pages"] = "top_pages"
    budget: int = Field(1024, ge=1, le=MAX_READ, description="average tokens read per kv head and decode step "
                                                             "(rounded up to whole pages)")
    page_size: int = Field(16, ge=1, le=256, description="consecutive kept entries per page (a power of two)")
    fraction: float | None = Field(None, gt=0.0, le=1.0, description="read at least this share of the pages each "
                                                                      "row's heads hold on average (None: budget only)")
    allocator: SerializeAsAny[HeadAllocator] = Field(default_factory=UniformHead,
                                                     description="splits a layer's read budget across its kv heads")

    @field_validator("allocator", mode="before")
    @classmethod
    def _build_allocator(cls, value: Any) -> Any:
        return ALLOCATORS.build(value)

    @model_validator(mode="after")
    def _check(self) -> "TopPages":
        P = self.page_size
        if P & (P - 1):
            raise ValueError(f"page_size={P} is not a power of two; use 1, 2, 4, 8, 16, 32, ...")
        if self.budget < 2 * P:
            raise ValueError(f"budget={self.budget} tokens cannot hold a row's first and newest pages of "
                             f"page_size={P}: give budget >= {2 * P}")
        if type(self.allocator).sets_budget:
            raise ValueError(f"allocator {type(self.allocator).__name__} sets its own budget; a read budget is split "
                             "by one that splits a given budget (uniform, ada)")
        return self

    def check_model(self, config: Any) -> None:
        self.allocator.check_model(config)

    @property
    def pages_per_head(self) -> int:
        """Average pages read per kv head: ``ceil(budget / page_size)``."""
        return -(-self.budget // self.page_size)

    def reads_every_page(self, longest: int) -> bool:
        return -(-longest // self.page_size) <= self.pages_per_head

    def page_counts(self, bounds: torch.Tensor, lengths: torch.Tensor,
                    layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [B, H, W], counts [B, H])``: what each page competes with (``+inf`` for the pages always read,
        ``-inf`` for those that hold nothing) and the pages each kv head reads."""
        scores, counts, _ = self._counts(bounds, lengths, layer_idx)
        return scores, counts

    def _counts(self, bounds: torch.Tensor, lengths: torch.Tensor,
                layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`page_counts` and the pages each row holds (``exists [B, H, W]``)."""
        B, H, _, W = bounds.shape
        exists, always = row_pages(lengths, self.page_size, W)
        # pages a row does not hold: the lowest finite logit (a row holding none gets finite shares, dropped below)
        logits = bounds.float().masked_fill(~exists[:, :, None], torch.finfo(torch.float32).min)
        # float64 shares rounded once: the order of the sums and exp's last bits decide no page (ties are near here:
        # bounds soft-capped or of similar pages), and the fused CPU kernel computes the same bits
        share = torch.softmax(logits.double(), dim=-1).amax(2).float()
        inf = torch.full_like(share, float("inf"))
        scores = torch.where(always, inf, torch.where(exists, share, -inf))
        per_head = torch.full((B,), self.pages_per_head, dtype=torch.long, device=bounds.device)
        if self.fraction is not None:  # the share of the row's mean pages held, whole pages, the budget its floor
            held = exists.sum(-1).double().mean(-1)
            per_head = torch.maximum(per_head, torch.ceil(held * self.fraction).long())
        counts = self.allocator.allocate_layer(scores, per_head, layer_idx, comparable=True).long()
        if (counts.device.type == "cpu" and not torch.compiler.is_compiling()
                and bool((counts <= exists.sum(-1)).all())):
            return scores, counts, exists  # they fit: fit_to_valid returns them unchanged (a free check on CPU)
        return scores, fit_to_valid(scores, counts, exists, _best), exists

    def select(self, bounds: torch.Tensor, lengths: torch.Tensor, layer_idx: int) -> torch.Tensor:
        scores, counts, exists = self._counts(bounds, lengths, layer_idx)
        return _best(scores, counts) & exists

    def select_fused(self, query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, table: torch.Tensor,
                     lengths: torch.Tensor, scale: float, layer_idx: int,
                     softcap: float | None = None) -> torch.Tensor | None:
        """Eager CPU calls with a uniform or Ada allocator: the bounds, shares, read budgets, fit and top-k of
        :meth:`select` in one C call per layer (:func:`~kvpress_ada.kernels.ragged.sparse_cpu_kernel.select_pages_cpu`;
        the same pages as :meth:`select` over the kernel's bounds); ``None`` otherwise (the torch code)."""
        kind = type(self.allocator)
        if kind is not UniformHead and kind is not AdaHead:  # a subclass may split otherwise
            return None
        alpha = self.allocator.alpha if isinstance(self.allocator, AdaHead) else None
        return select_pages_cpu(query, kmin, kmax, table, lengths, scale, softcap, self.page_size, self.pages_per_head,
                                alpha, TIE_RTOL, self.fraction)


def _best(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The ``counts [B, H]`` best pages of each head (ties: the newer pages)."""
    return top_k(scores, counts, recent_first=True)
