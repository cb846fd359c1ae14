"""Golden kept sets: what every registered preset keeps, in every mode, on fixed inputs.

For each preset x model x mode (one-shot prefill, chunked prefill, decode compression, fan-out),
on a batch of 2 left-padded rows, records the generated tokens and, per (layer, row, kv head),
the positions the final cache holds (a digest per layer, plus the counts). A refactor of the
selection path must leave this file unchanged; ``--check`` compares against it.

Positions are found without reading the press's internals: every key entering a press cache
passes through ``Cache.update`` (logged with its position in the sequence), and each kept key is
matched to the logged key it equals.

    python benchmarks/selection_golden.py --record            # tiny models (+ --default-model)
    python benchmarks/selection_golden.py --check [--default-model]
    python benchmarks/selection_golden.py --record --default-model --presets kvzap   # one changed preset
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
from kvpress_ada.hosts.transformers import MaskedLayer, PressCache, RaggedLayer, check_press  # noqa: E402
from kvpress_ada.hosts.transformers.fanout import capture_prefill  # noqa: E402

GOLDEN = ROOT / "benchmarks" / "results" / "selection_golden.json"
MODES = ("one_shot", "chunked", "decode", "fanout")

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


def _held(layer: Any) -> list[list[torch.Tensor]]:
    """Keys each (row, head) of a press cache layer holds, ``[n, D]`` each, in storage order."""
    if isinstance(layer, RaggedLayer):
        if not layer.compressed:
            B, H = layer.keys.shape[:2]
            return [[layer.keys[b, h] for h in range(H)] for b in range(B)]
        B, H, _ = layer.shape
        offsets, lengths = layer.row_offsets.tolist(), layer.row_lengths.tolist()
        return [[layer.k_flat[offsets[b * H + h]:offsets[b * H + h] + lengths[b * H + h]] for h in range(H)]
                for b in range(B)]
    if isinstance(layer, MaskedLayer):
        keys = layer.keys
        B, H, L, _ = keys.shape
        keep = torch.ones(B, H, L, dtype=torch.bool) if layer.keep is None else \
            torch.nn.functional.pad(layer.keep, (0, L - layer.keep.shape[-1]), value=True)
        return [[keys[b, h][keep[b, h]] for h in range(H)] for b in range(B)]
    raise TypeError(type(layer).__name__)


def _positions(cache: Any) -> list[list[list[int]]]:
    """Positions held per (layer, row, head), each matched to the logged key it equals."""
    out = []
    for i, layer in enumerate(cache.layers):
        log = _LOG[i]
        pos = torch.tensor(sorted(log))
        table = torch.stack([log[p] for p in pos.tolist()], dim=2)  # [B, H, P, D]
        rows = []
        for b, heads in enumerate(_held(layer)):
            per_head = []
            for h, keys in enumerate(heads):
                if keys.shape[0] == 0:
                    per_head.append([])
                    continue
                dist = torch.cdist(keys.float(), table[b, h].float(), compute_mode="donot_use_mm_for_euclid_dist")
                best = dist.argmin(-1)
                if float(dist.gather(-1, best[:, None]).max()) > 1e-4:
                    raise RuntimeError(f"layer {i} row {b} head {h}: a held key matches no logged key")
                per_head.append(sorted(pos[best].tolist()))
            rows.append(per_head)
        out.append(rows)
    return out


def _digest(positions: list[list[list[int]]]) -> dict:
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


def _press(name: str, mode: str, ratio: float, chunk: int, mask_evictor: bool):
    kwargs: dict[str, Any] = {}
    if mode == "chunked":
        kwargs["prefill_chunk"] = chunk
    if mode == "decode":
        kwargs.update(decode_budget=12, decode_interval=4)
    if mask_evictor:
        kwargs["evictor"] = Mask()
    return preset(name, compression_ratio=ratio, **kwargs)


def _run(model, name: str, mode: str, ids, mask, ratio: float, chunk: int, new_tokens: int,
         mask_evictor: bool) -> dict:
    try:
        press = _press(name, mode, ratio, chunk, mask_evictor)
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
                positions = _positions(prefill.compressed_cache(press))
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
    return {"tokens": tokens, "kept": _digest(_positions(cache))}


def _tiny_models(archs: tuple[str, ...] | None = None) -> dict[str, Any]:
    from conftest import ARCHITECTURES, build_model

    return {arch: build_model(arch) for arch in (archs or ARCHITECTURES)}


def collect(default_model: bool, tiny: bool = True, names: list[str] | None = None,
            archs: tuple[str, ...] | None = None) -> dict:
    """Records of every preset (or ``names``) in every mode, on the tiny models (or ``archs``) and,
    with ``default_model``, the embedded default model."""
    results: dict[str, Any] = {"versions": _versions()}
    models: dict[str, tuple[Any, tuple[int, int], float, int, int]] = {}
    if tiny:
        for arch, model in _tiny_models(archs).items():
            models[arch] = (model, (160, 121), 0.5, 48, 6)
    if default_model:
        from kvpress_ada.models import load

        model, _ = load("default")
        models["default"] = (model, (300, 233), 0.6, 128, 8)
    names = names or preset_names()
    with _logging_updates():
        _collect_into(results, models, names)
    return results


def _collect_into(results: dict, models: dict, names: list[str]) -> None:
    for key, (model, lengths, ratio, chunk, new_tokens) in models.items():
        vocab = int(model.config.vocab_size)
        ids, mask = _inputs(min(vocab, 5000), lengths, seed=0)
        for name in names:
            for mode in MODES:
                results[f"{key}/{name}/{mode}"] = _run(model, name, mode, ids, mask, ratio, chunk, new_tokens, False)
            results[f"{key}/{name}/one_shot_mask"] = _run(model, name, "one_shot", ids, mask, ratio, chunk,
                                                          new_tokens, True)
            if __name__ == "__main__":
                print(key, name, flush=True, file=sys.stderr)


def _versions() -> dict[str, str]:
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _collected(key: str, names: list[str] | None, default_model: bool) -> bool:
    """Whether a run of ``collect(default_model, names=names)`` writes the record ``key`` (model/preset/mode)."""
    model, preset_name = key.split("/")[:2]
    return (default_model or model != "default") and (names is None or preset_name in names)


def compare(golden: dict, now: dict) -> list[str]:
    """Keys whose record differs (versions aside)."""
    return [k for k in sorted(set(golden) | set(now)) if k != "versions" and golden.get(k) != now.get(k)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write the golden file")
    parser.add_argument("--check", action="store_true", help="compare against the golden file")
    parser.add_argument("--default-model", action="store_true", help="include the embedded default model")
    parser.add_argument("--presets", default="",
                        help="comma-separated presets to collect (default: all); --record keeps the others' records")
    parser.add_argument("--out", type=Path, default=GOLDEN)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = [n for n in args.presets.split(",") if n] or None
    unknown = sorted(set(names or ()) - set(preset_names()))
    if unknown:
        parser.error(f"unknown preset(s) {', '.join(unknown)}; known: {', '.join(preset_names())}")
    kept: dict[str, Any] = {}
    if args.record and args.out.exists():  # keep what this run does not collect (the default model's, other presets')
        old = json.loads(args.out.read_text())
        kept = {k: v for k, v in old.items() if k != "versions" and not _collected(k, names, args.default_model)}
        if kept and old.get("versions") != _versions():
            parser.error(f"{args.out} was recorded with {old.get('versions')}, this run has {_versions()}: "
                         "keeping its other records would mix versions; record every preset with --default-model")
    now = collect(args.default_model, names=names)
    if args.record:
        now = {**kept, **now}
        args.out.write_text(json.dumps(now, indent=0, sort_keys=True))
        print(f"wrote {args.out} ({len(now) - 1} records, kvpress_ada {kvpress_ada.__version__})")
    if args.check:
        golden = json.loads(args.out.read_text())
        golden = {k: v for k, v in golden.items() if k != "versions" and _collected(k, names, args.default_model)}
        diff = compare(golden, now)
        print("identical" if not diff else f"{len(diff)} records differ:\n" + "\n".join(diff))
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
