"""Named presets reproducing published methods as Pipeline configurations."""

from __future__ import annotations

from typing import Callable

from .allocators import (
    AdaHead,
    AdaLayer,
    Calibrated,
    CalibratedLayer,
    CompositeLayer,
    PyramidLayer,
    Threshold,
    UniformHead,
    UniformLayer,
)
from .channels import ThinK
from .evictors import CaM, SimilarityMerge, TopK
from .pipeline import Pipeline
from .readers import TopPages
from .refusals import refusal
from .scorers import (
    CAP,
    CUR,
    H2O,
    TOVA,
    ChunkKV,
    Compactor,
    Composed,
    CriticalKV,
    DuoAttention,
    EntropyGatedChunkKV,
    ExpectedAttention,
    ExpectedAttentionStats,
    FastKVzip,
    Finch,
    KeyDiff,
    KNorm,
    KVCompose,
    KVgrad,
    KVzip,
    LagKV,
    Leverage,
    NonCausalAttention,
    QFilter,
    RandomScorer,
    SimLayerKV,
    SnapKV,
    StreamingLLM,
)
from .scorers.kvzap import KVzap
from .surrogate import SHIPPED_LINEAR

ADA_ALPHA = 0.2  # the paper's safeguard default
# the shipped MLP surrogate's median predicted log score over every layer, head and token of 8
# calibration texts (seed 20,000, 1k tokens; benchmarks/README.md): kvzap_threshold evicts about half
KVZAP_HALF_TAU = -6.04
# recent tokens the top-k kvzap presets always keep: of 0 / 16 / 32 / 64, the best mean accuracy over
# r = 0.5 / 0.75 / 0.9, question-agnostic and question-aware, on 24 calibration samples (seed 20,000, 1k
# tokens; benchmarks/README.md, "KVzap presses")
KVZAP_WINDOW = 16
# tokens per block of the block_keydiff preset (kvpress's BlockPress default)
BLOCK_SIZE = 128

# LU-KV's keep curve of Expected Attention on the default model (`kvpress-ada calibrate --method lukv`)
LUKV_CURVE = "builtin:smollm2_135m_lukv"

