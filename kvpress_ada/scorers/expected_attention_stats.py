"""Expected Attention with calibrated query statistics (Devoto et al., 2025, "Expected Attention: KV Cache Compression
by Estimating Attention from Future Queries Distribution", arXiv 2510.00636; NVIDIA kvpress's
``ExpectedAttentionStatsPress``): Expected Attention whose Gaussian model of the future queries comes from the
model's queries over offline text (:mod:`kvpress_ada.query_stats`) instead of the prompt's own queries.

Per layer and query head ``g``, with ``mu``/``Sigma`` the pre-RoPE queries' mean and covariance and ``R`` the RoPE
rotation averaged over the next ``n_future`` positions after the context (``T .. T + n_future - 1``)::

    logit_i = scaling * (R mu) . k_i + scaling^2 / 2 * k_i^T (R Sigma R^T) k_i

a softmax over the context's keys but the first ``sinks`` (kept, as kvpress leaves them out of the softmax), the mean
over the kv head's query group, times ``||v_i||`` (``use_vnorm``). No prompt query is read.

Positions: the statistics are pre-RoPE, so the keys' absolute RoPE positions matter; a row's first token is taken at
position 0 (the library's ``generate`` and transformers' ``generate`` give padded rows their positions from the
attention mask so), and under chunked prefill or decode compression its first held entry (one of the sinks kept)
and ``T`` one past its newest entry.

The statistics are made by ``kvpress-ada query-stats`` and shipped for the default model (``builtin:smollm2_135m``)
and ``qwen2.5-coder-0.5b`` (``builtin:qwen2_5_coder_0_5b``); another model is refused in one line naming that
command. Scores are not compared across heads (softmax shares of each head's own statistics, as Expected
Attention's).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from .. import query_stats
from ..observation import Observation
from .base import Scorer, register_scorer
from .expected_attention import gaussian_scores, rotate


@register_scorer("expected_attention_stats")
class ExpectedAttentionStats(Scorer):
    """Expected Attention from the query statistics in ``path`` (module docstring); the first ``sinks`` tokens
    are protected."""

    name: Literal["expected_attention_stats"] = "expected_attention_stats"
    path: str = Field(query_stats.SHIPPED, description="query statistics file (`kvpress-ada query-stats --out FILE`) "
                                                        "or builtin:NAME for one shipped with kvpress_ada")
    n_future: int = Field(512, ge=1, description="future positions the expectation averages over")
    sinks: int = Field(4, ge=0, description="initial tokens always kept (and left out of the softmax)")
    use_covariance: bool = True
    use_vnorm: bool = True
    comparable_across_heads: ClassVar[bool] = False
    needs_rope: ClassVar[bool] = True
    model_specific: ClassVar[bool] = True  # statistics of one model: refused for any other

    def query_window(self) -> int:
        return 0

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.sinks)

    def load_stats(self) -> query_stats.QueryStats:
        """The query statistics file's content (read once, cached)."""
        return query_stats.load(self.path)

    def check_model(self, config: Any) -> None:
        self.load_stats().check_model(config, source=f"query statistics {self.path!r}")

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.rope_inv_freq is None:
            raise ValueError("ExpectedAttentionStats needs the model's RoPE inverse frequencies (obs.rope_inv_freq)")
        mean_all, cov_all = self.load_stats().on(obs.keys.device)
        B, Hkv, L, D = obs.keys.shape
        G = obs.group_size
        start = obs.global_head_offset * G
        if obs.layer_idx >= mean_all.shape[0] or mean_all.shape[-1] != D or start + Hkv * G > mean_all.shape[1]:
            raise ValueError(f"query statistics {self.path!r} were measured on another model (layer {obs.layer_idx}, "
                             f"{start + Hkv * G} query heads of dimension {D} here): make this model's with "
                             "`kvpress-ada query-stats`")
        position, valid = rope_positions(obs)  # [B, H_kv, L]
        nxt = position.masked_fill(~valid, -1).amax(dim=(1, 2)) + 1  # [B]: the next token's position
        ahead = (nxt[:, None] + torch.arange(self.n_future, device=nxt.device)).float()  # [B, n_future]
        angle = ahead[..., None] * obs.rope_inv_freq.float().to(obs.keys.device)  # [B, n_future, D / 2]
        cos = torch.cat([angle.cos().mean(1)] * 2, dim=-1)[:, None, None, :]  # [B, 1, 1, D]: R's average
        sin = torch.cat([angle.sin().mean(1)] * 2, dim=-1)[:, None, None, :]
        mean = mean_all[obs.layer_idx, start:start + Hkv * G].view(1, Hkv, G, D)
        mean = rotate(mean, cos, sin)  # [B, H_kv, G, D]: R mu
        cov = None
        if self.use_covariance:
            sigma = cov_all[obs.layer_idx, start:start + Hkv * G].view(1, Hkv, G, D, D)
            half = rotate(sigma, cos[..., None, :], sin[..., None, :])  # Sigma R^T (R on each row)
            cov = rotate(half.transpose(-1, -2), cos[..., None, :], sin[..., None, :]).transpose(-1, -2)
        sink = valid & (position < self.sinks)
        scores = gaussian_scores(mean, cov, obs.keys.float(), obs.values, valid & ~sink, obs.scaling, self.use_vnorm)
        return scores.nan_to_num(0.0).masked_fill(sink, float("inf"))


def rope_positions(obs: Observation) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position [B, H_kv, L] long, valid [B, H_kv, L])``: each entry's RoPE position, a row's first token at 0
    (its rank among the row's valid entries; with ``obs.positions``, its index less the row's first held one)."""
    B, H, L = obs.keys.shape[:3]
    valid = obs.key_mask[:, None, :].expand(B, H, L)
    if obs.positions is None:
        rank = obs.key_mask.long().cumsum(-1) - 1
        return rank[:, None, :].expand(B, H, L), valid
    pos = obs.positions.long()
    first = pos.masked_fill(~valid, torch.iinfo(torch.long).max).amin(dim=(1, 2), keepdim=True)
    return (pos - first).masked_fill(~valid, 0), valid

