"""Evictors: which cache representation drops the unselected entries."""

from .base import EVICTORS, Evictor, register_evictor, topk_mask
from .mask import Mask
from .merging import MERGES, CaM, Merge, SimilarityMerge, register_merge
from .topk import TopK

__all__ = ["EVICTORS", "Evictor", "Mask", "TopK", "register_evictor", "topk_mask", "MERGES", "CaM", "Merge",
           "SimilarityMerge", "register_merge"]
