"""Merging dropped entries into kept ones (SimilarityMerge: kvpress's MergingPress; CaM): each merge against its
formula written out on small tensors (left padding, heads keeping different entries), then the press through its
entry points: forward (ragged == Mask reference), fan-out, decode compaction, and the modes refused in one line."""

import math

import pytest
import torch
from conftest import build_model

from kvpress_ada import Pipeline, preset
from kvpress_ada.evictors import CaM, Mask, SimilarityMerge, TopK
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.scorers import SnapKV
from kvpress_ada.serving.requests import check_servable


def _case(seed=0, B=2, H=2, L=12, D=4):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
    valid = torch.ones(B, H, L, dtype=torch.bool)
    valid[1, :, :3] = False  # left padding
    keep = (torch.rand(B, H, L, generator=g) < 0.5) & valid  # every head keeps its own entries
    keep[:, :, -1] = True
    scores = torch.rand(B, H, L, generator=g)
    return keys, values, valid, keep, scores


def _cos(a, b):
    return float(a @ b) / max(float(a.norm()), 1e-6) / max(float(b.norm()), 1e-6)


@pytest.mark.parametrize("threshold, fraction", [(0.0, 1.0), (0.2, 1.0), (0.0, 0.45)])  # cuts between entries
def test_similarity_merge_matches_the_formula_written_out(threshold, fraction):
    keys, values, valid, keep, _ = _case()
    got = SimilarityMerge(similarity_threshold=threshold, merge_fraction=fraction).merge(keys, values, valid, keep,
                                                                                           None)
    B, H, L, D = values.shape
    for b in range(B):
        for h in range(H):
            kept = [j for j in range(L) if keep[b, h, j] and valid[b, h, j]]
            dropped = [i for i in range(L) if valid[b, h, i] and not keep[b, h, i]]
            best = {i: max((_cos(keys[b, h, i], keys[b, h, j]), -j) for j in kept) for i in dropped}
            ok = {i for i in dropped if best[i][0] >= threshold}
            if fraction < 1.0:
                cut = torch.quantile(torch.tensor([best[i][0] if i in ok else -math.inf for i in dropped]),
                                     1.0 - fraction)
                ok = {i for i in ok if best[i][0] >= float(cut)}
            total = {j: 0.0 for j in kept}
            added = {j: torch.zeros(D, dtype=torch.float64) for j in kept}
            for i in ok:
                s, t = best[i][0], -best[i][1]
                ni, nt = float(values[b, h, i].norm()), float(values[b, h, t].norm())
                w = max(s, 0.0) * ni / (ni + nt + 1e-6)
                total[t] += w
                added[t] += w * values[b, h, i].double()
            for j in range(L):
                want = values[b, h, j].double()
                if j in total and total[j] > 0:
                    want = (want + added[j]) / (1.0 + total[j])
                torch.testing.assert_close(got[b, h, j].double(), want, atol=1e-5, rtol=1e-5)


def test_cam_matches_the_formula_written_out():
    keys, values, valid, keep, scores = _case(seed=1)
    scores[0, 0, 5] = math.inf  # a protected kept entry: it counts as the head's highest finite score
    keep[0, 0, 5] = True
    m = 3
    got = CaM(merge_budget=m).merge(keys, values, valid, keep, scores)
    B, H, L, D = values.shape
    for b in range(B):
        for h in range(H):
            kept = [j for j in range(L) if keep[b, h, j] and valid[b, h, j]]
            want = {j: values[b, h, j].double().clone() for j in kept}
            top = max(float(scores[b, h, j]) for j in range(L) if math.isfinite(float(scores[b, h, j])))
            a = [top if float(scores[b, h, j]) == math.inf else float(scores[b, h, j]) for j in range(L)]
            for i in range(L):
                if not valid[b, h, i] or keep[b, h, i]:
                    continue
                targets = [j for j in kept if j > i][:m]
                if not targets:
                    continue
                mean = sum(a[j] for j in targets) / len(targets)
                p = (1.0 if a[i] > 0 else 0.0) if mean == 0 else min(max(a[i] / mean, 0), 1)
                for j in targets:
                    want[j] += p / len(targets) * values[b, h, i].double()
            for j in range(L):
                expected = want.get(j, values[b, h, j].double())
                torch.testing.assert_close(got[b, h, j].double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="scores"):
        CaM().merge(keys, values, valid, keep, None)


