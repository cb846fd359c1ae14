"""Kept positions of kvpress_ada's presets against NVIDIA kvpress 0.5.5's presses, on identical token ids.

For each case (a tiny model of the test suite, seeded token ids, a compression ratio whose kept counts agree:
kvpress keeps ``int(L (1 - r))``, we keep ``round(L (1 - r))``) kvpress runs its press in its own virtualenv
(``benchmarks/kvpress_agreement_worker.py``; kvpress pins ``transformers<5.3``) and what its cache holds after the
prefill is recorded in ``tests/fixtures/kvpress_agreement.json``, under a digest of the model's weights: the kept
positions per (layer, kv head), and for the presses that rewrite what they keep the kept keys (ThinK's zeroed
channels, re-rotated keys) or values (merged values). ``tests/test_kvpress_recorded.py`` then runs our preset
through the model (the transformers host, the cache it leaves) and compares, in any environment, without kvpress.

A case is ``exact`` where the semantics coincide: then every (layer, kv head) must keep kvpress's positions (a
difference only at a float tie of our scores: a repeated token's keys in the first layer; LagKV's rank scores) and
the rewritten tensors must agree. Where kvpress draws or downloads something, both sides get the same: the leverage
sketch, seeded random Q-filters, Fast KVzip gates and DuoAttention head patterns for the tiny model. Settings are
chosen where the semantics coincide (SnapKV without pooling, whose edge kvpress pads differently; ChunkKV's window a
whole number of chunks); the defaults are recorded too, as not ``exact`` cases: reported, not asserted, the reason
in :data:`DIFFERENCES`. The Ada variants are left out (kvpress's safeguard rule differs:
``benchmarks/kvpress_compare.py``'s ``~kvpress`` replicas). :data:`NOT_HERE` lists kvpress's presses without a
preset here and :data:`ELSEWHERE` those compared by other scripts.

    python benchmarks/kvpress_agreement.py --record   # builds the kvpress venv if needed (~2 min), rewrites the file
    python benchmarks/kvpress_agreement.py --check    # our kept positions against the records (no kvpress)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

FIXTURE = ROOT / "tests" / "fixtures" / "kvpress_agreement.json"
RATIO = 0.5
SEED = 1  # the tiny model's seed (conftest.build_model)
RECORD = "python benchmarks/kvpress_agreement.py --record"
DUO_SINKS, DUO_RECENT = 8, 24  # what a streaming head of the random DuoAttention patterns keeps

# kvpress press -> how its semantics differ from our preset's (a case that is not exact shows it; the exact cases
# take settings where they coincide, or assert only what coincides)
DIFFERENCES = {
    "SnapKVPress": "pooling: kvpress pools the scores after dropping the window's columns (the last context entries "
                   "average in zero padding); ours pools every column over valid entries only, then protects the "
                   "window",
    "TOVAPress": "kvpress averages the last query's attention over every query head of the layer (one ranking for all "
                 "kv heads); ours over each kv head's query group",
    "ObservedAttentionPress": "kvpress divides each key's accumulated attention by the number of queries that see it; "
                              "ours sums it (H2O's heavy hitters)",
    "ExpectedAttentionPress": "query statistics: kvpress's over every prefill query but the first 4, sinks out of the "
                              "softmax; ours over the last 128 queries (benchmarks/kvpress_compare.py's replica "
                              "expected_attention~kvpress reproduces kvpress's)",
    "CriticalKVPress": "kvpress: two stages (half the budget by the wrapped press's score, the rest by that score "
                       "times the group's mean ||W_o v||_1); ours: one score, each query head's attention times its "
                       "own ||W_o v||_1, pooled (the paper's per-head product)",
    "ChunkKVPress": "kvpress counts chunks from the first token and keeps int(chunks (1 - r)) whole chunks, the "
                    "window averaged into its chunks; ours counts from the last, protects the window one by one and "
                    "keeps exactly the budget",
    "EntropyGatedChunkKVPress": "as ChunkKVPress (chunks from the first token, the window averaged into its chunks); "
                                "ours counts chunks from the last entry, protects the window one by one and scores "
                                "it as the ranking's best score in its chunk's statistics (kvpress's SnapKV: the "
                                "best plus one): the same walk where the window is whole chunks at the end; ours takes "
                                "scores, means and entropies within the top-k's tie tolerance (1e-5) as ties, where "
                                "kvpress's rounding decides: with SnapKV on the tiny model every chunk's entropy lies "
                                "within 1e-6 of the median (near-uniform attention), so ours gates no chunk",
    "BlockPress": "layers after the first: ours is a real chunked prefill (later blocks attend to the compressed "
                  "cache, so deeper keys differ); kvpress scores its blocks after one full forward (the first layer's "
                  "keys are the same: exact there)",
    "FinchPress": "kvpress weights a window query's attention by its index (the keys it sees minus one) and finds the "
                  "window by a delimiter token it adds to the vocabulary; ours by the keys it sees, the window a fixed "
                  "number of trailing queries",
    "KeyRerotationPress": "kvpress re-rotates a head's n kept keys to positions 0..n-1 (the next token then at n); "
                          "ours to L-n..L-1 (the next token keeps its true position L): the same keys moved by L - n, "
                          "compared so",
    "SimLayerKVPress": "kvpress's lazy share omits the last query's own column and keeps n_recent - n_last recent "
                       "entries; ours counts the n_recent last entries, the query's own included, and keeps them",
    "ComposedPress": "kvpress hands the second press the first one's survivors in score order, so SnapKV's window "
                     "and causal mask fall on the lowest-scored survivors; ours keeps them in position order",
    "LUKVPress": "kvpress's only curve is Llama-3.1-8B's (downloaded; both sides here read one curve) and its "
                 "Expected Attention differs (above: the exact case sets its statistics alike); ours rescales the "
                 "curve's row to the ratio and gives each layer a whole per-head budget (kvpress rounds each "
                 "head's keep rate alone)",
    "KVgradPress": "one top-k over every layer and head: ours gives each layer a whole per-head budget (the layer's "
                   "total a multiple of its kv heads, AdaLayer), so fewer than H_kv entries per layer move to another "
                   "layer's next best; within a layer one side's kept set holds the other's (asserted)",
    "FastKVzipPress": "one top-k over every layer and head: ours gives each layer a whole per-head budget (the "
                      "layer's total a multiple of its kv heads, AdaLayer), so fewer than H_kv entries per layer move "
                      "to another layer's next best; within a layer one side's kept set holds the other's (asserted)",
    "CAMPress": "kvpress's CAMPress compresses while decoding (every compression_interval steps, one selection per "
                "layer from the kv heads' mean score, Bernoulli-sampled merges); ours merges at each eviction of a "
                "one-shot prefill or decode compaction, per kv head, with the expected weight: no prefill case",
    "RandomPress": "another random generator (ours hashes (seed, layer, head, index)): no case",
}
# kvpress 0.5.5 presses compared by other scripts (kvpress_compare.py's replicas and paired runs), or whose counterpart
# here is not compared with them
ELSEWHERE = {
    "AdaKVPress": "ada_snapkv, ada_expected_attention: benchmarks/kvpress_compare.py (~kvpress replicas; kvpress's "
                  "safeguard rule differs from ours)",
    "CriticalAdaKVPress": "ada_criticalkv: kvpress's AdaKV safeguard and two stages differ (see AdaKVPress, "
                          "CriticalKVPress); not compared",
    "PyramidKVPress": "pyramidkv: benchmarks/kvpress_compare.py (replica pyramidkv~kvpress: kvpress's layer budgets)",
    "KVzipPress": "kvzip, kvzip_layerwise: benchmarks/kvpress_compare.py (paired accuracy, kept sets)",
    "KVzapPress": "kvzap: benchmarks/kvpress_compare.py (DMSPress(KVzapPress) on our surrogate's weights)",
    "DMSPress": "kvzap_threshold is DMSPress's threshold rule (benchmarks/kvpress_compare.py); DMS's own trained "
                "decisions are refused (kvpress_ada/refusals.py)",
    "DecodingPress": "our counterpart: decode_budget / decode_interval (tests/test_decode_compression.py checks our "
                     "rule); kept positions not compared with kvpress's",
    "PrefillDecodingPress": "our counterpart: a press with decode_budget; not compared with kvpress's",
    "CompressionRatioDecodingPress": "our counterpart: decode_ratio (tests/test_decode_compression.py); not compared "
                                     "with kvpress's",
    "ScorerPress": "a base class: every Scorer",
    "BasePress": "a base class: Pipeline",
}
# kvpress 0.5.5 presses with no preset here, and why
NOT_HERE = {
    "RestoreKVPress": "refused (kvpress_ada/refusals.py): needs restore embeddings and a LoRA adapter trained by its "
                      "authors",
    "PerLayerCompressionPress": "no preset: a per-layer ratio is a LayerSchedule (e.g. CalibratedLayer)",
    "ChunkPress": "no preset: prefill_chunk is a real chunked prefill (kvpress's ChunkPress scores chunks of one "
                  "full forward)",
}


def kv(press: str, **kwargs: Any) -> dict:
    """A nested kvpress press spec (the worker builds it)."""
    return {"press": press, "kwargs": kwargs}


@dataclass(frozen=True)
class Case:
    """One comparison: kvpress's ``press(**kwargs)`` against our ``ours(model)``: a Pipeline, or a scorer (then
    ``Pipeline(scorer=..., compression_ratio=ratio)``)."""

    arch: str
    length: int
    press: str
    kwargs: dict
    ours: Callable[[Any], Any]
    ratio: float = RATIO
    sketch: tuple[int, int] | None = None  # (seed, columns) of the leverage sketch both sides use
    qfilters: bool = False  # both sides score with qfilter_tensor(model)
    gate: bool = False  # both sides score with random_gate(model)
    duo: bool = False  # both sides stream the heads of random_duo(model)
    attrs: dict = field(default_factory=dict)  # set on kvpress's press after it is built
    eager: bool = False  # kvpress reads the attention weights
    hook: str | None = None  # kvpress's press whose top-k scores name the kept positions ("": the top one)
    tensors: tuple[str, ...] = ()  # "keys" / "values" compared too
    rerotated: bool = False  # our kept keys are kvpress's moved by L - n (DIFFERENCES["KeyRerotationPress"])
    layers: tuple[int, ...] | None = None  # layers asserted (None: all); the others: DIFFERENCES[press]
    layer_rounding: bool = False  # one top-k over every layer: ours gives each layer a whole per-head budget
    curve: bool = False  # both sides read the keep curve of lukv_curve(model)
    ties: bool = True  # a kept set may differ at a float tie of our scorer's scores
    tokenizer: bool = False  # both sides prompt the model with text: plain_tokenizer(), saved with kvpress's model
    query_stats: bool = False  # both sides score with the statistics of random_query_stats(model)
    exact: bool = True  # False: reported only, DIFFERENCES[press] says why


def _cases() -> dict[str, Case]:
    from kvpress_ada import Pipeline, preset
    from kvpress_ada.allocators import Calibrated, CalibratedLayer
    from kvpress_ada.channels import ThinK
    from kvpress_ada.evictors import SimilarityMerge, TopK
    from kvpress_ada.scorers import (
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
        KVgrad,
        LagKV,
        Leverage,
        NonCausalAttention,
        QFilter,
        SimLayerKV,
        SnapKV,
        StreamingLLM,
    )

    r = dict(compression_ratio=RATIO)
    snap16 = dict(compression_ratio=RATIO, window_size=16, kernel_size=1)
    return {
        # key statistics
        "leverage": Case("llama", 100, "LeverageScorePress", r, lambda m: Leverage(), sketch=(0, 48)),
        "leverage/qwen3": Case("qwen3", 96, "LeverageScorePress", r, lambda m: Leverage(), sketch=(0, 48)),
        "cur": Case("llama", 100, "CURPress", r, lambda m: CUR()),
        "cur/kv_avg_global": Case("llama", 100, "CURPress",
                                  {**r, "leverage_type": "kv_avg", "use_local_approximation": False},
                                  lambda m: CUR(leverage_type="kv_avg", local_window=None)),
        "cur/value_window8": Case("llama", 100, "CURPress", {**r, "leverage_type": "value", "local_window_size": 8},
                                  lambda m: CUR(leverage_type="value", local_window=8)),
        "non_causal_attention": Case("llama", 100, "NonCausalAttnPress", {**r, "chunk_size": 25},
                                     lambda m: NonCausalAttention(chunk_size=25)),
        "compactor": Case("llama", 100, "CompactorPress", {**r, "chunk_size": 22},
                          lambda m: Compactor(chunk_size=22, blending=RATIO), sketch=(0, 48)),
        "compactor/qwen3": Case("qwen3", 108, "CompactorPress", {**r, "chunk_size": 48},
                                lambda m: Compactor(chunk_size=48, blending=RATIO), sketch=(0, 48)),
        "qfilter": Case("llama", 100, "QFilterPress", r, lambda m: QFilter(path=random_qfilters(m)), qfilters=True),
        "cap": Case("llama", 100, "CapPress", r, lambda m: CAP()),
        "cap/tau2_sinks8": Case("llama", 100, "CapPress", {**r, "tau": 2.0, "n_sink": 8},
                                lambda m: CAP(tau=2.0, sinks=8)),
        "cap/qwen3": Case("qwen3", 96, "CapPress", r, lambda m: CAP()),
        # scorers
        "knorm": Case("llama", 100, "KnormPress", r, lambda m: KNorm()),
        "streamingllm": Case("llama", 100, "StreamingLLMPress", r, lambda m: StreamingLLM()),
        "keydiff": Case("llama", 100, "KeyDiffPress", r, lambda m: KeyDiff()),
        "keydiff/qwen3": Case("qwen3", 96, "KeyDiffPress", r, lambda m: KeyDiff()),
        "lagkv/lag16": Case("llama", 100, "LagKVPress", {**r, "lag_size": 16}, lambda m: LagKV(lag=16)),
        "lagkv/lag16_cross": Case("llama", 100, "LagKVPress", {**r, "lag_size": 16, "cross_scoring": True},
                                  lambda m: LagKV(lag=16, cross_scoring=True)),
        "snapkv/window16_kernel1": Case("llama", 100, "SnapKVPress", snap16, lambda m: SnapKV(window=16, kernel=1)),
        "snapkv/qwen3_window16_kernel1": Case("qwen3", 96, "SnapKVPress", snap16,
                                              lambda m: SnapKV(window=16, kernel=1)),
        "snapkv/window16": Case("llama", 100, "SnapKVPress", {**r, "window_size": 16}, lambda m: SnapKV(window=16),
                                exact=False),
        "tova": Case("llama", 100, "TOVAPress", r, lambda m: TOVA(), exact=False),
        "h2o": Case("llama", 100, "ObservedAttentionPress", r, lambda m: H2O(), eager=True, exact=False),
        "expected_attention/all_queries_no_sinks": Case(
            "llama", 100, "ExpectedAttentionPress", {**r, "n_sink": 0},
            lambda m: ExpectedAttention(window=None, sinks=0)),
        "expected_attention": Case("llama", 200, "ExpectedAttentionPress", r, lambda m: ExpectedAttention(),
                                   exact=False),
        # calibrated query statistics (kvpress downloads them per model): both sides read random_query_stats(model)
        "expected_attention_stats": Case("llama", 100, "ExpectedAttentionStatsPress", r,
                                         lambda m: ExpectedAttentionStats(path=random_query_stats(m)),
                                         query_stats=True),
        "expected_attention_stats/qwen3_no_covariance_sinks2": Case(
            "qwen3", 96, "ExpectedAttentionStatsPress", {**r, "use_covariance": False, "n_sink": 2},
            lambda m: ExpectedAttentionStats(path=random_query_stats(m), use_covariance=False, sinks=2),
            query_stats=True),
        "criticalkv/window16": Case("llama", 100, "CriticalKVPress",
                                    {"press": kv("SnapKVPress", **r, window_size=16)},
                                    lambda m: CriticalKV(window=16), exact=False),
        # structure around a scorer
        "chunkkv/window20_kernel1_chunk10": Case(
            "llama", 100, "ChunkKVPress", {"press": kv("SnapKVPress", **{**snap16, "window_size": 20}),
                                           "chunk_length": 10},
            lambda m: ChunkKV(scorer=SnapKV(window=20, kernel=1), length=10)),
        "chunkkv/window16": Case("llama", 100, "ChunkKVPress", {"press": kv("SnapKVPress", **r, window_size=16)},
                                 lambda m: ChunkKV(scorer=SnapKV(window=16)), exact=False),
        "entropy_gated_chunkkv/knorm": Case(
            "llama", 100, "EntropyGatedChunkKVPress", {"press": kv("KnormPress", **r)},
            lambda m: EntropyGatedChunkKV(scorer=KNorm())),
        # (not KNorm on qwen3: its normed keys' norms lie within the tie tolerance of one another)
        "entropy_gated_chunkkv/qwen3_keydiff_chunk6": Case(
            "qwen3", 96, "EntropyGatedChunkKVPress",
            {"press": kv("KeyDiffPress", **r), "chunk_length": 6, "low_entropy_chunk_length": 2},
            lambda m: EntropyGatedChunkKV(scorer=KeyDiff(), length=6, low_entropy_length=2)),
        # the tiny model's attention is near uniform: its chunks' entropies lie within 1e-6, float ties of the median
        # gate (DIFFERENCES): reported
        "entropy_gated_chunkkv/window20_kernel1": Case(
            "llama", 100, "EntropyGatedChunkKVPress",
            {"press": kv("SnapKVPress", **{**snap16, "window_size": 20}), "chunk_length": 10,
             "low_entropy_chunk_length": 4},
            lambda m: EntropyGatedChunkKV(scorer=SnapKV(window=20, kernel=1), length=10, low_entropy_length=4),
            exact=False),
        "entropy_gated_chunkkv/window16": Case(
            "llama", 100, "EntropyGatedChunkKVPress", {"press": kv("SnapKVPress", **r, window_size=16)},
            lambda m: EntropyGatedChunkKV(scorer=SnapKV(window=16)), exact=False),
        "block_keydiff/block25": Case("llama", 100, "BlockPress", {"press": kv("KeyDiffPress", **r), "block_size": 25},
                                      lambda m: preset("block_keydiff", compression_ratio=RATIO, prefill_chunk=25),
                                      layers=(0,), ties=False),
        "finch/window16_unnormalized": Case(
            "llama", 100, "FinchPress", {**r, "normalize_scores": False},
            lambda m: preset("finch", compression_ratio=RATIO, scorer=Finch(window=16, normalize=False)),
            attrs={"window_size": 16, "delimiter_token_id": -1}, tensors=("keys",), rerotated=True, hook=""),
        "finch/window16": Case("llama", 100, "FinchPress", r,
                               lambda m: preset("finch", compression_ratio=RATIO, scorer=Finch(window=16)),
                               attrs={"window_size": 16, "delimiter_token_id": -1}, tensors=("keys",),
                               rerotated=True, hook="", exact=False),
        "rerotated_streamingllm": Case("llama", 100, "KeyRerotationPress", {"press": kv("StreamingLLMPress", **r)},
                                       lambda m: preset("rerotated_streamingllm", compression_ratio=RATIO),
                                       tensors=("keys",), rerotated=True, hook="press"),
        # every layer lazy on both sides (shares ~0.52 and ~0.53 against 0.5): the kept entries' rule asserted
        "simlayerkv/lazy": Case("llama", 100, "SimLayerKVPress", {"lazy_threshold": 0.5, "n_recent": 49},
                                lambda m: preset("simlayerkv", scorer=SimLayerKV(lazy_threshold=0.5, n_recent=48)),
                                ties=False),
        # between the two sides' shares: ours finds no lazy layer, kvpress every one
        "simlayerkv/threshold0.525": Case(
            "llama", 100, "SimLayerKVPress", {"lazy_threshold": 0.525, "n_recent": 49},
            lambda m: preset("simlayerkv", scorer=SimLayerKV(lazy_threshold=0.525, n_recent=48)), ties=False,
            exact=False),
        "think/window32_kernel1": Case(
            "llama", 100, "ComposedPress",
            {"presses": [kv("SnapKVPress", **{**snap16, "window_size": 32}),
                         kv("ThinKPress", key_channel_compression_ratio=0.5, window_size=32)]},
            lambda m: preset("think", compression_ratio=RATIO, scorer=SnapKV(window=32, kernel=1),
                             key_channels=ThinK(ratio=0.5, window=32)), tensors=("keys",)),
        "merging/window16_kernel1": Case(
            "llama", 100, "MergingPress", {"press": kv("SnapKVPress", **snap16)},
            lambda m: Pipeline(scorer=SnapKV(window=16, kernel=1), evictor=TopK(merge=SimilarityMerge()),
                               compression_ratio=RATIO), tensors=("values",)),
        "composed/knorm_keydiff": Case(
            "llama", 100, "ComposedPress", {"presses": [kv("KnormPress", compression_ratio=0.25),
                                                        kv("KeyDiffPress", compression_ratio=0.2)]},
            lambda m: Composed(stages=[KNorm(), KeyDiff()], keep=[0.75]), ratio=0.4),
        "composed/knorm_snapkv16": Case(
            "llama", 100, "ComposedPress", {"presses": [kv("KnormPress", compression_ratio=0.25),
                                                        kv("SnapKVPress", compression_ratio=1 / 3, window_size=16)]},
            lambda m: Composed(stages=[KNorm(), SnapKV(window=16)], keep=[0.75]), exact=False),
        # context reconstruction with a backward pass: one chunk (512), then chunks of 40 (three passes, the later
        # ones quoting the previous chunk and seeing the sinks); kept sets identical where kvpress's global top-k puts
        # a multiple of H_kv entries in every layer (at 100 tokens, one entry moves: DIFFERENCES)
        "kvgrad": Case("llama", 120, "KVgradPress", r, lambda m: preset("kvgrad", compression_ratio=RATIO),
                       tokenizer=True, ties=False, layer_rounding=True),
        "kvgrad/chunk40": Case("llama", 100, "KVgradPress", {**r, "chunk_size": 40},
                               lambda m: preset("kvgrad", compression_ratio=RATIO, scorer=KVgrad(chunk=40)),
                               tokenizer=True, ties=False, layer_rounding=True),
        "kvgrad/qwen3": Case("qwen3", 96, "KVgradPress", r, lambda m: preset("kvgrad", compression_ratio=RATIO),
                             tokenizer=True, ties=False, layer_rounding=True),
        # model scope, calibrated heads
        "kvcompose": Case("llama", 100, "KVComposePress", r, lambda m: preset("kvcompose", compression_ratio=RATIO),
                          ties=False),
        "fastkvzip": Case("llama", 100, "FastKVzipPress", r,
                          lambda m: preset("fastkvzip", compression_ratio=RATIO,
                                           scorer=FastKVzip(path=random_gate(m))), gate=True, ties=False,
                          layer_rounding=True),
        "lukv/all_queries_no_sinks": Case(
            "llama", 100, "LUKVPress", {"press": kv("ExpectedAttentionPress", n_sink=0), "compression_ratio": RATIO,
                                        "sink": 0, "window": 0},
            lambda m: preset("lukv", compression_ratio=RATIO, scorer=ExpectedAttention(window=None, sinks=0),
                             layers=CalibratedLayer(path=lukv_curve(m)), allocator=Calibrated(path=lukv_curve(m))),
            curve=True, ties=False),
        "duo_attention": Case("llama", 100, "DuoAttentionPress", {"head_compression_ratio": 0.5},
                              lambda m: preset("duo_attention", scorer=DuoAttention(path=random_duo(m),
                                                                                    head_ratio=0.5)),
                              duo=True, ties=False),
    }


def _temp(stem: str, tensors: list[torch.Tensor], suffix: str) -> Path:
    """A file in the temp folder named after ``stem`` and a digest of ``tensors`` (what it holds): written once."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().double().contiguous().numpy().tobytes())
    return Path(tempfile.gettempdir()) / f"{stem}_{h.hexdigest()[:12]}{suffix}"


