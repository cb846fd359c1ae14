"""kvpress_ada: composable KV-cache compression with Ada-KV head-wise budgets and a ragged cache
that really frees memory.

Importing the package imports nothing heavy: each public name is loaded on first use (the policy:
torch and pydantic; the transformers host and its caches: transformers), and no host registers
anything with its engine until a press is applied."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module (relative to this package) it is loaded from on first use
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["AdaHead", "AdaLayer", "Calibrated", "CalibratedLayer", "CompositeLayer", "HeadAllocator",
                     "LayerSchedule", "PyramidLayer", "Threshold", "UniformHead", "UniformLayer", "register_allocator"],
                    ".allocators"),
    "ConfigError": ".components",
    **dict.fromkeys(["Evictor", "Mask", "TopK", "register_evictor"], ".evictors"),
    **dict.fromkeys(["SUPPORTED_MODEL_TYPES", "Family", "LlamaLike", "family_for", "family_of", "register_family"],
                    ".families"),
    **dict.fromkeys(["MaskedCache", "PressCache", "QuantizedRaggedCache", "RaggedCache", "attach", "check_press",
                     "detach"], ".hosts.transformers"),
    "generate": ".hosts.transformers.generation",
    "use_tokenizer": ".hosts.transformers.model_pass",
    **dict.fromkeys(["Budget", "LayerView", "Observation"], ".observation"),
    "Pipeline": ".pipeline",
    **dict.fromkeys(["preset", "preset_names", "register_preset"], ".presets"),
    **dict.fromkeys(["H2O", "TOVA", "CriticalKV", "ExpectedAttention", "KeyDiff", "KNorm", "KVCompose", "KVzap",
                     "KVzip", "LagKV", "ObservedAttention", "RandomScorer", "Scorer", "SnapKV", "StreamingLLM",
                     "register_scorer"], ".scorers"),
    **dict.fromkeys(["FullPrecision", "Int4", "Int8", "Fp8", "RecordStorage", "Storage", "register_storage"],
                    ".storage"),
}

__all__ = [
    "Pipeline", "preset", "preset_names", "register_preset", "generate",
    "SnapKV", "StreamingLLM", "ObservedAttention", "H2O", "TOVA", "KNorm", "ExpectedAttention", "CriticalKV",
    "RandomScorer", "KVzap", "KVzip", "use_tokenizer", "LagKV", "KeyDiff", "KVCompose",
    "UniformHead", "AdaHead", "UniformLayer", "PyramidLayer", "AdaLayer", "Calibrated", "CalibratedLayer", "Threshold",
    "CompositeLayer",
    "TopK", "Mask", "Storage", "FullPrecision", "Int8", "Int4", "Fp8", "RecordStorage", "register_storage",
    "check_press",
    "Scorer", "HeadAllocator", "LayerSchedule", "Evictor", "Observation", "LayerView", "Budget",
    "register_scorer", "register_allocator", "register_evictor",
    "RaggedCache", "QuantizedRaggedCache", "MaskedCache", "SUPPORTED_MODEL_TYPES",
    "PressCache", "attach", "detach", "ConfigError",
    "Family", "LlamaLike", "family_for", "family_of", "register_family",
]


if TYPE_CHECKING:
    from .allocators import (
        AdaHead,
        AdaLayer,
        Calibrated,
        CalibratedLayer,
        CompositeLayer,
        HeadAllocator,
        LayerSchedule,
        PyramidLayer,
        Threshold,
        UniformHead,
        UniformLayer,
        register_allocator,
    )
    from .components import ConfigError
    from .evictors import Evictor, Mask, TopK, register_evictor
    from .families import SUPPORTED_MODEL_TYPES, Family, LlamaLike, family_for, family_of, register_family
    from .hosts.transformers import (
        MaskedCache,
        PressCache,
        QuantizedRaggedCache,
        RaggedCache,
        attach,
        check_press,
        detach,
    )
    from .hosts.transformers.generation import generate
    from .hosts.transformers.model_pass import use_tokenizer
    from .observation import Budget, LayerView, Observation
    from .pipeline import Pipeline
    from .presets import preset, preset_names, register_preset
    from .scorers import (
        H2O,
        TOVA,
        CriticalKV,
        ExpectedAttention,
        KeyDiff,
        KNorm,
        KVCompose,
        KVzap,
        KVzip,
        LagKV,
        ObservedAttention,
        RandomScorer,
        Scorer,
        SnapKV,
        StreamingLLM,
        register_scorer,
    )
    from .storage import Fp8, FullPrecision, Int4, Int8, RecordStorage, Storage, register_storage
else:  # mypy reads the imports above: a misspelt name stays an error there

    def __getattr__(name: str) -> Any:
        """Load a public name (or a subpackage, ``kvpress_ada.hosts``) the first time it is read."""
        if name in _EXPORTS:
            value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
            globals()[name] = value  # read once: later reads skip this function
            return value
        if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# where vLLM is installed, hide the CUDA builds of torchvision etc. it brings before anything imports transformers
if importlib.util.find_spec("vllm") is not None:
    from .hosts.vllm import site as _vllm_site  # noqa: F401
