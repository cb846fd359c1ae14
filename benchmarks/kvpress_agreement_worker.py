"""The NVIDIA-kvpress half of ``benchmarks/kvpress_agreement.py``; runs inside the kvpress virtualenv.

Never imports ``kvpress_ada``. Reads one JSON request on stdin: ``model`` (a saved tiny model's folder) and
``cases``, each with ``label``, ``press`` (a kvpress class name), ``kwargs`` (a value ``{"press": name, "kwargs":
{...}}`` is a nested press, e.g. ChunkKVPress's, and so is each item of a list of them, ComposedPress's), ``ids``,
and what is handed to kvpress instead of what it would draw or download (the presses are built and handed it by
``benchmarks/kvpress_presses.py``, shared with ``benchmarks/kvpress_worker.py``):

- ``sketch``: a ``[D, k]`` Gaussian sketch, the matrix ``LeverageScorePress`` draws at random;
- ``q_filters``: ``[layers, kv heads, D]``, set on every ``QFilterPress``;
- ``gates``: per layer ``{name: nested list}``, Fast KVzip gate weights in kvpress's ``FastKVzipGate`` layout;
- ``duo``: ``sink``, ``recent``, ``scores [layers, kv heads]``: DuoAttention's head patterns;
- ``curve``: LU-KV's prune ratios ``[99, layers, kv heads]``;
- ``query_stats``: ``mean`` and ``cov``, ExpectedAttentionStatsPress's query statistics;
- ``attrs``: attributes set on the top press once built (FinchPress's ``window_size``, a ``delimiter_token_id``
  absent from the ids);

and how to run and read it: ``eager`` (eager attention, for a press reading the attention weights), ``rerotated``
(the press re-rotates the keys it keeps), ``hook`` (the press whose ``score`` decides, ``""`` the top one: its top-k
names the kept positions where the cache alone cannot tell which of a repeated token's re-rotated keys it holds),
``tensors`` (``keys`` / ``values``: return them too). Writes one JSON reply on stdout: versions, the names of
kvpress's presses and, per case, what its cache holds after the prefill: the kept positions per (layer, kv head)
and, when asked, the kept keys or values in position order (float32, base64).

Positions are read back without hooks into the presses (but ``hook``): a press that masks (``masked_key_indices``:
DuoAttention, Fast KVzip, ...) keeps every position it does not mask; a press that gathers keeps the dense
prefill's entries whose key each cached row holds (unchanged, zeroed in some channels (ThinK) or re-rotated to the
row's index (key re-rotation); merging changes values only), matched to one dense position each to 1e-4.

Usage (by the driver): ``<kvpress-venv>/bin/python benchmarks/kvpress_agreement_worker.py < request.json``.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from contextlib import contextmanager

PROTO = sys.stdout
sys.stdout = sys.stderr  # library prints must never corrupt the reply

import kvpress  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from kvpress.presses.leverage_press import LeverageScorePress  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402
from kvpress_presses import build, hand_over  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402


@contextmanager
def fixed_sketch(sketch: list | None):
    """``LeverageScorePress.compute_leverage_scores`` with ``torch.randn``'s ``[B, H, D, k]`` draw replaced by
    ``sketch * sqrt(k)`` (kvpress then scales it by ``1/sqrt(k)``) for the duration."""
    if sketch is None:
        yield
        return
    phi = torch.tensor(sketch, dtype=torch.float32)
    original = LeverageScorePress.compute_leverage_scores

    def compute(key_states, sketch_dimension):
        real = torch.randn

        def draw(*shape, device=None, dtype=None, **_):
            B, H, d, k = shape
            assert (d, k) == tuple(phi.shape), (shape, phi.shape)
            return (phi * math.sqrt(k)).to(device=device, dtype=dtype).expand(B, H, d, k)

        torch.randn = draw
        try:
            return original(key_states, sketch_dimension)
        finally:
            torch.randn = real

    LeverageScorePress.compute_leverage_scores = staticmethod(compute)
    try:
        yield
    finally:
        LeverageScorePress.compute_leverage_scores = staticmethod(original)


def rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE (transformers' ``rotate_half`` layout) of ``x [..., D]`` moved by ``delta [...]`` positions."""
    angle = delta.double()[..., None] * inv_freq.double()
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    half = x.shape[-1] // 2
    return (x.double() * cos + torch.cat([-x[..., half:], x[..., :half]], -1).double() * sin).float()


