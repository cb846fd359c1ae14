"""A directory put first on ``PYTHONPATH`` for the Python processes a vLLM engine starts (its ``sitecustomize``:
:func:`kvpress_ada.hosts.vllm_server.hide_unimportable`)."""
