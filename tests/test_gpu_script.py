"""The one GPU call is self-sufficient: run_all.sh installs the carried wheels, fetch_wheels.sh pins what the GPU
machine lacks, benchmarks/gpu/wheels.py checks a wheel folder, and every result file is written even when a step
fails. No network, no GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "benchmarks" / "gpu"
RESULTS = ("gpu_kernels.json", "gpu_quantized.json", "gpu_e2e.json", "gpu_kernels_sweep.json")


def _wheels_module():
    spec = importlib.util.spec_from_file_location("gpu_wheels", GPU / "wheels.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pins() -> dict[str, str]:
    text = (GPU / "fetch_wheels.sh").read_text()
    return dict(re.findall(r"^\s+([A-Za-z0-9_.-]+)==([0-9][^\s]*)", text, re.M))


def test_run_all_installs_the_carried_wheels_first():
    text = (GPU / "run_all.sh").read_text()
    install = text.index("-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade")
    assert "--target \"$WHEEL_SITE\"" in text and 'WHEEL_DIR=${WHEEL_DIR:-.whl}' in text
    assert "export PYTHONPATH=$WHEEL_SITE:$PWD" in text
    assert install < text.index("bench_kernels.py")
    assert "/.whl/" in (ROOT / ".gitignore").read_text().split()


def test_fetch_wheels_pins_one_version_of_what_the_gpu_machine_lacks():
    pins = _pins()
    for name in ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "transformers"):
        assert name in pins, name
    wanted = [Requirement(r) for r in re.findall(r'^\s*"(transformers[^"]*)"', (ROOT / "pyproject.toml").read_text(),
                                                  re.M)]
    assert wanted and wanted[0].specifier.contains(pins["transformers"])
    assert "--python-version 3.12" in (GPU / "fetch_wheels.sh").read_text()


def _fake_wheel(folder: Path, name: str, version: str, requires=(), tag="py3-none-any") -> Path:
    path = folder / f"{name}-{version}-{tag}.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def _complete_folder(folder: Path) -> None:
    _fake_wheel(folder, "transformers", "5.18.0", ["huggingface-hub<3.0,>=1.31.0", "tqdm>=4.60", "regex"])
    _fake_wheel(folder, "pydantic", "2.14.4", ["pydantic-core==2.50.5", "annotated-types>=0.6.0"])
    _fake_wheel(folder, "pydantic_core", "2.50.5", tag="cp312-cp312-manylinux_2_17_x86_64")
    _fake_wheel(folder, "annotated_types", "0.8.0")


def test_wheel_check_accepts_a_complete_folder(tmp_path):
    _complete_folder(tmp_path)
    assert _wheels_module().check(tmp_path) == []


@pytest.mark.parametrize("case, expected", [
    ("missing", "annotated-types>=0.6.0: neither carried nor on the GPU machine's image"),
    ("two_versions", "a second version of pydantic"),
    ("cp311", "not built for CPython 3.12"),
    ("hub_too_old", "huggingface-hub<3.0,>=2.4.0: the image version is 1.33.0"),
])
def test_wheel_check_names_each_problem(tmp_path, case, expected):
    _complete_folder(tmp_path)
    if case == "missing":
        (tmp_path / "annotated_types-0.8.0-py3-none-any.whl").unlink()
    elif case == "two_versions":
        _fake_wheel(tmp_path, "pydantic", "2.14.3", ["pydantic-core==2.50.5"])
    elif case == "cp311":
        (tmp_path / "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl").unlink()
        _fake_wheel(tmp_path, "pydantic_core", "2.50.5", tag="cp311-cp311-manylinux_2_17_x86_64")
    else:
        (tmp_path / "transformers-5.18.0-py3-none-any.whl").unlink()
        _fake_wheel(tmp_path, "transformers", "5.25.0", ["huggingface-hub<3.0,>=2.4.0"])
    problems = _wheels_module().check(tmp_path)
    assert any(expected in p for p in problems), problems


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_run_all_writes_every_result_file_when_every_step_fails(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(fake), WHEEL_DIR=str(tmp_path / "none"), OUT=str(out))
    proc = subprocess.run(["bash", str(GPU / "run_all.sh"), "--cpu-smoke"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([*RESULTS, "run_all.log"])  # the device call brings back 8 files at most
    for name in RESULTS:
        assert "exit 3" in json.loads((out / name).read_text())["error"]
    assert "== run_all: exit 1" in (out / "run_all.log").read_text()
