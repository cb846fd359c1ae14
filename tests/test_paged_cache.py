"""Pages owned per (layer, kv head): the pool's accounting (hypothesis: pages held are exactly the
entries rounded up per head, no page is shared, nothing is lost), and the transformers host's
PagedCache against the ragged cache: same kept positions and the same greedy tokens for every preset
in every mode, batch 2 with left padding."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import RaggedCache, preset, use_tokenizer
from kvpress_ada.hosts.transformers.hf import cache_kwarg, output_cache
from kvpress_ada.hosts.transformers.paged_cache import PagedCache
from kvpress_ada.presets import portable_preset_names
from kvpress_ada.serving.pages import PagedSequence, PagePool, PoolExhausted


def _check_pool(pool: PagePool, seqs: list[PagedSequence]) -> None:
    held = [p for seq in seqs for pages in seq.pages for p in pages]
    assert len(held) == len(set(held)), "a page belongs to two heads"
    assert pool.free_pages + len(held) == pool.capacity
    for seq in seqs:
        for pages, n in zip(seq.pages, seq.lengths):
            assert len(pages) == -(-n // pool.page_size)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["append", "retain", "release"]), st.integers(0, 2),
                                st.integers(1, 9), st.integers(0, 2**16)), min_size=1, max_size=12),
       engine_view=st.booleans())
def test_the_pool_holds_exactly_the_entries_rounded_up_per_head(steps, engine_view):
    """Random appends, evictions and releases over 3 sequences of 2 kv heads: every entry written is read
    back with its position until evicted, and pages held == sum of ceil(entries / page size); on pages of
    its own or on strided views of an engine tensor ``[pages, 2, S, D]`` (keys, then values)."""
    if engine_view:
        memory = torch.zeros(40, 2, 4, 8)
        pool = PagePool(memory[:, 0], memory[:, 1])
    else:
        pool = PagePool.allocate(40, 4, 8, torch.float32)
    seqs = [PagedSequence(2) for _ in range(3)]
    truth: list[list[list[tuple[int, torch.Tensor]]]] = [[[], []] for _ in seqs]  # (position, key) per head
    clock = 0
    for op, n, count, seed in steps:
        g = torch.Generator().manual_seed(seed)
        if op == "append":
            keys = torch.randn(count, 2, 8, generator=g)
            try:
                pool.append([seqs[n]], keys, keys * 2, torch.arange(clock, clock + count), [count])
            except PoolExhausted:
                _check_pool(pool, seqs)
                continue
            for h in range(2):
                truth[n][h] += [(clock + i, keys[i, h]) for i in range(count)]
            clock += count
        elif op == "retain":
            _, _, present, _ = pool.view([seqs[n]])
            keep = (torch.rand(present.shape, generator=g) < 0.5) & present
            W = present.shape[-1]
            for h in range(2):
                entries = truth[n][h]
                kept = keep[0, h, W - len(entries):].tolist()
                truth[n][h] = [e for e, k in zip(entries, kept) if k]
            pool.retain([seqs[n]], keep)
        else:
            pool.release(seqs[n])
            truth[n] = [[], []]
        _check_pool(pool, seqs)
        keys, values, present, positions = pool.view(seqs)
        W = present.shape[-1]
        for i, seq in enumerate(seqs):
            for h in range(2):
                entries = truth[i][h]
                assert seq.lengths[h] == len(entries) == int(present[i, h].sum())
                if entries:
                    assert positions[i, h, W - len(entries):].tolist() == [p for p, _ in entries]
                    expected = torch.stack([k for _, k in entries])
                    assert torch.equal(keys[i, h, W - len(entries):], expected)
                    assert torch.equal(values[i, h, W - len(entries):], 2 * expected)


def test_an_append_the_pool_cannot_hold_changes_nothing():
    pool = PagePool.allocate(3, 4, 8, torch.float32)
    seq = PagedSequence(2)
    pool.append([seq], torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.arange(4), [4])
    with pytest.raises(PoolExhausted, match="2 pages needed"):
        pool.append([seq], torch.randn(1, 2, 8), torch.randn(1, 2, 8), torch.tensor([4]), [1])
    assert seq.lengths == [4, 4] and pool.free_pages == 1


def test_growing_a_pool_keeps_the_pages_held():
    pool = PagePool.allocate(2, 4, 8, torch.float32)
    seq = PagedSequence(1)
    keys = torch.randn(6, 1, 8)
    pool.append([seq], keys, keys, torch.arange(6), [6])
    pool.grow(3)
    assert pool.capacity == 5 and pool.free_pages == 3
    assert torch.equal(pool.view([seq])[0][0, 0], keys[:, 0])


MODES = {"one-shot": {}, "decode": {"decode_budget": 24, "decode_interval": 4},
         "chunked": {"prefill_chunk": 32}}


def _kept(cache) -> list[list[list[int]]]:
    """Sorted kept positions per (layer, row, kv head)."""
    out = []
    for i in range(len(cache.layers)):
        held = cache.view(i)
        out.append([[sorted(held.positions[b, h][held.valid[b, h]].tolist()) for h in range(held.valid.shape[1])]
                    for b in range(held.valid.shape[0])])
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", portable_preset_names())
def test_paged_keeps_and_generates_what_ragged_does(llama, tokenizer, name, mode):
    use_tokenizer(llama, tokenizer)
    try:
        press = preset(name, compression_ratio=0.5, **MODES[mode])
    except ValueError:
        pytest.skip(f"{name} does not run in {mode} mode")  # refused at construction (e.g. a model pass)
    if press.reader is not None:
        pytest.skip("a reader reads the ragged cache's page summaries; the paged cache reads densely (not compared)")
    if press.evictor.rerotate and mode != "one-shot":
        pytest.skip("a paged layer moves its kept entries as stored: it refuses to re-rotate them a second time")
    ids, mask = left_padded_batch()
    key = cache_kwarg(llama)
    results = []
    for cache in (RaggedCache(config=llama.config), PagedCache(config=llama.config, page_size=8)):
        with torch.no_grad(), press(llama):
            out = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=9, **{key: cache})
        results.append((out, _kept(cache)))
    (ragged_out, ragged_kept), (paged_out, paged_kept) = results
    assert paged_kept == ragged_kept
    assert torch.equal(paged_out, ragged_out)


def test_pages_held_are_the_kept_entries_rounded_up_per_head(llama):
    ids, mask = left_padded_batch()
    cache = PagedCache(config=llama.config, page_size=8, reserve_pages=0)
    with torch.no_grad(), preset("ada_snapkv", compression_ratio=0.75)(llama):
        llama(input_ids=ids, attention_mask=mask, **{cache_kwarg(llama): cache})
    lengths = torch.stack([cache.head_lengths(i) for i in range(len(cache.layers))])
    assert cache.pages_held() == int((-(-lengths // 8)).sum())
    assert lengths.sum(-1).tolist() == [[2 * 22, 2 * 18]] * len(cache.layers)  # H_kv * round(0.25 * length)


@pytest.mark.parametrize("cache_class", [RaggedCache, PagedCache])
def test_a_cache_given_to_generate_keeps_what_the_default_cache_keeps(llama, cache_class):
    """generate builds a 4-D mask for a compileable cache (RaggedCache): the padding it encodes still counts
    as padding (it once counted as real tokens: every row kept half of the padded length)."""
    ids, mask = left_padded_batch()
    press = preset("snapkv", compression_ratio=0.5)
    given = cache_class(config=llama.config)
    with torch.no_grad(), press(llama):
        llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=1, **{cache_kwarg(llama): given})
        default = output_cache(llama(input_ids=ids, attention_mask=mask))
    assert given.state.key_mask.sum(-1).tolist() == [90, 70]
    assert given.head_lengths(0).tolist() == default.head_lengths(0).tolist() == [[45, 45], [35, 35]]


@pytest.mark.parametrize("storage", ["int8", "int4", "fp8"])
def test_a_full_precision_cache_given_to_a_quantized_press_is_refused_in_one_line(llama, storage):
    ids, mask = left_padded_batch()
    quantized = {"name": storage, "group_size": 16}  # the tiny model's head dim
    with preset("snapkv", compression_ratio=0.5, storage=quantized)(llama), pytest.raises(ValueError) as err:
        llama(input_ids=ids, attention_mask=mask, **{cache_kwarg(llama): PagedCache(config=llama.config)})
    assert "\n" not in str(err.value) and storage in str(err.value) and "PagedCache" in str(err.value)