@pytest.mark.parametrize("name", ["merging", "ada_cam"])
def test_press_merges_what_the_formula_gives_and_equals_fanout_and_mask(name):
    model = build_model("llama")
    ids = torch.randint(5, 100, (2, 36), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    press = preset(name, compression_ratio=0.5, scorer=SnapKV(window=6))
    plain = press.replace(evictor=TopK())
    with torch.no_grad():
        with press(model):
            cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
        with plain(model):
            unmerged = output_cache(model(ids, attention_mask=mask, use_cache=True))
    prefill = capture_prefill(model, ids, mask)
    keeps = prefill.keep_masks(press)
    fanned = prefill.compressed_cache(press, keeps)
    changed = 0
    for i in range(3):
        view = prefill.view(press.scorer, i)
        scores = press._scores(view) if name.endswith("cam") else None
        merged = press.evictor.merge.merge(view.keys, view.values, view.valid, keeps[i], scores)
        held = cache.layers[i].view(cache.state.key_mask)
        want = held.values.new_zeros(held.values.shape)
        for b in range(2):
            for h in range(2):
                want[b, h, -int(keeps[i][b, h].sum()):] = merged[b, h][keeps[i][b, h]]
        torch.testing.assert_close(torch.where(held.valid[..., None], held.values, 0.0), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fanned.layers[i].view(fanned.state.key_mask).values, held.values)
        torch.testing.assert_close(held.keys, unmerged.layers[i].view(unmerged.state.key_mask).keys)  # keys untouched
        changed += int((held.values != unmerged.layers[i].view(unmerged.state.key_mask).values).any())
    assert changed  # something merged
    outs = []
    for p in (press, press.replace(evictor=Mask(**press.evictor.model_dump(exclude={"name"})))):
        with torch.no_grad(), p(model):
            outs.append(model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                                       output_logits=True, return_dict_in_generate=True))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    torch.testing.assert_close(torch.stack(outs[0].logits), torch.stack(outs[1].logits), atol=1e-4, rtol=0)


def test_cam_merges_at_every_decode_compaction_ragged_equals_mask():
    model = build_model("llama")
    ids = torch.randint(5, 100, (1, 24), generator=torch.Generator().manual_seed(4))
    fields = dict(scorer=SnapKV(window=4), budget=12, decode_budget=10, decode_interval=4)
    outs = []
    for evictor in (TopK(merge=CaM(merge_budget=4)), Mask(merge=CaM(merge_budget=4))):
        press = Pipeline(evictor=evictor, **fields)
        with torch.no_grad(), press(model):
            out = model.generate(ids, do_sample=False, max_new_tokens=12, output_logits=True,
                                 return_dict_in_generate=True)
        outs.append(out)
        assert min(output_cache(out).state.compactions) >= 2
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    torch.testing.assert_close(torch.stack(outs[0].logits), torch.stack(outs[1].logits), atol=1e-4, rtol=0)


def test_refused_modes_in_one_line():
    with pytest.raises(ValueError, match="cannot rewrite their values"):
        Pipeline(scorer=SnapKV(), budget=8, decode_budget=8, decode_interval=4, storage="int8",
                 evictor=TopK(merge=CaM()))
    press = preset("cam", compression_ratio=0.5)
    with pytest.raises(ValueError, match="serving engine"):
        check_servable(press)
    prefill = capture_prefill(build_model("llama"), torch.randint(5, 100, (1, 70)))
    with pytest.raises(ValueError, match="compressed_cache"):
        prefill.compressed_batch([press], [prefill.keep_masks(press)])
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
