"""Published presses kvpress_ada refuses: one line saying what each would need, from the API and the command line."""

import pytest

from kvpress_ada import preset, preset_names
from kvpress_ada.harness.cli import main
from kvpress_ada.refusals import REFUSED


@pytest.mark.parametrize("name, needs", [("dms", "retrained"), ("restorekv", "LoRA adapter")])
def test_preset_refuses_in_one_line_naming_what_it_needs(name, needs):
    assert name in REFUSED and name not in preset_names()
    with pytest.raises(ValueError, match=needs) as err:
        preset(name, compression_ratio=0.5)
    assert str(err.value).startswith(f"preset {name!r} is not available: ") and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        preset("nope")


@pytest.mark.parametrize("argv", [["eval", "--presets", "dms"], ["demo", "--preset", "restorekv"]])
def test_cli_refuses_in_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "is not available" in err and len(err.splitlines()) == 1
