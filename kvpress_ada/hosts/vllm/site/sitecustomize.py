"""Run at the start of each Python process a vLLM engine with a press starts (this directory is first on its
``PYTHONPATH``, see :func:`kvpress_ada.hosts.vllm.server.hide_unimportable`): the packages named in
``KVPRESS_ADA_HIDDEN`` (comma-separated; ones that do not import beside the installed torch) are marked absent before
anything looks for them; then the ``sitecustomize`` this one shadows, if any, runs."""

import importlib.machinery
import importlib.util
import os
import sys

for _name in filter(None, os.environ.get("KVPRESS_ADA_HIDDEN", "").split(",")):
    sys.modules.setdefault(_name, None)  # type: ignore[arg-type]

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _spec is not None and _spec.loader is not None:
    _shadowed = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_shadowed)
