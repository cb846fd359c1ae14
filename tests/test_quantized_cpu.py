"""The fused CPU kernel of quantized attention (kvpress_ada/kernels/quantized/cpu_kernel.c) against the torch reference,
and its build: cached per source and machine, refused in one warning when no compiler works, off by variable."""

import ctypes
import fnmatch
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from attention_oracle import dense_attention
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quantized_kernels import EXTRAS, _cache, _read_back, _records, _sinks, int_layout

from kvpress_ada import kernels
from kvpress_ada.kernels.quantized import cpu_kernel as quantized_cpu
from kvpress_ada.kernels.quantized import scheme as qz

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernel cannot be built")


def test_kernel_builds_where_a_compiler_is():
    assert quantized_cpu.cpu_kernel()


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.sampled_from(["int4", "int8", "e4m3"]),
       st.sampled_from([(32, 16), (64, 32), (64, 64), (128, 32), (48, 24), (64, 0), (128, 0)]), st.integers(1, 2),
       st.sampled_from([1, 3]), st.integers(1, quantized_cpu.MAX_QUERIES),
       st.lists(st.integers(0, 70), min_size=4, max_size=4), st.sampled_from([0, 1, 5, 32]), st.integers(0, 999),
       st.sampled_from([0, 16]))
def test_kernel_equals_reference(dtype, encoding, dims, B, G, Q, lens, residual, seed, scale_bits):
    """Specialised (head dim 64 / 128, groups of 32 / 64, e4m3 with one scale per head) and generic shapes, every
    scale dtype (float16 scales of float32 entries too), rows empty, shorter than the queries, shorter and longer
    than the ring."""
    D, group = dims
    if encoding == "e4m3":
        layout = qz.RecordLayout("e4m3", 8, group, rotate_keys=False)
    else:
        layout = qz.RecordLayout("int", int(encoding[3:]), group or D, scale_bits=scale_bits)
    H_kv = 2
    k, v, offs, lens_t = _cache(lens[:B * H_kv], D, dtype, seed=seed)
    k = k + torch.linspace(-3, 5, D).to(dtype)
    k_rec, v_rec, side, _ = _records(k, v, offs, lens_t, layout, residual)
    q = torch.randn(B, H_kv * G, Q, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    got = quantized_cpu.quantized_attention_cpu(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout)
    ref = qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout)
    assert got is not None and got.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    for r, n in enumerate(lens_t.tolist()):  # an empty row, or a query seeing no entry: 0
        b, h = divmod(r, H_kv)
        for i in range(max(Q - n, 0)):
            assert torch.equal(got[b, h * G:(h + 1) * G, i], torch.zeros(G, D, dtype=dtype))


