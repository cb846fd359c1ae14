"""Scorer strategies derived from the registry, so a newly registered scorer is tested automatically.

Other test modules import ``scorer_strategy`` / ``any_scorer`` / ``scorer_names`` from here: every
registered class is drawn with its fields varied inside their pydantic constraints (kept small so
the tensors stay tiny), with hand-written ranges only where a class is known to need them.
"""

from __future__ import annotations

import types
import typing
from typing import Literal

import annotated_types
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import Scorer, SnapKV, register_scorer
from kvpress_ada.scorers import SCORERS

SMALL = 8  # integer fields range over [lower bound, lower bound + SMALL]


def scorer_names() -> list[str]:
    """Canonical names of every registered scorer (for ``pytest.mark.parametrize``)."""
    return SCORERS.names()


def _bounds(field) -> tuple[float | None, float | None]:
    lo = hi = None
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            lo = m.ge
        elif isinstance(m, annotated_types.Gt):
            lo = m.gt + (1 if isinstance(m.gt, int) else 1e-6)
        elif isinstance(m, annotated_types.Le):
            hi = m.le
        elif isinstance(m, annotated_types.Lt):
            hi = m.lt - (1 if isinstance(m.lt, int) else 1e-6)
    return lo, hi


def _field_strategy(annotation, field) -> st.SearchStrategy | None:
    """Values of one field inside its declared constraints, or ``None`` when the type is unknown."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        parts = [s for s in (_field_strategy(a, field) for a in options) if s is not None]
        if not parts:
            return None
        if type(None) in typing.get_args(annotation):
            parts.append(st.none())
        return st.one_of(parts)
    lo, hi = _bounds(field)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        lo = 0 if lo is None else int(lo)
        return st.integers(lo, int(hi) if hi is not None else lo + SMALL)
    if annotation is float:
        lo = 0.0 if lo is None else float(lo)
        return st.floats(lo, float(hi) if hi is not None else lo + SMALL, allow_nan=False)
    return None


def scorer_strategy(cls: type[Scorer]) -> st.SearchStrategy[Scorer]:
    """Instances of ``cls`` with every field of a known type drawn inside its constraints."""
    fields = {}
    for fname, field in cls.model_fields.items():
        if fname == "name":
            continue
        strategy = _field_strategy(field.annotation, field)
        if strategy is not None:
            fields[fname] = strategy
    drawn = st.fixed_dictionaries(fields)
    if cls.__pydantic_decorators__.model_validators:  # a rule across fields (e.g. length > low_entropy_length)
        return drawn.map(lambda kw: _valid(cls, kw)).filter(lambda s: s is not None)
    return drawn.map(lambda kw: cls(**kw))


def _valid(cls: type[Scorer], kw: dict) -> Scorer | None:
    """``cls(**kw)``, or ``None`` where a rule across its fields refuses the draw."""
    try:
        return cls(**kw)
    except ValueError:
        return None


def any_scorer() -> st.SearchStrategy[Scorer]:
    """Any registered scorer (looked up when called, so late registrations are included)."""
    return st.one_of([scorer_strategy(cls) for cls in SCORERS.classes().values()])


# ----------------------------------------------------------------------------- the helpers follow the registry


@register_scorer("throwaway_registry_test")
class _Throwaway(Scorer):
    """Registered at import only to check that the helpers pick it up (removed again below)."""

    name: Literal["throwaway_registry_test"] = "throwaway_registry_test"
    depth: int = 3
    flag: bool = False

    def query_window(self) -> int:
        return 0

    def score(self, obs):
        return torch.zeros(obs.keys.shape[:3])


_THROWAWAY_NAMES = scorer_names()
_THROWAWAY_STRATEGY = any_scorer()
SCORERS.unregister("throwaway_registry_test")


def test_a_registered_scorer_shows_up_in_the_parametrisation():
    assert "throwaway_registry_test" in _THROWAWAY_NAMES
    assert "throwaway_registry_test" not in scorer_names()  # cleaned up
    assert set(scorer_names()) >= {"snapkv", "streamingllm", "h2o", "tova", "knorm", "expected_attention",
                                   "criticalkv", "random"}


@settings(max_examples=60, deadline=None)
@given(_THROWAWAY_STRATEGY)
def test_a_registered_scorer_is_drawn_by_the_strategy(scorer):
    assert isinstance(scorer, Scorer)


def test_the_strategy_draws_the_throwaway_with_varied_fields():
    seen = set()

    @settings(max_examples=1500, deadline=None, derandomize=True)  # deterministic: one of ~50 scorers
    @given(_THROWAWAY_STRATEGY)
    def collect(scorer):
        if isinstance(scorer, _Throwaway):
            seen.add((scorer.depth, scorer.flag))

    collect()
    assert len(seen) >= 2 and {flag for _, flag in seen} == {False, True}


@settings(max_examples=40, deadline=None)
@given(scorer_strategy(SnapKV))
def test_field_constraints_are_respected(scorer):
    assert 1 <= scorer.window <= 1 + SMALL and 1 <= scorer.kernel <= 1 + SMALL
