"""The README and the docs match the tree: links resolve, code blocks parse, the preset table lists
the registered presets, and the two set-up commands that CI and outside checks run stay as they are."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import preset_names

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SETUP = [
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[model]" && kvpress-ada demo',
    'pip install torch==2.13.0 -e ".[test]" && python -m pytest -p no:cacheprovider',
]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def _tracked() -> set[str] | None:
    """Files git tracks (None outside a git checkout): a link to an ignored file breaks in a clone."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return set(out.splitlines()) or None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    tracked = _tracked()
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, doc
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name}: {link} does not exist"
        if tracked is not None and path.is_file():
            assert str(path.relative_to(ROOT)) in tracked, f"{doc.name}: {link} is not in git"
        if anchor:
            assert path.suffix == ".md" and anchor in _anchors(path), f"{doc.name}: no heading for {link}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_parse(doc):
    for block in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S):
        ast.parse(block)


def test_readme_preset_table_lists_every_registered_preset():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| preset | scorer |"):].split("\n\n")[0]
    listed = set(re.findall(r"^\| `(\w+)`(?: / `(\w+)`)?", table, flags=re.M))
    names = {n for pair in listed for n in pair if n}
    assert names == set(preset_names())


def test_setup_commands_unchanged():
    lines = (ROOT / "README.md").read_text().splitlines()
    for command in SETUP:
        assert command in lines


def _readme_api_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The Python API"):]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


def test_readme_api_example_uses_every_import_and_names_each_press_once():
    tree = ast.parse(_readme_api_block())
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    assert imported <= used, f"imported but unused: {imported - used}"
    assigned = [t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name)]
    assert len(assigned) == len(set(assigned)), f"a name is assigned twice: {assigned}"


def test_readme_says_what_a_new_user_needs():
    readme = (ROOT / "README.md").read_text()
    assert "attention_mask" in readme  # a padded batch needs it
    assert re.search(r"`--context`[^.]*at least 64", readme)
    assert "MiB registry download" in readme and ", offline)" not in readme  # the first run downloads
    assert "eager 1.68x" not in readme and re.search(r"median of three runs", readme)


@pytest.mark.parametrize("doc", [ROOT / "README.md", ROOT / "docs" / "usage.md", ROOT / "docs" / "design.md"],
                         ids=lambda p: p.name)
def test_docs_state_the_budget_rule_the_pipeline_enforces(doc):
    text = doc.read_text()
    assert "at most one of `compression_ratio`" not in text and "give at most one" not in text
    assert "exactly one" in text


def test_qwen_details_link_points_to_the_qwen_section():
    readme = (ROOT / "README.md").read_text()
    slices = readme[readme.index("Qwen2.5-Coder slices"):]
    link = re.search(r"\]\(docs/usage\.md#([\w-]+)\)", slices)
    assert link and "qwen" in link.group(1)


def test_python_m_modules_in_the_docs_exist():
    import importlib.util

    for doc in DOCS:
        for module in re.findall(r"python3? -m\s+(kvpress_ada[\w.]*)", doc.read_text()):
            assert importlib.util.find_spec(module) is not None, f"{doc.name}: python -m {module} does not exist"


def test_cli_help_is_plain_text_and_sizes_say_mib():
    from kvpress_ada.harness.cli import build_parser

    assert "``" not in build_parser().format_help()
    for source in (ROOT / "kvpress_ada" / "harness").glob("*.py"):
        assert not re.search(r"2\s*\*\*\s*20[^\n]*\bMB\b", source.read_text()), f"{source.name}: MiB printed as MB"


def test_benchmark_results_in_git_hold_no_per_sample_records():
    tracked = _tracked()
    if tracked is None:
        pytest.skip("not a git checkout")
    results = [f for f in tracked if f.startswith("benchmarks/results/")]
    per_sample = [f for f in results if re.search(r"(quality_(agnostic|aware)|results|partial[^/]*)\.json$", f)]
    assert per_sample == []
    size = sum((ROOT / f).stat().st_size for f in results if (ROOT / f).is_file())
    # the selection goldens (1.6 MB: 13 tiny families x every preset x 2 transformers releases) are a test fixture,
    # tests/fixtures/selection_golden.json, not counted here
    assert size <= 6 * 10**6, f"benchmarks/results holds {size / 1e6:.2f} MB in git (summaries and plots: at most 6 MB)"


def _benchmarks_common():
    """``benchmarks/common.py`` (the benchmarks' shared helpers; the folder is not a package)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    return common


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                     max_leaves=20)


@given(_JSON)
@settings(max_examples=200, deadline=None)
def test_results_json_text_round_trips(payload):
    """The compact writer of results in git loses nothing: scalar lists on one line, everything else one per line."""
    common = _benchmarks_common()
    text = common.dumps_json(payload)
    assert json.loads(text) == payload
    assert all(not line.endswith(" ") for line in text.splitlines())


def test_committed_results_json_uses_the_compact_writer():
    tracked = _tracked()
    if tracked is None:
        pytest.skip("not a git checkout")
    common = _benchmarks_common()
    loose = [f for f in sorted(tracked) if f.startswith("benchmarks/results/") and f.endswith(".json")
             and (ROOT / f).is_file()
             and (ROOT / f).read_text() != common.dumps_json(json.loads((ROOT / f).read_text())) + "\n"]
    assert loose == [], f"rewrite with benchmarks/common.py dumps_json: {loose[:3]}"


def test_plots_are_saved_as_small_palette_pngs(tmp_path):
    """Committed plots go through save_figure: a 256-colour palette PNG, a fraction of matplotlib's RGBA file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from kvpress_ada.harness.eval.report import save_figure

    fig, ax = plt.subplots(figsize=(6, 4))
    for k in range(5):
        ax.plot(range(50), [((i * (k + 3)) % 17) / 17 for i in range(50)], marker="o", label=str(k))
    ax.legend()
    fig.savefig(tmp_path / "rgba.png", dpi=120)
    save_figure(fig, tmp_path / "palette.png", dpi=120)
    plt.close(fig)
    assert Image.open(tmp_path / "palette.png").mode == "P"
    assert (tmp_path / "palette.png").stat().st_size < 0.6 * (tmp_path / "rgba.png").stat().st_size
    assert Image.open(tmp_path / "palette.png").size == Image.open(tmp_path / "rgba.png").size


def test_the_padding_contract_states_its_dtype_caveat():
    design = (ROOT / "docs" / "design.md").read_text()
    contract = design[design.index("A padded row's scores equal the row's scores alone"):][:600]
    assert "in\n  fp32" in contract or "in fp32" in contract.replace("\n  ", " ")
    assert "fp16" in contract and "KVzap" in contract
    from kvpress_ada.scorers.kvzap import __doc__ as kvzap_doc

    assert kvzap_doc is not None and "fp16" in kvzap_doc
