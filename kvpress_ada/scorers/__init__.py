"""Scorers, one per file: each returns ``[B, H_kv, L]`` importance (higher = keep).

The file, the registry name and the preset name of a scorer are the same word (``snapkv.py`` is
``snapkv``, ``h2o.py`` is ``h2o``, ...); older registry names load as aliases."""

from .base import SCORERS, PassChunk, PassScorer, Scorer, register_scorer
from .cap import CAP
from .chunkkv import ChunkKV
from .compactor import Compactor
from .composed import Composed
from .criticalkv import CriticalKV
from .cur import CUR
from .duo_attention import DuoAttention
from .entropy_gated_chunkkv import EntropyGatedChunkKV
from .expected_attention import ExpectedAttention
from .expected_attention_stats import ExpectedAttentionStats
from .fastkvzip import FastKVzip
from .finch import Finch
from .h2o import H2O, ObservedAttention
from .keydiff import KeyDiff
from .knorm import KNorm
from .kvcompose import KVCompose
from .kvgrad import KVgrad
from .kvzap import KVzap
from .kvzip import KVzip
from .lagkv import LagKV
from .leverage import Leverage
from .non_causal_attention import NonCausalAttention
from .qfilter import QFilter
from .random import RandomScorer
from .simlayerkv import SimLayerKV
from .snapkv import SnapKV
from .streamingllm import StreamingLLM
from .tova import TOVA

__all__ = ["SCORERS", "PassChunk", "PassScorer", "Scorer", "register_scorer", "CAP", "ChunkKV", "Compactor", "Composed",
           "CriticalKV", "DuoAttention", "CUR", "EntropyGatedChunkKV", "ExpectedAttention", "ExpectedAttentionStats",
           "FastKVzip", "Finch", "H2O", "KeyDiff", "KNorm", "KVCompose", "KVgrad", "KVzap", "KVzip", "LagKV",
           "Leverage", "NonCausalAttention", "ObservedAttention", "QFilter", "RandomScorer", "SimLayerKV", "SnapKV",
           "StreamingLLM", "TOVA"]
