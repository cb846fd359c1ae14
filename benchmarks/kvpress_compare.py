"""Side-by-side comparison of kvpress_ada with NVIDIA's kvpress 0.5.5 on the same model and samples.

What it does
    1. Creates (or reuses) a separate virtualenv with ``torch==2.13.0 kvpress==0.5.5`` (kvpress pins
       ``transformers<5.3``; torch is pinned so pip takes the CPU build). kvpress never enters the
       kvpress_ada environment.
    2. Generates the samples once with kvpress_ada's synthetic tasks, renders the chat prompt with
       ``split_prompt`` and hands the *token ids* (context part, question part) to both libraries.
    3. kvpress side (``benchmarks/kvpress_worker.py``, a subprocess in the kvpress venv): per sample, the
       full-cache prefill under a capturing press, every press that acts only through kvpress's
       ``compress`` hook (ScorerPress subclasses, AdaKVPress) derived by its own ``compress`` on those
       captured inputs, and ``KVzipPress`` run once (prefill, then its context reconstruction when the
       ``with`` block exits) with the other ratios / ``layerwise`` derived by its ``compress_post`` on the
       same scores; then the question and a greedy answer on each compressed cache (question-agnostic), as
       ``KVPressTextGenerationPipeline`` does. Same caches as one prefill per press (checked: answers, bytes
       and masks); ``--kvpress-separate`` runs one prefill per press.
    4. kvpress_ada side: the fan-out evaluator (one prefill per sample) on the same presets. Samples go
       round-robin over tasks and the JSON is rewritten after every sample (``complete: false`` and
       ``coverage`` until done; ``--resume`` continues a stopped run).
    5. Decode speed: one long synthetic sample, one cache per (library, press, ratio), greedy decode
       steps timed in interleaved rounds (kvpress, ours, kvpress, ...), medians.
    6. Agreement analysis: per-(layer, head) kept sets of both libraries (Jaccard), paired accuracy
       differences, and diagnostic kvpress_ada pipelines that re-implement kvpress's exact rules
       (``*~kvpress``) or change one factor at a time, to attribute every disagreement. Kept sets are
       compared only where the worker can read kvpress's (masking presses, ScorerPress subclasses);
       ``--no-kept-sets`` skips them (they cost one more prefill per sample on our side).

Run from the repository root: ``python benchmarks/kvpress_compare.py --quick`` (smoke test, a few
minutes), ``python benchmarks/kvpress_compare.py`` (default run; about an hour on 2 CPU cores). The
question-agnostic comparison (KVzip, LagKV, KeyDiff; ``--methods question_agnostic`` adds ada_kvzip, ada_lagkv and
streamingllm on our side)::

    python benchmarks/kvpress_compare.py --methods kvzip,kvzip_layerwise,lagkv,keydiff \
        --tasks passkey,multikey,multivalue,multiquery --n 16 --ratios 0.25,0.5,0.75,0.9 --settings agnostic \
        --no-decode --no-diagnostics --no-kept-sets --out benchmarks/results/kvpress_compare_agnostic.json --resume

Every preset with a kvpress press at r = 0.75 (``--methods new_presets``), our answers read from the quality grid's
files (``benchmarks/quality.py``, one per setting; see benchmarks/README.md for the full command)::

    python benchmarks/kvpress_compare.py --methods new_presets --ratios 0.75 \
        --tasks passkey,multikey,multivalue,multiquery --n 16 --settings agnostic,aware \
        --ours-records quality_agnostic.json quality_aware.json --no-decode --resume

kvpress on transformers' ``QuantizedCache`` (``--kvpress-cache quanto-int4``; ``hqq-int4``/``hqq-int8`` take HQQ; the
driver installs the backend into the kvpress venv only): the full DynamicCache (bytes and accuracy reference), the
QuantizedCache alone and every kvpress press prefilled into it, our side skipped with ``--kvpress-only``::

    python benchmarks/kvpress_compare.py --kvpress-cache quanto-int4 --kvpress-only --methods kvzip,ada_snapkv \
        --tasks passkey,multikey,multivalue,multiquery --n 16 --ratios 0.75 --settings agnostic \
        --no-decode --no-diagnostics --no-kept-sets --out benchmarks/results/kvpress_compare_quantized.json --resume
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import ClassVar, Literal

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "kvpress_compare.json"
DEFAULT_VENV = Path(os.environ.get("KVPRESS_ADA_CACHE") or Path.home() / ".cache" / "kvpress_ada") / "kvpress-venv"
KVPRESS_REQUIREMENTS = ("torch==2.13.0", "kvpress==0.5.5")
METHODS = ("snapkv", "ada_snapkv", "pyramidkv", "expected_attention", "ada_expected_attention")  # default run
# question-agnostic presses (KVzip's context reconstruction, LagKV, KeyDiff) + baselines
AGNOSTIC_METHODS = ("kvzip", "kvzip_layerwise", "ada_kvzip", "lagkv", "ada_lagkv", "keydiff", "streamingllm")
# KVzap (score surrogates): compared with kvpress's KVzipPress (their teacher) and, for the threshold preset, with
# kvpress's DMSPress threshold logic on the very scores of our surrogate (SuppliedKVzapPress in the worker)
SURROGATE_METHODS = ("kvzap", "kvzap_linear", "kvzap_threshold")
# key statistics (question-agnostic scorers of the keys' and values' geometry; CAP reads every prefill query)
KEY_STATISTICS_METHODS = ("leverage", "ada_leverage", "cur", "ada_cur", "non_causal_attention", "compactor", "cap")
# the presets kvpress ships that were added with the key statistics ones (benchmarks/quality.py's new-presets grid);
# the Ada variants and CaM run on our side and pair with the uniform kvpress press (NEW_COUNTERPART) or nothing
NEW_PRESET_METHODS = ("qfilter", "chunkkv", "ada_chunkkv", "kvcompose", "ada_kvcompose", "block_keydiff", "lukv",
                      "finch", "ada_finch", "rerotated_streamingllm", "fastkvzip", "ada_fastkvzip", "think",
                      "ada_think", "merging", "ada_merging", "cam", "ada_cam", "simlayerkv", "duo_attention",
                      "composed")
TOKEN_METHODS = ("knorm", "tova", "h2o", "criticalkv")  # token scorers with a kvpress press (streamingllm above)
# presets of kvpress 0.5.5's later presses (not in the new-presets grid's records): run by name
LATER_METHODS = ("entropy_gated_chunkkv", "ada_entropy_gated_chunkkv", "kvgrad", "ada_kvgrad",
                 "expected_attention_stats")
RATIO_FREE = ("kvzap_threshold", "simlayerkv", "duo_attention")  # set their own budget (a threshold, lazy layers,
# streaming heads; a ratio would only cap each head on our side, kvpress ignores it): run once, at ratio 0 (no cap)
ALL_METHODS = (METHODS + AGNOSTIC_METHODS + SURROGATE_METHODS + KEY_STATISTICS_METHODS + NEW_PRESET_METHODS
               + TOKEN_METHODS + LATER_METHODS)
METHOD_GROUPS = {"question_agnostic": AGNOSTIC_METHODS, "new_presets": KEY_STATISTICS_METHODS + NEW_PRESET_METHODS}
# presets whose kvpress press needs something kvpress downloads for the models it knows: handed ours instead
# (benchmarks/kvpress_presses.py hand_over), for the default model only (each artefact refuses another)
HANDED = {"qfilter": "q_filters", "fastkvzip": "gates", "duo_attention": "duo", "lukv": "curve",
          "expected_attention_stats": "query_stats"}
# --kvpress-cache: transformers' QuantizedCache backends, what each needs in the kvpress venv, and the bit widths
# transformers 5.2 accepts for it (QuantoQuantizedLayer: 2 and 4 only; HQQQuantizedLayer: 1, 2, 3, 4, 8)
QUANTIZED_BACKENDS = {"quanto": ("optimum-quanto==0.2.7",), "hqq": ("hqq==0.2.8.post1",)}
QUANTIZED_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
# kvpress_ada preset -> the kvpress press run for it (benchmarks/kvpress_worker.py PRESSES builds them)
KVPRESS_NAMES = {
    "full": "no press",
    "snapkv": "SnapKVPress",
    "ada_snapkv": "AdaKVPress(SnapKVPress)",
    "pyramidkv": "PyramidKVPress",
    "expected_attention": "ExpectedAttentionPress",
    "ada_expected_attention": "AdaKVPress(ExpectedAttentionPress)",
    "kvzip": "KVzipPress(layerwise=False)",
    "kvzip_layerwise": "KVzipPress(layerwise=True)",
    "kvgrad": "KVgradPress(layerwise=False)",
    "lagkv": "LagKVPress",
    "keydiff": "KeyDiffPress",
    "kvzap_threshold": "DMSPress(KVzapPress(our surrogate))",
    "leverage": "LeverageScorePress",
    "ada_leverage": "AdaKVPress(LeverageScorePress)",
    "cur": "CURPress",
    "ada_cur": "AdaKVPress(CURPress)",
    "non_causal_attention": "NonCausalAttnPress",
    "compactor": "CompactorPress",
    "cap": "CapPress",
    "streamingllm": "StreamingLLMPress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
    "h2o": "ObservedAttentionPress, eager attention",
    "criticalkv": "CriticalKVPress(SnapKVPress)",
    "qfilter": "QFilterPress, our Q-filters",
    "chunkkv": "ChunkKVPress(SnapKVPress)",
    "entropy_gated_chunkkv": "EntropyGatedChunkKVPress(SnapKVPress)",
    "block_keydiff": "BlockPress(KeyDiffPress)",
    "finch": "FinchPress",
    "rerotated_streamingllm": "KeyRerotationPress(StreamingLLMPress)",
    "merging": "MergingPress(SnapKVPress)",
    "think": "ComposedPress(SnapKVPress, ThinKPress)",
    "composed": "ComposedPress(KnormPress, SnapKVPress)",
    "simlayerkv": "SimLayerKVPress",
    "duo_attention": "DuoAttentionPress, our head patterns",
    "kvcompose": "KVComposePress",
    "fastkvzip": "FastKVzipPress, our gates",
    "lukv": "LUKVPress(ExpectedAttentionPress), our keep curve",
    "expected_attention_stats": "ExpectedAttentionStatsPress, our query statistics",
}
# presets with no kvpress press of their own, compared (paired) with this kvpress press; presets in neither
# table run on our side only, as a baseline (NO_KVPRESS_ROW says why)
NEW_COUNTERPART = {"ada_chunkkv": "chunkkv", "ada_entropy_gated_chunkkv": "entropy_gated_chunkkv",
                   "ada_kvcompose": "kvcompose", "ada_finch": "finch",
                   "ada_fastkvzip": "fastkvzip", "ada_think": "think", "ada_merging": "merging"}
KVPRESS_COUNTERPART = {"ada_kvzip": "kvzip", "ada_kvgrad": "kvgrad", "ada_lagkv": "lagkv", "kvzap": "kvzip",
                       "kvzap_linear": "kvzip", **NEW_COUNTERPART}
NO_KVPRESS_ROW = {
    "cam": "kvpress's CAMPress is a DecodingPress: it compresses every compression_interval (512) decoding steps "
           "down to target_size (2048) entries, so on a 1k-token prompt answered in 24 tokens it never compresses "
           "(ours merges at the prefill's one-shot eviction)",
    "ada_cam": "see cam; and kvpress's AdaKVPress wraps a ScorerPress, not a DecodingPress",
}
# kvpress 0.5.5's defaults for the presses run (read from its source; every run also records each press's repr)
KVPRESS_DEFAULTS = {
    "KVzipPress": "layerwise=False (one top-k over all layers and kv heads; True: per layer, across its heads), "
                  "n_sink=4, kvzip_plus_normalization=False, chunk_size=2048; scores on leaving its `with` block "
                  "by reconstructing the context after the chat prefix ('\\n\\nRepeat the previous context "
                  "exactly.' + the template's assistant suffix + the context); the chat prefix tokens after the "
                  "sinks are never scored (score 0, evicted first); evicted keys are masked "
                  "(masked_key_indices), the full cache stays",
    "KVgradPress": "layerwise=False, n_sink=4, chunk_size=512: KVzipPress's reconstruction, each chunk's forward "
                   "and backward outside inference mode (weights frozen), score max over the pass of attention x "
                   "||v W_O|| x ||grad of sum ||h^L||^2 w.r.t. the attention output||; masks",
    "LagKVPress": "n_sink=4, lag_size=128, cross_scoring=False (ranks within each partition); gathers the kept "
                  "tokens (real eviction)",
    "DMSPress": "threshold = our preset's tau, sliding_window_size = our scorer's window (kvpress's default is 128), "
                "decoding=False; wraps KVzapPress with our surrogate file's weights loaded into kvpress's KVzapModel "
                "and the first `sinks` tokens scored +inf (as our KVzap); evicted keys are masked (masked_key_indices)",
    "KeyDiffPress": "no parameters besides compression_ratio (the paper's block-wise version is "
                    "BlockPress(KeyDiffPress), not run); gathers the kept tokens",
    "LeverageScorePress": "sketch_dimension=48, a fresh Gaussian sketch per layer and call (global RNG); z-scored "
                          "over the layer; gathers the kept tokens",
    "CURPress": "num_sinks=4, leverage_type='kv_product', use_random_leverage=False, use_local_approximation=True, "
                "local_window_size=16; gathers the kept tokens",
    "NonCausalAttnPress": "chunk_size=256 (a short last chunk attends to zero padding); gathers the kept tokens",
    "CompactorPress": "sink_size_start=8, sink_size_end=4, chunk_size=256, sketch_dimension=48, blending=None (the "
                      "compression ratio); gathers the kept tokens",
    "CapPress": "tau=5.0, n_future_positions=512, n_sink=4, epsilon=1e-6; gathers the kept tokens",
    "SnapKVPress": "window_size=64, kernel_size=5; gathers the kept tokens",
    "StreamingLLMPress": "n_sink=4; gathers the kept tokens",
    "KnormPress": "no parameters besides compression_ratio; gathers the kept tokens",
    "TOVAPress": "no parameters besides compression_ratio (the last query's attention averaged over every query "
                 "head of the layer); gathers the kept tokens",
    "ObservedAttentionPress": "no parameters besides compression_ratio; reads the prefill's attention weights, so "
                              "the prefill and the answer run in eager attention (kvpress asks for a model loaded so); "
                              "gathers the kept tokens",
    "CriticalKVPress": "epsilon=1e-4, first_stage_ratio=0.5 (half the budget by the wrapped press's score, the rest "
                       "by that score times mean ||W_o v||_1); gathers the kept tokens",
    "QFilterPress": "its filters downloaded for the models it knows: handed ours (kvpress_ada/qfilters/, the default "
                    "model) instead; gathers the kept tokens",
    "ChunkKVPress": "chunk_length=20 (whole chunks from the first token, int(chunks (1 - r)) kept); gathers",
    "EntropyGatedChunkKVPress": "chunk_length=10, low_entropy_chunk_length=4 (chunks from the first token in "
                                "decreasing mean; one at or above the median mean and below the median entropy keeps "
                                "its 4 best, the rest topped up to int(L (1 - r)) by score); gathers the kept tokens",
    "BlockPress": "block_size=128 (blocks scored after one full forward); gathers the kept tokens",
    "FinchPress": "normalize_scores=True, rerotate_keys=True, chunk_length=None; the window is the question, found by "
                  "a delimiter token after the context: question-aware, the question's tokens (set directly, no token "
                  "added); question-agnostic there is no question, so our preset's 64 trailing queries; the answer "
                  "continues at the kept count (KVPressTextGenerationPipeline's rule for re-rotated keys)",
    "KeyRerotationPress": "kept keys re-rotated to 0 .. n-1; the answer continues at n (KVPressTextGenerationPipeline)",
    "MergingPress": "similarity_threshold=0.0, merge_fraction=1.0; gathers the kept tokens",
    "ThinKPress": "window_size=32; key_channel_compression_ratio=0.0 turns it off: ours (0.5) is used",
    "ComposedPress": "its presses in order, each on the cache the previous left (think: SnapKVPress then ThinKPress; "
                     "composed: KnormPress(1 - our first keep, 0.25) then SnapKVPress(1 - (1 - r) / 0.75), r in all)",
    "SimLayerKVPress": "n_recent=1024, n_initial=4, n_last=1; lazy_threshold=1.0 turns it off: ours (0.9, kvpress's "
                       "value for Llama 3) is used; a prompt of at most n_initial + n_recent + n_last tokens is never "
                       "compressed (1029 with its defaults: off at ~1k tokens), so ours is used too (n_recent 128 + "
                       "n_last: kvpress keeps n_recent - n_last recent entries); sets its own budget (achieved_ratio)",
    "DuoAttentionPress": "head patterns downloaded for the models it knows: handed ours (sinks 128, recent 256, "
                         "kvpress_ada/calibration/smollm2_135m_duo.json); head_compression_ratio=0.0 turns it off: "
                         "ours (0.5) is used; masks (masked_key_indices), sets its own budget (achieved_ratio)",
    "KVComposePress": "structured=True, agg_task='max', agg_group='mean', agg_head='mean', add_v_norm=False, "
                      "add_mean_across_heads=True, keep_token_lower_bound=0; a second reading of the context in "
                      "eager attention; gathers per layer",
    "FastKVzipPress": "layerwise=False, n_sink=4, window_ratio=0.02; its gates downloaded for the models it knows: "
                      "handed ours (kvpress_ada/surrogates/smollm2_135m_kvzip_gate.safetensors); masks",
    "ExpectedAttentionStatsPress": "n_future_positions=512, n_sink=4, use_covariance=True, use_vnorm=True; its query "
                                   "statistics downloaded for the models it knows (BookSum, 100 samples): handed ours "
                                   "(kvpress_ada/query_stats/smollm2_135m.safetensors, documentation text); gathers "
                                   "the kept tokens",
    "LUKVPress": "press=ExpectedAttentionPress(epsilon=0.02), sink=4, window=1; its keep curve downloaded for "
                 "Llama-3.1-8B only: handed ours (kvpress_ada/calibration/smollm2_135m_lukv.json, rows at r = 0.05 "
                 ".. 0.95 interpolated to kvpress's 0.01 .. 0.99, prune = 1 - keep); masks",
}
# settings of our presets that differ from kvpress's defaults (the kvpress row keeps kvpress's, except where kvpress's
# default turns the press off: then ours, as said): preset -> what differs
SETTINGS_DIFFER = {
    "criticalkv": "kvpress first_stage_ratio=0.5 and epsilon=1e-4 (two stages); ours one stage (each query head's "
                  "attention times its own ||W_o v||_1)",
    "finch": "window: ours the last 64 queries; kvpress the question after a delimiter (question-aware: the question's "
             "tokens; question-agnostic: ours, 64, as there is no question)",
    "simlayerkv": "n_recent: kvpress's default 1024 compresses nothing at ~1k tokens, ours 128 used on both sides; "
                  "lazy_threshold: kvpress's default 1.0 is off, ours 0.9 used on both sides",
    "duo_attention": "head_compression_ratio: kvpress's default 0.0 is off, ours 0.5 used on both sides (patterns, "
                     "sinks 128 and recent 256: ours on both sides)",
    "think": "key_channel_compression_ratio: kvpress's default 0.0 is off, ours 0.5 used on both sides",
    "composed": "kvpress has no default composition: ours (KnormPress keeping 0.75, then SnapKVPress) on both sides",
    "lukv": "scorer: ours ExpectedAttention (query statistics over the last 128 queries, epsilon 0) with 4 sinks kept; "
            "kvpress ExpectedAttentionPress(epsilon=0.02) (statistics over all queries but the first 4) with sink=4 "
            "and window=1 kept; keep curve: ours on both sides",
}


def parse_kvpress_caches(text: str) -> list[str]:
    """``--kvpress-cache``: comma-separated ``dynamic`` (kvpress's DynamicCache) or ``<backend>-int<bits>``
    (transformers' ``QuantizedCache``), validated against what transformers 5.2 accepts, duplicates dropped."""
    specs = list(dict.fromkeys(x.strip().lower() for x in text.split(",") if x.strip()))
    if not specs:
        raise ValueError("--kvpress-cache needs at least one cache")
    for spec in specs:
        if spec == "dynamic":
            continue
        m = re.fullmatch(r"([a-z]+)-int(\d+)", spec)
        if m is None or m.group(1) not in QUANTIZED_BACKENDS:
            raise ValueError(f"unknown cache {spec!r}: use dynamic or <backend>-int<bits> with backend in "
                             f"{', '.join(QUANTIZED_BACKENDS)} (e.g. quanto-int4)")
        backend, bits = m.group(1), int(m.group(2))
        if bits not in QUANTIZED_BITS[backend]:
            raise ValueError(f"{spec}: transformers' QuantizedCache takes {backend} with "
                             f"{', '.join(map(str, QUANTIZED_BITS[backend]))} bits"
                             + (" (8 bits: hqq-int8)" if backend == "quanto" and bits == 8 else ""))
    return specs


def cache_requirements(specs: list[str]) -> tuple[str, ...]:
    """What the quantized caches among ``specs`` need in the kvpress venv (besides kvpress and torch)."""
    backends = dict.fromkeys(spec.split("-int")[0] for spec in specs if spec != "dynamic")
    return tuple(req for b in backends for req in QUANTIZED_BACKENDS[b])


def kvpress_name(label: str) -> str:
    """The kvpress row name of a kvpress record label: ``method`` or ``method+<backend>-int<bits>`` (a press on
    transformers' QuantizedCache), e.g. ``AdaKVPress(SnapKVPress) + QuantizedCache(quanto, 4 bits)``."""
    method, _, spec = label.partition("+")
    name = KVPRESS_NAMES.get(method, method)
    if not spec:
        return name
    backend, _, bits = spec.partition("-int")
    cache = f"QuantizedCache({backend}, {bits} bits)"
    return f"{cache}, no press" if method == "full" else f"{name} + {cache}"


def kvpress_counterpart(label: str) -> str | None:
    """The kvpress method whose answers ``label`` (a preset or a diagnostic pipeline) is paired with."""
    if label in DIAGNOSTICS:
        return DIAGNOSTICS[label][0]
    return KVPRESS_COUNTERPART.get(label, label if label in KVPRESS_NAMES else None)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Compare kvpress_ada with NVIDIA kvpress 0.5.5 (accuracy, KV bytes held, decode speed) "
                    "on the same model and the same token ids.",
        epilog="Writes a JSON report (default benchmarks/results/kvpress_compare.json; --quick writes to the "
               "temp dir unless --out is given) and prints a table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="default",
                   help="a named model of kvpress_ada.models ('default' is SmolLM2-135M-Instruct, "
                        "'qwen2.5-coder-0.5b', ...) or a local model dir")
    p.add_argument("--tasks", default="passkey,multikey", help="comma-separated kvpress_ada.harness.eval tasks")
    p.add_argument("--n", type=int, default=12, help="samples per task (cell n = n x tasks)")
    p.add_argument("--context", type=int, default=1000, help="context tokens per sample (before the chat template)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ratios", default="0.25,0.5",
                   help="compression ratios (fraction evicted) for accuracy; at 0.75 every method of both libraries "
                        "is at the floor on this model (<= 0.1), so the default stops at 0.5")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated kvpress_ada presets from " + ",".join(ALL_METHODS) + "; kvpress runs its "
                        "press for each one it has (" + ",".join(m for m in KVPRESS_NAMES if m != "full") + "); "
                        + "; ".join(f"'{k}' stands for " + ",".join(v) for k, v in METHOD_GROUPS.items()))
    p.add_argument("--settings", default="agnostic,aware",
                   help="agnostic: compress the context, then ask (the question is unknown when compressing); "
                        "aware: compress context + question together")
    p.add_argument("--max-new-tokens", type=int, default=24,
                   help="answer tokens (multikey answers need ~20: digits are single tokens)")
    p.add_argument("--decode-ratios", default="0.5,0.75", help="compression ratios timed in the decode part")
    p.add_argument("--decode-context", type=int, default=4000, help="context tokens of the decode-speed sample")
    p.add_argument("--decode-steps", type=int, default=32, help="greedy steps timed per measurement")
    p.add_argument("--decode-repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode-speed part")
    p.add_argument("--no-diagnostics", action="store_true",
                   help="skip the diagnostic kvpress_ada pipelines (kvpress-rule replicas, one-factor changes)")
    p.add_argument("--replica-accuracy", action="store_true",
                   help="also answer with the '~kvpress' replica pipelines (by default they are only compared "
                        "kept set by kept set, which is cheap)")
    p.add_argument("--ea-ablation", action="store_true",
                   help="add one-factor ExpectedAttention variants between ours and kvpress's (answered)")
    p.add_argument("--no-kept-sets", dest="kept_sets", action="store_false",
                   help="skip the kept-set comparison (one extra prefill per sample on our side, plus KVzip's model "
                        "pass when a KVzip preset is compared); it runs only for kvpress presses whose kept set the "
                        "worker can read (masking presses and ScorerPress subclasses)")
    p.add_argument("--resume", action="store_true",
                   help="keep the samples already in an incomplete JSON at --out of the same configuration (the JSON "
                        "is rewritten after every sample, marked complete: false until the run ends)")
    p.add_argument("--ours-records", type=Path, nargs="+", default=None,
                   help="one file per --settings entry, each the records of a run on the same samples (same model, "
                        "tasks, --n, --context, --seed, answer length; every sample's full-cache bytes checked "
                        "against its token count here): benchmarks/quality.py's quality_<setting>.json, or a "
                        "`kvpress-ada eval` run's results.json / partial.json; each pairs with the setting it was "
                        "run in. Our answers are read from them instead of being recomputed, and only kvpress runs "
                        "(pairs by (task, sample); implies --no-kept-sets and --no-diagnostics; our labels kept: "
                        "full and --methods)")
    p.add_argument("--max-samples", type=int, default=None,
                   help="run only the first K samples of the round-robin order (a smoke run on the samples of a "
                        "full configuration, e.g. against --ours-records)")
    p.add_argument("--surrogate", default=None,
                   help="surrogate file for the kvzap presets on both sides (default: each preset's own, made for the "
                        "default model; `kvpress-ada distill` makes one for another model)")
    p.add_argument("--kvpress-separate", action="store_true",
                   help="one kvpress prefill per (press, ratio) even where kvpress's own compress on the inputs "
                        "captured from the sample's full-cache prefill gives the same cache (ScorerPress, AdaKVPress) "
                        "and one KVzip context reconstruction per (ratio, layerwise) instead of one per sample "
                        "(the scores depend on neither); same answers, several times slower")
    p.add_argument("--kvpress-cache", default="dynamic",
                   help="comma-separated caches kvpress's presses prefill into: dynamic (its DynamicCache) or "
                        "transformers' QuantizedCache as <backend>-int<bits>: quanto-int2, quanto-int4 (optimum-quanto "
                        "0.2.7; transformers takes no 8-bit quanto cache), hqq-int4, hqq-int8, ... (installed into the "
                        "kvpress venv only). The full DynamicCache always runs (the KV-bytes reference), each "
                        "QuantizedCache also without a press (ratio 0); kvpress rows are labelled <method>+<cache>")
    p.add_argument("--kvpress-only", action="store_true",
                   help="run the kvpress side only (no kvpress_ada answers; pair with another run on the same "
                        "samples by sample index); needs --no-decode, implies --no-kept-sets and --no-diagnostics")
    p.add_argument("--no-plot", action="store_true", help="do not write the accuracy-vs-ratio PNG next to the JSON")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="kvpress virtualenv (created if missing)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in both processes; on a busy 2-core machine 1 thread measured 3x faster "
                        "prefill and 10x faster decode than 2 (0 = torch's default)")
    p.add_argument("--workdir", type=Path, default=None, help="where the samples/masks exchange files go")
    p.add_argument("--out", type=Path, default=None, help="JSON report path")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2 samples (1 per task), last accuracy ratio, first decode ratio, "
                        "decode context 600, 8 steps, 1 round")
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.ratios = [float(r) for r in args.ratios.split(",") if r]
    args.decode_ratios = [float(r) for r in args.decode_ratios.split(",") if r]
    args.methods = [m for m in args.methods.split(",") if m]
    args.settings = [x for x in args.settings.split(",") if x]
    if not args.settings or set(args.settings) - {"agnostic", "aware"}:
        p.error("--settings takes agnostic, aware or both (comma-separated)")
    args.methods = list(dict.fromkeys(m for x in args.methods for m in METHOD_GROUPS.get(x, [x])))
    unknown = sorted(set(args.methods) - set(ALL_METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {', '.join(ALL_METHODS)}")
    try:
        args.kvpress_caches = parse_kvpress_caches(args.kvpress_cache)
    except ValueError as exc:
        p.error(str(exc))
    if args.kvpress_only:
        if not args.no_decode:
            p.error("--kvpress-only runs no kvpress_ada model: add --no-decode")
        if args.ours_records is not None:
            p.error("--kvpress-only and --ours-records exclude each other")
        args.kept_sets, args.no_diagnostics = False, True
    if args.ours_records is not None:
        for path in args.ours_records:
            if not path.is_file():
                p.error(f"--ours-records {path} does not exist; pass benchmarks/quality.py's quality_<setting>.json "
                        "or a `kvpress-ada eval` run's results.json / partial.json")
        if len(args.ours_records) != len(args.settings):
            p.error(f"--ours-records takes one file per setting: {len(args.ours_records)} files for --settings "
                    f"{','.join(args.settings)}")
        args.kept_sets, args.no_diagnostics = False, True
    if args.max_samples is not None and args.max_samples < 1:
        p.error(f"--max-samples {args.max_samples}: give at least 1")
    if args.quick:
        args.n = max(1, 2 // max(len(args.tasks), 1))
        args.ratios = args.ratios[-1:]
        args.decode_ratios = args.decode_ratios[:1]
        args.decode_context = min(args.decode_context, 600)
        args.decode_steps = min(args.decode_steps, 8)
        args.decode_repeats = 1
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "kvpress_compare_quick.json" if args.quick else DEFAULT_OUT
    return args


# --------------------------------------------------------------------------- kvpress venv


def ensure_kvpress_venv(venv: Path, extra: tuple[str, ...] = ()) -> Path:
    """Python of a virtualenv holding exactly the pinned kvpress and torch (created on first use), plus the
    pinned ``extra`` requirements (``name==version``: a QuantizedCache backend) when asked for."""
    python = venv / "bin" / "python"
    dists = ("kvpress", "torch", "transformers") + tuple(r.split("==")[0] for r in extra)
    check = ("import json, importlib.metadata as m; "
             f"print(json.dumps({{d: m.version(d) for d in {dists!r}}}))")
    requirements = (*KVPRESS_REQUIREMENTS, *extra)
    if python.exists():
        res = subprocess.run([str(python), "-c", check], capture_output=True, text=True)
        if res.returncode == 0:
            versions = json.loads(res.stdout)
            if versions["kvpress"] == "0.5.5" and versions["torch"].split("+")[0] == "2.13.0" and all(
                    versions[r.split("==")[0]] == r.split("==")[1] for r in extra):
                return python
        print(f"[kvpress venv] {venv} is incomplete; (re)installing {' '.join(requirements)}", file=sys.stderr)
    else:
        print(f"[kvpress venv] creating {venv} (pip install {' '.join(requirements)}, ~2 min)",
              file=sys.stderr)
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *requirements], check=True)
    res = subprocess.run([str(python), "-c", check], capture_output=True, text=True, check=True)
    print(f"[kvpress venv] installed {res.stdout.strip()}", file=sys.stderr)
    return python


QUANTIZED_CHECK = """
import json, time, torch
from transformers import LlamaConfig, QuantizedCache
config = LlamaConfig(num_hidden_layers=1, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
cache = QuantizedCache(backend=BACKEND, config=config, nbits=BITS)
keys = torch.randn(1, 1, 200, 64)
t0 = time.perf_counter()
cache.update(keys, keys.clone(), 0)
layer = cache.layers[0]
err = (layer._dequantize(layer._quantized_keys) - keys).abs().max().item()
print(json.dumps({"max_abs_error": err, "seconds": time.perf_counter() - t0}))
"""


def check_quantized_caches(python: Path, specs: list[str]) -> dict:
    """Quantize and dequantize a small tensor with each QuantizedCache of ``specs`` in the kvpress venv, on CPU,
    before any model loads: the first use of optimum-quanto builds its C++ CPU extension (torch's JIT
    ``cpp_extension.load``: the machine's C++ compiler and ninja, ~2 min, cached in the venv). Exits with the
    backend's own error when that cannot work here."""
    out = {}
    for spec in specs:
        if spec == "dynamic":
            continue
        backend, bits = spec.split("-int")
        code = QUANTIZED_CHECK.replace("BACKEND", repr(backend)).replace("BITS", bits)
        print(f"[kvpress venv] checking QuantizedCache({backend}, {bits} bits) on CPU"
              + (" (the first quanto use builds its C++ extension, ~2 min)" if backend == "quanto" else ""),
              file=sys.stderr)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        res = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env,
                             cwd=tempfile.gettempdir())
        if res.returncode != 0:
            raise SystemExit(f"kvpress_compare.py: QuantizedCache({backend}, {bits} bits) does not work in the "
                             f"kvpress venv on this machine:\n{res.stderr[-3000:]}")
        out[spec] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


