"""The NVIDIA-kvpress half of ``benchmarks/kvpress_compare.py``; runs inside the kvpress virtualenv.

Never import ``kvpress_ada`` here: this process runs kvpress 0.5.5 on the transformers release it
pins (< 5.3). It is driven over stdin/stdout with one JSON object per line (requests in, replies
out); everything else (warnings, progress bars) goes to stderr. Commands:

``hello``         versions, threads, attention implementation.
``prompt_check``  tokenise every sample with kvpress's own ``KVPressTextGenerationPipeline.preprocess``
                  and compare with the token ids computed by kvpress_ada (the ids actually used).
``accuracy``      for every sample: one prefill per (press, ratio) plus a full-cache run, each with
                  kvpress's hooks (``with press(model): model.model(context_ids, cache)``), then the
                  question and a greedy answer on the compressed cache with explicit RoPE positions,
                  exactly as ``KVPressTextGenerationPipeline.generate_answer`` does (question-agnostic);
                  or, with ``question_aware``, the whole prompt (context + question) is prefilled and
                  compressed and the answer starts from the prefill's last logits. Returns answers
                  (token ids) and KV bytes held; writes per-(layer, head) kept masks (packed bits, .npz)
                  for the presses whose kept set can be read (``Worker._kept``; ``kept_sets: false``
                  skips them). ``indices`` restricts the run to some samples (checkpointing driver).
                  ``caches`` (absent: kvpress's DynamicCache only, as always) lists the caches each press runs on:
                  ``dynamic`` or a transformers ``QuantizedCache`` spec ``<backend>-int<bits>`` (``quanto-int4``,
                  ``hqq-int8``, ...); the full DynamicCache always runs first (the bytes reference), each quantized
                  cache also runs without a press, and its records are labelled ``<method>+<spec>`` with the bytes
                  held split into quantized data, scales, zero points and the full-precision residual.
                  ``supplied`` (with the method ``kvzap_threshold``) is a kvpress_ada surrogate file with the
                  threshold and protection of the preset: kvpress's ``DMSPress`` around its ``KVzapPress``
                  carrying that file's weights (:class:`SuppliedKVzapPress`); ``ratio_free`` methods run once,
                  at ratio 0 (they set their own budget), and report the achieved ratio. ``handed`` (a safetensors
                  file the driver writes from kvpress_ada's shipped artefacts, :func:`read_handed`) replaces what
                  QFilterPress, FastKVzipPress, DuoAttentionPress and LUKVPress download; ``ours`` holds, per
                  method, our preset's settings that ``SPECS`` reads. ObservedAttentionPress prefills and answers in
                  eager attention; after a press that re-rotates its keys the question continues at the kept count
                  (both as kvpress's pipeline).
``decode_setup``  prefill one long context once per configuration and keep every cache.
``decode``        time ``steps`` greedy single-token steps on one kept cache (after the question).
``quit``

Usage (by the driver): ``<kvpress-venv>/bin/python benchmarks/kvpress_worker.py --model DIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

PROTO = sys.stdout
sys.stdout = sys.stderr  # library prints must never corrupt the protocol

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
warnings.filterwarnings("ignore")

import kvpress  # noqa: E402
import kvpress_presses as kp  # noqa: E402
from kvpress import (  # noqa: E402
    AdaKVPress,
    BasePress,
    DMSPress,
    DuoAttentionPress,
    FinchPress,
    KeyRerotationPress,
    KVPressTextGenerationPipeline,
    KVzapPress,
    KVzipPress,
    ObservedAttentionPress,
    PyramidKVPress,
    ScorerPress,
    SimLayerKVPress,
)
from kvpress.presses.base_press import is_prefilling  # noqa: E402
from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel  # noqa: E402
from kvpress.utils import compute_n_kept, extract_keys_and_values  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, QuantizedCache  # noqa: E402

ADA_ALPHA = 0.2  # kvpress's default alpha_safeguard (and the paper's)


def _ada(inner: dict) -> dict:
    return kp.spec("AdaKVPress", press=inner, alpha_safeguard=ADA_ALPHA)


def _composed_second(r: float, first_keep: float) -> float:
    """The second press's ratio of ``ComposedPress([KnormPress(1 - first_keep), SnapKVPress(x)])`` removing ``r`` in
    all: kvpress's total is ``1 - first_keep (1 - x)``."""
    x = 1 - (1 - r) / first_keep
    if x < 0:
        raise ValueError(f"composed at ratio {r} keeps more than its first stage's {first_keep}: use a ratio >= "
                         f"{1 - first_keep:g}")
    return x


