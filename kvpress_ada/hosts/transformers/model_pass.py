"""A scorer's own model pass (KVzip's context reconstruction), run over a dense prefill cache.

After the prefill, every pass a :class:`~kvpress_ada.scorers.PassScorer` asks for (``pass_chunks``) runs through the
model with the cache; a :class:`PassRun` runs each layer's attention with
:func:`~kvpress_ada.kernels.model_pass.lse_attention.attention_with_lse` (output and log-sum-exp from one
kernel; for an unpadded pass :func:`~kvpress_ada.kernels.model_pass.lse_attention.prefix_then_causal_parts`,
which also gives the log-sum-exp over the pass's own tokens) and hands the post-RoPE queries and
keys, and those log-sum-exps, to the scorer's ``pass_scores`` (with the layer's values and
output projection weight, and, when the scorer's ``pass_reads_hidden_states()`` says so, the norm of each
pass token's hidden state entering the attention module, recorded by a forward pre-hook on that
module for the pass only) and the pass's own tokens are cropped off the cache again. The result
is one ``[B, H_kv, L]`` map per layer, handed back to the scorer as ``Observation.pass_scores``.

A scorer that declares ``pass_needs_gradients`` (KVgrad) gets each pass run by :func:`gradient_pass` instead:
autograd on (outside ``torch.inference_mode``, the model's weights frozen for the pass), the model's own attention,
each layer's queries, keys and values recorded, then the gradient of ``Phi = sum_p ||h_p||^2`` (the last decoder
layer's output at the pass's real tokens) w.r.t. each attention module's output; the scores read its norm per pass
token. The cache's tensors are only read (a layer that stored the pass's keys gets its own tensors back).

The pass needs the model's tokenizer (its prompt is text): :func:`use_tokenizer` registers one for
a model (``kvpress_ada.models.load`` and ``generate`` do it), otherwise it is loaded from the
model's ``name_or_path`` when that is a local directory or a cached hub id. Both the tokenizer and
the ids of the pass's prompts (``scorer.pass_prompt_ids``) are checked when the press meets the
model (:func:`check_pass_inputs`), so a missing or foreign tokenizer is one line before any prefill.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator
from weakref import WeakKeyDictionary

import torch

from ...kernels.model_pass.lse_attention import attention_with_lse, full_prefix_then_causal, prefix_then_causal_parts
from ...scorers.base import PassChunk, PassScorer
from .attention import (
    RUN_KWARG,
    Handler,
    attention_modules,
    attention_routed,
    dense_attention,
    logit_extras,
    masked_attention,
    output_weight,
    recording_attention_inputs,
)
from .hf import cache_kwarg
from .window_layer import recording_windows

_TOKENIZERS: WeakKeyDictionary[torch.nn.Module, Any] = WeakKeyDictionary()


def use_tokenizer(model: Any, tokenizer: Any) -> Any:
    """Tell kvpress_ada which tokenizer goes with ``model`` (for scorers whose model pass is text)."""
    _TOKENIZERS[model] = tokenizer
    return model


def tokenizer_for(model: Any) -> Any:
    """The tokenizer registered for ``model``, else the one saved with it (local files only)."""
    tokenizer = _TOKENIZERS.get(model)
    if tokenizer is not None:
        return tokenizer
    path = getattr(model.config, "name_or_path", "") or ""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means the same thing to the user
        raise ValueError(f"this scorer prompts the model with text and needs its tokenizer, which could not be "
                         f"loaded from name_or_path={path!r} ({type(exc).__name__}); call "
                         "kvpress_ada.use_tokenizer(model, tokenizer) once") from None
    _TOKENIZERS[model] = tokenizer
    return tokenizer


def check_pass_inputs(model: Any, scorer: PassScorer) -> None:
    """Raise a one-line ``ValueError`` when ``scorer``'s model pass could not run on ``model``: no
    tokenizer to be found, or one whose prompt ids lie beyond the model's vocabulary (nothing to check for a
    pass that adds no text)."""
    if not scorer.pass_reads_text:
        return
    tokenizer = tokenizer_for(model)
    vocab = int(model.get_input_embeddings().num_embeddings)
    parts = [t.reshape(-1) for t in scorer.pass_prompt_ids(tokenizer)]
    ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    if ids.numel() and int(ids.max()) >= vocab:
        raise ValueError(f"the tokenizer used with this model ({len(tokenizer)} tokens) encodes "
                         f"{type(scorer).__name__}'s prompt with id {int(ids.max())}, beyond the model's vocabulary of "
                         f"{vocab} embeddings: register the model's own tokenizer with "
                         "kvpress_ada.use_tokenizer(model, tokenizer)")


class RecordingRun(Handler):
    """What a handler of one plain forward that only records (a fan-out capture, a scorer's model pass)
    answers alike: never traced by a compiled step, its output handed back as it is."""

    @property
    def traceable(self) -> bool:
        return False

    def after_forward(self, output: Any) -> Any:
        return output


@dataclass
class PassRun(RecordingRun):
    """The prefill handler of one pass: every layer's forward hands its queries to the scorer."""

    scorer: PassScorer
    chunk: PassChunk
    scope: tuple[int, ...] | None = None  # the layers scored (None: all); the others attend densely
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden_norms: dict[int, torch.Tensor] = field(default_factory=dict)  # [B, T] per layer, when recorded
    _mask: tuple[Any, tuple[int, int], torch.Tensor, int | None] | None = None  # (model mask, shape, allowed, prefix)

    def handles_prefill(self, layer_idx: int) -> bool:
        return False  # the pass's attention runs in :meth:`attend`, which also yields the scores

    def after_prefill(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float) -> None:
        raise RuntimeError("PassRun runs every layer's attention itself")  # pragma: no cover

    def record_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """The norm of each pass token's hidden state entering layer ``layer_idx``'s attention (kept only
        when the scorer's ``pass_reads_hidden_states()`` asks for it)."""
        if self.scorer.pass_reads_hidden_states():
            self.hidden_norms[layer_idx] = torch.linalg.vector_norm(hidden.float(), dim=-1)

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """The pass's attention (one fused kernel giving output and log-sum-exp), then the scores,
        which reuse that log-sum-exp when the scorer's softmax spans what the model attends to."""
        layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
        if self.scope is not None and layer_idx not in self.scope:  # a hybrid model's sliding-window layer
            return dense_attention(module, query, key, value, attention_mask, scaling, **kwargs)
        shape = (query.shape[2], key.shape[2])
        if self._mask is None or self._mask[0] is not attention_mask or self._mask[1] != shape:
            allowed = _allowed(attention_mask, *shape)  # the same mask object serves every layer
            self._mask = (attention_mask, shape, allowed, full_prefix_then_causal(allowed))
        allowed, prefix = self._mask[2], self._mask[3]
        parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        if prefix is not None:  # an unpadded pass: two mask-free kernels, and the own tokens' lse for free
            try:
                parts = prefix_then_causal_parts(query, key, value, prefix, scaling)
            except RuntimeError:  # no fused CPU kernel for these inputs: the general path below
                pass
        if parts is None:
            parts = (*attention_with_lse(query, key, value, allowed, scaling), None)
        out, lse, lse_own = parts
        softcap, sinks = logit_extras(kwargs)
        if softcap is not None or sinks is not None:  # the model's own attention carries the pass forward; the
            # scores below read plain scaled logits (a soft-cap keeps each row's order; sink mass is not modelled)
            out = masked_attention(query, key, value, allowed, scaling, softcap, sinks)
        self.scores[layer_idx] = self.scorer.pass_scores(
            query, key, self.chunk, scaling, value=value, output_weight=output_weight(module),
            hidden_norm=self.hidden_norms.pop(layer_idx, None), lse=lse if self.chunk.whole_context else None,
            lse_own=lse_own)
        return out.transpose(1, 2).contiguous(), None


@dataclass
class GradientPassRun(RecordingRun):
    """The handler of one pass that back-propagates (:func:`gradient_pass`): every layer attends with the model's
    own (differentiable) attention, and each scored layer's queries, keys and values are recorded for the scores."""

    scope: tuple[int, ...] | None = None  # the layers scored (None: all)
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor]] = field(
        default_factory=dict)

    def handles_prefill(self, layer_idx: int) -> bool:
        return False

    def after_prefill(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float) -> None:
        raise RuntimeError("GradientPassRun runs every layer's attention itself")  # pragma: no cover

    def record_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        pass

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
        if self.scope is None or layer_idx in self.scope:
            self.inputs[layer_idx] = (query.detach(), key.detach(), value.detach(), scaling,
                                      output_weight(module).detach())
        return dense_attention(module, query, key, value, attention_mask, scaling, **kwargs)


