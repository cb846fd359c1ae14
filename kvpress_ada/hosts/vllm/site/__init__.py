"""Imported first by :mod:`kvpress_ada` (before anything imports transformers): where vLLM is installed, hides the
packages beside it that do not import (:func:`kvpress_ada.hosts.vllm.server.hide_unimportable`). The directory is
also put first on ``PYTHONPATH`` for the Python processes a vLLM engine starts (its ``sitecustomize``)."""

import importlib.util

if importlib.util.find_spec("vllm") is not None:
    from ..server import hide_unimportable

    hide_unimportable()
