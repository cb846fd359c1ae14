"""Which parts of the int8 / int4 record machinery e4m3 (fp8) records need: KL(full || stored) of teacher-forced
next-token distributions on tiny random models (head dim 64) when each (layer, kv head) row's entries are stored
through a scheme: a 256-token context stored at once, then 64 decoded tokens, each stored once it leaves the
residual window (the rest of the cache path is exact). Schemes: integers (asymmetric, groups of 32) or e4m3
(scale = max|x| / 448, per head or per group of 32), with or without the machinery (key centring by the row's
mean, the Hadamard rotation, the row's first entry exact) and a residual of 32 exact newest entries.

    OMP_NUM_THREADS=1 python benchmarks/fp8_scheme_choice.py     # about 10 minutes on 2 cores

Three models: plain Llama; Qwen2 with a large per-channel key offset and an outlier channel (k_proj bias); Llama
with two k_proj rows scaled up (outlier channels varying per token). Measured (KL mean): e4m3 per head plain
1.4e-6 / 4.1e-6 / 1.8e-6; with centring + rotation + anchor 1.4e-6 / 4.4e-6 / 1.8e-6; groups of 32 1.2e-6 /
3.2e-6 / 1.7e-6; a residual of 32 1.2e-6 / 3.5e-6 / 1.4e-6; int8 5.0e-8 / 1.3e-7 / 5.5e-8; int4 1.3e-5 / 3.3e-5 /
1.4e-5. So kvpress_ada's fp8 kind stores keys as they are, one scale per head, residual 0 by default.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import build_model  # noqa: E402


def hadamard(D: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < D:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    g = torch.Generator().manual_seed(0)
    s = torch.where(torch.rand(D, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    return (s[:, None] * h / D ** 0.5).float()


def fp8(x: torch.Tensor, group: int | None) -> torch.Tensor:
    *lead, D = x.shape
    g = D if group is None else group
    xg = x.reshape(*lead, D // g, g)
    s = (xg.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-30)
    return ((xg / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).reshape(x.shape)


def ints(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    *lead, D = x.shape
    xg = x.reshape(*lead, D // group, group)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    s = ((hi - lo) / (2 ** bits - 1)).clamp(min=1e-30)
    return (((xg - lo) / s).round().clamp(0, 2 ** bits - 1) * s + lo).reshape(x.shape)


def scheme(kind, group, machinery: bool, residual: int, rotate: bool = True, centre: bool = True):
    """``store(keys, values, centre)`` of ``[B, H, L, D]`` entries (the row's first entry is the anchor)."""
    def store(k, v, fixed=None):
        D = k.shape[-1]
        q = (lambda x: fp8(x, group)) if kind == "fp8" else (lambda x: ints(x, kind, group))
        if not machinery:
            return q(k), q(v)
        c = (k[..., 1:, :].mean(-2, keepdim=True) if fixed is None else fixed) * centre
        R = hadamard(D) if rotate else torch.eye(D)
        kq, vq = q((k - c) @ R) @ R.T + c, q(v)
        kq[..., 0, :], vq[..., 0, :] = k[..., 0, :], v[..., 0, :]
        return kq, vq
    store.residual = residual
    return store


def run(model, ids, n_ctx, store=None):
    with torch.no_grad():
        cache = model(ids[:, :n_ctx], use_cache=True).past_key_values
        if store is None:
            return model(ids[:, n_ctx:], past_key_values=cache).logits.float()
        R = store.residual
        for layer in cache.layers:
            L = layer.keys.shape[-2]
            k, v = store(layer.keys, layer.values)
            layer.keys[..., :L - R, :], layer.values[..., :L - R, :] = k[..., :L - R, :], v[..., :L - R, :]
        centres = [layer.keys[..., 1:n_ctx, :].mean(-2, keepdim=True) for layer in cache.layers]
        logits = []
        for t in range(n_ctx, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], past_key_values=cache).logits.float())
            for layer, c in zip(cache.layers, centres):  # the entry leaving the residual window is stored
                at = layer.keys.shape[-2] - 1 - R
                both = [torch.cat((x[..., :1, :], x[..., at:at + 1, :]), -2) for x in (layer.keys, layer.values)]
                k, v = store(*both, fixed=c)
                layer.keys[..., at:at + 1, :], layer.values[..., at:at + 1, :] = k[..., 1:, :], v[..., 1:, :]
        return torch.cat(logits, 1)


def models() -> dict:
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                 intermediate_size=512, max_position_embeddings=2048)
    out = {"llama": build_model("llama", **shape)}
    offset = build_model("qwen2", **shape)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in offset.model.layers:
            bias = layer.self_attn.k_proj.bias.view(2, 64)
            bias.copy_(torch.randn(2, 64, generator=g) * 3)
            bias[:, 5] += 25.0
    out["qwen2 key offset"] = offset
    outlier = build_model("llama", seed=2, **shape)
    with torch.no_grad():
        for layer in outlier.model.layers:
            w = layer.self_attn.k_proj.weight.view(2, 64, -1)
            w[:, 3] *= 15.0
            w[:, 40] *= 8.0
    out["llama outlier channels"] = outlier
    return out


def main() -> None:
    torch.set_num_threads(1)
    schemes = {
        "int8 g32 (centre+rot+anchor)": scheme(8, 32, True, 0),
        "int4 g32 (centre+rot+anchor)": scheme(4, 32, True, 0),
        "int4 g32 (centre+rot+anchor) +res32": scheme(4, 32, True, 32),
        "fp8 per head plain": scheme("fp8", None, False, 0),
        "fp8 g32 plain": scheme("fp8", 32, False, 0),
        "fp8 per head plain +res32": scheme("fp8", None, False, 32),
        "fp8 per head centre+rot+anchor": scheme("fp8", None, True, 0),
        "fp8 g32 centre+rot+anchor": scheme("fp8", 32, True, 0),
        "fp8 per head centre+anchor": scheme("fp8", None, True, 0, rotate=False),
        "fp8 per head anchor only": scheme("fp8", None, True, 0, rotate=False, centre=False),
    }
    ids = torch.randint(5, 120, (2, 320), generator=torch.Generator().manual_seed(3))
    for name, model in models().items():
        ref = run(model, ids, 256)
        p = ref.log_softmax(-1)
        print(f"== {name}")
        for label, store in schemes.items():
            got = run(model, ids, 256, store)
            kl = (p.exp() * (p - got.log_softmax(-1))).sum(-1)
            print(f"{label:40s} KL mean {kl.mean():.2e} max {kl.max():.2e} max|dlogit| {(got - ref).abs().max():.2e}")


if __name__ == "__main__":
    main()
