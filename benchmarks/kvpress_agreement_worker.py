"""The NVIDIA-kvpress half of ``benchmarks/kvpress_agreement.py``; runs inside the kvpress virtualenv.

Never imports ``kvpress_ada``. Reads one JSON request on stdin (``model``: a saved tiny model's folder;
``cases``: ``label``, ``press`` (a kvpress class name), ``kwargs``, ``ids``, optional ``sketch`` (a ``[D, k]``
Gaussian sketch, the matrix kvpress's ``LeverageScorePress`` draws at random: handed to it instead of
``torch.randn``'s draw so both sides use one matrix), optional ``q_filters`` (``[layers, kv heads, D]``, set
on a ``QFilterPress`` instead of downloading them)); writes one JSON reply on stdout: per case the kept
mask ``[layers, kv heads, L]`` as 0/1 lists, what kvpress's ``ScorerPress.compress`` keeps (the top
``compute_n_kept(L, r)`` scores of each head, read from the press's own ``score`` output), and versions.

Usage (by the driver): ``<kvpress-venv>/bin/python benchmarks/kvpress_agreement_worker.py < request.json``.
"""

from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager

PROTO = sys.stdout
sys.stdout = sys.stderr  # library prints must never corrupt the reply

import kvpress  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from kvpress.presses.leverage_press import LeverageScorePress  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402


@contextmanager
def fixed_sketch(sketch: list | None):
    """``LeverageScorePress.compute_leverage_scores`` with ``torch.randn``'s ``[B, H, D, k]`` draw replaced by
    ``sketch * sqrt(k)`` (kvpress then scales it by ``1/sqrt(k)``) for the duration."""
    if sketch is None:
        yield
        return
    phi = torch.tensor(sketch, dtype=torch.float32)
    original = LeverageScorePress.compute_leverage_scores

    def compute(key_states, sketch_dimension):
        real = torch.randn

        def draw(*shape, device=None, dtype=None, **_):
            B, H, d, k = shape
            assert (d, k) == tuple(phi.shape), (shape, phi.shape)
            return (phi * math.sqrt(k)).to(device=device, dtype=dtype).expand(B, H, d, k)

        torch.randn = draw
        try:
            return original(key_states, sketch_dimension)
        finally:
            torch.randn = real

    LeverageScorePress.compute_leverage_scores = staticmethod(compute)
    try:
        yield
    finally:
        LeverageScorePress.compute_leverage_scores = staticmethod(original)


@torch.inference_mode()
def kept(model, case: dict) -> list:
    press = getattr(kvpress, case["press"])(**case["kwargs"])
    if case.get("q_filters") is not None:
        press.q_filters = torch.tensor(case["q_filters"], dtype=model.dtype)
        press.post_init_from_model = lambda model: None  # the filters are given, not downloaded
    scores: dict[int, torch.Tensor] = {}
    original = press.score

    def score(module, *args, **kwargs):
        s = original(module, *args, **kwargs)
        scores[module.layer_idx] = s.detach().float().clone()
        return s

    press.score = score
    ids = torch.tensor([case["ids"]])
    with fixed_sketch(case.get("sketch")), press(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())
    n_kept = compute_n_kept(ids.shape[1], press.compression_ratio)
    masks = []
    for i in range(len(model.model.layers)):
        s = scores[i][0]
        keep = torch.zeros_like(s, dtype=torch.bool)
        keep.scatter_(-1, s.topk(n_kept, dim=-1).indices, True)
        masks.append(keep.int().tolist())
    return masks


def main() -> None:
    request = json.load(sys.stdin)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(request["model"], dtype=torch.float32).eval()
    reply = {"versions": {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else
                          __import__("importlib.metadata").metadata.version("kvpress"),
                          "transformers": transformers.__version__, "torch": torch.__version__},
             "kept": {case["label"]: kept(model, case) for case in request["cases"]}}
    PROTO.write(json.dumps(reply) + "\n")
    PROTO.flush()


if __name__ == "__main__":
    main()