# kvpress_ada preset name -> the kvpress press spec for it (benchmarks/kvpress_presses.py builds it) at a ratio ``r``,
# with ``ours`` = the accuracy request's ``ours[method]``: our preset's value of a setting whose kvpress default
# turns the press off (DuoAttention's head share, SimLayerKV's threshold and window, ThinK's channel share) or that
# kvpress finds another way (FINCH's window: a delimiter token), and Composed's first stage; kvpress's defaults
# otherwise (the driver records each press's repr, which lists every field)
SPECS = {
    "snapkv": lambda r, ours: kp.spec("SnapKVPress", compression_ratio=r),
    "ada_snapkv": lambda r, ours: _ada(kp.spec("SnapKVPress", compression_ratio=r)),
    "pyramidkv": lambda r, ours: kp.spec("PyramidKVPress", compression_ratio=r),
    "expected_attention": lambda r, ours: kp.spec("ExpectedAttentionPress", compression_ratio=r),
    "ada_expected_attention": lambda r, ours: _ada(kp.spec("ExpectedAttentionPress", compression_ratio=r)),
    # KVzipPress scores on leaving its `with` block (context reconstruction through the model) and masks
    # the evicted keys (masked_key_indices, like AdaKVPress): one top-k over all layers and heads
    # (layerwise=False, its default) or one per layer over its heads (layerwise=True)
    "kvzip": lambda r, ours: kp.spec("KVzipPress", compression_ratio=r),
    "kvzip_layerwise": lambda r, ours: kp.spec("KVzipPress", compression_ratio=r, layerwise=True),
    # KVgradPress: KVzipPress's reconstruction (chunks of 512) with a backward pass per chunk, masks alike
    "kvgrad": lambda r, ours: kp.spec("KVgradPress", compression_ratio=r),
    "lagkv": lambda r, ours: kp.spec("LagKVPress", compression_ratio=r),
    "keydiff": lambda r, ours: kp.spec("KeyDiffPress", compression_ratio=r),
    # key statistics (a fresh random leverage sketch per call, as kvpress draws it; Compactor's blending = r)
    "leverage": lambda r, ours: kp.spec("LeverageScorePress", compression_ratio=r),
    "ada_leverage": lambda r, ours: _ada(kp.spec("LeverageScorePress", compression_ratio=r)),
    "cur": lambda r, ours: kp.spec("CURPress", compression_ratio=r),
    "ada_cur": lambda r, ours: _ada(kp.spec("CURPress", compression_ratio=r)),
    "non_causal_attention": lambda r, ours: kp.spec("NonCausalAttnPress", compression_ratio=r),
    "compactor": lambda r, ours: kp.spec("CompactorPress", compression_ratio=r),
    "cap": lambda r, ours: kp.spec("CapPress", compression_ratio=r),
    # token scorers
    "streamingllm": lambda r, ours: kp.spec("StreamingLLMPress", compression_ratio=r),
    "knorm": lambda r, ours: kp.spec("KnormPress", compression_ratio=r),
    "tova": lambda r, ours: kp.spec("TOVAPress", compression_ratio=r),
    "h2o": lambda r, ours: kp.spec("ObservedAttentionPress", compression_ratio=r),  # eager attention (EAGER)
    "criticalkv": lambda r, ours: kp.spec("CriticalKVPress", press=kp.spec("SnapKVPress", compression_ratio=r)),
    "qfilter": lambda r, ours: kp.spec("QFilterPress", compression_ratio=r),  # our filters handed over
    # structure around a scorer
    "chunkkv": lambda r, ours: kp.spec("ChunkKVPress", press=kp.spec("SnapKVPress", compression_ratio=r)),
    "entropy_gated_chunkkv": lambda r, ours: kp.spec("EntropyGatedChunkKVPress",
                                                  press=kp.spec("SnapKVPress", compression_ratio=r)),
    "block_keydiff": lambda r, ours: kp.spec("BlockPress", press=kp.spec("KeyDiffPress", compression_ratio=r)),
    "finch": lambda r, ours: kp.spec("FinchPress", compression_ratio=r),  # window set per prompt (Worker._attrs)
    "rerotated_streamingllm": lambda r, ours: kp.spec("KeyRerotationPress",
                                                   press=kp.spec("StreamingLLMPress", compression_ratio=r)),
    "merging": lambda r, ours: kp.spec("MergingPress", press=kp.spec("SnapKVPress", compression_ratio=r)),
    "think": lambda r, ours: kp.spec("ComposedPress", presses=[
        kp.spec("SnapKVPress", compression_ratio=r),
        kp.spec("ThinKPress", key_channel_compression_ratio=ours["key_channel_compression_ratio"])]),
    "composed": lambda r, ours: kp.spec("ComposedPress", presses=[
        kp.spec("KnormPress", compression_ratio=1 - ours["first_keep"]),
        kp.spec("SnapKVPress", compression_ratio=_composed_second(r, ours["first_keep"]))]),
    # their own budget (the ratio is not theirs: the record carries the achieved one)
    # ours on both sides (kvpress's n_recent 1024 compresses nothing at ~1k tokens); kvpress keeps n_recent - n_last
    # recent entries where ours keeps n_recent (kvpress_agreement.py's DIFFERENCES): the same count handed over
    "simlayerkv": lambda r, ours: kp.spec("SimLayerKVPress", lazy_threshold=ours["lazy_threshold"],
                                       n_initial=ours["n_initial"], n_last=ours["n_last"],
                                       n_recent=ours["n_recent"] + ours["n_last"]),
    "duo_attention": lambda r, ours: kp.spec("DuoAttentionPress",
                                          head_compression_ratio=ours["head_compression_ratio"]),  # our patterns
    # model scope, calibrated heads
    "kvcompose": lambda r, ours: kp.spec("KVComposePress", compression_ratio=r),
    "fastkvzip": lambda r, ours: kp.spec("FastKVzipPress", compression_ratio=r),  # our gates handed over
    "lukv": lambda r, ours: kp.spec("LUKVPress", compression_ratio=r),  # our keep curve handed over
    "expected_attention_stats": lambda r, ours: kp.spec("ExpectedAttentionStatsPress",
                                                     compression_ratio=r),  # our query statistics handed over
}
EAGER = (ObservedAttentionPress,)  # presses reading the attention weights: prefill and answer in eager attention
OWN_BUDGET = (SimLayerKVPress, DuoAttentionPress, DMSPress)  # their compression_ratio is what they achieved


