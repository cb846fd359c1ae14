#!/usr/bin/env python
"""The wheels the GPU machine lacks: check a wheel folder against that machine's image, or mimic the image here.

``check DIR``: every wheel in DIR is one version of one distribution, builds for CPython 3.12 on manylinux x86_64
(or is pure Python), and every requirement of the carried wheels and of ``kvpress_ada`` (pyproject.toml) is met
by a carried wheel or by a package of the image (its version checked where known). Exit 1 with one line per
problem otherwise.

``base DEST``: link into DEST the import roots (and metadata) of every distribution of this interpreter that the
image also holds, so that ``PYTHONPATH=site:repo:DEST`` with a bare interpreter sees what the GPU machine's
python3 sees (other versions, the same names) and nothing else: the dry run's stand-in for the image.

The image (``nvidia-h200``, device README / KINDS.md, read 2026-11-17): Python 3.12.3 with the packages below.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata as md
import os
import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]

IMAGE_PYTHON = "3.12.3"
IMAGE_PACKAGES = frozenset(canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())
# versions a session saw there (KINDS.md's pip list row); the other packages' versions are unknown
IMAGE_VERSIONS = {canonicalize_name(k): v for k, v in {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "sentencepiece": "0.2.2", "tokenizers": "0.23.2", "torch": "2.11.0", "torchvision": "0.26.0",
    "transformers": "5.17.0", "triton": "3.6.0",
}.items()}
MARKER_ENV = {"python_version": "3.12", "python_full_version": IMAGE_PYTHON, "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def _wheel_tags_ok(tags) -> bool:
    """CPython 3.12 (or any Python 3) on manylinux x86_64, or pure Python."""
    for t in tags:
        interp_ok = t.interpreter in ("py3", "cp312") or (t.abi == "abi3" and t.interpreter.startswith("cp3")
                                                          and int(t.interpreter[3:]) <= 12)
        plat_ok = t.platform == "any" or (t.platform.endswith("_x86_64") and t.platform.startswith("manylinux"))
        if interp_ok and plat_ok:
            return True
    return False


def _requires(whl: Path) -> list[Requirement]:
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def _project_requires() -> list[Requirement]:
    """kvpress_ada's own dependencies (pyproject.toml's ``dependencies``)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    if block is None:
        raise ValueError("pyproject.toml: no 'dependencies = [...]' block found")
    return [Requirement(r) for r in re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)]


def check(folder: Path) -> list[str]:
    """Problems with the wheel folder, one line each (empty: the folder is complete for the image)."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return [f"{folder}: no wheels (run benchmarks/gpu/fetch_wheels.sh)"]
    problems: list[str] = []
    carried: dict[str, tuple[Version, Path]] = {}
    for w in wheels:
        name, version, _, tags = parse_wheel_filename(w.name)
        if name in carried:
            problems.append(f"{w.name}: a second version of {name} ({carried[name][0]} too): keep one")
        if not _wheel_tags_ok(tags):
            problems.append(f"{w.name}: not built for CPython 3.12 on manylinux x86_64 nor pure Python")
        carried[name] = (version, w)
    print(f"{'wheel':<100} {'KiB':>6}")
    for w in wheels:
        print(f"{w.name:<100} {w.stat().st_size // 1024:>6}")
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB")
    if total > 40 * 2**20:
        problems.append(f"{total / 2**20:.1f} MiB of wheels: over 40 MiB (the call carries 64 MiB with the repo)")
    needs = [("kvpress_ada", r) for r in _project_requires()]
    needs += [(f"{name}=={v}", r) for name, (v, w) in carried.items() for r in _requires(w)]
    for who, req in needs:
        if req.marker is not None and not Marker(str(req.marker)).evaluate(MARKER_ENV):
            continue  # an extra, or another platform or Python
        name = canonicalize_name(req.name)
        if name in carried:
            have, where = carried[name][0], "carried"
        elif name in IMAGE_VERSIONS:
            have, where = Version(IMAGE_VERSIONS[name]), "image"
        elif name in IMAGE_PACKAGES:
            if req.specifier:
                print(f"  {who} needs {req}: on the image, its version unknown there")
            continue
        else:
            problems.append(f"{who} needs {req}: neither carried nor on the GPU machine's image")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{who} needs {req}: the {where} version is {have}")
    return problems


def make_base(dest: Path) -> int:
    """Link this interpreter's distributions that the image also holds into ``dest``; returns how many."""
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    for dist in md.distributions():
        if canonicalize_name(dist.metadata["Name"] or "") not in IMAGE_PACKAGES:
            continue
        site = Path(str(dist.locate_file("")))
        roots = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for root in sorted(roots - {"__pycache__"}):
            src, dst = site / root, dest / root
            if src.exists() and not os.path.lexists(dst):
                dst.symlink_to(src)
        n += 1
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="check a wheel folder against the image").add_argument("folder", type=Path)
    sub.add_parser("base", help="link the image's packages of this interpreter into DEST").add_argument(
        "dest", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "base":
        print(f"linked {make_base(args.dest)} distributions that the GPU machine's image also holds into {args.dest}")
        return 0
    problems = check(args.folder)
    for line in problems:
        print(f"PROBLEM: {line}")
    print("wheels complete for the GPU machine" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
