"""``kvpress_ada.models``: the public path of the harness's model loader
(:mod:`kvpress_ada.harness.models`): ``load("default")``, ``load("qwen2.5-coder-0.5b")``, a local
checkpoint or a hub id. This module *is* that module (one object: attributes and patches are shared)."""

import sys

from kvpress_ada.harness import models as _loader

sys.modules[__name__] = _loader
