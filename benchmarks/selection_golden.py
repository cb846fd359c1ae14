"""Golden kept sets: what every registered preset keeps, in every mode, on fixed inputs.

Two kinds of records (``benchmarks/README.md``, "Golden kept sets") in ``tests/fixtures/selection_golden.json``,
both compared exactly by ``--check`` and ``tests/test_selection_golden.py``:

- policy: ``Pipeline.keep`` on fixed random tensors (:func:`policy_records`; no model, no transformers);
- end to end: for each preset x tiny model x mode (one-shot, chunked prefill, decode compression after a
  compressed or a full prefill, fan-out, the mask evictor; each again with int4 storage), on a batch of 2
  left-padded rows, the generated tokens and, per (layer, row, kv head), the positions the final cache holds (a
  digest per layer, plus the counts); filed under a digest of the model's press-free numerics
  (:func:`numerics`), so a transformers release that rounds differently gets records of its own.

Positions are found without reading the press's internals: every key entering a press cache passes through
``Cache.update`` (logged with its position in the sequence), and each kept key is matched to the logged key it
equals (int4 keys: the positions the layer reports, each checked near its logged key).

    python benchmarks/selection_golden.py --record            # this environment's records (+ --default-model)
    python benchmarks/selection_golden.py --check [--default-model] [--archs llama] [--presets snapkv]
    python benchmarks/selection_golden.py --record --presets kvzap   # one changed preset, the others kept
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import transformers  # noqa: E402

import kvpress_ada  # noqa: E402
from kvpress_ada import Mask, preset, preset_names  # noqa: E402
from kvpress_ada.hosts.transformers import (  # noqa: E402
    MaskedLayer,
    PressCache,
    QuantizedRaggedLayer,
    RaggedLayer,
    check_press,
)
from kvpress_ada.hosts.transformers.fanout import capture_prefill  # noqa: E402
from kvpress_ada.hosts.transformers.window_layer import WindowLayer  # noqa: E402
from kvpress_ada.storage import Int4  # noqa: E402

GOLDEN = ROOT / "tests" / "fixtures" / "selection_golden.json"  # a test fixture, not a result
MODES = ("one_shot", "chunked", "decode", "decode_only", "fanout")
DECODE = dict(decode_budget=72, decode_interval=4)  # above SnapKV's 64-query window: the scores choose
TINY_LENGTHS = (160, 121)  # the two rows of the tiny models' batch (left-padded to 160)
STORAGE_MODES = MODES  # recorded again with int4 storage ("MODE_int4")

_LOG: dict[int, dict[int, torch.Tensor]] = {}  # layer -> position -> keys [B, H, D]
_update = PressCache.update


def _logged_update(self, key_states, value_states, layer_idx, *args, **kwargs):
    start = self.layers[layer_idx].get_seq_length() if self.layers[layer_idx].is_initialized else 0
    for t in range(key_states.shape[2]):
        _LOG.setdefault(layer_idx, {})[start + t] = key_states[:, :, t].detach().clone()
    return _update(self, key_states, value_states, layer_idx, *args, **kwargs)


@contextmanager
def _logging_updates() -> Iterator[None]:
    """Log every key entering a press cache while inside (restored on exit: nothing else is patched)."""
    PressCache.update = _logged_update  # type: ignore[method-assign]
    try:
        yield
    finally:
        PressCache.update = _update  # type: ignore[method-assign]


def _held(layer: Any) -> list[list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """``(keys [n, D], positions [n] or None)`` each (row, head) of a press cache layer holds, in storage order.
    A quantized layer's keys are dequantized and come with the positions its view reports (int4 keys are too
    coarse to be told apart by value: ``_positions`` checks each one is near the logged key it claims)."""
    if isinstance(layer, QuantizedRaggedLayer):
        held = layer.view()
        B, H = held.keys.shape[:2]
        present = held.positions >= 0
        return [[(held.keys[b, h][present[b, h]], held.positions[b, h][present[b, h]]) for h in range(H)]
                for b in range(B)]
    if isinstance(layer, RaggedLayer):
        if not layer.compressed:
            dense = layer.keys
            assert dense is not None
            B, H = dense.shape[:2]
            return [[(dense[b, h], None) for h in range(H)] for b in range(B)]
        B, H, _ = layer.shape
        offsets, lengths = layer.row_offsets.tolist(), layer.row_lengths.tolist()
        return [[(layer.k_flat[offsets[b * H + h]:offsets[b * H + h] + lengths[b * H + h]], None) for h in range(H)]
                for b in range(B)]
    if isinstance(layer, MaskedLayer):
        keys = layer.keys
        assert keys is not None
        B, H, L, _ = keys.shape
        keep = torch.ones(B, H, L, dtype=torch.bool) if layer.keep is None else \
            torch.nn.functional.pad(layer.keep, (0, L - layer.keep.shape[-1]), value=True)
        return [[(keys[b, h][keep[b, h]], None) for h in range(H)] for b in range(B)]
    if isinstance(layer, WindowLayer):  # a hybrid model's sliding-window layer: its window, as the model holds it
        keys = layer.keys
        assert keys is not None
        return [[(keys[b, h], None) for h in range(keys.shape[1])] for b in range(keys.shape[0])]
    raise TypeError(type(layer).__name__)


def _rewrites_keys(press: Any) -> bool:
    """Whether ``press`` changes the keys it keeps (re-rotation, pruned key channels): its held keys match no logged
    key, so its positions are read from the cache's own record of them."""
    return bool(getattr(press.evictor, "rerotate", False)) or getattr(press, "key_channels", None) is not None


