"""``kvpress-ada demo``'s time columns: each row's whole cost (prefill, compression, answer), with the
first calls' warm-up excluded, so the table never shows a press cheaper than it is."""

from __future__ import annotations

import time

import pytest
from conftest import build_model, build_tokenizer

import kvpress_ada.harness.cli as cli
from kvpress_ada.hosts.transformers.fanout import Prefill


@pytest.fixture
def slow_starts(monkeypatch):
    """A model whose first forward costs 2.5 s (warm-up) and presses whose compression of the document costs 1 s."""
    model, tok = build_model("llama", max_position_embeddings=4096), build_tokenizer()
    calls = []

    def first_forward_is_slow(*_):
        if not calls:
            time.sleep(2.5)
        calls.append(1)

    model.register_forward_pre_hook(first_forward_is_slow)
    monkeypatch.setattr(cli, "_load_model", lambda name: (model, tok))
    original = Prefill.compressed_cache

    def slow_compression(self, press):
        if press is not None and self.seq_len > 128:  # the document, not the warm-up's first tokens
            time.sleep(1.0)
        return original(self, press)

    monkeypatch.setattr(Prefill, "compressed_cache", slow_compression)


def _table(out):
    rows = {}
    for line in out.splitlines():
        if line.startswith(("full cache", "snapkv @", "streamingllm @")):
            label = "full cache" if line.startswith("full cache") else line.split()[0]
            prefill, compress, answer, total = (float(x.rstrip("s")) for x in line.split()[-4:])
            rows[label] = (prefill, compress, answer, total)
    return rows


def test_rows_show_their_whole_cost_without_warm_up(slow_starts, capsys):
    assert cli.main(["demo", "--model", "tiny", "--preset", "snapkv", "--compare", "streamingllm", "--ratio", "0.5",
                     "--context", "300", "--max-new-tokens", "3"]) == 0
    rows = _table(capsys.readouterr().out)
    assert set(rows) == {"full cache", "snapkv", "streamingllm"}
    full = rows["full cache"]
    assert max(full[:3]) < 2.0  # the 2.5 s first forward went to the warm-up, not into any column
    for label in ("snapkv", "streamingllm"):
        prefill, compress, answer, total = rows[label]
        assert prefill == full[0]  # one prefill, shared
        assert compress >= 1.0 and abs(prefill + compress + answer - total) <= 0.02
        assert total >= full[3] + 0.7  # compression's cost shows in the press's row