class WorkerProcess:
    """``kvpress_worker.py`` in the kvpress venv, spoken to with one JSON object per line."""

    def __init__(self, python: Path, model_dir: str, threads: int | None):
        cmd = [str(python), str(HERE / "kvpress_worker.py"), "--model", model_dir]
        if threads:
            cmd += ["--threads", str(threads)]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True,
                                     env=env, cwd=tempfile.gettempdir())
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"kvpress worker exited (code {self.proc.wait()}); see its stderr above")
        return json.loads(line)

    def call(self, cmd: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if not out.get("ok"):
            raise RuntimeError(f"kvpress worker failed on {cmd!r}: {out.get('error')}")
        return out

    def close(self):
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.proc.kill()


# --------------------------------------------------------------------------- diagnostic components
# kvpress_ada components that re-implement kvpress 0.5.5's rules exactly, registered by name (public
# registry API). Used only to attribute differences; none of this is part of the library.

def _register_diagnostics():
    import torch
    import torch.nn.functional as F

    from kvpress_ada import (
        ExpectedAttention,
        HeadAllocator,
        LayerSchedule,
        Observation,
        Scorer,
        register_allocator,
        register_scorer,
    )
    from kvpress_ada.allocators.heads import flat_topk_counts
    from kvpress_ada.allocators.layers import register_layer_schedule
    from kvpress_ada.scorers.attention import window_attention
    from kvpress_ada.scorers.expected_attention import rotate

    @register_scorer("snapkv_kvpress")
    class SnapKVKvpress(Scorer):
        """kvpress's SnapKVPress.score: window columns dropped *before* 1-D pooling, zero padding
        counted in the average (``avg_pool1d`` default), window re-added as the maximum."""

        name: Literal["snapkv_kvpress"] = "snapkv_kvpress"
        window: int = 64
        kernel: int = 5

        def query_window(self) -> int:
            return self.window

        def min_context(self) -> int:
            return self.window + 1

        def score(self, obs: Observation) -> torch.Tensor:
            attn = window_attention(obs, self.window).mean(dim=3)[..., : -self.window]  # [B, Hkv, G, L - w]
            B, H, G, n = attn.shape
            pooled = F.avg_pool1d(attn.reshape(-1, 1, n), self.kernel, stride=1, padding=self.kernel // 2)
            scores = pooled.reshape(B, H, G, n).mean(dim=2)
            return F.pad(scores, (0, self.window), value=float("inf"))

    @register_scorer("expected_attention_kvpress")
    class ExpectedAttentionKvpress(Scorer):
        """kvpress's ExpectedAttentionPress.score: query statistics over *all* prefill queries but the
        first ``n_sink`` (mean, covariance / N) of the pre-RoPE queries, rotated by the RoPE matrix
        averaged over the next ``n_future`` positions; softmax over non-sink keys; x ||v||. Scores are
        compared raw across heads (kvpress's AdaKVPress does)."""

        name: Literal["expected_attention_kvpress"] = "expected_attention_kvpress"
        n_future: int = 512
        n_sink: int = 4
        needs_rope: ClassVar[bool] = True
        comparable_across_heads: ClassVar[bool] = True

        def query_window(self):
            return None

        def min_context(self) -> int:
            return self.n_sink + 2

        def score(self, obs: Observation) -> torch.Tensor:
            q = obs.queries.float()  # post-RoPE, positions 0 .. L-1
            B, Hq, L, D = q.shape
            Hkv, G = obs.n_kv_heads, obs.group_size
            inv = obs.rope_inv_freq.float().to(q.device)
            pos = torch.arange(L, device=q.device, dtype=torch.float32)
            back = -pos[:, None] * inv[None, :]
            q = rotate(q, torch.cat([back.cos()] * 2, -1), torch.cat([back.sin()] * 2, -1))  # back to pre-RoPE
            future = torch.arange(L, L + self.n_future, device=q.device, dtype=torch.float32)
            ang = future[:, None] * inv[None, :]
            cos = torch.cat([ang.cos().mean(0)] * 2)  # the averaged rotation R = mean_p R(p)
            sin = torch.cat([ang.sin().mean(0)] * 2)
            q = q[:, :, self.n_sink:]
            q = rotate(q, cos, sin)
            mu = q.mean(dim=2)  # [B, Hq, D]
            c = q - mu[:, :, None]
            cov = torch.einsum("bhsi,bhsj->bhij", c, c) / q.shape[2]
            keys = obs.keys.float()[:, :, self.n_sink:].repeat_interleave(G, dim=1)
            logits = torch.einsum("bhd,bhnd->bhn", mu, keys) * obs.scaling
            logits = logits + 0.5 * obs.scaling ** 2 * torch.einsum("bhnd,bhde,bhne->bhn", keys, cov, keys)
            scores = torch.softmax(logits, dim=-1).view(B, Hkv, G, -1).mean(dim=2)
            scores = scores * obs.values.float()[:, :, self.n_sink:].norm(dim=-1)
            return F.pad(scores, (self.n_sink, 0), value=float("inf"))

    @register_scorer("expected_attention_kvpress_shares")
    class ExpectedAttentionKvpressShares(ExpectedAttentionKvpress):
        """kvpress's ExpectedAttention scores, declared not comparable across heads, so kvpress_ada's Ada
        compares each head's scores as shares of its own mass."""

        name: Literal["expected_attention_kvpress_shares"] = "expected_attention_kvpress_shares"
        comparable_across_heads: ClassVar[bool] = False

    @register_scorer("expected_attention_rawscale")
    class ExpectedAttentionRawScale(ExpectedAttention):
        """kvpress_ada's ExpectedAttention, but Ada compares its raw scores across heads (as kvpress)."""

        name: Literal["expected_attention_rawscale"] = "expected_attention_rawscale"
        comparable_across_heads: ClassVar[bool] = True

    @register_allocator("ada_kvpress")
    class AdaKvpressSafeguard(HeadAllocator):
        """kvpress's AdaKVPress rule: every head first keeps its top ``int(alpha * b)`` tokens, the
        remaining ``H * (b - int(alpha * b))`` slots go to the layer-wide top-k of the rest."""

        name: Literal["ada_kvpress"] = "ada_kvpress"
        alpha: float = 0.2

        def allocate(self, scores, budget, comparable=True):
            B, H, L = scores.shape
            budget = budget.long()
            n_safe = (budget.double() * self.alpha).floor().long()
            if self.alpha > 0:
                n_safe = torch.where(budget > 0, n_safe.clamp(min=1), n_safe)
            rank = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
            forced = rank < n_safe[:, None, None]
            return flat_topk_counts(torch.where(forced, float("inf"), scores), H * budget)

    @register_layer_schedule("kvpress_budget")
    class KvpressBudget(LayerSchedule):
        """kvpress's per-layer kept count: ``max(1, int(L * (1 - r)))`` (ScorerPress), or PyramidKVPress's
        ``get_layer_budget`` (pyramid only when ``L >= max >= min >= window``, else SnapKV's count with
        ``round``)."""

        name: Literal["kvpress_budget"] = "kvpress_budget"
        ratio: float
        pyramid: bool = False
        window: int = 64
        beta: int = 20

        def budgets(self, avg, n_layers, lengths):
            rows = []
            for L in lengths.tolist():
                rows.append([self._one(L, i, n_layers) for i in range(n_layers)])
            return torch.tensor(rows, dtype=torch.long, device=lengths.device)

        def _one(self, L: int, layer: int, n_layers: int) -> int:
            if not self.pyramid:
                return max(1, int(L * (1 - self.ratio)))
            cap = self.window + L * (1 - self.ratio)
            lo = (cap - self.window) / self.beta
            hi = (cap - self.window) * 2 - lo
            if hi >= L - self.window:
                hi = L - self.window
                lo = (cap - self.window) * 2 - hi
            if not (L >= hi >= lo >= self.window):
                return max(1, round(L * (1 - self.ratio)))
            steps = (hi - lo) / (n_layers - 1) if n_layers > 1 else 0.0
            return round(hi - layer * steps)

    return (SnapKVKvpress, ExpectedAttentionKvpress, ExpectedAttentionKvpressShares, ExpectedAttentionRawScale,
            AdaKvpressSafeguard, KvpressBudget)


DIAGNOSTICS = {
    # label: (kvpress counterpart, what it changes w.r.t. our preset / reproduces of kvpress)
    "snapkv~kvpress": ("snapkv", "kvpress's SnapKV scores (pool after dropping the window, zero-padded) "
                                 "and kept count int(L(1-r))"),
    "ada_snapkv~kvpress": ("ada_snapkv", "kvpress's SnapKV scores + kvpress's safeguard rule + count"),
    "ada_snapkv~kvpress_rule": ("ada_snapkv", "our SnapKV scores, kvpress's safeguard rule (one factor)"),
    "pyramidkv~kvpress": ("pyramidkv", "kvpress's SnapKV scores + PyramidKVPress.get_layer_budget"),
    "expected_attention~kvpress": ("expected_attention", "kvpress's ExpectedAttention statistics "
                                                         "(all queries, pre-RoPE, sinks out of the softmax)"),
    "ada_expected_attention~kvpress": ("ada_expected_attention", "kvpress's EA scores + kvpress's safeguard, "
                                                                 "raw scores across heads"),
    "ada_expected_attention~rawscale": ("ada_expected_attention", "our EA scores and Ada rule, but raw scores "
                                                                  "across heads (no per-head shares; one factor)"),
}
# --ea-ablation: one factor at a time between our ExpectedAttention (+ Ada) and kvpress's
EA_ABLATION = {
    "expected_attention~allqueries": ("expected_attention", "our EA with statistics over all prefill queries "
                                                            "instead of the last 128"),
    "ada_expected_attention~kvpress_scores": ("ada_expected_attention", "kvpress's EA scores, our Ada rule, raw "
                                                                        "scores across heads"),
    "ada_expected_attention~kvpress_scores_shares": ("ada_expected_attention", "kvpress's EA scores, our Ada rule "
                                                                               "on per-head shares"),
    "ada_expected_attention~kvpress_rule": ("ada_expected_attention", "our EA scores, kvpress's safeguard rule "
                                                                      "(raw scores)"),
}
DIAGNOSTICS.update(EA_ABLATION)


def diagnostic_entries(ratios, methods, ea_ablation=False):
    from kvpress_ada import AdaHead, ExpectedAttention, Pipeline, SnapKV, UniformHead
    from kvpress_ada.harness.eval.runner import Entry
    from kvpress_ada.presets import ADA_ALPHA

    SnapKVKvpress, EAKvpress, EAKvpressShares, EARaw, AdaKvpress, KvpressBudget = _register_diagnostics()
    entries = []
    for label, (counterpart, _) in DIAGNOSTICS.items():
        if counterpart not in methods or (label in EA_ABLATION and not ea_ablation):
            continue
        for r in ratios:
            budget = KvpressBudget(ratio=r, pyramid=label.startswith("pyramidkv"))
            parts = {
                "snapkv~kvpress": dict(scorer=SnapKVKvpress(), allocator=UniformHead(), layers=budget),
                "ada_snapkv~kvpress": dict(scorer=SnapKVKvpress(), allocator=AdaKvpress(alpha=ADA_ALPHA),
                                           layers=budget),
                "ada_snapkv~kvpress_rule": dict(scorer=SnapKV(), allocator=AdaKvpress(alpha=ADA_ALPHA)),
                "pyramidkv~kvpress": dict(scorer=SnapKVKvpress(), allocator=UniformHead(), layers=budget),
                "expected_attention~kvpress": dict(scorer=EAKvpress(), allocator=UniformHead(), layers=budget),
                "ada_expected_attention~kvpress": dict(scorer=EAKvpress(), allocator=AdaKvpress(alpha=ADA_ALPHA),
                                                       layers=budget),
                "ada_expected_attention~rawscale": dict(scorer=EARaw(), allocator=AdaHead(alpha=ADA_ALPHA)),
                "expected_attention~allqueries": dict(scorer=ExpectedAttention(window=1 << 30)),
                "ada_expected_attention~kvpress_scores": dict(scorer=EAKvpress(), allocator=AdaHead(alpha=ADA_ALPHA)),
                "ada_expected_attention~kvpress_scores_shares": dict(scorer=EAKvpressShares(),
                                                                     allocator=AdaHead(alpha=ADA_ALPHA)),
                "ada_expected_attention~kvpress_rule": dict(scorer=ExpectedAttention(),
                                                            allocator=AdaKvpress(alpha=ADA_ALPHA)),
            }[label]
            entries.append(Entry(label, r, Pipeline(**parts, compression_ratio=r)))
    return entries


# --------------------------------------------------------------------------- statistics


def mean_ci(values):
    n = len(values)
    if n == 0:
        return None, None
    mean = sum(values) / n
    if n < 2:
        return mean, None
    sd = statistics.stdev(values)
    return mean, 1.96 * sd / math.sqrt(n)


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar test on the discordant pair counts."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def median(xs):
    return statistics.median(xs) if xs else None


# --------------------------------------------------------------------------- main


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    python = ensure_kvpress_venv(args.venv, cache_requirements(args.kvpress_caches))
    quantized_check = check_quantized_caches(python, args.kvpress_caches)
    kv_caches = None if args.kvpress_caches == ["dynamic"] else args.kvpress_caches  # None: the worker's default

    import numpy as np
    import torch
    import transformers
    from tqdm.auto import tqdm

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the worker before torch loads

    import kvpress_ada
    from kvpress_ada.harness.eval.runner import evaluate_sample, grid
    from kvpress_ada.harness.eval.scoring import score_sample
    from kvpress_ada.harness.eval.tasks import make_samples
    from kvpress_ada.hosts.transformers.fanout import capture_prefill
    from kvpress_ada.hosts.transformers.generation import decode_rows, split_prompt
    from kvpress_ada.hosts.transformers.hf import cache_kwarg as _cache_key
    from kvpress_ada.models import ensure_model, load, source_names
    from kvpress_ada.presets import preset
    from kvpress_ada.tokens import encode

    model_dir = str(ensure_model(args.model)) if args.model in source_names() else args.model
    if (args.ours_records is not None or args.kvpress_only) and args.no_decode:
        model, tok = None, tokenizer_only(model_dir)  # our answers come from the file or nowhere: no model here
    else:
        model, tok = load(args.model)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvpress_compare_"))
    workdir.mkdir(parents=True, exist_ok=True)

    # ---- samples, rendered once; both libraries get these token ids. Round-robin over tasks, so a run
    # stopped early covers every task equally.
    per_task = [make_samples(task, tok, args.n, args.context, seed=args.seed) for task in args.tasks]
    samples = [s for group in zip(*per_task) for s in group][: args.max_samples]
    payload = []
    for i, s in enumerate(samples):
        head, tail = split_prompt(tok, s.context, s.question)
        payload.append({"index": i, "task": s.task, "context": s.context, "question": s.question,
                        "answers": s.answers, "head_ids": encode(tok, head, "cpu")[0].tolist(),
                        "tail_ids": encode(tok, tail, "cpu")[0].tolist()})
    samples_file = workdir / "samples.json"
    samples_file.write_text(json.dumps({"samples": payload}))
    print(f"[samples] {len(samples)} samples ({', '.join(args.tasks)}) x {args.context} tokens; "
          f"prompt lengths {min(len(p['head_ids']) for p in payload)}-{max(len(p['head_ids']) for p in payload)} "
          f"context ids + {min(len(p['tail_ids']) for p in payload)}-{max(len(p['tail_ids']) for p in payload)} "
          f"question ids; exchange files in {workdir}", file=sys.stderr)

    kv_methods = [m for m in args.methods if m in KVPRESS_NAMES]
    entries = our_entries(args, grid, preset)
    supplied = supplied_scores(entries)
    diag_entries = [] if args.no_diagnostics else diagnostic_entries(args.ratios, args.methods, args.ea_ablation)
    answered = entries + [e for e in diag_entries if args.replica_accuracy or not e.label.endswith("~kvpress")]
    if args.ours_records is None:
        ours_files = None
    else:
        from transformers import AutoConfig

        ours_files = read_ours_records(args, payload, kv_bytes_per_token(AutoConfig.from_pretrained(model_dir)))
    handed = handed_artefacts(kv_methods, model_dir, workdir / "handed.safetensors", preset)
    ours = ours_settings(kv_methods, preset)
    state = load_checkpoint(args) if args.resume else None
    state = state or {"kv_records": [], "our_records": [], "overlap_samples": [], "done": {},
                      "seconds": {"kvpress": {}, "kvpress_ada": {}, "kept_sets": {}}, "presses": {},
                      "question_token_by_token": {}, "kept_set_methods": [], "kvpress_caches": {}}

    worker = WorkerProcess(python, model_dir, args.threads)
    decode = None
    try:
        kv_versions = worker.call("hello")
        prompt_check = worker.call("prompt_check", samples_file=str(samples_file))
        print(f"[kvpress] {kv_versions}; prompt check {prompt_check}", file=sys.stderr)

        def write(complete: bool):
            report = build_report(args, payload, state["kv_records"], state["our_records"],
                                  aggregate_overlap(state["overlap_samples"]), decode)
            done = {k: sorted(v) for k, v in state["done"].items()}
            report["complete"] = complete
            report["coverage"] = {
                setting: {"samples": len(idx), "of": len(samples),
                          "per_task": {t: sum(payload[i]["task"] == t for i in idx) for t in args.tasks}}
                for setting, idx in done.items()}
            report["meta"] = {
                "machine": machine_info(torch, transformers),
                "kvpress_env": {**kv_versions, "venv": str(args.venv),
                                "requirements": [*KVPRESS_REQUIREMENTS, *cache_requirements(args.kvpress_caches)]},
                "kvpress_ada_version": kvpress_ada.__version__, "git": git_state(),
                "model_dir": model_dir, "config": run_config(args),
                "args": {k: (str(v) if isinstance(v, Path) else [str(x) for x in v]
                             if isinstance(v, list) and v and isinstance(v[0], Path) else v)
                         for k, v in vars(args).items()},
                "prompt_check": prompt_check, "kvpress_presses": state["presses"],
                "kvpress_defaults": {KVPRESS_NAMES[m]: kvpress_defaults(m) for m in kv_methods},
                "kvpress_counterparts": {e.label: kvpress_counterpart(e.label) for e in answered},
                "kept_set_methods": state["kept_set_methods"],
                "kvpress_question_token_by_token": state["question_token_by_token"],
                "seconds": {"total": time.perf_counter() - t_start + state.get("resumed_seconds", 0.0),
                            "kvpress_accuracy": state["seconds"]["kvpress"],
                            "kvpress_ada_accuracy": state["seconds"]["kvpress_ada"],
                            "kept_sets": state["seconds"]["kept_sets"],
                            "decode": decode["seconds"] if decode else None},
                "diagnostics": {k: v[1] for k, v in DIAGNOSTICS.items()},
                "notes": NOTES,
                "ours_records": None if ours_files is None else {k: v["source"] for k, v in ours_files.items()},
                "settings_differ": {m: SETTINGS_DIFFER[m] for m in kv_methods if m in SETTINGS_DIFFER},
                "no_kvpress_row": {m: NO_KVPRESS_ROW[m] for m in args.methods if m in NO_KVPRESS_ROW},
                "kvpress_settings_from_ours": ours,
            }
            if kv_caches is not None:
                report["meta"]["kvpress_caches"] = state["kvpress_caches"]
                report["meta"]["quantized_cache_check"] = quantized_check
                report["meta"]["notes"] = NOTES + QUANTIZED_NOTES
            report["checkpoint"] = {"done": done, "overlap_samples": state["overlap_samples"]}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.out.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(report, indent=1) + "\n")
            tmp.replace(args.out)
            return report

        # ---- accuracy, sample by sample (checkpointed): kvpress (one prefill per press), ours (fan-out: one
        # prefill per sample), then the kept sets of both where kvpress's can be read
        for setting in args.settings:
            aware = setting == "aware"
            done = state["done"].setdefault(setting, [])
            todo = [i for i in range(len(samples)) if i not in done]
            bar = tqdm(total=len(samples), initial=len(samples) - len(todo), desc=f"{setting}: samples",
                       unit="sample", dynamic_ncols=True)
            for i in todo:
                masks_file = workdir / f"kvpress_masks_{setting}_{i}.npz"
                kv = worker.call("accuracy", samples_file=str(samples_file), masks_file=str(masks_file),
                                 indices=[i], methods=kv_methods, ratios=args.ratios,
                                 ratio_free=[m for m in kv_methods if m in RATIO_FREE], supplied=supplied,
                                 max_new_tokens=args.max_new_tokens, question_aware=aware, kept_sets=args.kept_sets,
                                 handed=handed, ours=ours,
                                 fanout=not args.kvpress_separate, quiet=True,
                                 **({} if kv_caches is None else {"caches": kv_caches}))
                for rec in kv["records"]:
                    text = tok.decode(rec["tokens"], skip_special_tokens=True).strip()
                    state["kv_records"].append({"setting": setting, **{k: v for k, v in rec.items() if k != "tokens"},
                                                "answer": text, "score": score_sample(samples[rec["sample"]], text)})
                state["presses"].update(kv["presses"])
                state["kvpress_caches"].update(kv.get("caches") or {})
                state["question_token_by_token"][setting] = (state["question_token_by_token"].get(setting, 0)
                                                             + kv["question_token_by_token"])
                _add(state["seconds"]["kvpress"], setting, kv["seconds"])
                if ours_files is not None:  # read, not recomputed
                    state["our_records"] += [{"setting": setting, **r}
                                             for r in ours_files[setting]["records"].get(i, [])]
                elif not args.kvpress_only:
                    t0 = time.perf_counter()
                    recs = evaluate_sample(model, tok, samples[i], answered, i, question_aware=aware,
                                           max_new_tokens=args.max_new_tokens)
                    _add(state["seconds"]["kvpress_ada"], setting, time.perf_counter() - t0)
                    state["our_records"] += [
                        {"setting": setting, "sample": r.sample, "task": r.task, "label": r.label, "ratio": r.ratio,
                         "answer": r.answer, "score": r.score, "kv_bytes": r.kv_bytes,
                         "full_kv_bytes": r.full_kv_bytes, "kl": r.kl, "top1": r.top1,
                         "achieved_ratio": r.achieved_ratio} for r in recs]
                kept = set(kv["kept_set_methods"])
                state["kept_set_methods"] = sorted(kept | set(state["kept_set_methods"]))
                compared = [e for e in entries + diag_entries if kvpress_counterpart(e.label) in kept]
                if compared:
                    t0 = time.perf_counter()
                    rows = kept_set_sample(model, payload[i], compared, masks_file, aware, capture_prefill, np,
                                           torch)
                    state["overlap_samples"] += [{"setting": setting, **r} for r in rows]
                    _add(state["seconds"]["kept_sets"], setting, time.perf_counter() - t0)
                masks_file.unlink(missing_ok=True)
                done.append(i)
                bar.update(1)
                write(complete=False)
            bar.close()

        # ---- decode speed at a long context
        decode = None if args.no_decode else decode_benchmark(
            args, worker, model, tok, make_samples, split_prompt, encode, capture_prefill, decode_rows, _cache_key,
            preset, torch, tqdm)
    finally:
        worker.close()

    report = write(complete=all(len(state["done"].get(s, [])) == len(samples) for s in args.settings))
    print(render_markdown(report))
    if kv_caches is not None:
        print("\nkvpress on transformers' QuantizedCache (paired per sample with kvpress's full DynamicCache):\n")
        print(quantized_rows(report))
    print("\nREADME rows (question-agnostic, paired per sample):\n")
    print(readme_rows(report))
    differ = report["meta"]["settings_differ"]
    if differ:
        print("\nour presets' settings that differ from kvpress's defaults (SETTINGS_DIFFER):")
        print(json.dumps(differ, indent=1))
    if report["meta"]["no_kvpress_row"]:
        print("\nno kvpress row (NO_KVPRESS_ROW):")
        print(json.dumps(report["meta"]["no_kvpress_row"], indent=1))
    if not args.no_plot:
        png = plot_report(report, args.out.with_suffix(".png"))
        if png:
            print(f"wrote {png}", file=sys.stderr)
    print(f"\nwrote {args.out} (total {report['meta']['seconds']['total'] / 60:.1f} min)", file=sys.stderr)
    return report


def _add(d: dict, key: str, value: float):
    d[key] = d.get(key, 0.0) + value


def run_config(args) -> dict:
    """What a resumed run must share with the checkpoint it continues."""
    return {"model": args.model, "tasks": args.tasks, "n": args.n, "context": args.context, "seed": args.seed,
            "ratios": args.ratios, "methods": args.methods, "settings": args.settings,
            "max_new_tokens": args.max_new_tokens, "no_diagnostics": args.no_diagnostics,
            "replica_accuracy": args.replica_accuracy, "ea_ablation": args.ea_ablation, "kept_sets": args.kept_sets,
            "kvpress_separate": args.kvpress_separate, "surrogate": args.surrogate,
            "ours_records": (None if args.ours_records is None else str(args.ours_records[0].resolve())
                             if len(args.ours_records) == 1 else [str(x.resolve()) for x in args.ours_records]),
            **({} if args.max_samples is None else {"max_samples": args.max_samples}),
            # only when not the defaults, so that earlier checkpoints of default runs still resume
            **({} if args.kvpress_caches == ["dynamic"] else {"kvpress_caches": args.kvpress_caches}),
            **({"kvpress_only": True} if args.kvpress_only else {})}


def load_checkpoint(args) -> dict | None:
    """The accumulated state of an earlier, incomplete run at ``args.out`` with the same configuration."""
    if not args.out.exists():
        return None
    old = json.loads(args.out.read_text())
    meta = old.get("meta", {})
    if old.get("complete", True) or "checkpoint" not in old:
        print(f"[resume] {args.out} is complete or has no checkpoint; starting over", file=sys.stderr)
        return None
    if meta.get("config") != json.loads(json.dumps(run_config(args))):
        print(f"[resume] {args.out} has another configuration; starting over", file=sys.stderr)
        return None
    sec = meta["seconds"]
    state = {"kv_records": old["records"]["kvpress"], "our_records": old["records"]["kvpress_ada"],
             "overlap_samples": old["checkpoint"]["overlap_samples"],
             "done": {k: list(v) for k, v in old["checkpoint"]["done"].items()},
             "seconds": {"kvpress": sec["kvpress_accuracy"], "kvpress_ada": sec["kvpress_ada_accuracy"],
                         "kept_sets": sec.get("kept_sets") or {}},
             "presses": meta["kvpress_presses"], "question_token_by_token": meta["kvpress_question_token_by_token"],
             "kept_set_methods": meta.get("kept_set_methods", []), "resumed_seconds": sec["total"],
             "kvpress_caches": meta.get("kvpress_caches", {})}
    print(f"[resume] {', '.join(f'{k}: {len(v)} samples' for k, v in state['done'].items())} from {args.out}",
          file=sys.stderr)
    return state


NOTES = [
    "Same token ids in both libraries: kvpress_ada's split_prompt renders the chat template (context + '\\n\\n' + "
    "question in one user turn); kvpress's own pipeline.preprocess yields the same ids when given context + '\\n\\n' "
    "(checked per sample in meta.prompt_check).",
    "kvpress side mirrors KVPressTextGenerationPipeline: prefill model.model(context_ids) under `with press(model)`, "
    "then question + greedy answer with explicit true RoPE positions; kvpress_ada side: fan-out evaluate_sample "
    "(one prefill per sample, every preset x ratio derived from it; KVzip's reconstruction pass once per sample). "
    "KVzipPress scores and masks when its `with` block exits, after the context prefill, before the question.",
    "Samples go round-robin over tasks and the JSON is rewritten after every sample (complete: false, coverage) "
    "so a stopped run still covers every task equally; --resume continues it.",
    "Paired differences: ours minus the kvpress press in meta.kvpress_counterparts (the same-named one, or for "
    "ada_kvzip KVzipPress(layerwise=False), for ada_lagkv LagKVPress), sample by sample, normal 95% CI.",
    "KV bytes: kvpress = key/value tensors held by its DynamicCache after compression (AdaKVPress and KVzipPress "
    "keep the full cache and mask evicted keys with fake keys at every attention call); "
    "kvpress_ada = RaggedCache.nbytes() "
    "(allocated capacity, including the reserve for appended tokens).",
    "Decode tok/s: greedy single-token steps after the question on one long synthetic passkey sample; rounds "
    "interleave libraries and configs; medians over rounds; 'x full' is the median of per-round ratios to the same "
    "library's full-cache run.",
]


QUANTIZED_NOTES = [
    "--kvpress-cache: kvpress's presses prefill into transformers' QuantizedCache (5.2: every prefilled token is "
    "quantized at once, per group of q_group_size channels along the head dimension, and decoded tokens stay in a "
    "full-precision residual until residual_length of them are re-quantized with the rest); kvpress's "
    "BasePress.forward_hook scores the dequantized keys and values and quantizes what the press keeps. AdaKVPress and "
    "KVzipPress mask instead of evicting, so their QuantizedCache still holds every token.",
    "KV bytes of a QuantizedCache record (kv_bytes, after compression, before the question): the quantized data "
    "(quanto: packed uint8), scales, zero points (quanto's shift) and the full-precision residual, summed over "
    "layers (kv_bytes_parts); kv_bytes_end: the same after the question and the answer (the residual holds them). "
    "kv_fraction divides by the same sample's full DynamicCache bytes (the 'full' record).",
    "KVzipPress on a QuantizedCache (kvpress 0.5.5 + transformers 5.2): during its context reconstruction the hook "
    "reads keys with extract_keys_and_values, which dequantizes only the quantized context and leaves out the "
    "full-precision residual where the reconstruction tokens sit, so keys[:, :, -q_len:] (meant as the "
    "reconstruction's own keys) are context keys: it scores, without error, against the wrong keys (checked on the "
    "default model: score_kvzip sees 825 keys on a QuantizedCache, 1640 on a DynamicCache, for an 825-token prompt).",
]


def quantized_rows(report) -> str:
    """Markdown rows for kvpress on QuantizedCache (labels ``method+<cache>``) and the full DynamicCache they are
    paired with: accuracy, per task, KV held after compression as a fraction of the full DynamicCache (and its
    parts), and the paired difference with the full DynamicCache sample by sample."""
    recs = [r for r in report["records"]["kvpress"] if r["setting"] == "agnostic"] or report["records"]["kvpress"]
    full = {r["sample"]: r for r in recs if r["label"] == "full"}
    cells: dict[tuple, list[dict]] = {}
    for r in recs:
        if r["label"] == "full" or "+" in r["label"]:
            cells.setdefault((r["label"], r["ratio"]), []).append(r)
    tasks = list(dict.fromkeys(r["task"] for r in recs))
    lines = ["| kvpress | r | accuracy (95% CI) | " + " | ".join(tasks) + " | KV held / full DynamicCache "
             "| of which data / scales / zero points / residual | vs full DynamicCache (paired) |",
             "|---|--:|--:|" + "--:|" * len(tasks) + "--:|---|---|"]
    for (label, ratio), rs in sorted(cells.items(), key=lambda kv: (kv[0][0] != "full", "+" in kv[0][0] and
                                                                    not kv[0][0].startswith("full+"), kv[0])):
        acc, ci = mean_ci([r["score"] for r in rs])
        per_task = " | ".join(f"{mean_ci([r['score'] for r in rs if r['task'] == t])[0]:.2f}" for t in tasks)
        frac = sum(r["kv_bytes"] / full[r["sample"]]["kv_bytes"] for r in rs) / len(rs)
        parts = "-"
        if all("kv_bytes_parts" in r for r in rs):
            total = sum(r["kv_bytes"] for r in rs)
            parts = " / ".join(f"{sum(r['kv_bytes_parts'][k] for r in rs) / total:.3f}"
                               for k in ("data", "scale", "zero_point", "residual"))
        paired = "-"
        common = [r for r in rs if r["sample"] in full]
        if label != "full" and common:
            d, dci = mean_ci([r["score"] - full[r["sample"]]["score"] for r in common])
            b = sum(r["score"] >= 0.5 > full[r["sample"]]["score"] for r in common)
            c = sum(full[r["sample"]]["score"] >= 0.5 > r["score"] for r in common)
            paired = (f"{d:+.3f}" + ("" if dci is None else f" ± {dci:.3f}") + f", {b}/{c} (McNemar p "
                      f"{mcnemar_p(b, c):.2f}, n = {len(common)})")
        lines.append(f"| {kvpress_name(label) if label != 'full' else 'full DynamicCache (no press)'} | {ratio:g} "
                     f"| {acc:.2f} (±{0.0 if ci is None else ci:.2f}) | {per_task} | {frac:.3f} | {parts} | {paired} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- our records from an eval run

OUR_RECORD_FIELDS = ("sample", "task", "label", "ratio", "answer", "score", "kv_bytes", "full_kv_bytes", "kl", "top1",
                     "achieved_ratio")


def our_entries(args, grid, preset) -> list:
    """Every (preset, ratio) our side answers: ``RATIO_FREE`` presets once, at ratio 0 (no cap); ``--surrogate``
    replaces the kvzap presets' surrogate file."""
    entries = []
    for m in args.methods:
        ratios = [0.0] if m in RATIO_FREE else args.ratios
        if args.surrogate and m in SURROGATE_METHODS:
            base = preset(m)
            base = base.model_copy(update={"scorer": base.scorer.model_copy(update={"path": args.surrogate})})
            entries += grid({m: base}, ratios)
        else:
            entries += grid([m], ratios)
    return entries


def supplied_scores(entries) -> dict | None:
    """What the worker needs to run kvpress's threshold logic (``DMSPress``) on our surrogate's scores: the
    surrogate file, ``tau`` and the protected sinks and window of our ``kvzap_threshold`` entry."""
    e = next((e for e in entries if e.label == "kvzap_threshold"), None)
    if e is None:
        return None
    from kvpress_ada import surrogate
    return {"path": str(surrogate.resolve(e.press.scorer.path)), "tau": e.press.allocator.tau,
            "sinks": e.press.scorer.sinks, "window": e.press.scorer.window}


def kvpress_defaults(method: str) -> str | None:
    """kvpress's defaults (KVPRESS_DEFAULTS) of every kvpress press named in ``method``'s row."""
    found = [f"{name}: {KVPRESS_DEFAULTS[name]}" for name in dict.fromkeys(re.findall(r"[A-Z]\w*Press",
                                                                                      KVPRESS_NAMES[method]))
             if name in KVPRESS_DEFAULTS]
    return "; ".join(found) or None


def ours_settings(methods, preset) -> dict:
    """Per kvpress method that reads one (the worker's SPECS), our preset's value of a setting whose kvpress default
    turns the press off, that kvpress finds another way, or that kvpress has no default for (SETTINGS_DIFFER)."""
    made = {m: preset(m, compression_ratio=0.5) for m in ("think", "simlayerkv", "duo_attention", "composed", "finch")
            if m in methods}
    out: dict[str, dict] = {}
    if "think" in made:
        out["think"] = {"key_channel_compression_ratio": made["think"].key_channels.ratio}
    if "simlayerkv" in made:
        scorer = made["simlayerkv"].scorer
        out["simlayerkv"] = {k: getattr(scorer, k) for k in ("lazy_threshold", "n_recent", "n_initial", "n_last")}
    if "duo_attention" in made:
        out["duo_attention"] = {"head_compression_ratio": made["duo_attention"].scorer.head_ratio}
    if "composed" in made:
        scorer = made["composed"].scorer
        if [type(x).__name__ for x in scorer.stages] != ["KNorm", "SnapKV"]:
            raise SystemExit(f"kvpress_compare.py: the composed preset's stages changed ({scorer.stages}); kvpress's "
                             "row composes KnormPress then SnapKVPress")
        out["composed"] = {"first_keep": scorer.keep[0]}
    if "finch" in made:
        out["finch"] = {"window_size": made["finch"].scorer.window}
    return out


def handed_artefacts(methods, model_dir: str, path: Path, preset) -> str | None:
    """Write, for the kvpress presses among ``methods`` that download something (HANDED), ours instead into
    ``path`` (safetensors, read by the worker's ``read_handed``): Q-filters ``[layers, kv heads, D]``, Fast KVzip
    gates in kvpress's layout, DuoAttention's head scores (sinks and recent in the metadata), query statistics
    (``mean [layers, H_q, D]``, ``cov [layers, H_q, D, D]``) and LU-KV's prune
    ratios ``[99, layers, kv heads]`` at r = 0.01 .. 0.99 (our keep curve interpolated linearly in r between its
    rows, held constant past its first and last, prune = 1 - keep). Each artefact refuses a model other than its
    own in one line. None when no such preset is run."""
    wanted = [m for m in methods if m in HANDED]
    if not wanted:
        return None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from kvpress_ada import calibration, qfilters, query_stats, surrogate
    from kvpress_ada.components import ConfigError

    config = AutoConfig.from_pretrained(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, int] = {}
    try:
        for m in wanted:
            press = preset(m, compression_ratio=0.5)
            if m == "qfilter":
                found = qfilters.load(press.scorer.path)
                found.check_model(config, f"the qfilter preset's Q-filters ({press.scorer.path})")
                tensors["q_filters"] = found.filters
            elif m == "fastkvzip":
                from kvpress_agreement import kvpress_gate_layout

                gate = surrogate.load(press.scorer.path)
                gate.check_model(config, f"the fastkvzip preset's gate ({press.scorer.path})")
                for i in range(gate.n_layers):
                    w = {k: v.float() for k, v in gate.weights(i).items()}
                    tensors.update({f"gates.{i}.{k}": v for k, v in kvpress_gate_layout(w).items()})
            elif m == "duo_attention":
                cal = calibration.load(press.scorer.path)
                cal.check_model(config, f"the duo_attention preset's head patterns ({press.scorer.path})")
                tensors["duo.scores"] = torch.tensor(cal.shares, dtype=torch.float64)
                meta["duo_sink"] = press.scorer.sinks if press.scorer.sinks is not None else cal.scorer["sinks"]
                meta["duo_recent"] = press.scorer.recent if press.scorer.recent is not None else cal.scorer["recent"]
            elif m == "expected_attention_stats":
                found_stats = query_stats.load(press.scorer.path)
                found_stats.check_model(config, f"the expected_attention_stats preset's statistics "
                                                f"({press.scorer.path})")
                tensors["query_stats.mean"], tensors["query_stats.cov"] = found_stats.mean, found_stats.cov
            elif m == "lukv":
                path_ = press.layers.path
                calibration.load(path_).check_model(config, f"the lukv preset's keep curve ({path_})")
                ratios, keep = calibration.keep_curve(path_)
                r = torch.arange(1, 100, dtype=torch.float64) / 100
                hi = torch.searchsorted(ratios, r).clamp(1, len(ratios) - 1)
                lo = hi - 1
                t = ((r - ratios[lo]) / (ratios[hi] - ratios[lo])).clamp(0, 1)[:, None, None]
                tensors["curve"] = 1 - (keep[lo] * (1 - t) + keep[hi] * t)
    except (ValueError, ConfigError) as err:
        raise SystemExit(f"kvpress_compare.py: {' '.join(str(err).split())}") from None
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
              metadata={"kvpress_compare.handed": json.dumps(meta)})
    return str(path)


def tokenizer_only(model_dir: str):
    """The tokenizer ``kvpress_ada.models.load`` returns for ``model_dir``, without loading the weights
    (enough to build the samples and decode kvpress's answers)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    return tok


def _flag(argv: list[str], name: str, default):
    """The value of ``name`` in a recorded command line (``--name V`` or ``--name=V``), else ``default``."""
    for j, a in enumerate(argv):
        if a == name and j + 1 < len(argv):
            return type(default)(argv[j + 1])
        if a.startswith(name + "="):
            return type(default)(a.split("=", 1)[1])
    return default


QUALITY_SEED = 0  # benchmarks/quality.py draws its samples with make_samples(..., seed=0)


def kv_bytes_per_token(config) -> tuple[int, int]:
    """Bytes one token's keys and values take in the full cache of a model with ``config`` (every layer, kv head and
    channel), at 2 and at 4 bytes a value."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    values = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim
    return 2 * values, 4 * values