def check_gradient_pass(model: Any, scorer: PassScorer) -> None:
    """Raise a one-line ``ValueError`` when ``scorer``'s passes cannot back-propagate through ``model``: its weights
    were made under ``torch.inference_mode`` (never usable by autograd), or it is split by tensor parallelism."""
    if not scorer.pass_needs_gradients:
        return
    name = type(scorer).__name__
    if any(p.is_inference() for p in model.parameters()):
        raise ValueError(f"{name} back-propagates through the model, whose weights were made under "
                         "torch.inference_mode (autograd cannot use them): load the model outside inference mode")
    if (getattr(model, "tp_size", None) or getattr(model, "_tp_size", None) or 1) > 1:
        raise ValueError(f"{name} back-propagates through the model, which a tensor-parallel model (tp_plan) does not "
                         "support here: run it on one process, or use a scorer without gradients (kvzip)")


@contextmanager
def _frozen(model: Any) -> Iterator[None]:
    """The model's weights do not require gradients inside (only the activations' are computed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


@contextmanager
def _kept_tensors(cache: Any) -> Iterator[None]:
    """Every cache layer holds, after the block, the very key and value tensors it held before (a layer that stored
    the pass's keys, part of the autograd graph, gets its own back once the pass is cropped off)."""
    held = [(layer, layer.keys, layer.values) for layer in getattr(cache, "layers", ())
            if isinstance(getattr(layer, "keys", None), torch.Tensor)
            and isinstance(getattr(layer, "values", None), torch.Tensor)]
    try:
        yield
    finally:
        for layer, keys, values in held:
            now = getattr(layer, "keys", None)
            if isinstance(now, torch.Tensor) and now is not keys and now.shape == keys.shape:
                layer.keys, layer.values = keys, values


def _output(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def gradient_pass(model: Any, scorer: PassScorer, cache: Any, chunk: PassChunk, mask: torch.Tensor,
                  positions: torch.Tensor, scope: tuple[int, ...] | None) -> dict[int, torch.Tensor]:
    """One pass of a scorer that declares ``pass_needs_gradients`` (module docstring): ``{layer: [B, H_kv, L]}`` for
    the layers of ``scope``; ``mask``/``positions`` as the plain pass's. The pass is cropped off the cache."""
    check_gradient_pass(model, scorer)
    run = GradientPassRun(scope=scope)
    outputs: dict[int, torch.Tensor] = {}
    last: list[torch.Tensor] = []
    T = chunk.ids.shape[1]

    def record_output(module: torch.nn.Module, args: tuple, output: Any) -> None:
        outputs[int(module.layer_idx)] = _output(output)  # type: ignore[arg-type]

    with ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(_frozen(model))
        stack.enter_context(_kept_tensors(cache))
        hooks = [m.register_forward_hook(record_output) for m in attention_modules(model)]
        hooks.append(model.get_decoder().layers[-1].register_forward_hook(
            lambda module, args, output: last.append(_output(output))))
        # the embeddings start the graph (the weights are frozen): a leaf that requires its gradient
        hooks.append(model.get_input_embeddings().register_forward_hook(
            lambda module, args, output: output.detach().requires_grad_(True)))
        for hook in hooks:
            stack.callback(hook.remove)
        ids, own, attention_mask, position_ids = (t.clone() for t in (chunk.ids, chunk.mask, mask, positions))
        stack.enter_context(attention_routed(model))
        model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
              logits_to_keep=1, **{cache_kwarg(model): cache, RUN_KWARG: run})
        cache.crop(-T)
        layers = sorted(run.inputs)
        energy = torch.where(own[..., None], last[-1].float().square(), torch.zeros((), device=own.device)).sum()
        grads = torch.autograd.grad(energy, [outputs[i] for i in layers], allow_unused=True)
    scores = {}
    with torch.no_grad():
        for i, grad in zip(layers, grads):
            query, key, value, scaling, weight = run.inputs.pop(i)
            norm = (torch.zeros(own.shape, device=key.device) if grad is None
                    else torch.linalg.vector_norm(grad.float(), dim=-1))
            scores[i] = scorer.pass_scores(query, key, chunk, scaling, value=value, output_weight=weight,
                                           output_grad_norm=norm)
    return scores


def _allowed(attention_mask: Any, T: int, S: int) -> torch.Tensor:
    """The model's attention mask as ``[B | 1, 1, T, S]`` booleans (``None``: causal, end-aligned)."""
    if attention_mask is None:
        return torch.ones(T, S, dtype=torch.bool).tril(S - T)[None, None]
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., :S]
    return attention_mask[..., :S] == 0  # an additive float mask: 0 where allowed, -inf elsewhere


