"""kvpress_ada: composable KV-cache compression with Ada-KV head-wise budgets and a ragged cache
that really frees memory."""

# where vLLM is installed, hide the CUDA builds of torchvision etc. it brings before anything imports transformers
from .hosts import vllm_site  # noqa: F401

# isort: split
from .allocators import (
                      AdaHead,
                      AdaLayer,
                      Calibrated,
                      CalibratedLayer,
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
from .hosts.transformers import (
    SUPPORTED_MODEL_TYPES,
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
from .storage import FullPrecision, Int4, Int8, Storage, register_storage

__version__ = "0.1.0"

__all__ = [
    "Pipeline", "preset", "preset_names", "register_preset", "generate",
    "SnapKV", "StreamingLLM", "ObservedAttention", "H2O", "TOVA", "KNorm", "ExpectedAttention", "CriticalKV",
    "RandomScorer", "KVzap", "KVzip", "use_tokenizer", "LagKV", "KeyDiff",
    "UniformHead", "AdaHead", "UniformLayer", "PyramidLayer", "AdaLayer", "Calibrated", "CalibratedLayer", "Threshold",
    "TopK", "Mask", "Storage", "FullPrecision", "Int8", "Int4", "register_storage", "check_press",
    "Scorer", "HeadAllocator", "LayerSchedule", "Evictor", "Observation", "LayerView", "Budget",
    "register_scorer", "register_allocator", "register_evictor",
    "RaggedCache", "QuantizedRaggedCache", "MaskedCache", "SUPPORTED_MODEL_TYPES",
    "PressCache", "attach", "detach", "ConfigError",
]