def _recorded_positions(cache: Any, i: int) -> list[list[list[int]]]:
    """Positions layer ``i`` of a press cache says it holds, per (row, head)."""
    held = cache.layers[i].view(cache.state.key_mask)
    B, H = held.valid.shape[:2]
    return [[sorted(held.positions[b, h][held.valid[b, h]].tolist()) for h in range(H)] for b in range(B)]


def _positions(cache: Any, rewritten: bool = False) -> list[list[list[list[int]]]]:
    """Positions held per (layer, row, head), each matched to the logged key it equals (``rewritten``: a press that
    changes the keys it keeps: the positions the cache records, sliding-window layers still matched)."""
    out = []
    for i, layer in enumerate(cache.layers):
        if rewritten and not isinstance(layer, WindowLayer):
            out.append(_recorded_positions(cache, i))
            continue
        log = _LOG[i]
        pos = torch.tensor(sorted(log))
        table = torch.stack([log[p] for p in pos.tolist()], dim=2)  # [B, H, P, D]
        rows = []
        for b, heads in enumerate(_held(layer)):
            per_head: list[list[int]] = []
            for h, (keys, claimed) in enumerate(heads):
                if keys.shape[0] == 0:
                    per_head.append([])
                    continue
                if claimed is not None:  # quantized: each key near the logged key at the position it claims
                    index = torch.searchsorted(pos, claimed.long())
                    logged = table[b, h][index.clamp(max=len(pos) - 1)].float()
                    far = (keys.float() - logged).norm(dim=-1) > 0.25 * logged.norm(dim=-1) + 1e-3
                    if bool((pos[index.clamp(max=len(pos) - 1)] != claimed).any() | far.any()):
                        raise RuntimeError(f"layer {i} row {b} head {h}: a held quantized key is not near the logged "
                                           "key at the position it claims")
                    per_head.append(sorted(claimed.tolist()))
                    continue
                dist = torch.cdist(keys.float(), table[b, h].float(), compute_mode="donot_use_mm_for_euclid_dist")
                best = dist.argmin(-1)
                if float(dist.gather(-1, best[:, None]).max()) > 1e-4:
                    raise RuntimeError(f"layer {i} row {b} head {h}: a held key matches no logged key")
                per_head.append(sorted(pos[best].tolist()))
            rows.append(per_head)
        out.append(rows)
    return out


def _digest(positions: list[list[list[list[int]]]]) -> dict:
    return {"layers": [hashlib.sha256(json.dumps(layer).encode()).hexdigest()[:16] for layer in positions],
            "counts": [[[len(h) for h in row] for row in layer] for layer in positions]}


def _inputs(vocab: int, lengths: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(4, vocab, (2, L), generator=g)
    mask = torch.ones(2, L, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :L - n] = 0
        mask[b, :L - n] = 0
    return ids, mask


def _press(name: str, mode: str, ratio: float, chunk: int, mask_evictor: bool, storage: str = "full"):
    kwargs: dict[str, Any] = {}
    if storage == "int4":  # groups of 16 fit the tiny models' head dim; a short ring, so most entries are int4
        kwargs["storage"] = Int4(group_size=16, residual=4)
    if mode == "chunked":
        kwargs["prefill_chunk"] = chunk
    if mode in ("decode", "decode_only"):
        kwargs.update(DECODE)
    if mask_evictor:
        kwargs["evictor"] = Mask()
    return preset(name, compression_ratio=None if mode == "decode_only" else ratio, **kwargs)


def _run(model, name: str, mode: str, ids, mask, ratio: float, chunk: int, new_tokens: int,
         mask_evictor: bool, storage: str = "full") -> dict:
    try:
        press = _press(name, mode, ratio, chunk, mask_evictor, storage)
        if mode != "fanout":
            check_press(press, model)
    except ValueError:
        return {"refused": True}
    _LOG.clear()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "fanout":
            prefill = capture_prefill(model, ids, mask)
            for i, c in enumerate(prefill.layers):  # the dense keys fan-out compresses from
                for t in range(c.keys.shape[2]):
                    _LOG.setdefault(i, {})[t] = c.keys[:, :, t].clone()
            try:
                positions = _positions(prefill.compressed_cache(press), _rewrites_keys(press))
            except ValueError:
                return {"refused": True}
            return {"kept": _digest(positions)}
        try:
            with press(model):
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                     return_dict_in_generate=True, pad_token_id=0)
        except ValueError:
            return {"refused": True}
        cache = out.past_key_values
        tokens = out.sequences[:, ids.shape[1]:].tolist()
    return {"tokens": tokens, "kept": _digest(_positions(cache, _rewrites_keys(press)))}


