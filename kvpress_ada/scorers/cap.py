"""CapKV (Tang et al., 2026, "Rethinking KV Cache Eviction via a Unified Information-Theoretic Objective", arXiv
2604.25975): keep the entries that add the most to the information capacity ``log det(I + sum_i w_i v_i v_i^T)``
of the kept cache, scored by their ridge leverage, weighted by how well their keys align with the queries."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from ..observation import Observation
from .base import Scorer, protect_first_valid, register_scorer
from .expected_attention import rotate_to_future
from .statistics import ranks


@register_scorer("cap")
class CAP(Scorer):
    """Per query head: the anchor ``mu`` is the mean of the queries (the last ``window``; ``None``: every prefill
    query) outside the first ``sinks`` tokens, each rotated to the average of the next ``n_future`` positions;
    ``w_i = exp(tau (cos(mu, k_i) - max_j cos(mu, k_j)))``; ``A = I + sum_j (w_j + epsilon) v_j v_j^T``; score
    ``w_i v_i^T A^-1 v_i``, averaged over the kv head's query group. The first ``sinks`` tokens are protected and
    left out of every sum and maximum.

    As NVIDIA kvpress's ``CapPress`` (``kvpress/presses/cap_press.py``, 0.5.5: L2-normalised anchor and keys, the
    values as output directions, the future-RoPE average), which reads every prefill query as its query history;
    here a finite ``window`` is allowed too (decode compression then re-scores with the last ``window`` queries,
    refused without one). The anchor's rotation uses the post-RoPE queries and relative positions
    (:func:`~.expected_attention.rotate_to_future`), the same rotation kvpress builds from the pre-RoPE queries;
    ``v_i^T A^-1 v_i`` is ``||F^-1 v_i||^2`` with ``F`` the Cholesky factor of ``A`` (``A >= I``).

    Across heads: ``A``'s identity term has each head's value scale against it, and ``w`` is shifted by each
    head's own maximum, so raw scores are not compared.

    Chunked prefill: the anchor comes from the chunk's queries; kept entries are re-scored at every compression."""

    name: Literal["cap"] = "cap"
    tau: float = Field(5.0, gt=0.0, description="sharpness of the query-key alignment weights")
    n_future: int = Field(512, ge=1, description="future positions the anchor's rotation averages over")
    sinks: int = Field(4, ge=0, description="initial tokens always kept (and left out of the statistics)")
    epsilon: float = Field(1e-6, ge=0.0, description="added to every weight in the capacity matrix")
    window: int | None = Field(None, ge=1, description="trailing queries averaged into the anchor (None: all)")
    comparable_across_heads: ClassVar[bool] = False
    needs_rope: ClassVar[bool] = True

    def query_window(self) -> int | None:
        return self.window

    def min_context(self) -> int:
        return self.sinks + 1

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.sinks)

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.rope_inv_freq is None:
            raise ValueError("CAP needs the model's RoPE inverse frequencies (obs.rope_inv_freq)")
        B, H, L, D = obs.keys.shape
        G = obs.group_size
        q = obs.queries.float()
        w = q.shape[2]
        content = obs.key_mask & (ranks(obs.key_mask) >= self.sinks)  # [B, L]
        q = rotate_to_future(q, obs.rope_inv_freq.float().to(q.device), self.n_future)
        counted = content[:, L - w:].to(q.dtype)[:, None, :, None]  # queries sit where their keys do
        anchor = (q * counted).sum(2) / counted.sum(2).clamp(min=1.0)  # [B, H_q, D]
        anchor = F.normalize(anchor, dim=-1).view(B, H, G, D)
        stat = torch.einsum("bhgd,bhld->bhgl", anchor, F.normalize(obs.keys.float(), dim=-1)).clamp(-1.0, 1.0)
        logits = (self.tau * stat).masked_fill(~content[:, None, None, :], float("-inf"))
        weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True)).nan_to_num(0.0)  # [B, H, G, L]
        values = (obs.values.float() * content[:, None, :, None])[:, :, None]  # [B, H, 1, L, D], 0 off content
        weighted = values * (weights + self.epsilon * content[:, None, None, :])[..., None]
        capacity = torch.eye(D, device=values.device) + weighted.transpose(-1, -2) @ values  # [B, H, G, D, D]
        factor = torch.linalg.cholesky(capacity)  # A >= I: positive definite
        solved = torch.linalg.solve_triangular(factor, values.transpose(-1, -2), upper=False)  # L^-1 v_i
        leverage = solved.square().sum(dim=-2)  # v_i^T A^-1 v_i, [B, H, G, L]
        scores = (weights * leverage).mean(dim=2)
        return protect_first_valid(scores, obs.key_mask, self.sinks)
