"""The names the command line checks its arguments against, readable without importing torch, so that
``--help`` and a bad argument answer at once. Each tuple lists what its registry holds once the library
has registered its built-in components (``tests/test_imports.py`` checks that the two agree); in a process
that has already imported a registry (and may have added to it), that registry answers instead."""

from __future__ import annotations

import sys

#: :func:`kvpress_ada.presets.preset_names`, in its order
PRESETS = ("snapkv", "pyramidkv", "ada_snapkv", "ada_pyramidkv", "streamingllm", "h2o", "tova", "knorm",
           "expected_attention", "ada_expected_attention", "expected_attention_stats", "criticalkv", "ada_criticalkv",
           "random", "lagkv", "ada_lagkv", "keydiff", "kvzip", "kvzip_plus", "kvzip_layerwise", "ada_kvzip", "kvgrad",
           "ada_kvgrad", "kvzap", "kvzap_linear", "kvzap_threshold", "calibrated_streamingllm", "leverage",
           "ada_leverage", "cur", "ada_cur", "non_causal_attention", "compactor", "qfilter", "cap", "chunkkv",
           "ada_chunkkv", "entropy_gated_chunkkv", "ada_entropy_gated_chunkkv", "kvcompose", "ada_kvcompose",
           "block_keydiff", "lukv", "finch", "ada_finch", "rerotated_streamingllm", "fastkvzip", "ada_fastkvzip",
           "think", "ada_think", "merging", "ada_merging", "cam", "ada_cam", "simlayerkv", "quest", "ada_snapkv_read",
           "duo_attention", "composed")
#: :data:`kvpress_ada.scorers.SCORERS`: canonical names (sorted), then the old names still accepted
SCORERS = ("cap", "chunkkv", "compactor", "composed", "criticalkv", "cur", "duo_attention", "entropy_gated_chunkkv",
           "expected_attention", "expected_attention_stats", "fastkvzip", "finch", "h2o", "keydiff", "knorm",
           "kvcompose", "kvgrad", "kvzap", "kvzip", "lagkv", "leverage", "non_causal_attention", "qfilter", "random",
           "simlayerkv", "snapkv", "streamingllm", "tova")
SCORER_ALIASES = ("observed_attention", "streaming_llm")
#: :data:`kvpress_ada.storage.STORAGES`: full precision first, then the others sorted
STORAGES = ("full", "fp8", "int4", "int8")
#: :data:`kvpress_ada.calibration.CALIBRATION_SEED`
CALIBRATION_SEED = 10_000


def preset_names() -> list[str]:
    """The presets ``--preset`` / ``--presets`` accept."""
    presets = sys.modules.get("kvpress_ada.presets")
    return list(presets.preset_names()) if presets is not None else list(PRESETS)


def scorer_names() -> list[str]:
    """The canonical scorer names (sorted), as the scorer registry lists them."""
    scorers = sys.modules.get("kvpress_ada.scorers")
    return scorers.SCORERS.names() if scorers is not None else list(SCORERS)


def accepts_scorer(name: str) -> bool:
    """Whether ``--scorer name`` names a registered scorer (or an old name of one)."""
    scorers = sys.modules.get("kvpress_ada.scorers")
    if scorers is not None:
        registry = scorers.SCORERS
        return name in registry.names() or name in registry.aliases()
    return name in SCORERS or name in SCORER_ALIASES


def storage_names() -> list[str]:
    """The storage kinds ``--storage`` accepts: full precision first, then the others sorted."""
    storage = sys.modules.get("kvpress_ada.storage")
    if storage is None:
        return list(STORAGES)
    return ["full", *(name for name in storage.STORAGES.names() if name != "full")]
