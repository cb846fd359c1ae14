"""The press runtime: what every host that applies a press shares, below the hosts and above the policy.

:class:`Schedule` says when a press evicts (every mode: prompt end, chunked prefill, decode compaction; which
evictions wait for every layer) and with what budget; :func:`layer_view` builds the one view a scorer reads;
:class:`EndOfStep` collects the evictions that wait for every layer; :func:`compressed_layers` says which layers
a press compresses (the hybrid rule). A host keeps only storage, attention and
its hooks. Imports torch and the policy's light modules only.
"""

from .collector import EndOfStep
from .layers import compressed_layers, held_windows, window_limit
from .schedule import Due, LayerClock, Schedule, Step, Trigger
from .views import FixedInputs, HeldEntries, LayerInputs, layer_view, window_of

__all__ = ["Due", "EndOfStep", "FixedInputs", "HeldEntries", "LayerClock", "LayerInputs", "Schedule", "Step",
           "Trigger", "compressed_layers", "held_windows", "layer_view", "window_limit", "window_of"]