@pytest.mark.parametrize("softcap, with_sinks", EXTRAS)
@settings(max_examples=25, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.sampled_from(["int4", "int8", "e4m3"]),
       st.sampled_from([(32, 16), (64, 32), (64, 64), (128, 32), (48, 24), (64, 0)]), st.integers(1, 2),
       st.sampled_from([1, 3]), st.integers(1, quantized_cpu.MAX_QUERIES),
       st.lists(st.integers(0, 70), min_size=4, max_size=4), st.sampled_from([0, 1, 5]), st.integers(0, 999),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_kernel_with_extras_equals_reference_and_dense(softcap, with_sinks, dtype, encoding, dims, B, G, Q, lens,
                                                       residual, seed, sinks_dtype):
    """Soft-cap (applied in the kernel after each query's ``q . c`` is added to its logits) and sinks (in each
    softmax denominator) on or off: the fused kernel equals the reference, and both the dense formula over the
    read-back keys and values; an empty row or a query seeing no entry gives exact zeros."""
    D, group = dims
    if encoding == "e4m3":
        layout = qz.RecordLayout("e4m3", 8, group, rotate_keys=False)
    else:
        layout = int_layout(int(encoding[3:]), group or D)
    H_kv = 2
    k, v, offs, lens_t = _cache(lens[:B * H_kv], D, dtype, seed=seed)
    k = k + torch.linspace(-3, 5, D).to(dtype)
    k_rec, v_rec, side, centres = _records(k, v, offs, lens_t, layout, residual)
    q = torch.randn(B, H_kv * G, Q, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    sinks = _sinks(H_kv * G, seed, sinks_dtype) if with_sinks else None
    got = quantized_cpu.quantized_attention_cpu(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout,
                                                softcap=softcap or 0.0, sinks=sinks)
    ref = qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens_t, side, D ** -0.5, layout, softcap=softcap,
                                     sinks=sinks)
    deq_k, deq_v = _read_back(k_rec, v_rec, side, centres, offs, lens_t, layout, dtype)
    want = dense_attention(q, deq_k, deq_v, offs, lens_t, D ** -0.5, softcap=softcap, sinks=sinks)
    assert got is not None and got.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    for r, n in enumerate(lens_t.tolist()):
        b, h = divmod(r, H_kv)
        for i in range(max(Q - n, 0)):
            assert torch.equal(got[b, h * G:(h + 1) * G, i], torch.zeros(G, D, dtype=dtype))


def test_longer_calls_go_to_the_reference():
    k, v, offs, lens = _cache([9, 40], 32, torch.float32)
    layout = int_layout(4, 16)
    k_rec, v_rec, side, _ = _records(k, v, offs, lens, layout, 5)
    q = torch.randn(1, 2, quantized_cpu.MAX_QUERIES + 1, 32)
    assert quantized_cpu.quantized_attention_cpu(q, k_rec, v_rec, offs, lens, side, 0.2, layout) is None
    got = kernels.quantized_attention(q, k_rec, v_rec, offs, lens, side, 0.2, layout)
    torch.testing.assert_close(got, qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens, side, 0.2, layout))


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """A build into an empty cache directory; the process's kernel is looked up again afterwards."""
    monkeypatch.setenv("KVPRESS_ADA_CACHE", str(tmp_path))
    quantized_cpu._library.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    quantized_cpu._library.cache_clear()


def test_build_is_cached_by_source_and_machine(fresh_library):
    first = quantized_cpu._build()
    assert first.parent == fresh_library and first.name.startswith("quantized_cpu-") and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert quantized_cpu._build() == first and first.stat().st_mtime_ns == stamp  # found, not rebuilt
    assert [p.name for p in fresh_library.iterdir()] == [first.name]  # no temporary file left


_PROBE = """#include "kvpress_half.h"
void halves(float *out, int dtype) { for (uint32_t h = 0; h < 65536; h++) out[h] = sixteen_to_float(h, dtype); }
"""


def test_shared_header_is_found_and_keys_the_build(fresh_library, tmp_path_factory):
    """A source including the shared header builds against it (every float16 and bfloat16 bit pattern converts as
    torch converts it, signed zeros, subnormals, infinities and NaN included), and an edit of the header alone gives
    another library (the cache key hashes it)."""
    include = tmp_path_factory.mktemp("include")
    shutil.copy(quantized_cpu.INCLUDE / "kvpress_half.h", include)
    source = tmp_path_factory.mktemp("src") / "probe.c"
    source.write_text(_PROBE)
    first = quantized_cpu.build_kernel(source, "probe", include)
    lib = ctypes.CDLL(str(first))
    bits = torch.arange(65536, dtype=torch.int32)
    bits = (bits - 65536 * (bits >= 32768)).to(torch.int16)
    for dtype, code in ((torch.float16, 1), (torch.bfloat16, 2)):
        got = torch.empty(65536, dtype=torch.float32)
        lib.halves(ctypes.c_void_p(got.data_ptr()), code)
        want = bits.view(dtype).float()
        assert torch.equal(got.isnan(), want.isnan())
        number = ~want.isnan()
        assert torch.equal(got[number], want[number]) and torch.equal(got[number].signbit(), want[number].signbit())
    assert quantized_cpu.build_kernel(source, "probe", include) == first  # found, not rebuilt
    (include / "kvpress_half.h").write_text((include / "kvpress_half.h").read_text() + "/* edited */\n")
    second = quantized_cpu.build_kernel(source, "probe", include)
    assert second != first and first.exists() and second.exists()


