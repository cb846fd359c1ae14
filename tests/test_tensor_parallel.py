"""Tensor parallelism: presses on a model loaded with ``tp_plan="auto"`` under torchrun.

The end-to-end test launches ONE ``torchrun --nproc-per-node 2`` (gloo, CPU) running ``tests/tp_worker.py``: every
preset, batch 2 with left padding, kept sets / tokens / bytes per rank against the single-process model. The rest
checks the pieces in one process: the head block of a rank, the refusal of unsupported layouts, the allocation
of a rank (its heads' counts of the global decision) and the random scorer's global head index.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import build_model, build_tokenizer, random_surrogate, two_ranks

from kvpress_ada import preset
from kvpress_ada import surrogate as sur
from kvpress_ada.hosts.transformers.tensor_parallel import HeadShard, head_shard, local_weight
from kvpress_ada.observation import LayerView, Observation
from kvpress_ada.presets import portable_preset_names
from kvpress_ada.scorers import RandomScorer

ROOT = Path(__file__).resolve().parents[1]


class FakeShard(HeadShard):
    """A rank's head block whose all-gather returns a known global tensor (no process group)."""

    def __init__(self, rank, size, n_local, everyone):
        super().__init__(rank, size, n_local)
        object.__setattr__(self, "everyone", everyone)

    def gather(self, local):
        assert torch.equal(local, self.local(self.everyone)), "a rank gathers what it holds"
        return self.everyone


def _obs(keys, queries, shard=None, output_weight=None):
    B, H, L, D = keys.shape
    return Observation(keys=keys, values=keys.flip(-1), queries=queries, key_mask=torch.ones(B, L, dtype=torch.bool),
                       layer_idx=0, n_layers=2, scaling=D ** -0.5, shard=shard, output_weight=output_weight)


def test_head_shard_offsets_and_slices():
    shard = HeadShard(rank=1, size=2, n_local=3)
    assert (shard.offset, shard.n_heads) == (3, 6)
    full = torch.arange(2 * 6).view(2, 6)
    assert shard.local(full).tolist() == [[3, 4, 5], [9, 10, 11]]


def test_no_shard_without_tensor_parallelism(llama):
    assert head_shard(llama) is None
    weight = torch.ones(2, 2)
    assert local_weight(weight) is weight


@pytest.mark.parametrize("n_kv, n_q", [(3, 6), (1, 4)])
def test_unsupported_layout_refused(n_kv, n_q):
    config = SimpleNamespace(model_type="llama", num_key_value_heads=n_kv, num_attention_heads=n_q)
    model = SimpleNamespace(tp_size=2, config=config, _tp_plan={"model.layers.*.self_attn.q_proj": "colwise"})
    with pytest.raises(ValueError, match="divisible by 2"):
        head_shard(model)


@pytest.mark.parametrize("arch, outcome", [("llama", "split"), ("gemma3_text", "split"), ("gpt_oss", "whole"),
                                           ("olmo2", "q_proj"), ("phi3", "qkv_proj")])
def test_a_familys_own_plan_splits_its_heads_leaves_them_whole_or_is_refused(arch, outcome):
    """transformers' plan of each family: heads split column-wise (a rank's block of kv heads), attention left
    whole on every rank (GPT-OSS: no shard, the press runs as in one process), or projections gathered after a
    column split (OLMo-2's q/k norms over all heads, Phi-3's fused qkv): refused in one line."""
    config = build_model(arch, num_attention_heads=8, num_key_value_heads=4).config
    model = SimpleNamespace(tp_size=2, config=config, _tp_plan=dict(config.base_model_tp_plan or {}))
    if outcome in ("split", "whole"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dist, "get_rank", lambda *a: 1)
            shard = head_shard(model)
        assert (shard is None) == (outcome == "whole")
        assert shard is None or (shard.rank, shard.size, shard.n_local) == (1, 2, 2)
    else:
        with pytest.raises(ValueError, match=f"need {outcome} sharded column-wise.*'colwise_gather_output'") as err:
            head_shard(model)
        assert "\n" not in str(err.value)


def test_rowwise_qkv_refused():
    config = SimpleNamespace(model_type="llama", num_key_value_heads=4, num_attention_heads=8)
    model = SimpleNamespace(tp_size=2, config=config, _tp_plan={"model.layers.*.self_attn.k_proj": "rowwise"})
    with pytest.raises(ValueError, match="k_proj sharded column-wise"):
        head_shard(model)


