"""Scorers, one per file: each returns ``[B, H_kv, L]`` importance (higher = keep)."""

from .base import SCORERS, Scorer, register_scorer
from .critical_kv import CriticalKV
from .expected_attention import ExpectedAttention
from .knorm import KNorm
from .observed_attention import ObservedAttention
from .random_scorer import RandomScorer
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM
from .tova import TOVA

__all__ = ["SCORERS", "Scorer", "register_scorer", "CriticalKV", "ExpectedAttention", "KNorm",
           "ObservedAttention", "RandomScorer", "SnapKV", "StreamingLLM", "TOVA"]