def ours_file_settings(data: dict) -> dict:
    """What samples a records file was run on: ``format``, ``setting`` (agnostic / aware), model, tasks, n (per task),
    context, seed and answer length, from benchmarks/quality.py's quality_<setting>.json (seed: quality.py's fixed
    one), a `kvpress-ada eval` checkpoint (partial.json: its ``settings``) or results.json (its command line)."""
    if "n_per_task" in data and "setting" in data:  # benchmarks/quality.py
        return {"format": "benchmarks/quality.py", "setting": data["setting"], "model": data.get("model"),
                "tasks": data.get("tasks"), "n": data.get("n_per_task"), "context": data.get("context"),
                "seed": data.get("seed", QUALITY_SEED), "max_new_tokens": data.get("max_new_tokens"),
                "complete": bool(data.get("complete"))}
    settings = data.get("settings")  # partial.json (a checkpoint) keeps them; results.json keeps its command
    complete = settings is None
    if settings is None:
        argv = [str(a) for a in data.get("command", [])]
        settings = {"model": data.get("model"), "tasks": data.get("tasks"), "n": data.get("n"),
                    "context": data.get("context"), "seed": _flag(argv, "--seed", 0),
                    "question_aware": data.get("question_aware"), "max_new_tokens": _flag(argv, "--max-new-tokens", 24)}
    aware = settings.get("question_aware")
    return {"format": "kvpress-ada eval", "setting": None if aware is None else ("aware" if aware else "agnostic"),
            **{k: settings.get(k) for k in ("model", "tasks", "n", "context", "seed", "max_new_tokens")},
            "complete": complete}


