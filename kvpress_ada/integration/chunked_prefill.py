"""Chunked prefill: ``Pipeline(prefill_chunk=N)`` compresses after every chunk of ``N`` tokens.

When ``model(ids)`` (or ``model.generate(ids)``) brings a context of ``L > N`` tokens into an empty
cache under such a press, the routing's forward pre-hook runs the model itself on every chunk but
the last (each a nested forward of the same model), then lets the caller's forward run on the last
chunk; the post-hook hands back the logits the caller asked for, gathered over the chunks.

Chunks are aligned on the *end* of the context (:meth:`Pipeline.chunks`): the last chunk always
holds ``N`` tokens, so every row of a left-padded batch is cut exactly as it would be alone, and the
last compression sees a full chunk of queries.

In every layer, a chunk's queries attend to the layer's compressed cache plus the chunk itself:
keys are read as a left-padded per-head view of the cache (:meth:`PressLayer.entries`), the mask
allows an entry when it is a real token (left padding never is) and its position is at most the
query's (kept entries always are; causal inside the chunk), and RoPE positions are the tokens'
true positions (the model's own ``position_ids``, continuing from the tokens seen, never from the
compressed length). The layer is then compressed back to its *final* budget, the per-head budget
the one-shot press gives this layer for the whole context, clipped to the (non-padding) tokens
seen so far: ``H_kv * min(b_layer, seen)`` entries per row, exactly. The scorer sees the kept
entries followed by the chunk; when the heads of a layer hold different numbers of entries (Ada),
each kv head is scored on its own (see :class:`~kvpress_ada.presses.Scorer`). A head allocator
may ask a head for more entries than it holds (Ada's uniform share after an uneven step); the
excess goes to the best remaining entries of the other heads of the row, so totals stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..allocators.heads import fit_to_valid
from .entries import left_pad_index
from .hf import check_left_padded, prefill_key_mask
from .press_context import RUN_KWARG, PressRun, _output_weight, observation_for

if TYPE_CHECKING:
    from ..pipeline import Pipeline
    from .press_cache import PressCache


@dataclass
class ChunkedPrefill(PressRun):
    """The prefill handler of every chunk forward of one chunked prefill (see the module docstring)."""

    chunks: list[tuple[int, int]] = field(default_factory=list)
    index: int = 0  # chunk being run
    budgets: torch.Tensor | None = None  # [B, n_layers] final per-head budget of every layer
    positions: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> kept positions [B, H, n], -1 pad
    logits_wanted: list[int] = field(default_factory=list)  # logits of each chunk the caller asked for
    logits: list[torch.Tensor] = field(default_factory=list)

    def handles_prefill(self, layer_idx: int) -> bool:
        return False  # every chunk goes through attend()

    @property
    def last(self) -> bool:
        return self.index == len(self.chunks) - 1

    def after_forward(self, output: Any) -> Any:
        if not self.last:
            return output  # a nested chunk forward: the pre-hook collects its logits
        self.cache.routed = False
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
        assert self.press is not None and self.key_mask is not None and self.budgets is not None
        layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
        layer = self.cache._layer(layer_idx)
        keys, values, _ = layer.entries()
        B, H, width, _ = keys.shape
        start, stop = self.chunks[self.index]
        C = stop - start
        device = keys.device
        chunk_pos = torch.arange(start, stop, device=device)
        kept = self.positions.get(layer_idx, torch.empty(B, H, 0, dtype=torch.long, device=device))
        if kept.shape[-1] + C != width or query.shape[2] != C:
            raise RuntimeError(f"chunked prefill lost track of layer {layer_idx}: {kept.shape[-1]} kept + {C} "
                               f"chunk entries, the cache holds rows of up to {width}")
        pos = torch.cat([kept, chunk_pos.expand(B, H, C)], dim=-1)  # [B, H, Lv] true positions
        key_mask = self.key_mask.to(device)
        valid = (pos >= 0) & key_mask.gather(1, pos.clamp(min=0).view(B, -1)).view(B, H, width)
        with torch.no_grad():
            out = _chunk_attention(query, keys, values, pos, valid, chunk_pos, scaling)
            keep = self._select(module, layer_idx, query, keys, values, valid, int(stop))
            layer.keep_entries(keep, (keys, values))
            n = keep.sum(-1)
            kept_width = int(n.max()) if n.numel() else 0
            order = torch.argsort(keep.to(torch.uint8), dim=-1, stable=True)[..., width - kept_width:]
            _, present = left_pad_index(n, kept_width)
            self.positions[layer_idx] = torch.where(present, pos.gather(-1, order), torch.full_like(order, -1))
        return out.transpose(1, 2).contiguous(), None

    def _select(self, module: torch.nn.Module, layer_idx: int, query: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, valid: torch.Tensor, stop: int) -> torch.Tensor:
        """Keep mask ``[B, H, Lv]`` bringing each row back to ``H * min(budget, seen)`` entries."""
        assert self.press is not None and self.key_mask is not None and self.budgets is not None
        H = keys.shape[1]
        seen = self.key_mask[:, :stop].sum(-1).to(keys.device)
        target = torch.minimum(self.budgets[:, layer_idx].to(keys.device), seen)
        n_valid = valid.sum(-1)
        evict = n_valid.sum(-1) > H * target
        keep = valid.clone()
        if not bool(evict.any()):  # one host sync per layer and chunk
            return keep
        rows = evict.nonzero()[:, 0]
        scores = self._scores(module, layer_idx, query[rows], keys[rows], values[rows], valid[rows])
        counts = fit_to_valid(scores, self.press._allocate(scores, target[rows], layer_idx), valid[rows])
        keep[rows] = self.press.evictor.select(scores, counts) & valid[rows]
        return keep

    def _scores(self, module: torch.nn.Module, layer_idx: int, query: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The pipeline's checked ``[B, H, Lv]`` scores (``-inf`` where not valid): the whole layer at
        once when its heads hold the same entries, else one kv head at a time."""
        assert self.press is not None
        press, scorer = self.press, self.press.scorer
        n_layers = len(self.cache.layers)
        weight = _output_weight(module)
        scaling = float(module.scaling)  # type: ignore[arg-type]
        if bool((valid == valid[:, :1]).all()):
            obs = observation_for(scorer, self.model, layer_idx, n_layers, query, keys, values, valid[:, 0], scaling,
                                  weight)
            return press.scores(obs).masked_fill(~valid, float("-inf"))
        H = keys.shape[1]
        G, D = query.shape[1] // H, query.shape[-1]
        heads = []
        for h in range(H):
            obs = observation_for(scorer, self.model, layer_idx, n_layers, query[:, h * G:(h + 1) * G],
                                  keys[:, h:h + 1], values[:, h:h + 1], valid[:, h], scaling,
                                  weight[:, h * G * D:(h + 1) * G * D])
            heads.append(press.scores(replace(obs, head_offset=h)))
        return torch.cat(heads, dim=1).masked_fill(~valid, float("-inf"))