def replay_key(press) -> str | None:
    """Which reconstruction a KVzipPress (or a subclass: KVgradPress) scores with, the key its scores are shared
    under within a sample (other ratios and ``layerwise`` reuse them); ``None`` for other presses."""
    if not isinstance(press, KVzipPress):
        return None
    return f"replay:{type(press).__name__}:{press.chunk_size}:{press.kvzip_plus_normalization}"


class SuppliedKVzapPress(KVzapPress):
    """kvpress's ``KVzapPress`` scoring with a kvpress_ada surrogate file (``kvpress-ada distill``) instead of a
    hub download: the same per-layer linear map or 2-layer GELU MLP, loaded into kvpress's own ``KVzapModel``,
    and the first ``sinks`` tokens scored +inf (kvpress_ada's KVzap protects them; the surrogate was not trained
    on them). Prefill only: positions are those of the scored chunk."""

    def __init__(self, path: str, sinks: int):
        super().__init__()
        self.path, self.sinks = path, sinks
        with safe_open(path, "pt") as f:
            meta = json.loads(f.metadata()["kvpress_ada.surrogate"])
            tensors = {k: f.get_tensor(k).float() for k in f.keys()}
        n_layers = 1 + max(int(k.split(".")[1]) for k in tensors)
        kind = meta["kind"]
        out = tensors["layers.0.w2" if kind == "mlp" else "layers.0.weight"].shape[1]
        config = KVzapConfig(input_dim=meta["hidden_size"], output_dim=out, n_modules=n_layers,
                             hidden_dim=meta["width"] if kind == "mlp" else None)
        model = KVzapModel(config)
        state = {}
        for layer in range(n_layers):  # ours stores h @ W (W [in, out]); nn.Linear holds W.T
            t = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"layers.{layer}.")}
            if kind == "mlp":
                state.update({f"layers.{layer}.0.weight": t["w1"].T, f"layers.{layer}.0.bias": t["b1"],
                              f"layers.{layer}.2.weight": t["w2"].T, f"layers.{layer}.2.bias": t["b2"]})
            else:
                state.update({f"layers.{layer}.weight": t["weight"].T, f"layers.{layer}.bias": t["bias"]})
        model.load_state_dict(state)
        self.kvzap_model = model.eval()
        self.model_type = kind
        self.kvzap_model_name = path

    def post_init_from_model(self, model):
        pass  # weights come from the file, never from the hub

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = super().score(module, hidden_states, keys, values, attentions, kwargs).float()
        scores[..., : self.sinks] = float("inf")
        return scores


SUPPLIED: dict = {}  # the accuracy request's ``supplied`` (surrogate file, tau, sinks, window)
OURS: dict = {}  # the accuracy request's ``ours``: per method, our preset's settings that SPECS reads


def build_press(method: str, ratio: float):
    """The kvpress press matching one of kvpress_ada's preset names (kvpress defaults otherwise), not yet handed
    what it would download (:meth:`Worker._hand_over`)."""
    if method == "full":
        return None
    if method == "kvzap_threshold":  # kvpress's threshold logic on the scores of our surrogate
        if not SUPPLIED:
            raise ValueError("kvzap_threshold needs the request's 'supplied' surrogate file and threshold")
        return DMSPress(SuppliedKVzapPress(SUPPLIED["path"], SUPPLIED["sinks"]), threshold=SUPPLIED["tau"],
                        sliding_window_size=SUPPLIED["window"])
    if method not in SPECS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(SPECS)}")
    made = SPECS[method](ratio, OURS.get(method) or {})
    return kp.build(made["press"], made["kwargs"])


class CapturePress(BasePress):
    """Records what kvpress's ``BasePress.forward_hook`` hands ``compress`` in every layer and compresses
    nothing: one prefill under it is the full-cache run and the input of every derived press."""

    def __init__(self):
        self.layers: dict[int, tuple] = {}

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        self.layers[module.layer_idx] = (module, hidden_states, keys, values, attentions, kwargs)
        return keys, values