# preset name == scorer registry name == file in scorers/ for the single-scorer presets
_PRESETS: dict[str, Callable[[], dict]] = {
    "snapkv": lambda: dict(scorer=SnapKV()),
    "pyramidkv": lambda: dict(scorer=SnapKV(), layers=PyramidLayer()),
    "ada_snapkv": lambda: dict(scorer=SnapKV(), allocator=AdaHead(alpha=ADA_ALPHA)),
    "ada_pyramidkv": lambda: dict(scorer=SnapKV(), allocator=AdaHead(alpha=ADA_ALPHA), layers=PyramidLayer()),
    "streamingllm": lambda: dict(scorer=StreamingLLM()),
    "h2o": lambda: dict(scorer=H2O()),
    "tova": lambda: dict(scorer=TOVA()),
    "knorm": lambda: dict(scorer=KNorm()),
    "expected_attention": lambda: dict(scorer=ExpectedAttention()),
    "ada_expected_attention": lambda: dict(scorer=ExpectedAttention(), allocator=AdaHead(alpha=ADA_ALPHA)),
    # Expected Attention whose query statistics were measured offline on the default model (kvpress's
    # ExpectedAttentionStatsPress; kvpress_ada/query_stats/smollm2_135m.safetensors; refused for another model:
    # `kvpress-ada query-stats`); no Ada variant: the scores are softmax shares of each head's own statistics
    "expected_attention_stats": lambda: dict(scorer=ExpectedAttentionStats()),
    "criticalkv": lambda: dict(scorer=CriticalKV()),
    "ada_criticalkv": lambda: dict(scorer=CriticalKV(), allocator=AdaHead(alpha=ADA_ALPHA)),
    "random": lambda: dict(scorer=RandomScorer()),
    "lagkv": lambda: dict(scorer=LagKV()),
    # rank scores are identical across heads (Ada would stay uniform): Ada competes on the softmax shares
    "ada_lagkv": lambda: dict(scorer=LagKV(cross_scoring=True), allocator=AdaHead(alpha=ADA_ALPHA)),
    "keydiff": lambda: dict(scorer=KeyDiff()),
    # KVzip: one top-k over all layers and heads (alpha 0 at both scopes), per layer, or Ada at model scope
    "kvzip": lambda: dict(scorer=KVzip(), layers=AdaLayer(alpha=0.0), allocator=AdaHead(alpha=0.0)),
    # KVzip+ (KVzap paper's normalisation: attention x ||W_O v|| / ||h||), same global top-k as kvzip
    "kvzip_plus": lambda: dict(scorer=KVzip(plus=True), layers=AdaLayer(alpha=0.0), allocator=AdaHead(alpha=0.0)),
    "kvzip_layerwise": lambda: dict(scorer=KVzip(), allocator=AdaHead(alpha=0.0)),
    "ada_kvzip": lambda: dict(scorer=KVzip(), layers=AdaLayer(alpha=ADA_ALPHA), allocator=AdaHead(alpha=ADA_ALPHA)),
    # KVgrad: KVzip's reconstruction (chunks of 512) with each attention weighted by ||W_O v|| and by the gradient
    # norm of the last hidden states' energy w.r.t. the attention output (one backward per pass); one top-k over all
    # layers and heads (kvpress's KVgradPress), or Ada at model scope
    "kvgrad": lambda: dict(scorer=KVgrad(), layers=AdaLayer(alpha=0.0), allocator=AdaHead(alpha=0.0)),
    "ada_kvgrad": lambda: dict(scorer=KVgrad(), layers=AdaLayer(alpha=ADA_ALPHA), allocator=AdaHead(alpha=ADA_ALPHA)),
    # KVzap: KVzip's scores predicted from each token's hidden state by the default model's shipped surrogate
    # (kvpress_ada/surrogates/; refused for another model: `kvpress-ada distill`), same global top-k as kvzip,
    # the last KVZAP_WINDOW prompt tokens kept (a question there is scored by a surrogate trained without one)
    "kvzap": lambda: dict(scorer=KVzap(window=KVZAP_WINDOW), layers=AdaLayer(alpha=0.0), allocator=AdaHead(alpha=0.0)),
    "kvzap_linear": lambda: dict(scorer=KVzap(path=SHIPPED_LINEAR, window=KVZAP_WINDOW), layers=AdaLayer(alpha=0.0),
                                 allocator=AdaHead(alpha=0.0)),
    # keep what clears the threshold (no ratio needed; a ratio caps each head)
    "kvzap_threshold": lambda: dict(scorer=KVzap(), allocator=Threshold(tau=KVZAP_HALF_TAU)),
    # StreamingLLM's tokens with KVzip's per-(layer, head) budgets, calibrated offline on the default model
    # (kvpress_ada/calibration/smollm2_135m_kvzip.json); refused for another model: `kvpress-ada calibrate`
    "calibrated_streamingllm": lambda: dict(scorer=StreamingLLM(), layers=CalibratedLayer(), allocator=Calibrated()),
    # key statistics: outlier keys of each head's pre-RoPE key matrix (Compactor's leverage scores)
    "leverage": lambda: dict(scorer=Leverage()),
    "ada_leverage": lambda: dict(scorer=Leverage(), allocator=AdaHead(alpha=ADA_ALPHA)),
    # CurDKV: squared key and value norms as shares of local windows (kvpress's CURPress)
    "cur": lambda: dict(scorer=CUR()),
    "ada_cur": lambda: dict(scorer=CUR(), allocator=AdaHead(alpha=ADA_ALPHA)),
    # Compactor: z-scored leverage blended with z-scored non-causal chunked attention (one-shot prefill only)
    "non_causal_attention": lambda: dict(scorer=NonCausalAttention()),
    "compactor": lambda: dict(scorer=Compactor()),
    # Q-Filters: each key's projection on its head's principal query direction, measured on the default model
    # (kvpress_ada/qfilters/smollm2_135m.safetensors); refused for another model: `kvpress-ada qfilters`
    "qfilter": lambda: dict(scorer=QFilter()),
    # CapKV: ridge leverage of each value in the query-weighted capacity matrix (kvpress's CapPress)
    "cap": lambda: dict(scorer=CAP()),
    # ChunkKV: SnapKV's scores averaged over chunks of 20 tokens, whole chunks kept (one ranking per layer, as in
    # kvpress); the Ada variant ranks each head's chunks and splits the budget across heads on them
    "chunkkv": lambda: dict(scorer=ChunkKV()),
    "ada_chunkkv": lambda: dict(scorer=ChunkKV(shared=False), allocator=AdaHead(alpha=ADA_ALPHA)),
    # entropy-gated ChunkKV (kvpress's EntropyGatedChunkKVPress): SnapKV's chunks of 10 in decreasing mean, an
    # important chunk whose scores sit on few tokens (entropy below the median) keeps only its 4 best, the budget
    # freed going to further chunks; the Ada variant walks each head apart and compares the heads' chunk means
    "entropy_gated_chunkkv": lambda: dict(scorer=EntropyGatedChunkKV()),
    "ada_entropy_gated_chunkkv": lambda: dict(scorer=EntropyGatedChunkKV(shared=False),
                                              allocator=AdaHead(alpha=ADA_ALPHA)),
    # KVCompose: attention received from a second reading of the context; composite tokens give every kv head of
    # a layer the same count (one top-k over the layers' composite scores); Ada splits each layer's count by heads
    "kvcompose": lambda: dict(scorer=KVCompose(), layers=CompositeLayer()),
    "ada_kvcompose": lambda: dict(scorer=KVCompose(), layers=CompositeLayer(), allocator=AdaHead(alpha=ADA_ALPHA)),
    # BlockPress (KeyDiff paper's block-wise prompt processing): the prompt prefilled and compressed in blocks of
    # BLOCK_SIZE tokens, each block scored with the entries kept so far (a real chunked prefill: peak memory
    # budget + block, where kvpress's BlockPress simulates it after one full forward)
    "block_keydiff": lambda: dict(scorer=KeyDiff(), prefill_chunk=BLOCK_SIZE),
    # LU-KV: Expected Attention's ranking with per-(layer, kv head) budgets read at the press's own ratio off a keep
    # curve profiled offline on the default model (kvpress_ada/calibration/smollm2_135m_lukv.json; refused for
    # another model: `kvpress-ada calibrate --method lukv`)
    "lukv": lambda: dict(scorer=ExpectedAttention(), layers=CalibratedLayer(path=LUKV_CURVE),
                         allocator=Calibrated(path=LUKV_CURVE)),
    # FINCH: the prompt's last 64 queries (the question) vote, normalised by the keys each sees; kept keys re-rotated
    # to contiguous positions (kvpress's FinchPress, rerotate_keys=True)
    "finch": lambda: dict(scorer=Finch(), evictor=TopK(rerotate=True)),
    "ada_finch": lambda: dict(scorer=Finch(), allocator=AdaHead(alpha=ADA_ALPHA), evictor=TopK(rerotate=True)),
    # kvpress's KeyRerotationPress around StreamingLLM (transformers' former SinkCache): sinks and recent tokens,
    # kept keys re-rotated so each head's entries sit right before the next token's position
    "rerotated_streamingllm": lambda: dict(scorer=StreamingLLM(), evictor=TopK(rerotate=True)),
    # Fast KVzip: the log of a sink-attention gate trained on KVzip's scores (shipped for the default model,
    # kvpress_ada/surrogates/; refused for another model: `kvpress-ada distill --kind gate`), one top-k over all
    # layers and heads as kvpress's FastKVzipPress; the first 4 and the last 2% of the tokens kept
    "fastkvzip": lambda: dict(scorer=FastKVzip(), layers=AdaLayer(alpha=0.0), allocator=AdaHead(alpha=0.0)),
    "ada_fastkvzip": lambda: dict(scorer=FastKVzip(), layers=AdaLayer(alpha=ADA_ALPHA),
                                  allocator=AdaHead(alpha=ADA_ALPHA)),
    # ThinK: SnapKV's tokens, then half the channels of each kv head's kept keys zeroed (query-driven; no memory
    # freed: the cache stores full-width keys, see kvpress_ada/channels.py); compression_ratio=0: channels only
    "think": lambda: dict(scorer=SnapKV(), key_channels=ThinK()),
    "ada_think": lambda: dict(scorer=SnapKV(), allocator=AdaHead(alpha=ADA_ALPHA), key_channels=ThinK()),
    # merging the dropped entries' values into kept ones (SnapKV's selection): by key similarity (kvpress's
    # MergingPress) or into the kept entries that follow, by score (CaM, kvpress's CAMPress), at every eviction
    "merging": lambda: dict(scorer=SnapKV(), evictor=TopK(merge=SimilarityMerge())),
    "ada_merging": lambda: dict(scorer=SnapKV(), allocator=AdaHead(alpha=ADA_ALPHA),
                                evictor=TopK(merge=SimilarityMerge())),
    "cam": lambda: dict(scorer=SnapKV(), evictor=TopK(merge=CaM())),
    "ada_cam": lambda: dict(scorer=SnapKV(), allocator=AdaHead(alpha=ADA_ALPHA), evictor=TopK(merge=CaM())),
    # SimLayerKV: a lazy layer (its last query gives > 90% of its attention to the 4 initial and 128 recent tokens)
    # keeps those, every other layer keeps everything (the paper keeps 1024 recent tokens of 4k-128k contexts; 128
    # for the default model's 1k: about 11 of its 30 layers are lazy on calibration samples, seed 10,007)
    "simlayerkv": lambda: dict(scorer=SimLayerKV(n_recent=128), allocator=Threshold(tau=0.0)),
    # Quest (Tang et al., ICML 2024): nothing evicted (no budget; the scorer would only serve one given), each decode
    # step reads each kv head's first, newest and best-bounded pages of 16 entries, 1,024 tokens per head
    "quest": lambda: dict(scorer=KNorm(), reader=TopPages()),
    # evict with Ada-SnapKV (give compression_ratio or budget), then read the kept cache by pages, the read budget
    # split across kv heads by Ada-KV's allocator over the page bounds (evicting and reading sparsely combined)
    "ada_snapkv_read": lambda: dict(scorer=SnapKV(), allocator=AdaHead(alpha=ADA_ALPHA),
                                    reader=TopPages(allocator=AdaHead(alpha=ADA_ALPHA))),
    # DuoAttention: half the (layer, kv head) pairs, those whose output moves least without the middle of the
    # context (the default model's measured patterns, kvpress_ada/calibration/smollm2_135m_duo.json; refused for
    # another model: `kvpress-ada calibrate --method duo`), keep only 128 sinks and 256 recent entries
    "duo_attention": lambda: dict(scorer=DuoAttention(), allocator=Threshold(tau=0.0)),
    # kvpress's ComposedPress of two token presses: KNorm keeps 3/4 of each head's entries, SnapKV ranks those for
    # the budget (compression_ratio is the total: kvpress's 1 - (1 - r_knorm) * (1 - r_snapkv))
    "composed": lambda: dict(scorer=Composed()),
}


