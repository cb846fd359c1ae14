"""``benchmarks/decode_compression.py --config FILE[@R]``: pipeline files teacher-forced beside the built-in configs,
labelled by file name (and ``@R`` when the ratio is set there); bad specs fail in one line before the model loads."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import common  # noqa: E402
import decode_compression as dc  # noqa: E402

CONFIG = "scorer: {name: snapkv}\nreader: {name: top_pages, budget: 32, page_size: 16}\ncompression_ratio: 0.5\n"


@pytest.fixture
def config(tmp_path) -> str:
    path = tmp_path / "snap_read.yaml"
    path.write_text(CONFIG)
    return str(path)


def test_labels_and_ratio_override(config):
    pipelines = common.config_pipelines([config, f"{config}@0.9375"])
    assert list(pipelines) == ["snap_read", "snap_read@0.9375"]
    assert pipelines["snap_read"].compression_ratio == 0.5
    assert pipelines["snap_read@0.9375"].compression_ratio == 0.9375
    assert pipelines["snap_read@0.9375"].reader == pipelines["snap_read"].reader  # only the ratio changes


@pytest.mark.parametrize("suffix, message", [("@1.5", "in [0, 1), got '1.5'"), ("@x", "got 'x'")])
def test_bad_ratio_is_one_line(config, suffix, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        common.config_pipelines([config + suffix])


def test_duplicate_label_and_missing_file(config, tmp_path):
    with pytest.raises(ValueError, match="label 'snap_read' is taken"):
        common.config_pipelines([config, config])
    with pytest.raises(ValueError, match="no such file"):
        common.config_pipelines([str(tmp_path / "missing.yaml")])


def test_cli_errors_before_the_model_loads(config, capsys):
    with pytest.raises(SystemExit):
        dc.parse_args(["--quick", "--config", config + "@-0.1"])
    assert "the ratio after @ must be a number in [0, 1)" in capsys.readouterr().err