@torch.no_grad()
def model_pass_scores(model: Any, scorer: PassScorer, cache: Any, context_ids: torch.Tensor | None,
                      key_mask: torch.Tensor, next_position: torch.Tensor,
                      scope: tuple[int, ...] | None = None) -> list[torch.Tensor]:
    """Run ``scorer``'s passes over the dense ``cache`` of ``context_ids`` and return one
    ``[B, H_kv, L]`` map per layer the press compresses; the cache is left as it was (the passes are cropped off).

    ``next_position [B]``: the RoPE position of the first token after each row's context; ``scope``: the layers
    the press compresses (``None``: all).
    """
    if context_ids is None:
        raise ValueError(f"{type(scorer).__name__} re-reads the context's token ids; call the model with "
                         "input_ids, not inputs_embeds")
    tokenizer = tokenizer_for(model) if scorer.pass_reads_text else None
    with recording_windows(cache):
        return _passes(model, scorer, cache, context_ids, key_mask, next_position, tokenizer, scope)


def _passes(model: Any, scorer: PassScorer, cache: Any, context_ids: torch.Tensor, key_mask: torch.Tensor,
            next_position: torch.Tensor, tokenizer: Any, scope: tuple[int, ...] | None) -> list[torch.Tensor]:
    """The passes of :func:`model_pass_scores`: one map per layer of ``scope``."""
    total: list[torch.Tensor] | None = None
    for chunk in scorer.pass_chunks(context_ids, key_mask, tokenizer):
        T = chunk.ids.shape[1]
        positions = next_position[:, None] + (chunk.mask.long().cumsum(-1) - 1).clamp(min=0)
        mask = torch.cat([key_mask, chunk.mask], dim=1).long()
        if scorer.pass_needs_gradients:
            measured = gradient_pass(model, scorer, cache, chunk, mask, positions, scope)
        else:
            run = PassRun(scorer=scorer, chunk=chunk, scope=scope)
            recording = recording_attention_inputs(model, run.record_hidden, scorer.pass_reads_hidden_states())
            with attention_routed(model), recording:
                model(input_ids=chunk.ids, attention_mask=mask, position_ids=positions, use_cache=True,
                      logits_to_keep=1, **{cache_kwarg(model): cache, RUN_KWARG: run})
            cache.crop(-T)
            measured = run.scores
        layers = [measured[i] for i in (range(len(measured)) if scope is None else scope)]
        total = layers if total is None else [torch.maximum(a, b) for a, b in zip(total, layers)]
    assert total is not None
    return total