class QuantizedCapturePress(CapturePress):
    """:class:`CapturePress` for a ``QuantizedCache``: records what ``BasePress.forward_hook`` hands ``compress``
    (the dequantized keys and values, ``extract_keys_and_values``) and leaves the cache as a prefill without a
    press leaves it (``BasePress.forward_hook`` would quantize the dequantized tensors a second time)."""

    def forward_hook(self, module, input, kwargs, output):
        hidden_states = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return output
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        self.layers[module.layer_idx] = (module, hidden_states, keys, values, output[1], kwargs)
        return output


def derivable(press) -> bool:
    """Presses that act only through ``BasePress.forward_hook -> compress`` (ScorerPress subclasses,
    AdaKVPress, ...): a prefill is unchanged by them (each layer compresses after its own attention), so
    ``press.compress`` on the inputs captured from one uncompressed prefill gives what a prefill of their
    own gives. Not those reading the attention weights (:data:`EAGER`: the capture runs in SDPA, which returns
    none)."""
    return (type(press).__call__ is BasePress.__call__ and type(press).forward_hook is BasePress.forward_hook
            and not any(isinstance(p, EAGER) for p in kp.presses(press)))


def needs_eager(press) -> bool:
    """A press reading the attention weights (kvpress asks for a model loaded with eager attention)."""
    return press is not None and any(isinstance(p, EAGER) for p in kp.presses(press))


def rerotates(press) -> bool:
    """``KVPressTextGenerationPipeline``'s test for presses that re-rotate the keys they keep to ``0 .. n-1``."""
    return isinstance(press, KeyRerotationPress) or (isinstance(press, FinchPress) and press.rerotate_keys)


def read_handed(path: str) -> dict:
    """What the driver hands kvpress instead of its downloads (a safetensors file it wrote from kvpress_ada's
    shipped artefacts): ``q_filters``, ``gates`` (per layer, kvpress's FastKVzipGate layout), ``duo`` (sink, recent,
    scores), ``curve`` (LU-KV's prune ratios) and ``query_stats`` (mean, cov), each where the file has it."""
    with safe_open(path, "pt") as f:
        meta = json.loads((f.metadata() or {}).get("kvpress_compare.handed", "{}"))
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out: dict = {}
    if "q_filters" in tensors:
        out["q_filters"] = tensors["q_filters"]
    if "curve" in tensors:
        out["curve"] = tensors["curve"].double().numpy()
    if "query_stats.mean" in tensors:
        out["query_stats"] = {"mean": tensors["query_stats.mean"], "cov": tensors["query_stats.cov"]}
    if "duo.scores" in tensors:
        out["duo"] = {"sink": meta["duo_sink"], "recent": meta["duo_recent"],
                      "scores": tensors["duo.scores"].double().numpy()}
    layers = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("gates.")})
    if layers:
        out["gates"] = [{k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"gates.{i}.")}
                        for i in layers]
    return out


# what each press needs handed over (else kvpress would download it for a model it knows)
NEEDS = {"QFilterPress": "q_filters", "FastKVzipPress": "gates", "DuoAttentionPress": "duo", "LUKVPress": "curve",
         "ExpectedAttentionStatsPress": "query_stats"}


