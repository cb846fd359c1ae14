"""Chunked prefill: ``Pipeline(prefill_chunk=N)`` compresses after every chunk of ``N`` tokens.

When a forward brings a context of ``L > N`` tokens into an empty cache under such a press, the
routing's pre-hook runs the model itself on every chunk but the last (nested forwards), then lets
the caller's forward run the last chunk; the caller gets the logits it asked for, gathered over the
chunks. Chunks are aligned on the end of the context (:meth:`Pipeline.chunks`). In every layer a
chunk's queries attend to the layer's view (kept entries, then the chunk; causal by position, true
RoPE positions), then :meth:`Pipeline.keep` brings each row back to ``H_kv * min(b_layer, seen)``
entries, ``b_layer`` the one-shot press's budget for the layer. A model-scope layer schedule
(``AdaLayer``) waits for the end of each chunk's forward and splits ``n_layers * min(b, seen)``
entries per row across every layer's view at once (peak: every layer's kept entries plus one chunk).
Design notes: ``docs/design.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...observation import Budget
from ...runtime import Due, Schedule
from .attention import (
    RUN_KWARG,
    Handler,
    dense_attention,
    layer_view,
    logit_extras,
    masked_attention,
    record_entry_scores,
)
from .eviction import Eviction
from .hf import check_left_padded, prefill_key_mask
from .press_cache import PressCache

if TYPE_CHECKING:
    from ...pipeline import Pipeline


@dataclass
class ChunkedPrefill(Handler):
    """The handler of every chunk forward of one chunked prefill (see the module docstring)."""

    press: Pipeline
    cache: PressCache
    model: torch.nn.Module
    key_mask: torch.Tensor  # [B, L] real tokens of the whole context
    chunks: list[tuple[int, int]] = field(default_factory=list)
    index: int = 0  # chunk being run
    logits_wanted: list[int] = field(default_factory=list)  # logits of each chunk the caller asked for
    logits: list[torch.Tensor] = field(default_factory=list)
    due: Due | None = None  # the eviction the schedule makes due after the chunk being run
    eviction: Eviction = field(init=False)

    def __post_init__(self) -> None:
        self.schedule = Schedule(self.press)
        self.eviction = Eviction(self.press, self.cache, waits=self.schedule.prompt_waits)

    def start(self, index: int) -> None:
        """Chunk ``index`` is run next: every layer's clock counts it (the same step in every layer)."""
        self.index = index
        start, stop = self.chunks[index]
        steps = self.cache.state.advance(self.schedule, stop - start)
        self.due = next((step.due for step in steps if step.due is not None), None)  # the compressed layers' due

    def handles_prefill(self, layer_idx: int) -> bool:
        return False  # every chunk goes through attend()

    @property
    def traceable(self) -> bool:
        return False

    def record_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """The chunk's hidden states entering layer ``layer_idx``'s attention (a scorer reading them scores here)."""
        if self.press.scorer.reads_hidden_states:
            record_entry_scores(self.cache.state, self.press.scorer, layer_idx, hidden)

    def after_prefill(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float) -> None:  # pragma: no cover - handles_prefill is False
        raise RuntimeError("ChunkedPrefill attends through attend()")

    @property
    def last(self) -> bool:
        return self.index == len(self.chunks) - 1

    def after_forward(self, output: Any) -> Any:
        """End of a chunk's forward: a model-scope press evicts every layer of the chunk at once; the
        cache stays routed until the last chunk's forward ends."""
        if self.last:
            self.cache.routed = False
        for i in self.eviction.every_layer(output, self._budget):
            self._done(i)
        if not self.last:
            return output  # a nested chunk forward: the pre-hook collects its logits
        if output is not None and self.logits:
            wanted = self.logits_wanted[-1]
            parts = self.logits + ([output.logits[:, -wanted:]] if wanted else [])
            output.logits = torch.cat(parts, dim=1)
            self.logits = []
        return output

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Attention of the chunk's queries over the layer's kept entries plus the chunk, then
        compression of the layer back to its budget."""
        layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
        if layer_idx not in self.cache.state.scope:  # a hybrid model's sliding-window layer: the model's attention
            return self.cache.attend(layer_idx, query, key, value, attention_mask, scaling, dense_attention, module,
                                     **kwargs)
        start, stop = self.chunks[self.index]
        held = self.cache.view(layer_idx)
        if query.shape[2] != stop - start or held.keys.shape[2] < stop - start:
            raise RuntimeError(f"chunked prefill lost track of layer {layer_idx}: chunk {start}:{stop}, the cache "
                               f"holds rows of up to {held.keys.shape[2]}")
        with torch.no_grad():
            out = _chunk_attention(query, held.keys, held.values, held.positions, held.valid,
                                   torch.arange(start, stop, device=query.device), scaling, *logit_extras(kwargs))
            if self.due is not None:
                view = layer_view(self.press.scorer, self.model, module, len(self.cache.layers), held, query, scaling,
                                  state=self.cache.state)
                if self.eviction.layer(layer_idx, view, held, self._budget):
                    self._done(layer_idx)
        return out.transpose(1, 2).contiguous(), None

    def _budget(self) -> Budget:
        """The budget after the current chunk: the one-shot press's, capped at the tokens seen so far."""
        assert self.due is not None
        seen = self.key_mask[:, :self.chunks[self.index][1]].sum(-1)
        return self.schedule.budget(self.due, self.key_mask.sum(-1), seen=seen)

    def _done(self, layer_idx: int) -> None:
        """After the last chunk a layer's hidden-state scores serve only later decode compactions."""
        if self.last and not self.press.compresses_decode:
            self.cache.state.entry_scores[layer_idx] = None


