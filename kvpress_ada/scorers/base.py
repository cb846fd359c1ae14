"""The Scorer contract: ``score(obs) -> [B, H_kv, L]``, higher means keep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable

import torch

from ..components import Component, Registry
from ..observation import Observation


class Scorer(Component):
    """Base class of every scorer.

    Subclasses declare what they read: ``query_window()`` trailing queries (``None`` for all of
    them), ``needs_output_weight`` / ``needs_rope`` for extra model tensors. Protected tokens get
    ``+inf`` and count toward the budget. ``comparable_across_heads`` says whether raw scores of
    different heads share a scale (attention probabilities do); Ada allocation makes the comparison
    scale-free when they do not. ``needs_model_pass``: the scorer runs inputs of its own through the
    model after the prefill (:class:`~kvpress_ada.scorers.kvzip.KVzip`); the integration runs that
    pass and hands what it measured back as ``obs.pass_scores``, and eviction waits for the end of
    prefill. ``reads_hidden_states``: the scorer scores each entry from the hidden state that entered
    the attention with its token (:meth:`entry_scores`, computed once as the token arrives, in
    every mode); the integration hands those scores back, aligned with the entries, as
    ``obs.entry_scores``.

    Chunked prefill (``Pipeline(prefill_chunk=N)``): after each chunk the scorer is handed the
    layer's kept entries followed by the chunk, as an ordinary left-padded observation (kept entries
    first, in position order; ``queries`` are the chunk's trailing queries, at the end of the keys).
    When the kv heads of a layer hold different numbers of entries (Ada allocation), each kv head is
    scored on its own (``H_kv == 1``, ``obs.head_offset`` = its index in the layer, ``output_weight``
    restricted to its query group). ``supports_chunked_prefill = False`` refuses chunked prefill
    with a clear error (a scorer that needs the whole context at once).
    """

    kind: ClassVar[str] = "scorer"
    comparable_across_heads: ClassVar[bool] = True
    needs_output_weight: ClassVar[bool] = False
    needs_rope: ClassVar[bool] = False
    needs_model_pass: ClassVar[bool] = False
    supports_chunked_prefill: ClassVar[bool] = True
    reads_hidden_states: ClassVar[bool] = False

    def query_window(self) -> int | None:
        """How many trailing prefill queries ``score`` reads (``None`` = all)."""
        return 1

    def min_context(self) -> int:
        """Shortest context (non-padding tokens) this scorer accepts."""
        return 1

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        """``[B]`` long: entries per kv head this scorer always protects (``+inf``) on rows of
        ``lengths [B]`` valid tokens (its window, its sinks; 0 by default). Declared, not read from
        scores, so every path (one layer, end of prefill, chunked prefill, decode) floors the layer
        budgets alike: a layer schedule keeps at least this many per head in every layer when it fits."""
        return torch.zeros_like(lengths, dtype=torch.long)

    def score(self, obs: Observation) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement score(obs)")

    def entry_scores(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:  # pragma: no cover - abstract
        """``[B, H_kv, T]`` (every kv head of the layer) scores of the entries of ``T`` tokens from the
        hidden states ``[B, T, hidden]`` entering layer ``layer_idx``'s attention (scorers that declare
        ``reads_hidden_states``)."""
        raise NotImplementedError(f"{type(self).__name__} declares reads_hidden_states but has no entry_scores")

    def entry_scored(self, obs: Observation) -> torch.Tensor:
        """``obs.entry_scores``, or a clear error when the integration did not record them."""
        if obs.entry_scores is None:
            raise ValueError(f"{type(self).__name__} scores each entry from the hidden state its token brought "
                             "(obs.entry_scores): run it through `with press(model)`, or fan-out with "
                             "capture_prefill(..., hidden_states=True)")
        return obs.entry_scores


class WindowScorer(Scorer):
    """A scorer whose last ``window`` prefill queries vote for the entries (SnapKV, CriticalKV): it reads
    those queries, needs a context at least that long, and always keeps the window. Each subclass
    declares the ``window`` field itself."""

    if TYPE_CHECKING:
        window: int

    def query_window(self) -> int:
        return self.window

    def min_context(self) -> int:
        return self.window

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.window)


@dataclass(frozen=True)
class PassChunk:
    """One model pass over a left-padded batch (what a :class:`PassScorer` asks the model to read).

    ``ids``/``mask``: ``[B, T]`` the pass's input (left padding False); ``scored``: ``[B, L]`` the
    context entries this pass scores; ``visible``: ``[B, L]`` the context entries its scoring
    softmax spans; ``whole_context``: whether ``visible`` is every valid context entry (the softmax is
    then the model's own attention's).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    scored: torch.Tensor
    visible: torch.Tensor
    whole_context: bool = False