def _reinit(model: Any, seed: int) -> Any:
    """Weights drawn here, not by transformers' initialiser (which may change between releases): every matrix
    and bias ``N(0, 0.02)`` from one generator in parameter-name order, every norm weight 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=g) * 0.02)
    return model


def tiny_model(arch: str) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the tiny random model of ``arch`` the golden sets are recorded on (the suite's
    config and character tokenizer, weights drawn here)."""
    from conftest import ARCHITECTURES, build_model, build_tokenizer

    return _reinit(build_model(arch), seed=1 + ARCHITECTURES.index(arch)), build_tokenizer()


def _models(default_model: bool, archs: tuple[str, ...] | None) -> dict[str, tuple]:
    """``name -> ((model, tokenizer), (row lengths), ratio, prefill chunk, new tokens)``: the tiny models (or
    ``archs``; ``()`` for none) and, with ``default_model``, the embedded default model."""
    from conftest import ARCHITECTURES

    models: dict[str, tuple] = {arch: (tiny_model(arch), TINY_LENGTHS, 0.5, 48, 10)
                                for arch in (ARCHITECTURES if archs is None else archs)}
    if default_model:
        from kvpress_ada.models import load  # type: ignore[attr-defined]  # the loader module, aliased

        models["default"] = (load("default"), (300, 233), 0.6, 128, 8)
    return models


def _model_inputs(model: Any, lengths: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    return _inputs(min(int(model.config.vocab_size), 5000), lengths, seed=0)


def numerics(model: Any, tokenizer: Any, lengths: tuple[int, int], new_tokens: int) -> str:
    """Digest of what the model computes without a press on the golden inputs, bit for bit (the prefill's and
    every greedy step's logits, the final cache's keys and values) and of its tokenizer's ids for a fixed text.
    Where it equals a recorded one, every kept set must equal that recording's: only the selection code can
    differ. Two transformers releases, or two machines, may round differently (then it differs)."""
    ids, mask = _model_inputs(model, lengths)
    h = hashlib.sha256()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True)
    cache = [x for layer in out.past_key_values.layers for x in (layer.keys, layer.values)]
    for t in [*out.logits, *cache]:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    h.update(json.dumps(list(tokenizer("Repeat the previous context exactly.\n")["input_ids"])).encode())
    return h.hexdigest()[:16]


