"""DuoAttention (Xiao et al., ICLR 2025, arXiv 2410.10819): retrieval heads keep the whole context, streaming heads
only their attention sinks and recent tokens, the heads chosen once per model from measured head patterns."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from .. import calibration
from ..observation import Observation
from .base import Scorer, register_scorer

#: the default model's head patterns (``kvpress-ada calibrate --method duo``), shipped with the package
SHIPPED_DUO = "builtin:smollm2_135m_duo"
#: score of an entry a streaming head may drop (below any threshold >= 0; more recent entries score higher)
_DROPPABLE = -1.0


@register_scorer("duo_attention")
class DuoAttention(Scorer):
    """The ``head_ratio`` share of the model's (layer, kv head) pairs whose patterns (a calibration of
    ``kvpress-ada calibrate --method duo``: how far a head's attention output moves when it attends only to its
    sinks and recent entries) are lowest become streaming heads: their first ``sinks`` and last ``recent`` valid
    entries are protected (``+inf``), the others score ``-1 - (valid entries after them)``; every entry of a
    retrieval head is protected. With the ``duo_attention`` preset's ``Threshold(tau=0)`` streaming heads keep
    exactly their sinks and recent entries (the rest leaves memory) and retrieval heads everything; under chunked
    prefill or decode compaction a streaming head stays at that size, as in DuoAttention's decoding.

    ``path``: the patterns (default: the shipped ones of the default model; another model is refused in one
    line naming the command that measures its own); ``sinks``/``recent`` ``None``: the values the patterns were
    measured with. kvpress downloads the patterns trained by the authors (six 7-8B models) and masks the
    streaming heads' entries without freeing them; the shipped patterns are measured, not trained
    (:mod:`kvpress_ada.harness.duo`)."""

    name: Literal["duo_attention"] = "duo_attention"
    path: str = Field(SHIPPED_DUO, description="head patterns (`kvpress-ada calibrate --method duo --out FILE`) or "
                                               "builtin:NAME for ones shipped with kvpress_ada")
    head_ratio: float = Field(0.5, ge=0.0, le=1.0, description="share of the (layer, kv head) pairs made streaming")
    sinks: int | None = Field(None, ge=0, description="initial entries a streaming head keeps (None: the patterns')")
    recent: int | None = Field(None, ge=0, description="recent entries a streaming head keeps (None: the patterns')")

    model_specific: ClassVar[bool] = True  # the patterns belong to the model they were measured on

    def query_window(self) -> int:
        return 0

    def patterns(self) -> calibration.Calibration:
        """The head patterns (read once, cached), refused in one line when not DuoAttention's."""
        cal = calibration.load(self.path)
        if cal.scorer.get("name") != "duo_attention":
            raise calibration.CalibrationError(
                f"calibration {self.path!r} holds {cal.scorer.get('name')!r} budget shares, not DuoAttention's head "
                "patterns: run `kvpress-ada calibrate --method duo --out duo.json` and use "
                "DuoAttention(path='duo.json')")
        return cal

    def window(self) -> tuple[int, int]:
        """``(sinks, recent)`` a streaming head keeps."""
        measured = self.patterns().scorer
        sinks = self.sinks if self.sinks is not None else int(measured["sinks"])
        recent = self.recent if self.recent is not None else int(measured["recent"])
        return sinks, recent

    def check_model(self, config: Any) -> None:
        try:
            self.patterns().check_model(config, source=f"DuoAttention patterns {self.path!r}")
        except calibration.CalibrationError as err:
            if "not for" not in str(err):
                raise
            raise calibration.CalibrationError(
                f"{str(err).split('; ')[0]}; measure this model's with `kvpress-ada calibrate --method duo --model "
                "<that model> --out duo.json` and use DuoAttention(path='duo.json')") from None

    def streaming(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[n_layers, n_kv_heads]`` bool: the streaming heads (the ``head_ratio`` share with the lowest patterns,
        ties to the lower (layer, head) index)."""
        self.patterns()  # DuoAttention's, or refused
        shares = calibration.shares_tensor(self.path, device)
        order = torch.sort(shares.flatten(), stable=True).indices
        mask = torch.zeros(shares.numel(), dtype=torch.bool, device=device)
        mask[order[:round(shares.numel() * self.head_ratio)]] = True
        return mask.view_as(shares)

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        sinks, recent = self.window()
        return lengths.long().clamp(max=sinks + recent)

    def score(self, obs: Observation) -> torch.Tensor:
        B, H, L = obs.keys.shape[:3]
        streaming = self.streaming(obs.keys.device)
        first = obs.global_head_offset
        if not 0 <= obs.layer_idx < streaming.shape[0] or first + H > streaming.shape[1]:
            raise calibration.CalibrationError(
                f"DuoAttention patterns {self.path!r} cover {streaming.shape[0]} layers x {streaming.shape[1]} kv "
                f"heads, not layer {obs.layer_idx}'s kv heads {first}..{first + H - 1}: measure this model's with "
                "`kvpress-ada calibrate --method duo`")
        heads = streaming[obs.layer_idx, first:first + H]  # [H]
        sinks, recent = self.window()
        rank = obs.key_mask.long().cumsum(-1)  # 1-based among the valid entries
        after = obs.key_mask.sum(-1, keepdim=True) - rank  # valid entries after this one
        window = (rank <= sinks) | (after < recent)  # [B, L]
        keep = window[:, None, :] | ~heads[None, :, None]
        return torch.where(keep, float("inf"), _DROPPABLE - after.float()[:, None, :]).expand(B, H, L).clone()
