"""Budget allocation: layer schedules (how much per layer) apart from head allocators (how to split it)."""

from .heads import ALLOCATORS, AdaHead, HeadAllocator, UniformHead, register_allocator
from .layers import LAYER_SCHEDULES, LayerSchedule, PyramidLayer, UniformLayer, register_layer_schedule

__all__ = ["ALLOCATORS", "AdaHead", "HeadAllocator", "UniformHead", "register_allocator",
           "LAYER_SCHEDULES", "LayerSchedule", "PyramidLayer", "UniformLayer", "register_layer_schedule"]
