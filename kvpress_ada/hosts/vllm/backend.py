"""vLLM's CPU attention backend, overridden: with a press configured, every layer keeps its entries in
pages owned per (request, kv head) through :class:`~kvpress_ada.serving.requests.PagedServing`; without one, it
is vLLM's own backend.

The pages are carved out of the KV tensors vLLM reserved (a layer's ``[blocks, H_kv, S, 2 * D]`` viewed as
``[blocks * H_kv, 2, S, D]``: a page holds ``S`` keys then ``S`` values of one head), in vLLM's own in-page
layout for the ISA vLLM picks, written and attended by vLLM's own CPU ops, one kernel request per (request, kv
head) row (:mod:`.pages`; our plain layout and kernels where that layout cannot be mapped). When the
layers' tensors lie one after the other in one storage (vLLM 0.32 on CPU) they make one pool of
``layers * blocks * H_kv`` pages for every (layer, kv head); else each
layer has its pool. A press with a quantized storage gets a
:class:`~kvpress_ada.serving.record_pages.QuantizedPagePool` over the same bytes instead (records, our kernels).
Either way a request never holds more pages than ``H_kv`` times its real blocks per layer (:mod:`.scheduler`), so
a pool cannot run out while vLLM's accounting holds. Each worker (:mod:`.worker`) owns a :class:`HostState` (no
module-global state): it builds the serving state at the first step and hands itself to its layers' impls; the
metadata builder adds each step's token counts and positions once per step (vLLM's builder pattern).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
    _get_attn_isa,
)

from ...families import Family, family_for
from ...pipeline import Pipeline
from ...serving.pages import PagePool
from ...serving.pools import page_pool
from ...serving.requests import PagedServing
from .pages import vllm_pool


@dataclass
class HostState:
    """What the backend of one worker needs besides its tensors, owned by that worker
    (:class:`~.worker.PressWorker`, which hands it to its attention layers' impls): the press, the serving state
    (built at the first step, from the KV tensors), the model runner whose batch order maps rows to requests, and
    the hooks it installed (removed by :meth:`close`)."""

    press: Pipeline | None = None
    serving: PagedServing | None = None
    runner: Any = None
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # this step's hidden states entering attention
    handles: list[Any] = field(default_factory=list)
    _step: tuple[Any, list[str]] | None = None  # (this step's metadata, its request ids)

    def start_step(self, vllm_config: Any, runner: Any) -> PagedServing | None:
        """Called by the worker before each step: the serving state (built at the first step) or ``None``."""
        self.runner = runner
        if self.press is not None and self.serving is None:
            self.serving = _build_serving(self.press, vllm_config, runner)
            for module in _attention_layers(vllm_config):
                if isinstance(getattr(module, "impl", None), PressAttentionImpl):
                    module.impl.host = self
            if self.press.scorer.reads_hidden_states:
                self._record_hidden_states(family_for(vllm_config.model_config.hf_config).engine_attention_modules(
                    runner.model))
        self.hidden.clear()
        self._step = None
        return self.serving

    def request_ids(self, attn_metadata: Any) -> list[str]:
        """The ids of the step's requests in batch order, read once per step (every layer shares the metadata)."""
        if self._step is None or self._step[0] is not attn_metadata:
            n = len(attn_metadata.counts)
            self._step = (attn_metadata, list(self.runner.input_batch.req_ids[:n]))
        return self._step[1]

    def close(self) -> None:
        """Remove the hooks this host installed and let the serving state go (the engine shuts down)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.serving, self.runner, self._step = None, None, None
        self.hidden.clear()

    def _record_hidden_states(self, modules: list[torch.nn.Module]) -> None:
        """A forward pre-hook on every decoder layer's attention module (``modules``, in layer order) keeps the
        hidden states entering it ``[T, hidden]`` (vLLM's ``forward(positions, hidden_states)``; a ``hidden_states``
        keyword ``[1, T, hidden]`` where vLLM's Transformers modeling backend runs a transformers model's modules),
        for a scorer that scores entries from them."""
        def record(module: Any, args: tuple, kwargs: dict) -> None:
            hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
            if isinstance(hidden, torch.Tensor):  # [1, T, hidden] where vLLM runs a transformers model's modules
                self.hidden[index[id(module)]] = hidden.reshape(-1, hidden.shape[-1])

        index = {id(module): i for i, module in enumerate(modules)}
        self.handles += [module.register_forward_pre_hook(record, with_kwargs=True) for module in modules]


def _attention_layers(vllm_config: Any) -> list[Any]:
    """The static forward context's attention layers with a KV tensor, in layer order."""
    context = vllm_config.compilation_config.static_forward_context
    layers = sorted(((extract_layer_index(name), module) for name, module in context.items()
                     if isinstance(getattr(module, "kv_cache", None), torch.Tensor)), key=lambda x: x[0])
    return [module for _, module in layers]


def _build_serving(press: Pipeline, vllm_config: Any, runner: Any) -> PagedServing:
    """The pools over the KV tensors vLLM reserved (the static forward context's attention layers): one pool for
    every layer when the layers' tensors lie one after the other in one storage (vLLM 0.32 on CPU: a page then
    serves any (layer, kv head) and a request is counted by its pages over all layers), else one per layer."""
    caches = [module.kv_cache for module in _attention_layers(vllm_config)]
    blocks, heads, size, two_d = caches[0].shape
    isa = _get_attn_isa(caches[0].dtype, size, two_d // 2, vllm_config.cache_config.cache_dtype)
    stride = caches[0].numel() * caches[0].element_size()
    if all(c.is_contiguous() and c.shape == caches[0].shape and c.data_ptr() == caches[0].data_ptr() + i * stride
           for i, c in enumerate(caches)):
        pages = torch.as_strided(caches[0], (len(caches) * blocks * heads, 2, size, two_d // 2),
                                 (2 * size * two_d // 2, size * two_d // 2, two_d // 2, 1))
        shared = _pool(press, pages, isa)
        pools = [shared] * len(caches)
    else:
        pools = [_pool(press, kv.view(blocks * heads, 2, size, two_d // 2), isa) for kv in caches]
    config = vllm_config.model_config.hf_config
    family = family_for(config)
    modules = family.engine_attention_modules(runner.model) if runner is not None else []
    cache: dict[tuple[int, str], torch.Tensor] = {}
    return PagedServing(press, pools, int(heads), lambda i: LayerInfo(config, family, modules, i, cache))


class LayerInfo(Mapping[str, torch.Tensor]):
    """What scorers read of layer ``layer_idx`` besides its tensors (:class:`PagedServing`'s ``layer_info``), each
    computed when a scorer first asks and kept in ``cache`` (one per serving state): ``output_weight``, read back
    from vLLM's output projection (:func:`output_weight`; CriticalKV, ...), and ``rope_inv_freq``, the frequencies
    the transformers host reads, from the engine's HF config ``config`` through the family's rule
    (:func:`~kvpress_ada.hosts.transformers.rotary.config_rope_inv_freq`; ExpectedAttention, leverage, CAP, ...). A
    layer without an output projection has no ``output_weight``."""

    def __init__(self, config: Any, family: Family, modules: list[torch.nn.Module], layer_idx: int,
                 cache: dict[Any, Any]):
        self.config, self.family, self.modules, self.layer_idx, self.cache = config, family, modules, layer_idx, cache

    def _read(self, name: str) -> torch.Tensor | None:
        if name == "rope_inv_freq":
            from ..transformers.rotary import config_rope_inv_freq, rotary_embedding

            if "rotary" not in self.cache:  # built once, for every layer
                self.cache["rotary"] = rotary_embedding(self.config)
            return config_rope_inv_freq(self.config, self.layer_idx, self.cache["rotary"]).detach()
        if name == "output_weight" and self.layer_idx < len(self.modules):
            proj = self.family.engine_output_projection(self.modules[self.layer_idx])
            return None if proj is None else output_weight(proj)
        return None

    def __getitem__(self, name: str) -> torch.Tensor:
        key = (self.layer_idx, name)
        if key not in self.cache:
            value = self._read(name)
            if value is None:
                raise KeyError(name)
            self.cache[key] = value
        return self.cache[key]

    def __iter__(self) -> Iterator[str]:
        return iter(("output_weight", "rope_inv_freq"))

    def __len__(self) -> int:
        return 2


def output_weight(proj: Any) -> torch.Tensor:
    """The weight ``[out, in]`` of one of vLLM's linear layers (tensor parallel size 1). On CPU, vLLM hands it to a
    packed GEMM (oneDNN, sgl-kernel) after loading and keeps an empty one; it is then read back through that GEMM,
    as the layer's product with the identity (exact: each output is one weight times one)."""
    weight = proj.weight.detach()
    if weight.numel() > 0:
        return weight
    method = getattr(proj, "quant_method", None)
    size = getattr(proj, "input_size_per_partition", None)
    if method is None or size is None:
        raise ValueError(f"{type(proj).__name__} holds no weight and no vLLM linear method to read it back through")
    with torch.no_grad():
        eye = torch.eye(int(size), dtype=weight.dtype, device=weight.device)
        return method.apply(proj, eye, None).t().contiguous()


def _pool(press: Pipeline, pages: torch.Tensor, isa: str) -> PagePool:
    """The pool over ``pages [P, 2, S, D]`` (contiguous pages) that ``press``'s storage kind declares
    (:meth:`~kvpress_ada.storage.Storage.page_pool`): vLLM's layout and kernels in the model's dtype
    (:func:`.pages.vllm_pool`, the host's native pool); a record kind's records over the same bytes, our kernels."""
    return page_pool(press.storage, pages, native=lambda p: vllm_pool(p, isa))


@dataclass
class PressAttentionMetadata(CPUAttentionMetadata):
    """vLLM's CPU metadata of a step plus what the press's attention reads, built once per step by
    :class:`PressMetadataBuilder`: ``counts`` the tokens each request brings, ``positions [T]`` their positions."""

    counts: list[int] = field(default_factory=list)
    positions: torch.Tensor | None = None


class PressMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder; each step's metadata also carries the requests' token counts and positions."""

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        starts = common_attn_metadata.query_start_loc_cpu.tolist()
        counts = [b - a for a, b in zip(starts, starts[1:])]
        seq_lens = meta.seq_lens.tolist()
        positions = torch.cat([torch.arange(n - c, n) for n, c in zip(seq_lens, counts)]) if counts else \
            torch.zeros(0, dtype=torch.long)
        return PressAttentionMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)}, counts=counts,
                                      positions=positions.to(meta.seq_lens.device))


class PressAttentionImpl(CPUAttentionBackendImpl):
    """The CPU backend's impl; once its worker hands it a :class:`HostState` serving a press (``host``), its
    forward goes through :class:`PagedServing`; until then (or with no press), vLLM's own."""

    host: HostState | None = None

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, output_scale: Any = None,
                output_block_scale: Any = None) -> torch.Tensor:
        host = self.host
        if host is None or host.serving is None:  # the host is off: vLLM's own write and attention
            if attn_metadata is not None:
                super().do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if attn_metadata is None:  # warm-up
            return output
        serving = host.serving
        T = int(attn_metadata.num_actual_tokens)
        counts = attn_metadata.counts
        ids = host.request_ids(attn_metadata)
        batch = host.runner.input_batch
        for i, rid in enumerate(ids):
            if rid not in serving.requests:
                serving.add(rid, int(batch.num_prompt_tokens[i]))
        layer_idx = extract_layer_index(layer.layer_name)
        hidden = host.hidden.get(layer_idx)
        out = serving.attend(layer_idx, ids, query[:T], key[:T], value[:T], attn_metadata.positions, counts,
                             self.scale, hidden=None if hidden is None else hidden[:T])
        output[:T].copy_(out.view_as(output[:T]))
        return output


class PressAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with :class:`PressAttentionImpl` and :class:`PressMetadataBuilder`; the impl writes the layer's
    keys and values itself."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls() -> type[PressAttentionImpl]:
        return PressAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[PressMetadataBuilder]:
        return PressMetadataBuilder
