"""The README and the docs match the tree: links resolve, code blocks parse, the preset table lists
the registered presets, and the two set-up commands that CI and outside checks run stay as they are."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

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