class PassScorer(Scorer):
    """A scorer that runs inputs of its own through the model after the prefill (a model pass, e.g.
    KVzip's context reconstruction) and scores each context entry from what the pass measured.

    The integration runs :meth:`pass_chunks` through the model over the dense prefill cache; in each
    pass every layer's attention hands its post-RoPE queries and keys (and, when asked, values, the
    output projection weight, the pass tokens' hidden-state norms and log-sum-exps) to :meth:`pass_scores`;
    the per-layer maxima over the passes come back as ``obs.pass_scores``. Eviction then waits for the
    end of prefill. No prefill query is read (``query_window() == 0``); chunked prefill and decode
    compression are refused (the pass reads the whole context at once)."""

    needs_model_pass: ClassVar[bool] = True
    supports_chunked_prefill: ClassVar[bool] = False
    #: the passes add text to the context (a prompt): the integration needs the model's tokenizer; False: the
    #: passes re-read the context's own ids and ``pass_chunks`` is handed ``tokenizer=None``
    pass_reads_text: ClassVar[bool] = True
    #: the scores need the gradient of an objective w.r.t. each layer's attention output at the pass's tokens
    #: (KVgrad): the integration back-propagates through each pass (the model's weights frozen for it) and hands
    #: ``pass_scores`` the gradient's norm per pass token as ``output_grad_norm``
    pass_needs_gradients: ClassVar[bool] = False

    def query_window(self) -> int:
        return 0

    def measured(self, obs: Observation) -> torch.Tensor:
        """``obs.pass_scores``, or a clear error when the pass did not run."""
        if obs.pass_scores is None:
            raise ValueError(f"{type(self).__name__} scores come from its model pass (obs.pass_scores); run the "
                             "press through `with press(model)` or fan-out, which run that pass")
        return obs.pass_scores

    def pass_chunks(self, context_ids: torch.Tensor, key_mask: torch.Tensor,
                    tokenizer: Any) -> list[PassChunk]:  # pragma: no cover - abstract
        """The passes to run for a left-padded context ``context_ids [B, L]`` (``key_mask``: real tokens)."""
        raise NotImplementedError(f"{type(self).__name__} must implement pass_chunks")

    def pass_prompt_ids(self, tokenizer: Any) -> tuple[torch.Tensor, ...]:
        """Token ids of the text the passes add to the context (checked against the model's vocabulary
        when the press meets the model); none by default."""
        return ()

    def pass_reads_hidden_states(self) -> bool:
        """Whether :meth:`pass_scores` reads ``hidden_norm`` (recording it costs a hook per layer)."""
        return False

    def pass_scores(self, query: torch.Tensor, key: torch.Tensor, chunk: PassChunk, scaling: float,
                    value: torch.Tensor | None = None, output_weight: torch.Tensor | None = None,
                    hidden_norm: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                    lse_own: torch.Tensor | None = None,
                    output_grad_norm: torch.Tensor | None = None) -> torch.Tensor:  # pragma: no cover - abstract
        """``[B, H_kv, L]`` scores of one layer from one pass: ``query [B, H_q, T, D]`` the pass's
        queries, ``key``/``value`` ``[B, H_kv, L + T, D]`` (context then the pass's tokens),
        ``output_weight`` the layer's output projection weight, ``hidden_norm [B, T]``, ``lse [B, H_q, T]`` the
        pass attention's log-sum-exp when it spans exactly ``chunk.visible`` (else None), ``lse_own``
        the log-sum-exp over the pass's own tokens when the caller has it, ``output_grad_norm [B, T]`` the norm of
        the objective's gradient w.r.t. the layer's attention output at each pass token (scorers that declare
        ``pass_needs_gradients``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement pass_scores")


SCORERS = Registry("scorer", Scorer)


def register_scorer(name: str, aliases: Iterable[str] = (), override: bool = False):
    """Decorator making a user's ``Scorer`` subclass usable by ``name`` in configs and presets.

    ``aliases``: old names that still load (configs written with them); ``override=True`` replaces
    a scorer already registered under ``name`` (refused otherwise)."""
    return SCORERS.register(name, aliases=aliases, override=override)


def protect_last(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Give the last ``n`` positions ``+inf`` (they are always valid: padding is on the left)."""
    if n > 0:
        scores = scores.clone()
        scores[..., -n:] = float("inf")
    return scores


def protect_first_valid(scores: torch.Tensor, key_mask: torch.Tensor, n: int) -> torch.Tensor:
    """Give the first ``n`` non-padding positions of each row ``+inf`` (attention sinks)."""
    if n <= 0:
        return scores
    rank = key_mask.long().cumsum(-1)  # 1-based rank among valid tokens
    sink = key_mask & (rank <= n)
    return scores.masked_fill(sink[:, None, :], float("inf"))