@contextmanager
def _one_thread() -> Iterator[None]:
    """One torch thread while inside (a thread count can change how a reduction rounds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def collect(default_model: bool, names: list[str] | None = None, archs: tuple[str, ...] | None = None) -> dict:
    """``{variant key: {"versions", "records"}}``, a variant key being ``"llama@<numerics digest>"``: every
    preset (or ``names``) in every mode on the tiny models (or ``archs``) and, with ``default_model``, the
    embedded default model."""
    out: dict[str, Any] = {}
    names = names or preset_names()
    with _logging_updates(), _one_thread():
        for key, ((model, tokenizer), lengths, ratio, chunk, new_tokens) in _models(default_model, archs).items():
            variant = f"{key}@{numerics(model, tokenizer, lengths, new_tokens)}"
            records = _collect_model(key, model, names, lengths, ratio, chunk, new_tokens)
            out[variant] = {"versions": [_versions()], "records": records}
    return out


def _collect_model(key: str, model: Any, names: list[str], lengths: tuple[int, int], ratio: float, chunk: int,
                   new_tokens: int) -> dict:
    ids, mask = _model_inputs(model, lengths)
    results: dict[str, Any] = {}
    for name in names:
        for mode in MODES:
            results[f"{key}/{name}/{mode}"] = _run(model, name, mode, ids, mask, ratio, chunk, new_tokens, False)
        results[f"{key}/{name}/one_shot_mask"] = _run(model, name, "one_shot", ids, mask, ratio, chunk,
                                                      new_tokens, True)
        for mode in STORAGE_MODES:
            results[f"{key}/{name}/{mode}_int4"] = _run(model, name, mode, ids, mask, ratio, chunk, new_tokens,
                                                        False, "int4")
        if __name__ == "__main__":
            print(key, name, flush=True, file=sys.stderr)
    return results


POLICY_SHAPE = dict(B=2, H=2, G=2, L=160, D=16, layers=3)  # fixed tensors fed to Pipeline.keep
POLICY_CASES = ("uniform", "ragged", "capped")


def _policy_views(case: str, window: int | None) -> tuple[list[Any], Any]:
    """``(views, budget)`` from fixed random tensors (torch's generator: no model, no transformers): a batch
    of two rows (the second left-padded to 121 entries) in every kv head (``uniform``) or with a head of the
    first row holding 20 entries fewer (``ragged``, as after an earlier eviction); ``capped``: the uniform
    views with a per-head ceiling (a chunked prefill's)."""
    from kvpress_ada import Budget, LayerView

    B, H, G, L, D, n = (POLICY_SHAPE[k] for k in ("B", "H", "G", "L", "D", "layers"))
    g = torch.Generator().manual_seed(7)
    valid = torch.ones(B, H, L, dtype=torch.bool)
    valid[1, :, :L - 121] = False
    if case == "ragged":
        valid[0, 1, :20] = False
    w = L if window is None else min(window, L)
    views = []
    for i in range(n):
        scale = torch.rand(B, H, L, 1, generator=g) * 2  # keys of uneven norms: scores far apart
        views.append(LayerView(
            keys=torch.randn(B, H, L, D, generator=g) * scale, values=torch.randn(B, H, L, D, generator=g),
            valid=valid, queries=torch.randn(B, H * G, w, D, generator=g), layer_idx=i, n_layers=n,
            scaling=D ** -0.5, output_weight=torch.randn(H * G * D, H * G * D, generator=g) * 0.1,
            rope_inv_freq=1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D),
            pass_scores=torch.rand(B, H, L, generator=g), entry_scores=torch.randn(B, H, L, generator=g),
            uniform=None if case == "ragged" else True))
    lengths = valid[:, 0].sum(-1)
    cap = torch.tensor([70, 70]) if case == "capped" else None
    return views, Budget(average=torch.tensor([80.0, 60.0]), lengths=lengths, cap=cap)


def policy_records(names: list[str] | None = None) -> dict:
    """``{"preset/case": record}``: what ``Pipeline.keep`` keeps from fixed tensors (no model: exact wherever
    torch rounds as it did at the recording), per layer a digest of the kept positions of every (row, head)."""
    out: dict[str, Any] = {}
    with _one_thread():
        for name in names or preset_names():
            for case in POLICY_CASES:
                try:
                    press = preset(name, compression_ratio=0.5)
                    views, budget = _policy_views(case, press.scorer.query_window())
                    keep = press.keep(views, budget)
                except ValueError:
                    out[f"{name}/{case}"] = {"refused": True}
                    continue
                out[f"{name}/{case}"] = {"kept": _digest([[[torch.nonzero(k[b, h])[:, 0].tolist()
                                                             for h in range(k.shape[1])] for b in range(k.shape[0])]
                                                           for k in keep])}
    return out


def _versions() -> dict[str, str]:
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def compare(golden: dict, now: dict) -> list[str]:
    """Record keys whose record differs."""
    return [k for k in sorted(set(golden) | set(now)) if golden.get(k) != now.get(k)]


def missing_message(variant: str, golden: dict) -> str:
    """One line: no golden records for ``variant`` (this environment's numerics) and the command recording them."""
    name = variant.split("@")[0]
    known = [f"{k} (" + "; ".join(f"torch {e['torch']}, transformers {e['transformers']}" for e in v["versions"]) + ")"
             for k, v in sorted(golden["variants"].items()) if k.split("@")[0] == name]
    flag = " --default-model" if name == "default" else ""
    return (f"no golden kept sets for {variant} (torch {torch.__version__}, transformers {transformers.__version__}: "
            f"this model computes differently here than in {', '.join(known) or 'any recording'}); record them at a "
            f"commit whose kept sets you trust: python benchmarks/selection_golden.py --record{flag}")


def load(path: Path = GOLDEN) -> dict:
    """The golden file: ``{"policy": {"versions", "records"}, "variants": {variant key: {"versions", "records"}}}``
    (``versions``: the torch / transformers pairs that recorded it). On disk a variant may name a ``base`` variant
    and hold only the records that differ from it (:func:`dumps`)."""
    golden = json.loads(path.read_text()) if path.exists() else {"variants": {}}
    for variant in golden["variants"].values():
        if "base" in variant:
            variant["records"] = {**golden["variants"][variant.pop("base")]["records"], **variant["records"]}
    return golden


def dumps(golden: dict) -> str:
    """The golden file's text: one record per line; a variant with the same records as the first variant of its
    model (a release that rounds differently, keeps the same) holds only those that differ, over that ``base``."""
    def block(records: dict) -> str:
        return "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}"
                                   for k, v in sorted(records.items())) + "\n}"

    firsts: dict[str, str] = {}
    parts = []
    for key, variant in sorted(golden["variants"].items()):
        model, records = key.split("@")[0], variant["records"]
        base = firsts.setdefault(model, key)
        head = f"{json.dumps(key)}: {{\"versions\": {json.dumps(variant['versions'])}"
        base_records = golden["variants"][base]["records"]
        if base != key and set(base_records) == set(records):
            own = {k: v for k, v in records.items() if base_records[k] != v}
            parts.append(f"{head}, \"base\": {json.dumps(base)}, \"records\": {block(own)}}}")
        else:
            parts.append(f"{head}, \"records\": {block(records)}}}")
    policy = golden.get("policy")
    text = "{\n"
    if policy:
        versions = json.dumps(policy["versions"])
        text += f"\"policy\": {{\"versions\": {versions}, \"records\": {block(policy['records'])}}},\n"
    return text + "\"variants\": {\n" + ",\n".join(parts) + "\n}\n}\n"


