"""Budget allocation: layer schedules (how much per layer) apart from head allocators (how to split it)."""

from .calibrated import Calibrated, CalibratedLayer
from .composite import CompositeLayer
from .heads import ALLOCATORS, AdaHead, HeadAllocator, UniformHead, register_allocator
from .layers import LAYER_SCHEDULES, LayerSchedule, PyramidLayer, UniformLayer, register_layer_schedule
from .model_scope import AdaLayer, model_topk_counts
from .threshold import Threshold

__all__ = ["ALLOCATORS", "AdaHead", "HeadAllocator", "UniformHead", "register_allocator",
           "LAYER_SCHEDULES", "LayerSchedule", "PyramidLayer", "UniformLayer", "register_layer_schedule",
           "AdaLayer", "model_topk_counts", "Calibrated", "CalibratedLayer", "CompositeLayer", "Threshold"]