def test_a_source_edited_after_import_is_not_built(fresh_library, tmp_path_factory):
    """A process whose bindings were imported before its kernel's source (or a shared header) changed refuses to
    build it, naming the file (its ctypes argument types may be those of the old source); the kernel modules then
    warn and run the torch reference. Sources older than the import build as usual."""
    include = tmp_path_factory.mktemp("include")
    shutil.copy(quantized_cpu.INCLUDE / "kvpress_half.h", include)
    source = tmp_path_factory.mktemp("src") / "probe.c"
    source.write_text(_PROBE)
    before = min(source.stat().st_mtime, (include / "kvpress_half.h").stat().st_mtime) - 10.0
    after = max(source.stat().st_mtime, (include / "kvpress_half.h").stat().st_mtime) + 10.0
    with pytest.raises(RuntimeError, match=r"probe\.c, kvpress_half\.h changed after this process imported"):
        quantized_cpu.build_kernel(source, "probe", include, loaded_at=before)
    assert quantized_cpu.build_kernel(source, "probe", include, loaded_at=after).exists()


def test_every_kernel_source_and_shared_header_ships_as_package_data():
    """An installed (non-editable) wheel builds the kernels from its own files: every C source under kernels/ and
    every header it includes (found in the shared include folder) match pyproject's package-data."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(quantized_cpu.__file__).resolve().parents[2]  # the kvpress_ada package
    pyproject = root.parent / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not a source checkout")
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["kvpress_ada"]
    shipped = lambda path: any(fnmatch.fnmatch(path.relative_to(root).as_posix(), p) for p in patterns)  # noqa: E731
    sources = sorted((root / "kernels").glob("*/*.c"))
    assert sources and all(shipped(c) for c in sources)
    included = {name for c in sources for name in re.findall(r'#include "([^"]+)"', c.read_text())}
    assert included  # the shared 16-bit helpers at least
    assert all((quantized_cpu.INCLUDE / name).is_file() and shipped(quantized_cpu.INCLUDE / name) for name in included)


def test_no_compiler_is_one_warning_and_the_reference(fresh_library, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-kvpress")
    with pytest.warns(RuntimeWarning, match="no C compiler .no-such-compiler-kvpress.*torch reference runs"):
        assert not quantized_cpu.cpu_kernel()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        k, v, offs, lens = _cache([7], 16, torch.float32)
        layout = int_layout(8, 16)
        k_rec, v_rec, side, _ = _records(k, v, offs, lens, layout)
        q = torch.randn(1, 1, 1, 16)
        assert quantized_cpu.quantized_attention_cpu(q, k_rec, v_rec, offs, lens, side, 0.25, layout) is None
        got = kernels.quantized_attention(q, k_rec, v_rec, offs, lens, side, 0.25, layout)
    torch.testing.assert_close(got, qz.quantized_attention_ref(q, k_rec, v_rec, offs, lens, side, 0.25, layout))


def test_failing_build_names_the_compiler_error(fresh_library, monkeypatch):
    monkeypatch.setattr(quantized_cpu, "_FLAGS", quantized_cpu._FLAGS + ("-fno-such-flag-kvpress",))
    with pytest.warns(RuntimeWarning, match="failed: .*no-such-flag-kvpress"):
        assert not quantized_cpu.cpu_kernel()
    assert not any(fresh_library.iterdir())  # the failed build's file is removed


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_variable_turns_the_kernel_off(fresh_library, monkeypatch, value):
    monkeypatch.setenv(quantized_cpu.ENV_VAR, value)
    assert not quantized_cpu.cpu_kernel()
    assert not any(fresh_library.iterdir())  # nothing built
    k, v, offs, lens = _cache([9], 16, torch.float32)
    k_rec, v_rec, side, _ = _records(k, v, offs, lens, int_layout(8, 16))
    q = torch.randn(1, 1, 1, 16)
    assert quantized_cpu.quantized_attention_cpu(q, k_rec, v_rec, offs, lens, side, 0.25, int_layout(8, 16)) is None


def test_block_chooses_the_path():
    k, v, offs, lens = _cache([9, 40], 32, torch.float32)
    layout = int_layout(4, 16)
    k_rec, v_rec, side, _ = _records(k, v, offs, lens, layout, 5)
    q = torch.randn(1, 2, 1, 32)
    with quantized_cpu.use_cpu_kernel(False):
        assert not quantized_cpu.cpu_kernel()
        assert quantized_cpu.quantized_attention_cpu(q, k_rec, v_rec, offs, lens, side, 0.2, layout) is None
        with quantized_cpu.use_cpu_kernel(True):
            assert quantized_cpu.quantized_attention_cpu(q, k_rec, v_rec, offs, lens, side, 0.2, layout) is not None
    assert quantized_cpu.cpu_kernel()
