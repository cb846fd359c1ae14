"""kernels.support: the TRITON_INTERPRET rule, the backend choice, and the module layout
(``triton_kernels`` and ``ops`` depend on ``support``, not on each other)."""

import contextlib
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import kernels
from kvpress_ada.kernels import support
from kvpress_ada.kernels.support import parse_triton_interpret, resolve_backend, use_backend

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# ----------------------------------------------------------------------------- TRITON_INTERPRET

TABLE = [
    (None, False),  # unset
    ("", False),
    ("1", True),
    ("0", False),
    ("true", True),
    ("TRUE", True),
    ("True", True),
    ("tRuE", True),
    ("on", True),
    ("ON", True),
    ("On", True),
    ("yes", True),
    ("YES", True),
    ("y", True),
    ("Y", True),
    ("false", False),
    ("off", False),
    ("no", False),
    ("n", False),
    ("2", False),
    ("01", False),
    ("10", False),
    ("-1", False),
    (" 1", False),  # Triton does not strip
    ("1 ", False),
    ("true\n", False),
    ("t", False),
    ("enable", False),
    ("truE1", False),
    ("\u0131", False),  # dotless i: not ASCII
    ("Ｏｎ", False),  # full-width letters: not ASCII
]


@pytest.mark.parametrize("value,expected", TABLE)
def test_parse_triton_interpret_table(value, expected):
    assert parse_triton_interpret(value) is expected


def _case_variants(word: str) -> st.SearchStrategy[str]:
    return st.lists(st.booleans(), min_size=len(word), max_size=len(word)).map(
        lambda ups: "".join(c.upper() if u else c for c, u in zip(word, ups))
    )


WORDS = ["1", "y", "yes", "on", "true", "0", "n", "no", "off", "false", "", "2", "t", "enable"]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(WORDS).flatmap(_case_variants))
def test_parse_triton_interpret_is_case_insensitive(value):
    assert parse_triton_interpret(value) is (value.lower() in ("1", "y", "yes", "on", "true"))


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


_env_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=6)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), _env_text, st.sampled_from(WORDS).flatmap(_case_variants)))
def test_triton_interpret_agrees_with_installed_triton(value):
    """The rule is Triton's own: compare with ``triton.knobs.runtime.interpret``."""
    knobs = pytest.importorskip("triton.knobs")
    with _env("TRITON_INTERPRET", value):
        assert support.triton_interpret() is bool(knobs.runtime.interpret), repr(value)


def test_triton_interpret_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "On")
    assert kernels.triton_interpret()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels.triton_interpret()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not kernels.triton_interpret()


# ----------------------------------------------------------------------------- backend choice


@pytest.fixture
def no_backend_env(monkeypatch):
    monkeypatch.delenv(support.ENV_VAR, raising=False)
    with use_backend(None):
        yield


def test_auto_on_cpu_is_torch(no_backend_env, monkeypatch):
    for interp in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interp)
        assert resolve_backend(torch.device("cpu")) == "torch"
        assert resolve_backend(torch.device("cpu"), head_dim=96) == "torch"


@pytest.mark.parametrize("value", ["0", "", "2", " 1", "off"])
def test_triton_on_cpu_without_interpreter_is_a_clear_error(no_backend_env, monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    with use_backend("triton"), pytest.raises(RuntimeError, match=r"interpreter mode.*TRITON_INTERPRET=1"):
        resolve_backend(torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    with use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        resolve_backend(torch.device("cpu"))


@pytest.mark.parametrize("value", ["1", "true", "ON", "yes"])
def test_triton_on_cpu_with_interpreter(no_backend_env, monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    with use_backend("triton"):
        assert resolve_backend(torch.device("cpu")) == "triton"


def test_auto_unsupported_head_dim_falls_back_with_one_warning(no_backend_env, monkeypatch):
    monkeypatch.setattr(support, "triton_available", lambda: True)
    monkeypatch.setattr(support, "_warned", set())
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    assert resolve_backend(cuda, head_dim=64) == "triton"
    with pytest.warns(UserWarning, match=r"head_dim=96 .*torch reference") as rec:
        assert resolve_backend(cuda, head_dim=96) == "torch"
        assert resolve_backend(cuda, head_dim=96) == "torch"
        assert resolve_backend(cuda, head_dim=96) == "torch"
    assert len(rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend(cuda, head_dim=96) == "torch"  # still no second warning
        assert resolve_backend(cuda, head_dim=128) == "triton"


def test_auto_without_triton_is_torch_even_on_cuda(no_backend_env, monkeypatch):
    monkeypatch.setattr(support, "triton_available", lambda: False)
    assert resolve_backend(torch.device("cuda"), head_dim=64) == "torch"


def test_check_head_dim():
    for d in kernels.SUPPORTED_HEAD_DIMS:
        kernels.check_head_dim(d)
    with pytest.raises(ValueError, match=r"head_dim=96 .*\(16, 32, 64, 128, 256\)"):
        kernels.check_head_dim(96)


def test_public_names_are_one_object():
    """The names kept in ``ops`` (and ``triton_kernels``) for old imports are ``support``'s."""
    from kvpress_ada.kernels.ragged import ops

    names = ["BACKENDS", "ENV_VAR", "SUPPORTED_HEAD_DIMS", "use_backend", "get_backend", "resolve_backend"]
    for name in names + ["triton_available"]:
        assert getattr(ops, name) is getattr(support, name) is getattr(kernels, name), name
    if support.triton_available():
        from kvpress_ada.kernels.ragged import triton_kernel as triton_kernels

        assert triton_kernels.SUPPORTED_HEAD_DIMS is support.SUPPORTED_HEAD_DIMS
        assert triton_kernels.check_head_dim is support.check_head_dim


# ----------------------------------------------------------------------------- module layout

# Run one kernels module in a fresh interpreter with the package __init__s bypassed (the
# packages are bare modules pointing at the real directories), so that sys.modules shows
# exactly what the module itself imports.
_ISOLATED = """
import sys, types
for name in ("kvpress_ada", "kvpress_ada.kernels"):
    m = types.ModuleType(name)
    m.__path__ = [{root!r} + "/" + name.replace(".", "/")]
    sys.modules[name] = m
import importlib
importlib.import_module({module!r})
print(sorted(m for m in sys.modules if m.startswith("kvpress_ada.") and m != "kvpress_ada.kernels"))
"""


def _imports_of(module):
    code = _ISOLATED.format(root=os.path.abspath(ROOT), module=module)
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


def test_triton_kernels_does_not_import_ops():
    pytest.importorskip("triton")
    mods = _imports_of("kvpress_ada.kernels.ragged.triton_kernel")
    assert "kvpress_ada.kernels.ragged.ops" not in mods, mods
    assert "kvpress_ada.kernels.support" in mods


def test_ops_does_not_import_triton_kernels_at_import():
    mods = _imports_of("kvpress_ada.kernels.ragged.ops")
    assert "kvpress_ada.kernels.support" in mods
    assert "kvpress_ada.kernels.ragged.triton_kernel" not in mods, mods


def test_support_imports_no_other_kernels_module():
    assert _imports_of("kvpress_ada.kernels.support") == "['kvpress_ada.kernels.support']"