def candidates(keys: torch.Tensor, dense_k: torch.Tensor, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """``[n, L]`` bool: the dense positions (``dense_k [L, D]``) whose key each cached row (``keys [n, D]``) of one
    (layer, kv head) holds, to 1e-4 of the largest key: as is or zeroed where the cached key is zero (ThinK), or, with
    ``inv_freq``, re-rotated to the row's index (key re-rotation)."""
    n = keys.shape[0]
    forms = [dense_k[None], dense_k[None] * (keys != 0)[:, None, :]]
    if inv_freq is not None:
        rows = torch.arange(n)[:, None].expand(n, dense_k.shape[0])
        forms = [rotate(dense_k[None].expand(n, -1, -1), rows - torch.arange(dense_k.shape[0])[None], inv_freq)]
    d_key = torch.stack([(keys[:, None] - form).norm(dim=-1) for form in forms]).amin(0)
    return d_key <= 1e-4 * dense_k.norm(dim=-1).max()


def match(close: torch.Tensor, chosen: list[int] | None) -> list[int]:
    """The dense position each cached row holds, from ``candidates`` ``close [n, L]``: its only candidate, or, where a
    row has several (the same token's re-rotated keys in the first layer are one key), the position ``chosen``
    (kvpress's own top-k of its scores, rows in position order) after checking that it is a candidate."""
    n = close.shape[0]
    assert bool(close.any(-1).all()), f"{int((~close.any(-1)).sum())} cached rows match no dense entry"
    if chosen is not None:
        assert len(chosen) == n and all(bool(close[m, p]) for m, p in enumerate(chosen)), \
            "the press's top-k scores are not what its cache holds"
        return chosen
    assert bool((close.sum(-1) == 1).all()), "a cached row matches several dense entries: hook the press's scores"
    found = close.long().argmax(-1).tolist()
    assert len(set(found)) == n, "two cached rows hold one dense entry"
    return found


def pack(t: torch.Tensor) -> str:
    return base64.b64encode(t.float().contiguous().numpy().tobytes()).decode()


@torch.inference_mode()
def dense(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = DynamicCache()
    model.model(input_ids=ids, past_key_values=cache)
    return [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]


@torch.inference_mode()
def kept(model, case: dict, full: list) -> dict:
    press = build(case["press"], case["kwargs"])
    hand_over(press, case, model)
    layers = model.model.layers
    for layer in layers:
        layer.self_attn.masked_key_indices = None
    ids = torch.tensor([case["ids"]])
    L = ids.shape[1]
    scores: dict[int, torch.Tensor] = {}
    if case.get("hook") is not None:  # the press whose scores decide (its top-k, rows in position order)
        target = press if case["hook"] == "" else getattr(press, case["hook"])
        original = target.score

        def score(module, *args, **kwargs):
            s = original(module, *args, **kwargs)
            scores[module.layer_idx] = s.detach().float().clone()
            return s

        target.score = score
    cache = DynamicCache()
    with fixed_sketch(case.get("sketch")), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    inv_freq = model.model.rotary_emb.inv_freq.float() if case.get("rerotated") else None
    out: dict = {"kept": [], **{name: [] for name in case.get("tensors") or ()}}
    for i, layer in enumerate(layers):
        keys, values = cache.layers[i].keys[0], cache.layers[i].values[0]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        per_head = []
        for name in case.get("tensors") or ():
            out[name].append([])
        for h in range(keys.shape[0]):
            if masked is not None:
                assert keys.shape[1] == L, "a masking press that also gathers"
                drop = set(masked[2][masked[1] == h].tolist())
                order = [j for j in range(L) if j not in drop]
                rows = order
            else:
                chosen = None
                if scores:
                    top = scores[i][0, h].topk(compute_n_kept(L, press.compression_ratio)).indices
                    chosen = sorted(top.tolist())
                found = match(candidates(keys[h], full[i][0][h], inv_freq), chosen)
                order = sorted(found)
                rows = [found.index(j) for j in order]
            per_head.append(order)
            for name in case.get("tensors") or ():
                t = keys if name == "keys" else values
                out[name][-1].append(pack(t[h, rows]))
        out["kept"].append(per_head)
    return out


def main() -> None:
    request = json.load(sys.stdin)
    torch.manual_seed(0)
    models = {}
    reply: dict = {"versions": {"kvpress": __import__("importlib.metadata").metadata.version("kvpress"),
                                "transformers": transformers.__version__, "torch": torch.__version__},
                   "presses": sorted(name for name, obj in vars(kvpress).items()
                                     if isinstance(obj, type) and issubclass(obj, kvpress.BasePress)),
                   "cases": {}}
    for case in request["cases"]:
        attn = "eager" if case.get("eager") else "sdpa"
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(request["model"], dtype=torch.float32,
                                                                attn_implementation=attn).eval()
        model = models[attn]
        ids = torch.tensor([case["ids"]])
        try:
            reply["cases"][case["label"]] = kept(model, case, dense(model, ids))
        except AssertionError as err:
            raise AssertionError(f"case {case['label']}: {err}") from err
    PROTO.write(json.dumps(reply) + "\n")
    PROTO.flush()


if __name__ == "__main__":
    main()