def _merged(old: dict | None, records: dict, partial: bool) -> dict:
    """``{"versions", "records"}``: ``records`` recorded here, over ``old``'s other records when ``partial``."""
    seen = old["versions"] if old else []
    kept = old["records"] if old and partial else {}
    return {"versions": seen + [v for v in [_versions()] if v not in seen],
            "records": dict(sorted({**kept, **records}.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write this environment's records into the golden file")
    parser.add_argument("--check", action="store_true", help="compare against the golden file")
    parser.add_argument("--default-model", action="store_true", help="include the embedded default model")
    parser.add_argument("--archs", default="", help="comma-separated tiny models (default: all; 'none': none)")
    parser.add_argument("--presets", default="",
                        help="comma-separated presets to collect (default: all); --record keeps the others' records")
    parser.add_argument("--out", type=Path, default=GOLDEN)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from conftest import ARCHITECTURES

    names = [n for n in args.presets.split(",") if n] or None
    unknown = sorted(set(names or ()) - set(preset_names()))
    if unknown:
        parser.error(f"unknown preset(s) {', '.join(unknown)}; known: {', '.join(preset_names())}")
    archs = None if not args.archs else () if args.archs == "none" else tuple(a for a in args.archs.split(",") if a)
    if archs and set(archs) - set(ARCHITECTURES):
        parser.error(f"unknown tiny model(s) {', '.join(sorted(set(archs) - set(ARCHITECTURES)))}; "
                     f"known: {', '.join(ARCHITECTURES)}, none")
    golden = load(args.out)
    now = collect(args.default_model, names=names, archs=archs)
    policy = policy_records(names)
    if args.record:
        for variant in now:
            if names and variant not in golden["variants"]:
                parser.error(f"{variant} has no records in {args.out} yet: record every preset first (no --presets)")
        golden["policy"] = _merged(golden.get("policy"), policy, partial=bool(names))
        for variant, fresh in now.items():
            golden["variants"][variant] = _merged(golden["variants"].get(variant), fresh["records"], bool(names))
        args.out.write_text(dumps(golden))
        print(f"wrote {args.out}: policy, {', '.join(now) or 'no model'} "
              f"({len(policy) + sum(len(v['records']) for v in now.values())} records, "
              f"kvpress_ada {kvpress_ada.__version__})")
    if args.check:
        diff = compare({k: v for k, v in golden.get("policy", {}).get("records", {}).items()
                        if k.split("/")[0] in (names or preset_names())}, policy)
        for variant, fresh in now.items():
            if variant not in golden["variants"]:
                print(missing_message(variant, golden))
                sys.exit(1)
            recorded = golden["variants"][variant]["records"]
            diff += compare({k: v for k, v in recorded.items() if k.split("/")[1] in (names or preset_names())},
                            fresh["records"])
        print("identical" if not diff else f"{len(diff)} records differ:\n" + "\n".join(diff))
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
