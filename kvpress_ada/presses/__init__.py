"""``kvpress_ada.presses``: the import path the scorers had before they moved to
:mod:`kvpress_ada.scorers`, kept so existing imports (``from kvpress_ada.presses import SnapKV``,
``from kvpress_ada.presses.kvzip import KVzip``) keep working. New code imports
:mod:`kvpress_ada.scorers`."""

import importlib
import sys

from kvpress_ada.scorers import *  # noqa: F403
from kvpress_ada.scorers import __all__  # noqa: F401

for _module in ("base", "criticalkv", "expected_attention", "h2o", "keydiff", "knorm", "kvzip", "lagkv", "random",
                "snapkv", "streamingllm", "tova", "attention"):
    sys.modules[f"{__name__}.{_module}"] = importlib.import_module(f"kvpress_ada.scorers.{_module}")