class Worker:
    def __init__(self, model_dir: str, threads: int | None):
        if threads:
            torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
        if self.tokenizer.eos_token_id is not None:
            self.eos.add(self.tokenizer.eos_token_id)
        self.decode_states: dict[str, dict] = {}
        self.question_token_by_token = 0  # forwards that needed the per-token workaround (see _question)
        self.last_run = None  # how _prefill produced the last cache: "prefill" or "derived"

    @property
    def attn_modules(self):
        return [layer.self_attn for layer in self.model.model.layers]

    # ------------------------------------------------------------------ commands
    def hello(self, req):
        return {"kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress"),
                "transformers": transformers.__version__, "torch": torch.__version__,
                "threads": torch.get_num_threads(), "attn_implementation": self.model.config._attn_implementation,
                "python": sys.version.split()[0]}

    def prompt_check(self, req):
        data = _read_json(req["samples_file"])
        dummy = SimpleNamespace(tokenizer=self.tokenizer)
        same, same_raw, first_diff = 0, 0, None
        for s in data["samples"]:
            ours = s["head_ids"], s["tail_ids"]
            # kvpress's own formatting, given the context exactly as kvpress_ada puts it in the user turn
            out = KVPressTextGenerationPipeline.preprocess(dummy, s["context"] + "\n\n", [s["question"]], "", 10**9)
            theirs = out["context_ids"][0].tolist(), out["questions_ids"][0][0].tolist()
            if theirs == ours:
                same += 1
            elif first_diff is None:
                first_diff = {"index": s["index"], "task": s["task"], "head_len": [len(ours[0]), len(theirs[0])],
                              "tail": [ours[1], theirs[1]]}
            # kvpress's formatting of the raw context: no separator between context and question
            raw = KVPressTextGenerationPipeline.preprocess(dummy, s["context"], [s["question"]], "", 10**9)
            if (raw["context_ids"][0].tolist(), raw["questions_ids"][0][0].tolist()) == ours:
                same_raw += 1
        return {"n": len(data["samples"]), "identical_with_separator": same, "identical_raw_context": same_raw,
                "first_difference": first_diff}

    def accuracy(self, req):
        data = _read_json(req["samples_file"])
        methods, ratios, max_new = req["methods"], req["ratios"], req["max_new_tokens"]
        aware = bool(req.get("question_aware"))
        kept_sets = req.get("kept_sets", True)
        samples = data["samples"]
        if req.get("indices") is not None:  # a subset (the driver checkpoints sample by sample)
            wanted = set(req["indices"])
            samples = [s for s in samples if s["index"] in wanted]
        ratio_free = set(req.get("ratio_free") or [])
        SUPPLIED.clear()
        SUPPLIED.update(req.get("supplied") or {})
        OURS.clear()
        OURS.update(req.get("ours") or {})
        handed = self._handed(req.get("handed"))
        caches = req.get("caches")  # None: DynamicCache only (the records carry no cache fields)
        pressed = [(m, r) for m in methods for r in ([0.0] if m in ratio_free else ratios)]
        configs = [("full", 0.0, "dynamic")]  # the full DynamicCache first: every cache's bytes reference
        for spec in caches or ["dynamic"]:
            configs += ([] if spec == "dynamic" else [("full", 0.0, spec)]) + [(m, r, spec) for m, r in pressed]
        records, masks, presses = [], {}, {}
        start = time.perf_counter()
        setting = "question-aware" if aware else "question-agnostic"
        bar = tqdm(total=len(samples) * len(configs), desc=f"kvpress {setting} (one prefill per press)",
                   unit="run", file=sys.stderr, dynamic_ncols=True, disable=bool(req.get("quiet")))
        for s in samples:
            head = torch.tensor([s["head_ids"]])
            tail = torch.tensor([s["tail_ids"]])
            by_cache: dict[str, dict] = {}  # per cache: what later configs of this sample derive from
            for method, ratio, spec in configs:
                shared = by_cache.setdefault(spec, {}) if req.get("fanout", True) else None
                label = method if spec == "dynamic" else f"{method}+{spec}"
                press = build_press(method, ratio)
                presses[label if method == "full" else f"{label}@{ratio}"] = repr(press)
                self._hand_over(press, handed, tail.shape[1], aware)
                prompt = torch.cat([head, tail], dim=1) if aware else head
                with self._attention("eager" if needs_eager(press) else None):
                    t0 = time.perf_counter()
                    cache, keep, logits = self._prefill(press, prompt, record=kept_sets, lm_head=aware,
                                                        shared=shared, cache_spec=spec)
                    prefill_s = time.perf_counter() - t0
                    parts = _quantized_bytes(cache) if isinstance(cache, QuantizedCache) else None
                    kv_bytes = _cache_bytes(cache) if parts is None else parts["total"]
                    # KVPressTextGenerationPipeline: after a press that re-rotates the keys it keeps to 0 .. n-1, the
                    # question (or the answer) continues at n, layer 0's kept count
                    start_at = cache.get_seq_length() if rerotates(press) else prompt.shape[1]
                    t0 = time.perf_counter()
                    if aware:  # the whole prompt was compressed; answer from the prefill's last logits
                        tokens = self._greedy(cache, logits, start_at, max_new)
                    else:
                        tokens = self._answer(cache, start_at, tail, max_new)
                    answer_s = time.perf_counter() - t0
                rec = {"sample": s["index"], "task": s["task"], "label": label, "ratio": ratio, "tokens": tokens,
                       "kv_bytes": kv_bytes, "prefill_s": prefill_s, "answer_s": answer_s,
                       "context_len": int(prompt.shape[1]), "kvpress_run": self.last_run}
                if caches is not None:
                    rec.update(method=method, cache=spec)
                if parts is not None:  # bytes after compression, and after the question + answer (residual grown)
                    rec.update(kv_bytes_parts=parts, kv_bytes_end=_quantized_bytes(cache))
                if isinstance(press, OWN_BUDGET):  # the fraction of entries it masked or evicted (its own measure)
                    rec["achieved_ratio"] = float(press.compression_ratio)
                if keep is not None:
                    rec["kept_per_head"] = keep.sum(-1).tolist()  # [layers][heads]
                    masks[f"{method}|{ratio}|{s['index']}"] = np.packbits(keep.numpy().reshape(-1))
                    masks[f"{method}|{ratio}|{s['index']}|shape"] = np.array(keep.shape)
                records.append(rec)
                del cache
                bar.update(1)
        bar.close()
        if req.get("masks_file"):
            np.savez_compressed(req["masks_file"], **masks)
        kept = sorted({k.split("|")[0] for k in masks})
        out = {"records": records, "kept_set_methods": kept, "presses": presses,
               "seconds": time.perf_counter() - start, "question_token_by_token": self.question_token_by_token}
        if caches is not None:
            out["caches"] = {spec: self._cache_info(spec) for spec in caches}
        return out

    def _new_cache(self, spec: str):
        """``dynamic``: kvpress's default ``DynamicCache``; ``<backend>-int<bits>``: transformers'
        ``QuantizedCache(backend, config, nbits)`` with its other defaults (as kvpress's pipeline builds it)."""
        if spec == "dynamic":
            return DynamicCache()
        backend, bits = spec.split("-int")
        return QuantizedCache(backend=backend, config=self.model.config, nbits=int(bits))

    def _cache_info(self, spec: str) -> dict:
        """The class and parameters of the cache built for ``spec`` (read from its first layer)."""
        if spec == "dynamic":
            return {"class": "DynamicCache"}
        layer = self._new_cache(spec).layers[0]
        backend = spec.split("-int")[0]
        dist = {"quanto": "optimum-quanto", "hqq": "hqq"}.get(backend, backend)
        return {"class": "QuantizedCache", "layer_class": type(layer).__name__, "backend": backend,
                "backend_version": _dist_version(dist), "nbits": layer.nbits, "axis_key": layer.axis_key,
                "axis_value": layer.axis_value, "q_group_size": layer.q_group_size,
                "residual_length": layer.residual_length}

    def decode_setup(self, req):
        head = torch.tensor([req["head_ids"]])
        self.decode_tail = torch.tensor([req["tail_ids"]])
        configs = [("full", 0.0)] + [(m, r) for m in req["methods"] for r in req["ratios"]]
        out = {}
        self.decode_states.clear()
        for method, ratio in tqdm(configs, desc=f"kvpress prefill at {head.shape[1]} tokens", file=sys.stderr,
                                  dynamic_ncols=True):
            press = build_press(method, ratio)
            self._hand_over(press, self._handed(req.get("handed")), len(req["tail_ids"]), False)
            t0 = time.perf_counter()
            cache, _, _ = self._prefill(press, head, record=False)
            prefill_s = time.perf_counter() - t0
            key = f"{method}|{ratio}"
            self.decode_states[key] = {
                "cache": cache, "length": int(head.shape[1]),
                "lengths": [layer.keys.shape[2] for layer in cache.layers],
                "masked": [getattr(m, "masked_key_indices", None) for m in self.attn_modules],
            }
            out[key] = {"kv_bytes": _cache_bytes(cache), "prefill_s": prefill_s}
        return {"configs": out}

    @torch.inference_mode()
    def decode(self, req):
        st = self.decode_states[req["config"]]
        cache, length, steps = st["cache"], st["length"], req["steps"]
        for m, masked in zip(self.attn_modules, st["masked"]):
            m.masked_key_indices = masked  # AdaKV's per-module state belongs to the cache being decoded
        _truncate(cache, st["lengths"])
        tail = self.decode_tail
        out = self._question(cache, length, tail)
        next_id = out.logits[:, -1].argmax(-1, keepdim=True)
        p = length + tail.shape[1]
        t0 = time.perf_counter()
        for i in range(steps):
            out = self.model(input_ids=next_id, past_key_values=cache, position_ids=torch.tensor([[p + i]]))
            next_id = out.logits[:, -1].argmax(-1, keepdim=True)
        seconds = time.perf_counter() - t0
        _truncate(cache, st["lengths"])
        return {"seconds": seconds, "steps": steps}

    # ------------------------------------------------------------------ helpers
    def _handed(self, path: str | None) -> dict:
        """:func:`read_handed` of ``path`` (read once per path); ``{}`` for None."""
        if path is None:
            return {}
        if getattr(self, "_handed_path", None) != path:
            self._handed_cache, self._handed_path = read_handed(path), path
        return self._handed_cache

    def _hand_over(self, press, handed: dict, tail_len: int, aware: bool) -> None:
        """Hand ``press`` what it would download (``handed``) and FinchPress its window: the question, as kvpress's
        delimiter token would find it after the context (question-aware); without a question in the prompt
        (question-agnostic), our preset's window (``ours['finch']['window_size']``). The delimiter id is set to
        -1, which no prompt holds."""
        if press is None:
            return
        for p in kp.presses(press):
            need = NEEDS.get(type(p).__name__)
            if need is not None and handed.get(need) is None:
                raise ValueError(f"{type(p).__name__} needs the request's handed {need} (kvpress would download them "
                                 "for the models it knows)")
        attrs = {}
        if isinstance(press, FinchPress):
            window = tail_len if aware else (OURS.get("finch") or {}).get("window_size")
            if window is None:
                raise ValueError("finch question-agnostic needs the request's ours['finch']['window_size']")
            attrs = {"window_size": int(window), "delimiter_token_id": -1}
        kp.hand_over(press, {**handed, "attrs": attrs}, self.model)

    @contextmanager
    def _attention(self, implementation: str | None):
        """The model's attention implementation set to ``implementation`` for the block (None: unchanged)."""
        if implementation is None:
            yield
            return
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = implementation
        try:
            yield
        finally:
            config._attn_implementation = before

    @torch.inference_mode()
    def _prefill(self, press, head: torch.Tensor, record: bool = True, lm_head: bool = False, shared=None,
                 cache_spec: str = "dynamic"):
        """kvpress's prefill (``KVPressTextGenerationPipeline._forward``): hooks on, model without LM head
        (with it, last position only, when the answer starts right after the prefill).

        With ``record``, also the kept set ``[layers, kv_heads, L]`` of presses whose kept set can be
        read without changing them (see :meth:`_kept`); None for the others and for the full cache.

        ``shared`` (a dict per sample, or None for one prefill per press) lets configs reuse kvpress's own
        work on identical inputs: the full-cache run captures every layer's ``compress`` inputs, and
        :func:`derivable` presses call their ``compress`` on them; the first KVzipPress of a sample runs
        for real (prefill + context reconstruction) and later ones (other ratio / ``layerwise``) call
        ``compress_post`` on its reconstruction scores, which depend on neither.

        ``cache_spec`` other than ``dynamic``: the prefill goes into a ``QuantizedCache`` (kvpress's hook then
        compresses its dequantized keys and values and quantizes what it keeps); derived presses compress the
        dequantized tensors captured by :class:`QuantizedCapturePress` and quantize the result with the cache's
        own ``update``, as the hook does; KVzipPress always runs for real, and kept sets are not read."""
        quantized = cache_spec != "dynamic"
        record = record and not quantized
        cache = self._new_cache(cache_spec)
        scores: dict[int, torch.Tensor] = {}
        inner = press.press if isinstance(press, AdaKVPress) else press
        if record and isinstance(inner, ScorerPress):
            original = inner.score

            def score(module, *args, **kwargs):
                s = original(module, *args, **kwargs)
                scores[module.layer_idx] = s.detach().clone()  # AdaKVPress scatters into s afterwards
                return s

            inner.score = score
        logits = None
        self.last_run = "derived"
        if shared is not None and "layers" in shared and press is not None and derivable(press):
            logits = shared["logits"]
            self._reset_masks()
            press.post_init_from_model(self.model)
            for i, (module, hidden, keys, values, attn, kwargs) in sorted(shared["layers"].items()):
                keys, values = press.compress(module, hidden, keys.clone(), values.clone(), attn, kwargs)
                cache.update(keys, values, i)
        elif shared is not None and replay_key(press) in shared and not quantized:
            reused = shared[replay_key(press)]
            logits = reused["logits"]
            for i, layer in enumerate(reused["cache"].layers):
                cache.update(layer.keys.clone(), layer.values.clone(), i)
            self._reset_masks()
            press.score_val = reused["scores"].clone()  # compress_post overwrites the sinks' scores
            press.compress_post(self.model)
        else:
            self.last_run = "prefill"
            capture = None
            if shared is not None and press is None:
                capture = QuantizedCapturePress() if quantized else CapturePress()
            if shared is not None and isinstance(press, KVzipPress) and not quantized:
                compress_post = press.compress_post

                def keep_scores(model):
                    shared["kvzip_scores"] = press.score_val.clone()
                    return compress_post(model)

                press.compress_post = keep_scores
            context = press or capture
            with context(self.model) if context is not None else nullcontext():  # KVzipPress compresses on exit
                if lm_head:
                    logits = self.model(input_ids=head, past_key_values=cache, logits_to_keep=1).logits[:, -1]
                else:
                    self.model.model(input_ids=head, past_key_values=cache)
            if capture is not None:
                shared.update(layers=capture.layers, logits=logits)
            if "kvzip_scores" in (shared or {}):
                pristine = DynamicCache()
                for i, layer in enumerate(cache.layers):
                    pristine.update(layer.keys.clone(), layer.values.clone(), i)
                shared[replay_key(press)] = {"cache": pristine, "scores": shared.pop("kvzip_scores"),
                                             "logits": logits}
        if not record or press is None:
            return cache, None, logits
        return cache, self._kept(press, scores, cache, head.shape[1]), logits

    def _reset_masks(self):
        """What a prefill does to kvpress's masking state (attention_patch: a prefill call sets None)."""
        for m in self.attn_modules:
            m.masked_key_indices = None

    def _kept(self, press, scores, cache, length: int) -> torch.Tensor | None:
        """Bool ``[layers, kv_heads, L]``: the tokens each (layer, head) still attends to, read by mechanism:

        - masking presses (AdaKVPress, KVzipPress) leave ``masked_key_indices`` on every attention module
          (the prefill resets them, so they belong to this press) and keep the full cache;
        - ScorerPress subclasses gather ``topk(scores, n_kept)``: the same call on the scores recorded
          during the prefill gives the same set (checked against the cache length);
        - anything else: None (no kept-set comparison for it)."""
        masked = [getattr(m, "masked_key_indices", None) for m in self.attn_modules]
        keeps = []
        for i, module in enumerate(self.attn_modules):
            H = cache.layers[i].keys.shape[1]
            if any(m is not None for m in masked):
                keep = torch.ones(H, length, dtype=torch.bool)
                if masked[i] is not None:
                    _, heads, pos = masked[i]
                    keep[heads, pos] = False
                assert cache.layers[i].keys.shape[2] == length
            elif i in scores:
                s = scores[i][0]  # [H, L]
                keep = torch.zeros_like(s, dtype=torch.bool)
                # the same topk call on the same scores the press made (ScorerPress / PyramidKVPress.compress)
                n_kept = press.get_layer_budget(module, length) if isinstance(press, PyramidKVPress) \
                    else compute_n_kept(length, press.compression_ratio)
                keep.scatter_(-1, s.topk(n_kept, dim=-1).indices, True)
                assert cache.layers[i].keys.shape[2] == n_kept, (cache.layers[i].keys.shape, n_kept)
            else:
                return None
            keeps.append(keep)
        return torch.stack(keeps)

    @torch.inference_mode()
    def _question(self, cache, length: int, tail: torch.Tensor):
        """The question forward of ``generate_answer`` (true RoPE positions after the context).

        Workaround: when layers hold different numbers of tokens (PyramidKVPress), transformers builds
        one causal mask sized from layer 0 and a multi-token forward fails in every other layer
        ("The size of tensor a ... must match the size of tensor b ..."), in kvpress's own pipeline
        too. Then the question goes in one token at a time, which is the same computation (causal),
        and needs no mask (SDPA skips it for a single query).
        """
        if isinstance(cache, QuantizedCache):  # its layers hold an empty residual after the prefill
            lengths = {layer.get_seq_length() for layer in cache.layers}
        else:
            lengths = {layer.keys.shape[2] for layer in cache.layers}
        if len(lengths) == 1:
            pos = torch.arange(length, length + tail.shape[1])[None]
            return self.model(input_ids=tail, past_key_values=cache, position_ids=pos, logits_to_keep=1)
        self.question_token_by_token += 1
        for j in range(tail.shape[1]):
            out = self.model(input_ids=tail[:, j:j + 1], past_key_values=cache,
                             position_ids=torch.tensor([[length + j]]), logits_to_keep=1)
        return out

    @torch.inference_mode()
    def _answer(self, cache, length: int, tail: torch.Tensor, max_new: int) -> list[int]:
        """``KVPressTextGenerationPipeline.generate_answer``: true RoPE positions, greedy, stop at EOS."""
        out = self._question(cache, length, tail)
        return self._greedy(cache, out.logits[:, -1], length + tail.shape[1], max_new)

    @torch.inference_mode()
    def _greedy(self, cache, logits: torch.Tensor, p: int, max_new: int) -> list[int]:
        """Greedy answer from next-token ``logits`` whose first token sits at RoPE position ``p``."""
        next_id = logits.argmax(-1, keepdim=True)
        tokens = []
        for step in range(max_new):
            token = int(next_id[0, 0])
            if token in self.eos:
                break
            tokens.append(token)
            if step + 1 == max_new:
                break
            out = self.model(input_ids=next_id, past_key_values=cache, position_ids=torch.tensor([[p + step]]))
            next_id = out.logits[:, -1].argmax(-1, keepdim=True)
        return tokens


