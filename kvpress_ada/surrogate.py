"""Learned score surrogates (KVzap, Jégou and Jeblick 2026, arXiv 2601.07891): a small per-layer map
from the hidden state entering an attention layer to the log of a teacher's score (KVzip's or
KVzip+'s measured score) of that token's entry in each kv head.

Per layer ``l`` (``h``: ``[.., hidden]``, the attention module's input after its input norm):

* ``linear``: ``h @ W + b`` (``W [hidden, H_kv]``);
* ``mlp``: ``gelu(h @ W1 + b1) @ W2 + b2`` (``W1 [hidden, width]``, ``W2 [width, H_kv]``);
* ``gate``: Fast KVzip's low-rank sink-attention gate (Kim, Han and Yun, 2026, arXiv 2601.17668), ``d = width``,
  ``S = sinks``, ``G`` the model's query group: per kv head ``k = rms(h @ Wk) * nk`` (``[d]``) and per query head
  ``g`` of its group ``q_g = rms(h @ Wq + bq)_g * nq``; the entry's gate is
  ``mean_g 1 / (1 + sum_s exp(q_g . c_s / sqrt(d) - q_g . k / sqrt(d) - b_g))`` (``c_s [S, d]`` learned sink
  keys per kv head, ``b [H_kv, G]``), in ``(0, 1)``; ``predict`` gives its log. Trained on the teacher's raw score
  by binary cross-entropy (:func:`kvpress_ada.harness.distill.fit_gate`).

Any input standardisation used in training is folded into the weights. A surrogate file is a
safetensors file (tensors ``layers.<l>.<name>``) whose metadata header ``kvpress_ada.surrogate``
holds JSON: format, model identity (:func:`kvpress_ada.calibration.model_identity`), teacher,
kind, training data, sizes, library version and held-out fit quality per layer. A file made for
another model is refused (:meth:`Surrogate.check_model`). ``kvpress-ada distill`` trains one
(:mod:`kvpress_ada.harness.distill`).

``path`` values: a file path, or ``builtin:NAME`` for ``kvpress_ada/surrogates/NAME.safetensors``
shipped with the package (:data:`SHIPPED_MLP`, :data:`SHIPPED_LINEAR`, :data:`SHIPPED_GATE`: the default model,
teacher KVzip).
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import packaged
from .calibration import ModelIdentity, model_identity

FORMAT = "kvpress_ada.surrogate/1"
METADATA_KEY = "kvpress_ada.surrogate"
BUILTIN_PREFIX = packaged.BUILTIN_PREFIX
SUFFIX = ".safetensors"
SHIPPED_MLP = "builtin:smollm2_135m_kvzip_mlp"  # the default model (SmolLM2-135M-Instruct), teacher KVzip
SHIPPED_LINEAR = "builtin:smollm2_135m_kvzip_linear"
SHIPPED_GATE = "builtin:smollm2_135m_kvzip_gate"  # Fast KVzip's gate, the default model, teacher KVzip
_HERE = Path(__file__).resolve().parent / "surrogates"
_TENSORS = {"linear": ("weight", "bias"), "mlp": ("w1", "b1", "w2", "b2"),
            "gate": ("q_w", "q_b", "k_w", "q_norm", "k_norm", "k_base", "b")}
GATE_EPS = 1e-6  # the gate's RMS norm epsilon


class SurrogateError(ValueError):
    """A surrogate file that is missing, malformed, or made for another model."""


class SurrogateMeta(BaseModel):
    """What a surrogate file records besides its weights."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: str = FORMAT
    model: ModelIdentity
    teacher: dict[str, Any] = Field(description="the teacher scorer's name and config")
    kind: Literal["linear", "mlp", "gate"]
    hidden_size: int = Field(ge=1)
    width: int | None = Field(None, ge=1, description="the MLP's hidden width (mlp), the gate's dimension (gate)")
    sinks: int | None = Field(None, ge=1, description="the gate's learned sink keys per kv head (gate only)")
    dtype: str = Field(description="dtype the weights are stored in")
    target: dict[str, Any] = Field(description="what is predicted: log(max(score, floor)), tokens excluded")
    training: dict[str, Any] = Field(description="tasks, seeds, documentation text, samples, context, tokens")
    fit: dict[str, Any] = Field(description="held-out fit quality, per layer and summarised")
    library_version: str
    created: str
    seconds: float | None = None
    command: list[str] | None = None

    @model_validator(mode="after")
    def _check(self) -> "SurrogateMeta":
        if self.format != FORMAT:
            raise ValueError(f"format {self.format!r} is not {FORMAT!r}")
        if (self.kind in ("mlp", "gate")) != (self.width is not None):
            raise ValueError("width is given for kinds 'mlp' and 'gate' and only for them")
        if (self.kind == "gate") != (self.sinks is not None):
            raise ValueError("sinks is given for kind 'gate' and only for it")
        return self

    @property
    def group(self) -> int:
        """Query heads per kv head of the model."""
        config = self.model.config
        return int(config.get("num_attention_heads") or self.model.num_kv_heads) // self.model.num_kv_heads