def qfilter_tensor(model: Any) -> torch.Tensor:
    """Seeded random Q-filters ``[layers, kv heads, D]`` for ``model`` (both sides score with these)."""
    attn = model.model.layers[0].self_attn
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads, attn.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def random_qfilters(model: Any) -> str:
    """A Q-filters file of :func:`qfilter_tensor` for ``model`` (written once per process, in the temp folder)."""
    from kvpress_ada.calibration import model_identity
    from kvpress_ada.qfilters import QFilters, QFiltersMeta, save

    meta = QFiltersMeta(model=model_identity(model.config), data={"source": "seeded random (agreement test)"},
                        library_version="test", created="test")
    path = _temp(f"kvpress_ada_agreement_qfilters_{meta.model.fingerprint}", [qfilter_tensor(model)],
                 ".safetensors")
    if not path.exists():
        save(QFilters(qfilter_tensor(model), meta), path)
    return str(path)


def random_query_stats(model: Any) -> str:
    """A query statistics file of seeded random means and covariances (``A A^T / D``) for ``model`` (written once per
    process, in the temp folder); both sides read what it holds (the covariance's float16 triangle)."""
    from kvpress_ada.calibration import model_identity
    from kvpress_ada.query_stats import QueryStats, QueryStatsMeta, save

    attn = model.model.layers[0].self_attn
    n, hq, d = model.config.num_hidden_layers, model.config.num_attention_heads, attn.head_dim
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(n, hq, d, generator=g)
    a = torch.randn(n, hq, d, d, generator=g)
    cov = a @ a.transpose(-1, -2) / d
    meta = QueryStatsMeta(model=model_identity(model.config), data={"source": "seeded random (agreement test)"},
                          library_version="test", created="test")
    path = _temp(f"kvpress_ada_agreement_query_stats_{meta.model.fingerprint}", [mean, cov], ".safetensors")
    if not path.exists():
        save(QueryStats(mean, cov, meta), path)
    return str(path)