def _chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                     valid: torch.Tensor, chunk_pos: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[B, H_q, C, D]``: each query over the valid entries at or before its position (and always
    itself, so a padding query never meets an empty softmax)."""
    H, Hq = keys.shape[1], query.shape[1]
    before = pos[:, :, None, :] <= chunk_pos[None, None, :, None]
    itself = pos[:, :, None, :] == chunk_pos[None, None, :, None]
    allowed = (valid[:, :, None, :] & before) | itself
    mask = allowed.repeat_interleave(Hq // H, dim=1)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=Hq != H)


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
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        raise ValueError("chunked prefill takes a 2-D attention_mask [batch, tokens] (or none)")
    positions = kwargs.pop("position_ids", None)
    for stale in ("past_key_values", cache_key, "use_cache", "cache_position"):
        kwargs.pop(stale, None)
    length = int(source.shape[1])
    lengths = key_mask.sum(-1)
    n_layers = len(cache.layers)
    budgets = press.layers.floored_budgets(press.average_budget(lengths), n_layers, lengths,
                                           press.scorer.protected(lengths))
    wanted = length if wanted == 0 else min(wanted, length)
    chunks = press.chunks(length)
    run = ChunkedPrefill(press=press, cache=cache, model=model, compress=True, key_mask=key_mask, chunks=chunks,
                         budgets=budgets, logits_wanted=[max(0, stop - max(start, length - wanted))
                                                         for start, stop in chunks])

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
            run.index = i
            cache.routed = True
            out = model(**chunk_kwargs(i))
            if run.logits_wanted[i]:
                run.logits.append(out.logits[:, -run.logits_wanted[i]:])
            del out
    run.index = len(chunks) - 1
    cache.routed = True
    return (), chunk_kwargs(run.index)