class Surrogate:
    """Per-layer weights plus :class:`SurrogateMeta`; :meth:`predict` scores a layer's tokens."""

    def __init__(self, layers: list[dict[str, torch.Tensor]], meta: SurrogateMeta | dict[str, Any]):
        self._meta = meta if isinstance(meta, SurrogateMeta) else SurrogateMeta.model_validate(meta)
        m = self._meta
        if len(layers) != m.model.num_layers:
            raise ValueError(f"{len(layers)} layers of weights for a model of {m.model.num_layers} layers")
        shapes = _shapes(m.kind, m.hidden_size, m.width, m.model.num_kv_heads, m.group, m.sinks)
        for i, layer in enumerate(layers):
            if sorted(layer) != sorted(shapes):
                raise ValueError(f"layer {i} has tensors {sorted(layer)}, expected {sorted(shapes)}")
            for name, shape in shapes.items():
                if tuple(layer[name].shape) != shape:
                    raise ValueError(f"layers.{i}.{name} has shape {tuple(layer[name].shape)}, expected {shape}")
        self._layers = [{k: v.detach().cpu().contiguous() for k, v in layer.items()} for layer in layers]
        self._on_device: dict[torch.device, list[dict[str, torch.Tensor]]] = {}

    # ------------------------------------------------------------ what it is
    @property
    def meta(self) -> SurrogateMeta:
        return self._meta

    @property
    def kind(self) -> str:
        return self._meta.kind

    @property
    def teacher(self) -> dict[str, Any]:
        return self._meta.teacher

    @property
    def n_layers(self) -> int:
        return self._meta.model.num_layers

    @property
    def n_kv_heads(self) -> int:
        return self._meta.model.num_kv_heads

    @property
    def hidden_size(self) -> int:
        return self._meta.hidden_size

    def weights(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """The stored tensors of layer ``layer_idx`` (CPU, stored dtype)."""
        return self._layers[layer_idx]

    # ------------------------------------------------------------ using it
    def check_model(self, config: Any, source: str = "this surrogate") -> None:
        """Refuse a model whose fingerprint differs from the one this surrogate was trained on."""
        packaged.refuse_other_model(self._meta.model, model_identity(config), _HERE, SUFFIX,
                                    lambda p: load(p).meta.model.fingerprint, SurrogateError,
                                    source, "was trained for model {made}, not for {other}", "",
                                    "train one with `kvpress-ada distill --model <that model> --out "
                                    "surrogate.safetensors`")

    def predict(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """``[B, H_kv, T]`` float32: the predicted log teacher score of every token of ``hidden
        [B, T, hidden_size]`` (the input of attention layer ``layer_idx``) in each kv head."""
        if not 0 <= layer_idx < self.n_layers:
            raise IndexError(f"layer_idx {layer_idx} is outside this surrogate's {self.n_layers} layers")
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden must be [B, T, {self.hidden_size}], got {list(hidden.shape)}")
        w = self._device_weights(hidden.device)[layer_idx]
        h = hidden.float()
        if self.kind == "linear":
            out = torch.addmm(w["bias"], h.reshape(-1, h.shape[-1]), w["weight"])
        elif self.kind == "gate":
            out = gate_log_scores(w, h.reshape(-1, h.shape[-1]), self.n_kv_heads, self._meta.group)
        else:
            inner = torch.nn.functional.gelu(torch.addmm(w["b1"], h.reshape(-1, h.shape[-1]), w["w1"]))
            out = torch.addmm(w["b2"], inner, w["w2"])
        return out.view(hidden.shape[0], hidden.shape[1], -1).transpose(1, 2).contiguous()

    def _device_weights(self, device: torch.device) -> list[dict[str, torch.Tensor]]:
        found = self._on_device.get(device)
        if found is None:
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable in any mode later
                found = [{k: v.to(device=device, dtype=torch.float32) for k, v in layer.items()}
                         for layer in self._layers]
            self._on_device[device] = found
        return found

    def __repr__(self) -> str:
        width = f", width {self._meta.width}" if self._meta.width else ""
        return (f"Surrogate({self.kind}{width}, teacher {self.teacher.get('name')!r}, "
                f"model {self._meta.model.describe()})")


def gate_log_scores(w: dict[str, torch.Tensor], h: torch.Tensor, heads: int, group: int) -> torch.Tensor:
    """``[N, H_kv]``: the log of Fast KVzip's gate (module docstring) for the tokens ``h [N, hidden]``, from a
    gate layer's float32 tensors ``w``."""
    d = w["k_norm"].shape[0]
    q = (h @ w["q_w"] + w["q_b"]).view(-1, heads, group, d)
    k = (h @ w["k_w"]).view(-1, heads, d)
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + GATE_EPS) * w["q_norm"]
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + GATE_EPS) * w["k_norm"]
    own = (q * k[:, :, None]).sum(-1) / d**0.5 + w["b"]  # [N, H, G]
    sink = torch.einsum("hsd,nhgd->nhgs", w["k_base"], q) / d**0.5  # [N, H, G, S]
    against = torch.cat([torch.zeros_like(own)[..., None], sink - own[..., None]], dim=-1)
    log_gate = -torch.logsumexp(against, dim=-1)  # log 1 / (1 + sum_s exp(sink_s - own))
    return torch.logsumexp(log_gate, dim=-1) - math.log(group)  # log of the mean over the query group


