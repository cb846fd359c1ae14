"""Quality signals beyond accuracy.

* Eviction loss (Ada-KV, Feng et al. 2025, Fig. 2 / Thm. 1): L1 distance between the attention
  outputs of the observation-window queries over the full cache and over the kept entries only,
  per layer (mean over batch, query heads and window queries).
* Fidelity: KL(full || compressed) and top-1 agreement of next-token distributions over a
  teacher-forced continuation, plus the per-layer relative error of hidden states.
"""

from __future__ import annotations

import torch

from kvpress_ada.hosts.transformers.fanout import Prefill


def _window_output(q, keys, values, visible, scaling):
    B, Hq, w, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    logits = torch.matmul(q.reshape(B, Hkv, G * w, D).float(), keys.float().transpose(-1, -2)) * scaling
    logits = logits.view(B, Hkv, G, w, -1).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = torch.matmul(probs.view(B, Hkv, G * w, -1), values.float())
    return out.view(B, Hkv, G, w, D)


@torch.inference_mode()
def eviction_loss(prefill: Prefill, keep_masks: list[torch.Tensor], window: int = 64) -> torch.Tensor:
    """Per-layer L1 eviction loss ``[n_layers]`` for the last ``window`` context queries."""
    losses = []
    for capture, keep in zip(prefill.layers, keep_masks):
        L = capture.keys.shape[2]
        w = min(window, L)
        q = capture.queries[:, :, -w:]
        q_pos = torch.arange(L - w, L, device=q.device)
        causal = torch.arange(L, device=q.device)[None, :] <= q_pos[:, None]
        visible = causal[None, None, None] & prefill.key_mask[:, None, None, None, :]
        full = _window_output(q, capture.keys, capture.values, visible, capture.scaling)
        kept = _window_output(q, capture.keys, capture.values, visible & keep[:, :, None, None, :], capture.scaling)
        losses.append((full - kept).abs().sum(-1).mean())
    return torch.stack(losses)


def fidelity(full_logits: torch.Tensor, logits: torch.Tensor, full_hidden, hidden) -> dict:
    """KL(full || compressed) (nats, mean over positions), top-1 agreement, per-layer hidden error."""
    log_p = torch.log_softmax(full_logits.float(), dim=-1)
    log_q = torch.log_softmax(logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    top1 = (full_logits.argmax(-1) == logits.argmax(-1)).float().mean()
    per_layer = [float(((a - b).norm(dim=-1) / a.norm(dim=-1).clamp(min=1e-6)).mean())
                 for a, b in zip(full_hidden[1:], hidden[1:])]
    return {"kl": float(kl), "top1": float(top1), "hidden_error": per_layer}