def preset_names() -> list[str]:
    return list(_PRESETS)


def portable_preset_names() -> list[str]:
    """Presets that serve any supported model (not those tied to one model by a calibration file)."""
    return [name for name, factory in _PRESETS.items()
            if not any(getattr(type(c), "model_specific", False) for c in factory().values())]


def register_preset(name: str, factory: Callable[[], dict], override: bool = False) -> None:
    """Add a preset: ``factory()`` returns Pipeline fields (scorer, allocator, layers, evictor).

    A name that already exists is refused unless ``override=True``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"register_preset needs a non-empty string name, got {name!r}")
    if not callable(factory):
        raise TypeError(f"register_preset({name!r}) needs a callable returning Pipeline fields, got {factory!r}")
    if name in _PRESETS and not override:
        raise ValueError(f"a preset named {name!r} already exists; pass register_preset({name!r}, factory, "
                         f"override=True) to replace it")
    _PRESETS[name] = factory


def unregister_preset(name: str) -> None:
    """Remove a preset added with :func:`register_preset` (tests and plugins cleaning up)."""
    _PRESETS.pop(name, None)


def preset(name: str, compression_ratio: float | None = None, budget: int | None = None, **overrides) -> Pipeline:
    """Build a named preset, e.g. ``preset("ada_snapkv", compression_ratio=0.75)``.

    ``overrides`` replace components (``evictor=Mask()``, ``allocator=AdaHead(alpha=0.5)``).
    """
    try:
        fields = _PRESETS[name]()
    except KeyError:
        reason = refusal(name) if isinstance(name, str) else None
        if reason is not None:  # a published press kvpress_ada does not build: say what it would need
            raise ValueError(f"preset {name!r} is not available: {reason}") from None
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(_PRESETS)}") from None
    fields.update(overrides)
    fields.setdefault("allocator", UniformHead())
    fields.setdefault("layers", UniformLayer())
    return Pipeline(**fields, compression_ratio=compression_ratio, budget=budget)
