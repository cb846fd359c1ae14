"""Threshold budgets (``Threshold(tau, floor)``): every entry scored at least ``tau`` is kept, plus each
head's floor, capped by the pipeline's budget when it has one."""

import pytest
import torch
from conftest import build_model, generate_ragged_and_mask
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvpress_ada import AdaLayer, KNorm, Observation, Pipeline, SnapKV, Threshold
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import output_cache

torch.set_num_threads(1)


def _obs(scores: torch.Tensor, key_mask: torch.Tensor) -> Observation:
    B, H, L = scores.shape
    return Observation(keys=scores[..., None].expand(B, H, L, 4).contiguous(), values=torch.zeros(B, H, L, 4),
                       queries=torch.zeros(B, H, 0, 4), key_mask=key_mask, layer_idx=0, n_layers=1, scaling=1.0)


class Given(SnapKV):
    """Scores read from the keys' first coordinate (a test scorer)."""

    def query_window(self) -> int:
        return 0

    def score(self, obs):
        return obs.keys[..., 0]


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 3), L=st.integers(1, 12), tau=st.integers(-4, 4),
       floor=st.integers(0, 5), pad=st.integers(0, 4), seed=st.integers(0, 99),
       cap=st.one_of(st.none(), st.integers(1, 8)))
def test_keeps_exactly_what_clears_tau_plus_the_floor_up_to_the_cap(B, H, L, tau, floor, pad, seed, cap):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(-8, 9, (B, H, L), generator=gen).float() / 2  # a grid: no near-ties at tau
    key_mask = torch.ones(B, L, dtype=torch.bool)
    key_mask[0, :min(pad, L - 1)] = False
    press = Pipeline(scorer=Given(), allocator=Threshold(tau=tau, floor=floor), budget=cap)
    keep = press.select(_obs(scores, key_mask))
    valid = key_mask[:, None, :].expand(B, H, L)
    assert not bool((keep & ~valid).any())
    for b in range(B):
        n_valid = int(key_mask[b].sum())
        limit = n_valid if cap is None else min(cap, n_valid)
        for h in range(H):
            s = scores[b, h][key_mask[b]]
            kept = s[keep[b, h][key_mask[b]]]
            above = int((s >= tau).sum())
            want = min(max(above, min(floor, n_valid)), limit)
            assert int(kept.numel()) == want
            # the kept entries are the head's best: all of those clearing tau when they fit
            if kept.numel():
                assert float(kept.min()) >= float(s.sort(descending=True).values[want - 1])
            if want == above:
                assert bool((kept >= tau).all())


def test_threshold_needs_no_budget_and_refuses_model_scope():
    press = Pipeline(scorer=SnapKV(), allocator=Threshold(tau=0.1))
    assert press.compresses_prefill and not press.is_noop
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    with pytest.raises(ValidationError, match="uniform layer schedule"):
        Pipeline(scorer=SnapKV(), allocator=Threshold(tau=0.1), layers=AdaLayer())
    with pytest.raises(ValidationError, match="tau"):
        Pipeline(scorer=SnapKV(), allocator={"name": "threshold"})


def test_threshold_press_is_ragged_and_mask_agrees():
    model = build_model("llama", seed=2)
    ids = torch.randint(4, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    keys = capture_prefill(model, ids).layers[0].keys
    tau = float(-keys.norm(dim=-1).median())  # KNorm scores -||k||: about half of layer 0 clears it
    press = Pipeline(scorer=KNorm(), allocator=Threshold(tau=tau, floor=2))
    with torch.no_grad(), press(model):
        cache = output_cache(model(input_ids=ids, use_cache=True))
    lengths = torch.stack([cache.head_lengths(i) for i in range(len(cache.layers))])
    assert len(set(lengths.flatten().tolist())) > 1  # ragged per row, head and layer
    assert int(lengths.min()) >= 2 and int(lengths.max()) <= 40
    assert torch.equal(*generate_ragged_and_mask(model, press, ids))


def test_eval_records_the_achieved_ratio(tokenizer):
    from kvpress_ada.harness.eval import Sample
    from kvpress_ada.harness.eval.runner import Entry, evaluate

    model = build_model("qwen2", seed=4)
    sample = Sample(context="The pass key is 4821. " + "Blue doors and seven gates. " * 5, question="Pass key?",
                    answers=["4821"], task="passkey", metric="string_match_all")
    prefill = capture_prefill(model, torch.tensor([tokenizer(sample.context)["input_ids"]]))
    tau = float(-prefill.layers[1].keys.norm(dim=-1).median())
    entries = [Entry("knorm", 0.5, Pipeline(scorer=KNorm(), compression_ratio=0.5)),
               Entry("threshold", 0.0, Pipeline(scorer=KNorm(), allocator=Threshold(tau=tau)))]
    records = {r.label: r for r in evaluate(model, tokenizer, [sample], entries, max_new_tokens=2,
                                            progress=False).records}
    assert records["full"].achieved_ratio == 0.0
    assert abs(records["knorm"].achieved_ratio - 0.5) < 0.02  # rounding per row of a short context
    assert 0.0 < records["threshold"].achieved_ratio < 1.0 and records["threshold"].achieved_ratio != 0.5
