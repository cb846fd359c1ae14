"""Hosts: what attaches a press (:class:`~kvpress_ada.Pipeline`, pure policy) to something that runs a
model. :mod:`.base` holds the :class:`~.base.Host` contract and the registry the policy looks hosts up
in; each host is one package below (:mod:`.transformers`: Hugging Face models). Hosts import the policy,
never the other way round."""