@pytest.mark.parametrize("name", ["ada_snapkv", "ada_criticalkv", "ada_pyramidkv", "snapkv", "pyramidkv"])
def test_rank_counts_are_its_heads_of_the_global_allocation(name):
    """A rank's keep mask (its heads' scores, allocation on the all-gathered scores) equals the rows of its heads in
    the single-process keep mask: Ada's budgets are a layer-global decision."""
    torch.manual_seed(0)
    B, H, G, L, D = 2, 4, 2, 96, 8
    keys, queries, w_o = torch.randn(B, H, L, D), torch.randn(B, H * G, L, D), torch.randn(16, H * G * D)
    keys[:, 0] *= 3  # heads with very different attention spreads: Ada moves budget between them
    press = preset(name, compression_ratio=0.6)
    # a window under the budget: with every kept entry protected (+inf ties) Ada would split them evenly
    press = press.model_copy(update={"scorer": press.scorer.model_copy(update={"window": 16})})
    whole = press.select(_obs(keys, queries, output_weight=w_o))
    scores = press._scores(LayerView.of(_obs(keys, queries, output_weight=w_o)))
    assert name.startswith("ada") == (whole.sum(-1).unique().numel() > 1)
    for rank in range(2):  # rank r: kv heads 2r, 2r+1 with their query groups and o_proj columns (colwise plan)
        shard = FakeShard(rank, 2, H // 2, scores)
        q = queries[:, rank * H:(rank + 1) * H]
        w = w_o[:, rank * H * D:(rank + 1) * H * D]
        part = press.select(_obs(shard.local(keys), q, shard, w))
        assert torch.equal(part, shard.local(whole))


def test_random_scorer_uses_the_global_head_index():
    torch.manual_seed(0)
    keys = torch.randn(1, 4, 32, 8)
    scorer = RandomScorer(seed=3)
    whole = scorer.score(_obs(keys, keys))
    shard = HeadShard(rank=1, size=2, n_local=2)
    assert torch.equal(scorer.score(_obs(keys[:, 2:], keys[:, 2:], shard)), whole[:, 2:])


needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


@needs_gloo
def test_two_ranks_equal_one_process(tmp_path):
    """Every preset under ``torchrun --nproc-per-node 2`` (gloo): per rank, the keep mask of every layer is the
    single-process one's rows of its kv heads (up to swaps of entries whose scores tie within float rounding, see
    tp_worker.py), the generated tokens are equal, and the cache holds exactly the rank's rows."""
    model_dir = tmp_path / "llama4kv"
    model = build_model("llama", num_attention_heads=8, num_key_value_heads=4)
    model.save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    surrogate = tmp_path / "surrogate.safetensors"  # KVzap: each rank keeps its heads' entry scores
    sur.save(random_surrogate(model.config, kind="mlp", seed=2), surrogate)
    report = tmp_path / "report.json"
    code, stderr, data = two_ranks("tp_worker.py", [str(model_dir), str(report), "", str(surrogate)], report)
    assert data is not None, stderr[-4000:]
    failed = {name: r["problems"] for ranked in data["ranks"] for name, r in ranked.items() if not r["ok"]}
    assert not failed and code == 0, (failed, stderr[-2000:])
    assert data["world_size"] == 2
    presses = {n: preset(n, compression_ratio=0.5) for n in portable_preset_names()}
    served = {n for n, p in presses.items()  # TP refuses the others: a reader, a chunked prefill, a backward pass
              if p.reader is None and p.prefill_chunk is None and not getattr(p.scorer, "pass_needs_gradients", False)}
    assert all(set(ranked) == served | {"kvzap"} for ranked in data["ranks"])
    # Ada gives the heads of a layer different budgets, decided across both ranks' heads
    ada = [ranked["ada_snapkv"]["layer0_lengths"] for ranked in data["ranks"]]
    assert len({n for rank in ada for row in rank for n in row}) > 1
    swaps = sum(r["near_tie_swaps"] for ranked in data["ranks"] for r in ranked.values())
    assert swaps <= 4, f"{swaps} near-tie swaps: more than float rounding explains"


@needs_gloo
@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_two_ranks_equal_one_process_on_a_hybrid_family(tmp_path, arch):
    """Gemma-3 (heads split; its sliding-window layers hold the rank's kv heads of the window) and GPT-OSS (sinks;
    its plan leaves attention whole, so each rank runs the press as one process): kept sets, tokens and bytes per
    rank equal the single-process model's for a one-pass, a model-pass and an output-weight press."""
    model_dir = tmp_path / arch
    build_model(arch, num_attention_heads=8, num_key_value_heads=4).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    report = tmp_path / "report.json"
    names = ["ada_snapkv", "kvzip", "criticalkv"]
    code, stderr, data = two_ranks("tp_worker.py", [str(model_dir), str(report), ",".join(names)], report)
    assert data is not None, stderr[-4000:]
    failed = {name: r["problems"] for ranked in data["ranks"] for name, r in ranked.items() if not r["ok"]}
    assert not failed and code == 0, (failed, stderr[-2000:])
    assert all(set(ranked) == set(names) for ranked in data["ranks"])
    heads = [len(ranked["ada_snapkv"]["layer0_lengths"][0]) for ranked in data["ranks"]]
    assert heads == ([4, 4] if arch == "gpt_oss" else [2, 2])  # whole attention on every rank, or its block