def gate_weights(model: Any, width: int = 8, sinks: int = 4) -> list[dict[str, torch.Tensor]]:
    """Seeded random Fast KVzip gate weights per layer for ``model``, in our surrogate's layout."""
    g = torch.Generator().manual_seed(0)
    d, h = int(model.config.hidden_size), int(model.config.num_key_value_heads)
    group = int(model.config.num_attention_heads) // h
    return [{"q_w": torch.randn(d, h * group * width, generator=g) / d**0.5,
             "q_b": torch.randn(h * group * width, generator=g),
             "k_w": torch.randn(d, h * width, generator=g) / d**0.5,
             "q_norm": 1 + 0.2 * torch.randn(width, generator=g), "k_norm": 1 + 0.2 * torch.randn(width, generator=g),
             "k_base": torch.randn(h, sinks, width, generator=g), "b": torch.randn(h, group, generator=g)}
            for _ in range(model.config.num_hidden_layers)]


def kvpress_gate_layout(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer of a Fast KVzip gate in our surrogate's layout, in kvpress's ``FastKVzipGate`` state-dict layout."""
    return {"q_proj.weight": w["q_w"].T.contiguous(), "q_proj.bias": w["q_b"], "k_proj.weight": w["k_w"].T.contiguous(),
            "q_norm.weight": w["q_norm"], "k_norm.weight": w["k_norm"], "k_base": w["k_base"][:, None].contiguous(),
            "b": w["b"][:, None].contiguous()}


def kvpress_gates(model: Any) -> list[dict[str, list]]:
    """:func:`gate_weights` in kvpress's ``FastKVzipGate`` state-dict layout."""
    return [{k: v.tolist() for k, v in kvpress_gate_layout(w).items()} for w in gate_weights(model)]


def random_gate(model: Any) -> str:
    """A Fast KVzip gate file of :func:`gate_weights` for ``model`` (written once per process)."""
    from kvpress_ada import surrogate as sur
    from kvpress_ada.calibration import model_identity

    layers = gate_weights(model)
    width, sinks = layers[0]["q_norm"].numel(), layers[0]["k_base"].shape[1]
    identity = model_identity(model.config)
    path = _temp(f"kvpress_ada_agreement_gate_{identity.fingerprint}", [t for w in layers for t in w.values()],
                 ".safetensors")
    if not path.exists():
        meta = {"model": identity, "teacher": {"name": "kvzip"}, "kind": "gate",
                "hidden_size": model.config.hidden_size, "width": width, "sinks": sinks, "dtype": "float32",
                "target": {}, "training": {"source": "seeded random (agreement test)"}, "fit": {},
                "library_version": "test", "created": "test"}
        sur.save(sur.Surrogate(layers, meta), path)
    return str(path)


def duo_scores(model: Any) -> torch.Tensor:
    """Seeded random DuoAttention head patterns ``[layers, kv heads]`` for ``model``, summing to 1."""
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads)
    raw = torch.rand(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.1
    return raw / raw.sum()


def random_duo(model: Any) -> str:
    """A DuoAttention patterns file of :func:`duo_scores` for ``model`` (written once per process)."""
    from kvpress_ada.calibration import Calibration, model_identity

    identity = model_identity(model.config)
    path = _temp(f"kvpress_ada_agreement_duo_{identity.fingerprint}",
                 [duo_scores(model), torch.tensor([DUO_SINKS, DUO_RECENT])], ".json")
    if not path.exists():
        Calibration(model=identity, scorer={"name": "duo_attention", "sinks": DUO_SINKS, "recent": DUO_RECENT},
                    reference={"source": "seeded random (agreement test)"}, ratios=[], tasks=[], n=1, seeds={},
                    context=0, library_version="test", created="test",
                    shares=duo_scores(model).tolist()).save(path)
    return str(path)


def curve_keep(model: Any) -> torch.Tensor:
    """A keep curve ``[99, layers, kv heads]`` at ratios 0.01 .. 0.99 for ``model``: at ratio ``r`` the fractions
    average ``1 - r``, spread across layers and heads by seeded random offsets; at ``r = 0.5`` each (layer, head)
    keeps a whole number of a 100-token context's entries and each layer a whole per-head average (then neither
    side rounds: ours gives a layer a whole per-head budget, DIFFERENCES["LUKVPress"])."""
    n, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    g = torch.Generator().manual_seed(0)
    layer = (torch.rand(n, generator=g, dtype=torch.float64) * 20 - 10).round()
    layer[-1] -= layer.sum()  # per-head averages summing to n * 50
    head = (torch.rand(n, H, generator=g, dtype=torch.float64) * 20 - 10).round()
    head[:, -1] -= head.sum(-1)
    ratios = torch.arange(1, 100, dtype=torch.float64) / 100
    offset = (layer[:, None] + head) / 100  # at r = 0.5: whole entries of 100
    keep = ((1 - ratios)[:, None, None] + offset[None] * (2 * torch.minimum(ratios, 1 - ratios))[:, None, None])
    return keep.clamp(0, 1)


def lukv_curve(model: Any) -> str:
    """A keep-curve calibration file of :func:`curve_keep` for ``model`` (written once per process)."""
    from kvpress_ada.calibration import Calibration, model_identity

    identity = model_identity(model.config)
    keep = curve_keep(model)
    path = _temp(f"kvpress_ada_agreement_lukv_{identity.fingerprint}", [keep], ".json")
    if not path.exists():
        shares = keep.mean(0) / keep.mean(0).sum()
        Calibration(model=identity, scorer={"name": "expected_attention"}, reference={"method": "lukv", "source": (
                    "seeded random (agreement test)")}, ratios=[round(x / 100, 2) for x in range(1, 100)], tasks=[],
                    n=1, seeds={}, context=100, library_version="test", created="test", shares=shares.tolist(),
                    keep=keep.tolist()).save(path)
    return str(path)


def plain_tokenizer() -> Any:
    """The test suite's tokenizer without its chat template: kvpress's KVzip-style presses then score the whole
    context with the suffix ``"\\n"``, as ours does with it (``tokenizer`` cases)."""
    from conftest import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def _model(arch: str):
    from conftest import build_model

    return build_model(arch, seed=SEED)


def weights_digest(model: Any) -> str:
    """sha256 of the model's parameters (name order), bit for bit: the records hold for these weights only."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def token_ids(length: int) -> torch.Tensor:
    return torch.randint(5, 120, (1, length), generator=torch.Generator().manual_seed(0))


@dataclass
class Held:
    """What a press holds after the prefill: ``kept`` bool ``[layers, kv heads, L]``; ``scores`` (our scorer's,
    ``[layers, kv heads, L]``, or None); ``tensors[name][layer][head]``: kept keys or values ``[n, D]`` in
    position order."""

    kept: torch.Tensor
    scores: torch.Tensor | None = None
    tensors: dict[str, list[list[torch.Tensor]]] = field(default_factory=dict)


def pipeline(case: Case, model: Any):
    from kvpress_ada import Pipeline
    from kvpress_ada.scorers.base import Scorer

    built = case.ours(model)
    return Pipeline(scorer=built, compression_ratio=case.ratio) if isinstance(built, Scorer) else built


def ours(case: Case, model: Any) -> Held:
    """What our press holds after prefilling the case's ids through the model (the transformers host)."""
    from kvpress_ada.hosts.transformers.fanout import capture_prefill
    from kvpress_ada.hosts.transformers.hf import output_cache
    from kvpress_ada.hosts.transformers.model_pass import tokenizer_for, use_tokenizer

    press = pipeline(case, model)
    ids = token_ids(case.length)
    before = tokenizer_for(model) if case.tokenizer else None
    try:
        if case.tokenizer:
            use_tokenizer(model, plain_tokenizer())
        with torch.no_grad(), press(model):
            cache = output_cache(model(ids, use_cache=True))
    finally:
        if before is not None:
            use_tokenizer(model, before)
    n_layers = model.config.num_hidden_layers
    kept = torch.zeros(n_layers, model.config.num_key_value_heads, case.length, dtype=torch.bool)
    tensors: dict[str, list[list[torch.Tensor]]] = {name: [] for name in case.tensors}
    for i in range(n_layers):
        view = cache.layers[i].view()
        for name in case.tensors:
            tensors[name].append([])
        for h in range(kept.shape[1]):
            valid = view.valid[0, h]
            kept[i, h, view.positions[0, h][valid]] = True
            for name in case.tensors:
                tensors[name][i].append((view.keys if name == "keys" else view.values)[0, h][valid].float())
    scores = None
    if case.ties:
        scorer = press.scorer
        with torch.inference_mode():
            prefill = capture_prefill(model, ids)
            scores = torch.stack([scorer.score(prefill.view(scorer, i).observations()[0])[0].float()
                                  for i in range(n_layers)]).cpu()
    return Held(kept, scores, tensors)


def as_mask(positions: list, length: int) -> torch.Tensor:
    """Bool ``[layers, heads, length]`` from kept positions per (layer, head)."""
    mask = torch.zeros(len(positions), len(positions[0]), length, dtype=torch.bool)
    for i, layer in enumerate(positions):
        for h, kept in enumerate(layer):
            mask[i, h, kept] = True
    return mask


def unpack(text: str, dim: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.float32).view(-1, dim).clone()


def rotate(x: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE (transformers' ``rotate_half`` layout) of ``x [n, D]`` moved by ``delta`` positions."""
    angle = delta * inv_freq.double()
    cos, sin = torch.cat([angle, angle]).cos(), torch.cat([angle, angle]).sin()
    half = x.shape[-1] // 2
    return (x.double() * cos + torch.cat([-x[..., half:], x[..., :half]], -1).double() * sin).float()


def compare(mine: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor | None, rtol: float = 1e-4) -> dict:
    """Mean Jaccard of the kept sets over (layer, head), the (layer, head) pairs that differ and that are
    identical, equal counts, and ``untied``: positions kept by one side only whose score (ours) is not within
    ``rtol`` of the head's last kept score (a tie, e.g. a repeated token in the first layer, is broken by rounding
    on either side; every difference counts when ``scores`` is None)."""
    inter = (mine & theirs).sum(-1).double()
    union = (mine | theirs).sum(-1).double().clamp(min=1)
    differ = mine != theirs
    if scores is None:
        untied = int(differ.sum())
    else:
        finite = torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores))
        # the lowest kept score, protected (+inf) entries aside (they are kept whatever the others score)
        boundary = finite.masked_fill(~mine | ~torch.isfinite(scores), float("inf")).amin(-1, keepdim=True)
        boundary = torch.where(torch.isfinite(boundary), boundary, torch.zeros_like(boundary))
        near = (finite - boundary).abs() <= rtol * boundary.abs().clamp(min=1.0)
        untied = int((differ & ~near).sum())
    return {"jaccard": float((inter / union).mean()), "differing_heads": int(differ.any(-1).sum()),
            "identical_heads": int((~differ.any(-1)).sum()), "heads": int(differ.shape[0] * differ.shape[1]),
            "same_counts": bool(torch.equal(mine.sum(-1), theirs.sum(-1))), "untied": untied}


def nested_layers(mine: torch.Tensor, theirs: torch.Tensor) -> tuple[int, int]:
    """``(layers where one side's kept set holds the other's and their totals differ by fewer than H_kv, layers)``:
    what one top-k over every layer leaves when one side gives each layer a whole per-head budget."""
    H = mine.shape[1]
    ok = 0
    for a, b in zip(mine, theirs):
        inside = bool((a & ~b).sum() == 0 or (b & ~a).sum() == 0)
        ok += inside and abs(int(a.sum()) - int(b.sum())) < H
    return ok, mine.shape[0]


def compare_tensors(case: Case, rec: dict, held: Held, model: Any) -> dict[str, float]:
    """Largest difference (relative to the largest entry) between our kept keys or values and kvpress's, per
    tensor, over the (layer, head) pairs that keep the same positions; re-rotated keys moved by ``L - n`` first."""
    inv_freq = model.model.rotary_emb.inv_freq.float()
    out = {}
    for name in case.tensors:
        worst = 0.0
        for i, layer in enumerate(rec[name]):
            for h, text in enumerate(layer):
                mine = held.tensors[name][i][h]
                theirs = unpack(text, mine.shape[-1])
                if mine.shape != theirs.shape or not torch.equal(held.kept[i, h], as_mask(rec["kept"], rec["length"])[
                        i, h]):
                    continue
                if case.rerotated and name == "keys":
                    theirs = rotate(theirs, case.length - theirs.shape[0], inv_freq)
                scale = float(theirs.abs().max().clamp(min=1e-6))
                worst = max(worst, float((mine - theirs).abs().max()) / scale)
        out[name] = worst
    return out


def zeroed_channels(rec: dict, held: Held) -> tuple[int, int]:
    """``(pairs whose zeroed key channels agree, pairs)`` over (layer, kv head) (ThinK)."""
    same = total = 0
    for i, layer in enumerate(rec["keys"]):
        for h, text in enumerate(layer):
            mine = held.tensors["keys"][i][h]
            theirs = unpack(text, mine.shape[-1])
            same += bool(torch.equal((mine == 0).all(0), (theirs == 0).all(0)))
            total += 1
    return same, total


def load() -> dict:
    return json.loads(FIXTURE.read_text())


def query_stats_payload(model: Any) -> dict:
    """What :func:`random_query_stats` holds, as kvpress's ExpectedAttentionStatsPress reads it: ``mu [layers, H_q,
    D]`` and ``cov [layers, H_q, D, D]``."""
    from kvpress_ada.query_stats import load as load_stats

    stats = load_stats(random_query_stats(model))
    return {"mean": stats.mean.tolist(), "cov": stats.cov.tolist()}


def request(case: Case, label: str, model: Any) -> dict:
    from kvpress_ada.scorers.statistics import gaussian_sketch

    head_dim = model.model.layers[0].self_attn.head_dim
    return {"label": label, "press": case.press, "kwargs": case.kwargs, "ids": token_ids(case.length)[0].tolist(),
            "sketch": None if case.sketch is None else gaussian_sketch(head_dim, case.sketch[1], case.sketch[0],
                                                                       "cpu").tolist(),
            "q_filters": qfilter_tensor(model).tolist() if case.qfilters else None,
            "gates": kvpress_gates(model) if case.gate else None,
            "duo": ({"sink": DUO_SINKS, "recent": DUO_RECENT, "scores": duo_scores(model).tolist()} if case.duo
                    else None),
            "curve": (1 - curve_keep(model)).tolist() if case.curve else None,
            "query_stats": query_stats_payload(model) if case.query_stats else None, "attrs": case.attrs,
            "eager": case.eager, "hook": case.hook, "rerotated": case.rerotated, "tensors": list(case.tensors)}


def record(only: list[str] | None = None) -> dict:
    """Run kvpress on every case (``only``: those labels, the others kept from the file) and rewrite the file."""
    import kvpress_compare

    cases = _cases()
    python = kvpress_compare.ensure_kvpress_venv(kvpress_compare.DEFAULT_VENV)
    out: dict[str, Any] = {"ratio": RATIO, "seed": SEED, "models": {}, "cases": {}}
    if only:
        out = load()
        out["cases"] = {k: v for k, v in out["cases"].items() if k in cases and k not in only}
    for arch in sorted({c.arch for c in cases.values()}):
        model = _model(arch)
        mine = {label: c for label, c in cases.items() if c.arch == arch and (not only or label in only)}
        if not mine:
            continue
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            if any(c.tokenizer for c in mine.values()):  # kvpress loads it from the model's folder
                plain_tokenizer().save_pretrained(folder)
            payload = {"model": folder, "cases": [request(c, label, model) for label, c in mine.items()]}
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            res = subprocess.run([str(python), str(ROOT / "benchmarks" / "kvpress_agreement_worker.py")],
                                 input=json.dumps(payload), capture_output=True, text=True, env=env,
                                 cwd=tempfile.gettempdir())
            if res.returncode != 0:
                raise SystemExit(f"kvpress worker failed:\n{res.stderr[-3000:]}")
            reply = json.loads(res.stdout.strip().splitlines()[-1])
        out["versions"] = reply["versions"]
        out["presses"] = reply["presses"]
        out["models"][arch] = weights_digest(model)
        for label, got in reply["cases"].items():
            c = cases[label]
            out["cases"][label] = {"arch": arch, "length": c.length, "kvpress": c.press, "kwargs": c.kwargs,
                                   **got}
    out["cases"] = {label: out["cases"][label] for label in cases if label in out["cases"]}
    text = json.dumps(out, indent=1)
    text = re.sub(r"\[\s+([\d,\s]*?)\s+\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    text = re.sub(r'\[\s+("[^"\]]*"(?:,\s+"[^"\]]*")*)\s+\]', lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]",
                  text)
    FIXTURE.write_text(text + "\n")
    return out


def check_case(label: str, rec: dict, model: Any) -> dict:
    """``compare(...)`` of one recorded case, ours computed now (asserted layers only when the case names them,
    ``all_layers``: over every layer), with ``tensors`` (largest relative difference per compared tensor) and
    ``channels`` ((pairs whose zeroed key channels agree, pairs)) where recorded."""
    case = _cases()[label]
    held = ours(case, model)
    theirs = as_mask(rec["kept"], rec["length"])
    res = compare(held.kept, theirs, held.scores)
    if case.layers is not None:
        index = list(case.layers)
        res = {**compare(held.kept[index], theirs[index], None if held.scores is None else held.scores[index]),
               "all_layers": res}
    if case.layer_rounding:
        res["nested_layers"] = nested_layers(held.kept, theirs)
    res["tensors"] = compare_tensors(case, rec, held, model)
    if "keys" in case.tensors and case.press == "ComposedPress":
        res["channels"] = zeroed_channels(rec, held)
    return res


def check(recorded: dict) -> dict[str, dict]:
    """``{label: check_case(...)}`` of every recorded case."""
    models: dict[str, Any] = {}
    results = {}
    for label, rec in recorded["cases"].items():
        arch = rec["arch"]
        if arch not in models:
            models[arch] = _model(arch)
            if weights_digest(models[arch]) != recorded["models"][arch]:
                raise SystemExit(f"the tiny {arch} model's weights differ from the recorded ones (another torch or "
                                 f"transformers initialises them differently): re-record with `{RECORD}`")
        results[label] = check_case(label, rec, models[arch])
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="run kvpress in its venv and rewrite the records")
    parser.add_argument("--check", action="store_true", help="compare our kept positions with the records")
    parser.add_argument("--only", default="", help="comma-separated case labels to record again (others kept)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    only = [x for x in args.only.split(",") if x]
    recorded = record(only) if args.record else load()
    cases = _cases()
    for label, res in check(recorded).items():
        note = "" if cases[label].exact else "  (not exact: " + cases[label].press + ")"
        asserted = cases[label].layers
        layers = "" if asserted is None else f" layers {list(asserted)}"
        extra = "".join(f"  {k} max rel diff {v:.1e}" for k, v in res["tensors"].items())
        if "nested_layers" in res:
            extra += f"  layers nested {res['nested_layers'][0]}/{res['nested_layers'][1]}"
        if "channels" in res:
            extra += f"  zeroed channels same {res['channels'][0]}/{res['channels'][1]}"
        if "all_layers" in res:
            a = res["all_layers"]
            extra += f"  all layers: identical {a['identical_heads']}/{a['heads']} jaccard {a['jaccard']:.4f}"
        print(f"{label:34s}{layers} identical (layer, head) {res['identical_heads']}/{res['heads']}  jaccard "
              f"{res['jaccard']:.4f}  counts equal {res['same_counts']}  not at a tie {res['untied']}{extra}{note}")
    print("\nintended differences (kvpress press: reason):")
    for press, reason in DIFFERENCES.items():
        print(f"  {press}: {reason}")
    print("\nkvpress presses compared elsewhere, or not compared:")
    for press, reason in ELSEWHERE.items():
        print(f"  {press}: {reason}")
    print("\nkvpress presses with no preset here:")
    for press, reason in NOT_HERE.items():
        print(f"  {press}: {reason}")


if __name__ == "__main__":
    main()