def _shapes(kind: str, hidden: int, width: int | None, heads: int, group: int = 1,
            sinks: int | None = None) -> dict[str, tuple[int, ...]]:
    if kind == "linear":
        return {"weight": (hidden, heads), "bias": (heads,)}
    assert width is not None
    if kind == "gate":
        assert sinks is not None
        return {"q_w": (hidden, heads * group * width), "q_b": (heads * group * width,), "k_w": (hidden, heads * width),
                "q_norm": (width,), "k_norm": (width,), "k_base": (heads, sinks, width), "b": (heads, group)}
    return {"w1": (hidden, width), "b1": (width,), "w2": (width, heads), "b2": (heads,)}


def resolve(path: str) -> Path:
    """The file a ``path`` value names (``builtin:NAME`` is a file shipped in this package)."""
    return packaged.resolve(path, _HERE, SUFFIX)


def load(path: str) -> Surrogate:
    """The surrogate at ``path`` (cached: read once per file version)."""
    return _load(*packaged.version(path, resolve(path), "surrogate", "kvpress-ada distill --out FILE",
                                   SurrogateError), path)


@functools.lru_cache(maxsize=16)
def _load(file: str, mtime_ns: int, size: int, label: str) -> Surrogate:
    try:
        header, tensors = packaged.read_tensors(file, METADATA_KEY)
        meta = SurrogateMeta.model_validate_json(header)
        layers: list[dict[str, torch.Tensor]] = [{} for _ in range(meta.model.num_layers)]
        for key, tensor in tensors.items():
            parts = key.split(".")
            if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or int(parts[1]) >= len(layers):
                raise ValueError(f"unexpected tensor {key!r}")
            layers[int(parts[1])][parts[2]] = tensor
        return Surrogate(layers, meta)
    except Exception as err:  # noqa: BLE001 - safetensors, JSON, pydantic and shape errors all mean one thing
        raise SurrogateError(f"surrogate file {label!r} is not a kvpress-ada surrogate "
                             f"({packaged.why_unreadable(err)})") from None


def save(surrogate: Surrogate, path: str | os.PathLike) -> None:
    """Write ``surrogate`` to ``path`` (through a temporary file: never half a file)."""
    tensors = {f"layers.{i}.{k}": surrogate.weights(i)[k] for i in range(surrogate.n_layers)
               for k in _TENSORS[surrogate.kind]}
    packaged.write_tensors(path, tensors, METADATA_KEY, surrogate.meta.model_dump_json())


__all__ = ["FORMAT", "SHIPPED_GATE", "SHIPPED_LINEAR", "SHIPPED_MLP", "Surrogate", "SurrogateError", "SurrogateMeta",
           "gate_log_scores", "load", "resolve", "save"]