SCORE_BYTES = 64 * 2**20  # one attention call's score matrix at most: longer rows take the queries in blocks


def _chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                     valid: torch.Tensor, chunk_pos: torch.Tensor, scaling: float, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H_q, C, D]``: each query over the valid entries at or before its position (and always
    itself, so a padding query never meets an empty softmax).

    The layer's rows are padded to its longest (a head given most of the context under one top-k
    over all heads), so the queries go in blocks whose ``[B, H_q, block, L]`` scores fit
    :data:`SCORE_BYTES`: temporaries stay bounded however long one head grows."""
    B, Hq, C, _ = query.shape
    block = max(1, SCORE_BYTES // (4 * B * Hq * max(keys.shape[2], 1)))
    if block >= C:
        return _attention_block(query, keys, values, pos, valid, chunk_pos, scaling, softcap, sinks)
    return torch.cat([_attention_block(query[:, :, s:s + block], keys, values, pos, valid, chunk_pos[s:s + block],
                                       scaling, softcap, sinks) for s in range(0, C, block)], dim=2)


def _attention_block(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                     valid: torch.Tensor, chunk_pos: torch.Tensor, scaling: float, softcap: float | None,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    H, Hq = keys.shape[1], query.shape[1]
    before = pos[:, :, None, :] <= chunk_pos[None, None, :, None]
    itself = pos[:, :, None, :] == chunk_pos[None, None, :, None]
    allowed = (valid[:, :, None, :] & before) | itself
    return masked_attention(query, keys, values, allowed.repeat_interleave(Hq // H, dim=1), scaling, softcap, sinks)


def start_chunked_prefill(model: Any, press: Pipeline, cache: PressCache, args: tuple, kwargs: dict,
                          cache_key: str) -> tuple[tuple, dict]:
    """Run every chunk but the last through ``model`` and return the forward arguments of the last
    one (the caller's forward runs it). Called by the routing's pre-hook."""
    for name in ("output_attentions", "output_hidden_states"):
        if kwargs.get(name):
            raise ValueError(f"chunked prefill (prefill_chunk={press.prefill_chunk}) does not return {name}; "
                             "call the model without it or use a press without prefill_chunk")
    if kwargs.get("labels") is not None:
        raise ValueError("chunked prefill is inference only: call the model without labels")
    if kwargs.get("return_dict") is False:
        raise ValueError("chunked prefill returns a ModelOutput: call the model without return_dict=False")
    wanted = kwargs.pop("logits_to_keep", 0)
    if not isinstance(wanted, int) or wanted < 0:
        raise ValueError(f"chunked prefill takes logits_to_keep as an int >= 0 (last positions), got {wanted!r}")
    if len(args) > 1:
        raise ValueError("chunked prefill takes the model's inputs as keyword arguments (besides input_ids)")
    key_mask = prefill_key_mask(args, kwargs)
    check_left_padded(key_mask)
    press.check_context(int(key_mask.sum(-1).min()))
    name = "inputs_embeds" if args == () and kwargs.get("input_ids") is None else "input_ids"
    source = args[0] if args else kwargs.pop(name)
    mask = kwargs.pop("attention_mask", None)
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:  # generate's mask for a compileable cache: its padding
        mask = key_mask.long()
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        raise ValueError("chunked prefill takes a 2-D attention_mask [batch, tokens] (or none)")
    positions = kwargs.pop("position_ids", None)
    for stale in ("past_key_values", cache_key, "use_cache", "cache_position"):
        kwargs.pop(stale, None)
    length = int(source.shape[1])
    wanted = length if wanted == 0 else min(wanted, length)
    chunks = Schedule(press).chunks(length)
    run = ChunkedPrefill(press=press, cache=cache, model=model, key_mask=key_mask, chunks=chunks,
                         logits_wanted=[max(0, stop - max(start, length - wanted)) for start, stop in chunks])

    def chunk_kwargs(i: int) -> dict:
        start, stop = chunks[i]
        kw = {**kwargs, name: source[:, start:stop], "use_cache": True, cache_key: cache, RUN_KWARG: run,
              "logits_to_keep": max(run.logits_wanted[i], 1)}
        if mask is not None:
            kw["attention_mask"] = mask[:, :stop]
        if positions is not None:
            kw["position_ids"] = positions[..., start:stop]
        return kw

    with torch.no_grad():
        for i in range(len(chunks) - 1):
            run.start(i)
            cache.routed = True
            out = model(**chunk_kwargs(i))
            if run.logits_wanted[i]:
                run.logits.append(out.logits[:, -run.logits_wanted[i]:])
            del out
    run.start(len(chunks) - 1)
    cache.routed = True
    return (), chunk_kwargs(run.index)