def read_ours_records(args, payload: list[dict], bytes_per_token: tuple[int, ...]) -> dict[str, dict]:
    """Our records per setting from ``args.ours_records`` (one file per setting of ``args.settings``, each paired with
    the setting it was run in), checked to come from the samples built here: same model, tasks, n, context, seed and
    answer length, every record's task that of the sample with its index (the same round-robin order), and every
    sample's full-cache bytes its prompt's token count here (context ids, plus the question's when question-aware)
    times ``bytes_per_token`` (one of them): a prompt tokenised otherwise would hold another number of tokens.
    Refuses in one line otherwise. Records of samples past ``payload`` (``--max-samples``) are left out. Returns
    ``{setting: {"records": {sample: [record, ...]}, "source": {...}}}`` with the labels full and ``args.methods``."""
    out: dict[str, dict] = {}
    tasks = list(args.tasks)
    for path in args.ours_records:
        where = f"kvpress_compare.py: --ours-records {path}"
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise SystemExit(f"{where} is not whole JSON ({err.msg}; a run rewriting it? read it again)") from None
        if not isinstance(data, dict) or not isinstance(data.get("records"), list):
            raise SystemExit(f"{where} holds no records list: pass benchmarks/quality.py's quality_<setting>.json or "
                             "a `kvpress-ada eval` run's results.json / partial.json")
        info = ours_file_settings(data)
        setting = info["setting"]
        if setting not in args.settings:
            raise SystemExit(f"{where} was run question-{setting}, not in --settings {','.join(args.settings)}")
        if setting in out:
            raise SystemExit(f"{where}: a second file for the question-{setting} setting (one file per setting)")
        want = {"model": args.model, "tasks": tasks, "n": args.n, "context": args.context, "seed": args.seed,
                "max_new_tokens": args.max_new_tokens}
        differ = [f"{k} {info.get(k)!r} there, {v!r} here" for k, v in want.items() if info.get(k) != v]
        if differ:
            raise SystemExit(f"{where} was run on other samples: {'; '.join(differ)}")
        aware = setting == "aware"
        labels = {"full", *args.methods}
        by_sample: dict[int, list[dict]] = {}
        full: dict[int, int] = {}
        for r in data["records"]:
            i = r["sample"]
            if not 0 <= i < args.n * len(tasks) or tasks[i % len(tasks)] != r["task"]:
                raise SystemExit(f"{where}: record of sample {i} ({r['task']}) does not match the samples built here "
                                 f"({args.n * len(tasks)} samples, round-robin over {','.join(tasks)})")
            if i >= len(payload):
                continue
            if r["label"] == "full":
                full[i] = r["kv_bytes"]
            # a preset with its own budget pairs uncapped (ratio 0) only, as kvpress runs it: a grid's capped rows
            # are not its pair
            if r["label"] in labels and (r["label"] not in RATIO_FREE or r["ratio"] == 0):
                by_sample.setdefault(i, []).append({k: r.get(k) for k in OUR_RECORD_FIELDS})
        for i in sorted(by_sample):
            p = payload[i]
            tokens = len(p["head_ids"]) + (len(p["tail_ids"]) if aware else 0)
            if i not in full:
                raise SystemExit(f"{where}: sample {i} has no full-cache record, so its token ids cannot be checked")
            if full[i] not in [tokens * b for b in bytes_per_token]:
                raise SystemExit(f"{where}: sample {i}'s full cache holds {full[i]} bytes, not {tokens} tokens (its "
                                 f"prompt here) x {' or '.join(map(str, bytes_per_token))} bytes: other token ids")
        found = sorted({r["label"] for rs in by_sample.values() for r in rs})
        missing = sorted(labels - set(found))
        if missing:
            print(f"[ours] {path} has no records for {', '.join(missing)}: no pair for them in question-{setting}",
                  file=sys.stderr)
        print(f"[ours] question-{setting}: {len(by_sample)} of {len(payload)} samples x {len(found)} labels read from "
              f"{path} ({info['format']}; token counts checked)", file=sys.stderr)
        out[setting] = {"records": by_sample,
                        "source": {"path": str(path.resolve()), "format": info["format"], "samples": len(by_sample),
                                   "labels": found, "complete": info["complete"], "seconds": data.get("seconds")}}
    missing_settings = [x for x in args.settings if x not in out]
    if missing_settings:
        raise SystemExit(f"kvpress_compare.py: --ours-records has no file for question-{missing_settings[0]}")
    return out


