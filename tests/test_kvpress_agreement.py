"""The ``*~kvpress`` replicas (benchmarks/kvpress_compare.py) select exactly the tokens NVIDIA kvpress
selects (the benchmark's kept-set Jaccard 1.000), checked on a tiny model whenever kvpress is importable.

kvpress 0.5.5 pins ``transformers<5.3``, so this is skipped in the main environment; run it in an
environment holding both (``pip install kvpress==0.5.5`` next to this package). kvpress's side follows
``benchmarks/kvpress_worker.py`` (the same hooks on ``score``, the same kept-set recovery).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_model

kvpress = pytest.importorskip("kvpress")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

RATIO = 0.5
L = 100  # > SnapKV's window + 1 (the replica's min_context)
# replica label -> kvpress press built like kvpress_worker.build_press
REPLICAS = ("snapkv~kvpress", "ada_snapkv~kvpress", "pyramidkv~kvpress", "expected_attention~kvpress",
            "ada_expected_attention~kvpress")


@functools.lru_cache(maxsize=1)
def _entries():
    import kvpress_compare  # registers the replica components once per process

    methods = sorted({kvpress_compare.DIAGNOSTICS[label][0] for label in REPLICAS})
    entries = kvpress_compare.diagnostic_entries([RATIO], methods)
    return {e.label: e.press for e in entries}, kvpress_compare.DIAGNOSTICS


def _kvpress_press(method: str):
    from kvpress import AdaKVPress, ExpectedAttentionPress, PyramidKVPress, SnapKVPress

    return {
        "snapkv": lambda: SnapKVPress(compression_ratio=RATIO),
        "ada_snapkv": lambda: AdaKVPress(SnapKVPress(compression_ratio=RATIO), alpha_safeguard=0.2),
        "pyramidkv": lambda: PyramidKVPress(compression_ratio=RATIO),
        "expected_attention": lambda: ExpectedAttentionPress(compression_ratio=RATIO),
        "ada_expected_attention": lambda: AdaKVPress(ExpectedAttentionPress(compression_ratio=RATIO),
                                                     alpha_safeguard=0.2),
    }[method]()


@torch.inference_mode()
def _kvpress_kept(model, press, ids) -> torch.Tensor:
    """Bool ``[layers, kv_heads, L]``: what kvpress keeps (kvpress_worker.Worker._prefill + _kept)."""
    from kvpress import AdaKVPress, PyramidKVPress
    from kvpress.utils import compute_n_kept
    from transformers import DynamicCache

    cache = DynamicCache()
    scores: dict[int, torch.Tensor] = {}
    inner = press.press if isinstance(press, AdaKVPress) else press
    original = inner.score

    def score(module, *args, **kwargs):
        s = original(module, *args, **kwargs)
        scores[module.layer_idx] = s.detach().clone()  # AdaKVPress scatters into s afterwards
        return s

    inner.score = score
    with press(model):
        model.model(input_ids=ids, past_key_values=cache)
    length = ids.shape[1]
    keeps = []
    for i, layer in enumerate(model.model.layers):
        module = layer.self_attn
        s = scores[i][0]
        keep = torch.zeros_like(s, dtype=torch.bool)
        if isinstance(press, AdaKVPress):
            keep.fill_(True)
            _, heads, pos = module.masked_key_indices
            keep[heads, pos] = False
        else:
            n_kept = press.get_layer_budget(module, length) if isinstance(press, PyramidKVPress) \
                else compute_n_kept(length, press.compression_ratio)
            keep.scatter_(-1, s.topk(n_kept, dim=-1).indices, True)
        keeps.append(keep)
    return torch.stack(keeps)


@pytest.mark.parametrize("label", REPLICAS)
def test_replica_keeps_what_kvpress_keeps(label):
    from kvpress_ada.hosts.transformers.fanout import capture_prefill

    presses, diagnostics = _entries()
    model = build_model("llama", seed=1)
    ids = torch.randint(5, 120, (1, L), generator=torch.Generator().manual_seed(0))
    theirs = _kvpress_kept(model, _kvpress_press(diagnostics[label][0]), ids)
    with torch.inference_mode():
        prefill = capture_prefill(model, ids)
        ours = torch.stack([m[0] for m in prefill.keep_masks(presses[label])]).cpu()
    assert ours.shape == theirs.shape
    inter = (ours & theirs).sum(-1).double()
    union = (ours | theirs).sum(-1).double().clamp(min=1)
    jaccard = float((inter / union).mean())
    assert jaccard >= 0.999, (label, jaccard)
    assert torch.equal(ours.sum(-1), theirs.sum(-1))