def _cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _nbytes(t) -> int:
    """Bytes of a tensor; a tensor subclass (quanto's packed and quantized tensors) counts its inner tensors."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


QUANTO_PARTS = {"_data": "data", "_scale": "scale", "_shift": "zero_point"}  # WeightQBitsTensor's inner tensors
HQQ_PARTS = {"scale": "scale", "zero": "zero_point"}  # tensors of HQQ's meta dict


def _quantized_bytes(cache) -> dict:
    """Bytes a ``QuantizedCache`` holds, by part: the quantized keys and values (``data``: quanto's packed
    uint8 / HQQ's packed tensor), their ``scale`` and ``zero_point`` (quanto's ``_shift``, HQQ's ``zero``),
    any ``other`` tensor of HQQ's meta, and the full-precision ``residual`` (``layer.keys``/``layer.values``:
    the tokens appended since the last quantization, at most ``residual_length``); ``total`` sums them."""
    parts = {"data": 0, "scale": 0, "zero_point": 0, "other": 0, "residual": 0}
    for layer in cache.layers:
        for q in (layer._quantized_keys, layer._quantized_values):
            if isinstance(q, tuple):  # HQQ: (packed tensor, meta)
                data, meta = q
                parts["data"] += _nbytes(data)
                for k, v in meta.items():
                    if torch.is_tensor(v):
                        parts[HQQ_PARTS.get(k, "other")] += _nbytes(v)
            else:  # quanto: WeightQBitsTensor
                names, _ = q.__tensor_flatten__()
                for n in names:
                    parts[QUANTO_PARTS.get(n, "other")] += _nbytes(getattr(q, n))
        parts["residual"] += _nbytes(layer.keys) + _nbytes(layer.values)
    parts["total"] = sum(parts.values())
    return parts


def _truncate(cache, lengths):
    """kvpress's ``_remove_answer_from_cache``: drop what decoding appended."""
    for layer, n in zip(cache.layers, lengths):
        layer.keys = layer.keys[:, :, :n]
        layer.values = layer.values[:, :, :n]


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def _dist_version(name):
    from importlib.metadata import version
    return version(name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="converted model directory")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    worker = Worker(args.model, args.threads)
    reply({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.get("cmd")
        if cmd == "quit":
            reply({"bye": True})
            return
        try:
            reply({"ok": True, **getattr(worker, cmd)(req)})
        except Exception as exc:  # report to the driver, which raises
            import traceback
            traceback.print_exc()
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def reply(obj):
    PROTO.write(json.dumps(obj) + "\n")
    PROTO.flush()


if __name__ == "__main__":
    main()