def vs_kvpress_best(report, ours=("kvzip", "ada_kvzip", "kvzap", "kvzap_linear")) -> list[dict]:
    """Per ratio: kvpress's most accurate press (question-agnostic) and each of ``ours`` minus it, paired."""
    recs = report["records"]
    rows = []
    ratios = sorted({r["ratio"] for r in recs["kvpress"] if r["label"] != "full" and r["setting"] == "agnostic"})
    for ratio in ratios:
        kv: dict[str, dict] = {}
        for r in recs["kvpress"]:  # kvpress's presses on its DynamicCache (not on a QuantizedCache: label with '+')
            if r["setting"] == "agnostic" and r["ratio"] == ratio and r["label"] != "full" and "+" not in r["label"]:
                kv.setdefault(r["label"], {})[r["sample"]] = r["score"]
        if not kv:
            continue
        best = max(kv, key=lambda m: (sum(kv[m].values()) / len(kv[m]), m))
        for label in ours:
            mine = {r["sample"]: r["score"] for r in recs["kvpress_ada"]
                    if r["setting"] == "agnostic" and r["label"] == label and r["ratio"] == ratio}
            common = sorted(set(mine) & set(kv[best]))
            if not common:
                continue
            diff, ci = mean_ci([mine[i] - kv[best][i] for i in common])
            rows.append({"ratio": ratio, "ours": label, "kvpress_best": KVPRESS_NAMES[best], "n": len(common),
                         "ours_accuracy": mean_ci([mine[i] for i in common])[0],
                         "kvpress_accuracy": mean_ci([kv[best][i] for i in common])[0], "diff": diff, "diff_ci95": ci,
                         "ours_only": sum(mine[i] >= 0.5 > kv[best][i] for i in common),
                         "kvpress_only": sum(kv[best][i] >= 0.5 > mine[i] for i in common)})
    return rows


