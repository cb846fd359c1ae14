"""torch.compile(fullgraph=True): one layer's score -> allocate -> select compiles with no graph break."""

import pytest
import torch

from kvpress_ada import Observation, preset


def _inputs(B=2, Hkv=2, G=2, L=96, D=16, w=64):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(B, Hkv, L, D, generator=g)
    values = torch.randn(B, Hkv, L, D, generator=g)
    queries = torch.randn(B, Hkv * G, w, D, generator=g)
    key_mask = torch.ones(B, L, dtype=torch.bool)
    key_mask[1, :10] = False
    return keys, values, queries, key_mask


@pytest.mark.parametrize("name", ["ada_snapkv", "ada_pyramidkv"])
def test_score_allocate_select_compiles_without_graph_breaks(name):
    press = preset(name, compression_ratio=0.6)

    def step(keys, values, queries, key_mask):
        obs = Observation(keys=keys, values=values, queries=queries, key_mask=key_mask, layer_idx=1, n_layers=4,
                          scaling=0.25)
        return press.select(obs)

    args = _inputs()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    assert torch.equal(compiled(*args), step(*args))
