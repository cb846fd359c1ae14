"""Engine-neutral serving: a press applied to the packed requests of any serving engine, over pages owned per
(layer, kv head). Below the engine hosts (``hosts/vllm``), beside the transformers host; drives the press
runtime (:mod:`kvpress_ada.runtime`) like every host.

* :mod:`.pages`: :class:`PagePool` and :class:`PagedSequence`, pages of one layer owned per (sequence, kv head);
* :mod:`.record_pages`: :class:`QuantizedPagePool`, the same pages holding a record storage kind's records;
* :mod:`.pools`: which pool holds each storage structure (:func:`page_pool`, :func:`register_page_pool`);
* :mod:`.requests`: :class:`PagedServing`, the requests' pages, attention and evictions as they advance.
"""

from .pages import PagedSequence, PagePool, PoolExhausted
from .pools import PoolKind, page_pool, pool_reserve, register_page_pool
from .record_pages import QuantizedPagePool
from .requests import PagedServing, ServedRequest, check_servable

__all__ = ["PagePool", "PagedSequence", "PagedServing", "PoolExhausted", "PoolKind", "QuantizedPagePool",
           "ServedRequest", "check_servable", "page_pool", "pool_reserve", "register_page_pool"]