def readme_rows(report) -> str:
    """The benchmarks/README.md rows: ours vs its kvpress counterpart per ratio, paired, with KV held; then
    ``kvzip`` / ``ada_kvzip`` against kvpress's best press at each ratio."""
    frac = {(r["library"], r["method"], r["ratio"]): r["accuracy"]["agnostic"]["kv_fraction"]
            for r in report["table"] if "agnostic" in r["accuracy"]}
    achieved = {(r["library"], r["method"], r["ratio"]): r["accuracy"]["agnostic"].get("achieved_ratio")
                for r in report["table"] if "agnostic" in r["accuracy"]}
    lines = ["| ours | kvpress | r | ours | kvpress | ours - kvpress | KV held ours / kvpress |",
             "|---|---|--:|--:|--:|---|---|"]
    for a in report["agreement"]:
        if a["setting"] != "agnostic" or "n" not in a:
            continue
        ci = "" if a["diff_ci95"] is None else f" ± {a['diff_ci95']:.3f}"
        ours = "full cache" if a["label"] == "full" else f"`{a['label']}`"
        kv_held = (f"{frac.get(('kvpress_ada', a['label'], a['ratio']), float('nan')):.3f} / "
                   f"{frac.get(('kvpress', a['kvpress_counterpart'], a['ratio']), float('nan')):.3f}")
        ratio = f"{a['ratio']:g}"
        if a["label"] in RATIO_FREE:  # its own budget: the achieved ratios (ours / kvpress)
            ours_r = achieved.get(("kvpress_ada", a["label"], a["ratio"]))
            theirs_r = achieved.get(("kvpress", a["kvpress_counterpart"], a["ratio"]))
            ratio = "achieved " + " / ".join("-" if x is None else f"{x:.3f}" for x in (ours_r, theirs_r))
        lines.append(f"| {ours} | `{KVPRESS_NAMES[a['kvpress_counterpart']]}` | {ratio} | {a['accuracy']:.2f} | "
                     f"{a['kvpress_accuracy']:.2f} | {a['diff']:+.3f}{ci}, {a['ours_only']}/{a['kvpress_only']} "
                     f"(n = {a['n']}, same answer {a['same_answer']:.2f}) | {kv_held} |")
    best = report.get("vs_kvpress_best") or []
    if best:
        lines += ["", "| r | ours | kvpress's best there | ours | kvpress | ours - best (paired) |",
                  "|--:|---|---|--:|--:|---|"]
        for b in best:
            ci = "" if b["diff_ci95"] is None else f" ± {b['diff_ci95']:.3f}"
            lines.append(f"| {b['ratio']:g} | `{b['ours']}` | `{b['kvpress_best']}` | {b['ours_accuracy']:.2f} | "
                         f"{b['kvpress_accuracy']:.2f} | {b['diff']:+.3f}{ci}, {b['ours_only']}/{b['kvpress_only']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- pieces


ADA_LABELS = ("ada_snapkv", "ada_expected_attention", "ada_snapkv~kvpress_rule", "ada_kvzip", "ada_lagkv", "kvzip",
              "kvzip_layerwise")  # head allocations worth summarising (Ada-like rules on either side)


def kept_set_sample(model, p, entries, masks_file, aware, capture_prefill, np, torch) -> list[dict]:
    """One sample: per entry whose kvpress counterpart left a kept mask, the Jaccard of the kept sets of
    kvpress and kvpress_ada per (layer, head) averaged, the fraction of (layer, head) rows selected
    identically, the mean |kept-count difference| per head, and for Ada-like rules how unequal the
    heads' kept counts are. Costs one prefill (plus a model pass for model-pass scorers)."""
    kv_masks = np.load(masks_file)
    hidden = any(getattr(type(e.press.scorer), "reads_hidden_states", False) for e in entries)
    prefill = capture_prefill(model, torch.tensor([p["head_ids"] + (p["tail_ids"] if aware else [])]),
                              hidden_states=hidden)
    rows = []
    for e in entries:
        key = f"{kvpress_counterpart(e.label)}|{e.ratio}|{p['index']}"
        if key not in kv_masks:
            continue
        shape = tuple(kv_masks[key + "|shape"])
        theirs = torch.from_numpy(np.unpackbits(kv_masks[key])[: int(np.prod(shape))].reshape(shape).astype(bool))
        ours = torch.stack([m[0] for m in prefill.keep_masks(e.press)]).cpu()  # [layers, H, L]
        inter = (ours & theirs).sum(-1).double()
        union = (ours | theirs).sum(-1).double().clamp(min=1)
        row = {"label": e.label, "ratio": e.ratio, "sample": p["index"], "jaccard": float((inter / union).mean()),
               "identical": float((ours == theirs).all(-1).double().mean()),
               "count_diff": float((ours.sum(-1) - theirs.sum(-1)).abs().double().mean())}
        if e.label in ADA_LABELS:
            o, t = ours.sum(-1).double(), theirs.sum(-1).double()
            row["head_allocation"] = {
                "ours_min_share": float((o / o.mean(-1, keepdim=True).clamp(min=1e-9)).min()),
                "kvpress_min_share": float((t / t.mean(-1, keepdim=True).clamp(min=1e-9)).min()),
                "ours_cv": float((o.std(-1) / o.mean(-1).clamp(min=1e-9)).mean()),
                "kvpress_cv": float((t.std(-1) / t.mean(-1).clamp(min=1e-9)).mean()),
                "ours_layer_share_min": float((o.sum(-1) / o.sum(-1).mean()).min()),
                "kvpress_layer_share_min": float((t.sum(-1) / t.sum(-1).mean()).min())}
        rows.append(row)
    del prefill
    return rows


def aggregate_overlap(sample_rows: list[dict]) -> list[dict]:
    """Per (setting, label, ratio): the per-sample kept-set numbers of :func:`kept_set_sample`, averaged."""
    groups: dict[tuple, list[dict]] = {}
    for r in sample_rows:
        groups.setdefault((r["setting"], r["label"], r["ratio"]), []).append(r)
    rows = []
    for (setting, label, ratio), rs in groups.items():
        row = {"setting": setting, "label": label, "ratio": ratio, "kvpress_counterpart": kvpress_counterpart(label),
               "kept_set_n": len(rs), "jaccard": sum(r["jaccard"] for r in rs) / len(rs),
               "identical_rows": sum(r["identical"] for r in rs) / len(rs),
               "mean_abs_count_diff": sum(r["count_diff"] for r in rs) / len(rs)}
        alloc = [r["head_allocation"] for r in rs if "head_allocation" in r]
        if alloc:
            row["head_allocation"] = {k: sum(a[k] for a in alloc) / len(alloc) for k in alloc[0]}
        rows.append(row)
    return rows


def decode_benchmark(args, worker, model, tok, make_samples, split_prompt, encode, capture_prefill, decode_rows,
                     cache_key, preset, torch, tqdm):
    """Decode tokens/s for full + every (method, ratio) in both libraries, interleaved rounds."""
    start = time.perf_counter()
    s = make_samples("passkey", tok, 1, args.decode_context, seed=args.seed)[0]
    head, tail = split_prompt(tok, s.context, s.question)
    head_ids, tail_ids = encode(tok, head, "cpu"), encode(tok, tail, "cpu")
    length = head_ids.shape[1]
    configs = [("full", 0.0)] + [(m, r) for m in args.methods for r in args.decode_ratios]

    kv_setup = worker.call("decode_setup", head_ids=head_ids[0].tolist(), tail_ids=tail_ids[0].tolist(),
                           methods=[m for m in args.methods if m in KVPRESS_NAMES],
                           ratios=args.decode_ratios)["configs"]
    t0 = time.perf_counter()
    prefill = capture_prefill(model, head_ids)
    ours_prefill_s = time.perf_counter() - t0
    caches = {}
    for method, ratio in configs:
        press = None if method == "full" else preset(method, compression_ratio=ratio)
        t0 = time.perf_counter()
        cache = prefill.compressed_cache(press)
        nbytes = cache.nbytes() if hasattr(cache, "nbytes") else \
            sum(t.numel() * t.element_size() for c in prefill.layers for t in (c.keys, c.values))
        caches[f"{method}|{ratio}"] = {"press": press, "cache": cache, "kv_bytes": nbytes,
                                       "compress_s": time.perf_counter() - t0}
    del prefill

    def crop(cache):
        extra = cache.get_seq_length() - length
        if extra > 0:  # crop(0) would empty a DynamicCache
            cache.crop(-extra)

    @torch.inference_mode()
    def ours_decode(key, steps):
        c = caches[key]
        cache, press = c["cache"], c["press"]
        with press(model) if press is not None else nullcontext():
            crop(cache)
            out = model(input_ids=tail_ids, use_cache=True, **{cache_key(model): cache})
            t0 = time.perf_counter()
            _, cache = decode_rows(model, out.logits[:, -1], cache, steps + 1, set())  # `steps` forwards
            seconds = time.perf_counter() - t0
            crop(cache)
        return seconds

    times = {"kvpress": {}, "kvpress_ada": {}}
    rounds = args.decode_repeats + 1  # round 0 warms up (short)
    n_runs = len(configs) + sum(f"{m}|{r}" in kv_setup for m, r in configs)
    bar = tqdm(total=rounds * n_runs, desc=f"decode timing at {length} tokens", unit="run")
    for rnd in range(rounds):
        order = configs if rnd % 2 == 0 else configs[::-1]
        for method, ratio in order:
            key = f"{method}|{ratio}"
            libs = ("kvpress", "kvpress_ada") if rnd % 2 == 0 else ("kvpress_ada", "kvpress")
            for lib in (x for x in libs if x == "kvpress_ada" or key in kv_setup):
                steps = 2 if rnd == 0 else args.decode_steps
                sec = worker.call("decode", config=key, steps=steps)["seconds"] if lib == "kvpress" \
                    else ours_decode(key, steps)
                if rnd > 0:
                    times[lib].setdefault(key, []).append(steps / sec)
                bar.update(1)
    bar.close()

    result = {"context_tokens": length, "steps": args.decode_steps, "rounds": args.decode_repeats,
              "ours_prefill_s": ours_prefill_s, "configs": {}}
    for lib in times:
        full = times[lib]["full|0.0"]
        for key, tps in times[lib].items():
            method, ratio = key.split("|")
            kv_bytes = kv_setup[key]["kv_bytes"] if lib == "kvpress" else caches[key]["kv_bytes"]
            full_bytes = kv_setup["full|0.0"]["kv_bytes"] if lib == "kvpress" else caches["full|0.0"]["kv_bytes"]
            result["configs"][f"{lib}|{key}"] = {
                "library": lib, "label": method, "ratio": float(ratio), "tok_s": tps, "tok_s_median": median(tps),
                "x_full_median": median([a / b for a, b in zip(tps, full)]),
                "kv_bytes": kv_bytes, "kv_fraction": kv_bytes / full_bytes,
                "setup_s": kv_setup[key]["prefill_s"] if lib == "kvpress" else caches[key]["compress_s"]}
    result["seconds"] = time.perf_counter() - start
    return result


def build_report(args, payload, kv_records, our_records, overlap, decode):
    def cells(records):
        out = {}
        for r in records:
            out.setdefault((r["setting"], r["label"], r["ratio"]), []).append(r)
        return out

    kv_cells, our_cells = cells(kv_records), cells(our_records)
    by_sample = lambda recs: {r["sample"]: r for r in recs}  # noqa: E731
    rows: dict[tuple, dict] = {}

    def row_for(lib, label, ratio):
        return rows.setdefault((lib, label, ratio), {
            "library": lib, "method": label, "ratio": ratio,
            "name": kvpress_name(label) if lib == "kvpress" else label, "accuracy": {}})

    for lib, lib_cells in (("kvpress", kv_cells), ("kvpress_ada", our_cells)):
        for (setting, label, ratio), recs in lib_cells.items():
            if "~" in label:
                continue
            full_bytes = {r["sample"]: r["kv_bytes"] for r in lib_cells[(setting, "full", 0.0)]}
            acc, ci = mean_ci([r["score"] for r in recs])
            row = row_for(lib, label, ratio)
            row["accuracy"][setting] = {
                "mean": acc, "ci95": ci, "n": len(recs),
                "per_task": {t: mean_ci([r["score"] for r in recs if r["task"] == t])[0] for t in args.tasks},
                "kv_bytes": sum(r["kv_bytes"] for r in recs) / len(recs),
                "kv_fraction": sum(r["kv_bytes"] / full_bytes[r["sample"]] for r in recs) / len(recs)}
            achieved = [r["achieved_ratio"] for r in recs if r.get("achieved_ratio") is not None]
            if achieved:  # fraction of entries evicted (or masked), for presses that set their own budget
                row["accuracy"][setting]["achieved_ratio"] = sum(achieved) / len(achieved)
            if recs and all("kv_bytes_parts" in r for r in recs):  # a QuantizedCache: mean bytes by part
                row["accuracy"][setting]["kv_bytes_parts"] = {
                    k: sum(r["kv_bytes_parts"][k] for r in recs) / len(recs) for k in recs[0]["kv_bytes_parts"]}
                row["accuracy"][setting]["kv_bytes_end"] = sum(r["kv_bytes_end"]["total"] for r in recs) / len(recs)
    for d in (decode or {}).get("configs", {}).values():
        row_for(d["library"], d["label"], d["ratio"])["decode"] = {
            "tok_s": d["tok_s_median"], "x_full": d["x_full_median"], "kv_bytes": d["kv_bytes"],
            "kv_fraction": d["kv_fraction"]}
    order = {m: i for i, m in enumerate(("full",) + ALL_METHODS)}
    table = sorted(rows.values(), key=lambda r: (order.get(r["method"], 99), r["ratio"], r["library"]))

    # paired agreement of ours (presets and diagnostics) with kvpress, sample by sample
    agreement = []
    keys = list(our_cells) + [(o["setting"], o["label"], o["ratio"]) for o in overlap
                              if (o["setting"], o["label"], o["ratio"]) not in our_cells]
    for setting, label, ratio in keys:
        counterpart = kvpress_counterpart(label)
        theirs = by_sample(kv_cells.get((setting, counterpart, ratio), []))
        if not theirs:
            continue
        row = {"setting": setting, "label": label, "ratio": ratio, "kvpress_counterpart": counterpart}
        mine = by_sample(our_cells.get((setting, label, ratio), []))
        common = sorted(set(mine) & set(theirs))
        if common:
            diffs = [mine[i]["score"] - theirs[i]["score"] for i in common]
            b = sum(1 for i in common if mine[i]["score"] >= 0.5 > theirs[i]["score"])
            c = sum(1 for i in common if theirs[i]["score"] >= 0.5 > mine[i]["score"])
            d_mean, d_ci = mean_ci(diffs)
            row.update({"n": len(common), "accuracy": mean_ci([mine[i]["score"] for i in common])[0],
                        "kvpress_accuracy": mean_ci([theirs[i]["score"] for i in common])[0],
                        "diff": d_mean, "diff_ci95": d_ci, "ours_only": b, "kvpress_only": c,
                        "mcnemar_p": mcnemar_p(b, c),
                        "same_answer": sum(mine[i]["answer"] == theirs[i]["answer"] for i in common) / len(common)})
        ov = next((o for o in overlap if (o["setting"], o["label"], o["ratio"]) == (setting, label, ratio)), None)
        if ov:
            row.update({k: v for k, v in ov.items() if k not in ("setting", "label", "ratio", "kvpress_counterpart")})
        agreement.append(row)

    base = {m: i for i, m in enumerate(("full",) + ALL_METHODS)}
    agreement.sort(key=lambda a: (args.settings.index(a["setting"]), base.get(a["kvpress_counterpart"], 99),
                                  a["label"] != a["kvpress_counterpart"], a["label"], a["ratio"]))
    report = {"table": table, "agreement": agreement, "decode": decode,
            "samples": [{"index": p["index"], "task": p["task"], "answers": p["answers"],
                         "context_ids": len(p["head_ids"]), "question_ids": len(p["tail_ids"])} for p in payload],
            "records": {"kvpress": kv_records, "kvpress_ada": our_records}}
    report["vs_kvpress_best"] = vs_kvpress_best(report)
    return report


def render_markdown(report) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    settings = list(dict.fromkeys(s for r in report["table"] for s in r["accuracy"]))
    d = report.get("decode") or {}
    ctx = report["samples"][0]["context_ids"] if report.get("samples") else "?"
    lines = ["| library | method | ratio | " + " | ".join(f"accuracy, {s} (95% CI)" for s in settings)
             + f" | KV held @{ctx} | KV held @{d.get('context_tokens', '-')}"
             + f" | decode tok/s @{d.get('context_tokens', '-')}"
             " | x full |",
             "|---|---|---:|" + "---|" * len(settings) + "---:|---:|---:|---:|"]
    for r in report["table"]:
        accs = " | ".join(f"{r['accuracy'][s]['mean']:.2f} (±{f(r['accuracy'][s]['ci95'], '.2f')})"
                          if s in r["accuracy"] else "-" for s in settings)
        kv1k = next((a["kv_fraction"] for a in r["accuracy"].values()), None)
        dec = r.get("decode", {})
        lines.append(f"| {r['library']} | {r['name']} | {r['ratio']:g} | {accs} | {f(kv1k, '.3f')} | "
                     f"{f(dec.get('kv_fraction'), '.3f')} | {f(dec.get('tok_s'), '.2f')} | "
                     f"{f(dec.get('x_full'), '.2f')} |")
    n = sorted({a["n"] for r in report["table"] for a in r["accuracy"].values()})
    lines.append(f"\nn per accuracy cell: {', '.join(map(str, n))}")
    lines += ["", "Agreement with kvpress (paired per sample; kept-set Jaccard per layer x kv head, averaged):", "",
              "| setting | kvpress_ada pipeline | vs kvpress | ratio | acc ours | acc kvpress | diff (95% CI) | "
              "ours-only / kvpress-only | McNemar p | same answer | kept-set Jaccard | identical rows |",
              "|---|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    for a in report["agreement"]:
        if "n" in a:
            acc = (f"{a['accuracy']:.2f} | {a['kvpress_accuracy']:.2f} | "
                   f"{a['diff']:+.2f} (±{f(a['diff_ci95'], '.2f')}) "
                   f"| {a['ours_only']} / {a['kvpress_only']} | {a['mcnemar_p']:.2f} | {a['same_answer']:.2f}")
        else:
            acc = "- | - | - | - | - | -"
        lines.append(f"| {a['setting']} | {a['label']} | {KVPRESS_NAMES.get(a['kvpress_counterpart'], '-')} | "
                     f"{a['ratio']:g} | {acc} | {f(a.get('jaccard'), '.3f')} | "
                     f"{f(a.get('identical_rows'), '.2f')} |")
    alloc = [a for a in report["agreement"] if a.get("head_allocation")]
    if alloc:
        lines += ["", "Ada head allocation (kept count per kv head / layer mean; min over heads and layers, and mean "
                      "coefficient of variation across heads):", "",
                  "| setting | pipeline | ratio | min share ours | min share kvpress | CV ours | CV kvpress |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for a in alloc:
            h = a["head_allocation"]
            lines.append(f"| {a['setting']} | {a['label']} | {a['ratio']:g} | {h['ours_min_share']:.3f} | "
                         f"{h['kvpress_min_share']:.3f} | {h['ours_cv']:.3f} | {h['kvpress_cv']:.3f} |")
    if d:
        lines += ["", f"Decode: {d['steps']} greedy steps after the question at {d['context_tokens']} context tokens, "
                      f"median of {d['rounds']} interleaved rounds; x full = median per-round ratio to the same "
                      "library's full cache."]
    return "\n".join(lines)


def plot_report(report, path: Path) -> Path | None:
    """Accuracy vs ratio per setting, both libraries: ours solid, kvpress dashed in the same colour as the
    preset it is run for, full caches dotted. Returns None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(s for r in report["table"] for s in r["accuracy"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(7.5 * len(settings), 4.8), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in report["table"] if r["method"] != "full"))
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    for ax, setting in zip(axes[0], settings):
        for lib, style, marker in (("kvpress_ada", "-", "o"), ("kvpress", "--", "s")):
            for m in methods:
                rows = sorted((r for r in report["table"] if r["library"] == lib and r["method"] == m
                               and setting in r["accuracy"]), key=lambda r: r["ratio"])
                if not rows:
                    continue
                acc = [r["accuracy"][setting] for r in rows]
                ax.errorbar([r["ratio"] for r in rows], [a["mean"] for a in acc],
                            yerr=[a["ci95"] or 0.0 for a in acc], color=colors[m], linestyle=style, marker=marker,
                            capsize=3, label=f"{'ours' if lib == 'kvpress_ada' else 'kvpress'} {rows[0]['name']}")
            full = next((r for r in report["table"] if r["library"] == lib and r["method"] == "full"
                         and setting in r["accuracy"]), None)
            if full:
                ax.axhline(full["accuracy"][setting]["mean"], color="black" if lib == "kvpress_ada" else "grey",
                           linestyle=":", label=f"{'ours' if lib == 'kvpress_ada' else 'kvpress'} full cache")
        n = sorted({a["n"] for r in report["table"] for s, a in r["accuracy"].items() if s == setting})
        ax.set_title(f"question-{setting}, n={'/'.join(map(str, n))} per cell"
                     + ("" if report.get("complete", True) else " (incomplete run)"), fontsize=10)
        ax.set_xlabel("compression ratio (fraction of KV entries evicted)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    from kvpress_ada.harness.eval.report import save_figure

    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def machine_info(torch, transformers) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(), "gpu": None,
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def git_state() -> dict:
    def run(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": run("rev-parse", "HEAD"),
            "library_dirty": bool(run("status", "--porcelain", "--untracked-files=no", "--", "kvpress_ada"))}


if __name__ == "__main__":
    main()
