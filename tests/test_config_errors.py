"""A refused configuration is one line, in Python as on the command line: ``ConfigError`` is pydantic's
``ValidationError`` (so ``except ValidationError``/``ValueError`` and ``errors()`` work as before) whose
message names the model, the field and the first error, without pydantic's type/input/URL lines."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpress_ada import Pipeline, SnapKV, Threshold, preset
from kvpress_ada.components import ConfigError
from kvpress_ada.harness.cli import main


@pytest.mark.parametrize("build, message", [
    (lambda: Pipeline(scorer=SnapKV()), "Pipeline: give exactly one of compression_ratio"),
    (lambda: SnapKV(window=0), "SnapKV: window: Input should be greater than or equal to 1"),
    (lambda: Pipeline(scorer={"name": "snapkv", "window": -1}, budget=3),
     "Pipeline: scorer.window: Input should be greater than or equal to 1"),
    (lambda: preset("snapkv", compression_ratio=2), "Pipeline: compression_ratio: Input should be less than 1"),
    (lambda: Pipeline.model_validate({"scorer": "nope", "budget": 2}), "Pipeline: scorer: unknown scorer 'nope'"),
    (lambda: Pipeline.model_validate_json('{"scorer": "snapkv", "budget": 0}'),
     "Pipeline: budget: Input should be greater than or equal to 1"),
    (lambda: Pipeline(scorer="kvzip", budget=8, prefill_chunk=4), "Pipeline: prefill_chunk=4 is not supported"),
    (lambda: Pipeline(scorer="snapkv", budget=10**30),
     "Pipeline: budget: Input should be less than or equal to 2147483647"),
    (lambda: Pipeline(scorer="snapkv", decode_budget=10**30, decode_interval=4),
     "Pipeline: decode_budget: Input should be less than or equal to 2147483647"),
    (lambda: Pipeline(scorer="snapkv", allocator=Threshold(tau=float("nan"))),
     "Threshold: tau: Input should be a finite"),
    (lambda: Pipeline(scorer="snapkv", allocator={"name": "threshold", "tau": float("inf")}),
     "Pipeline: allocator.tau: Input should be a finite"),
])
def test_construction_refusal_is_one_line_and_still_a_validation_error(build, message):
    with pytest.raises(ValidationError) as info:
        build()
    err = info.value
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    text = str(err)
    assert "\n" not in text and text.startswith(message), text
    assert "[type=" not in text and "errors.pydantic.dev" not in text and "Value error," not in text
    assert err.errors() and err.error_count() >= 1  # the structured errors are all there


def test_several_errors_say_how_many_more():
    with pytest.raises(ValidationError) as info:
        Pipeline(scorer="snapkv", budget=0, compression_ratio=3)
    assert str(info.value).endswith("(and 1 more errors)")


def test_cli_decode_refusal_is_one_clean_line(capsys):
    code = main(["demo", "--preset", "kvzip", "--decode-budget", "8", "--decode-interval", "4"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("kvpress-ada demo: error: decode compression: KVzip scores from a model pass")
