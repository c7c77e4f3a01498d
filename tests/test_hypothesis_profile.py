"""Every property test runs under the suite's hypothesis profile (tests/conftest.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st


def test_the_profile_sets_no_deadline_and_fixed_examples() -> None:
    assert settings().deadline is None
    assert settings().derandomize is True
    assert settings().database is None


seen: list[int] = []


@given(st.integers())
def _draw(value: int) -> None:
    seen.append(value)


def test_a_property_test_draws_the_same_examples_on_every_run() -> None:
    _draw()
    first = list(seen)
    seen.clear()
    _draw()
    assert seen == first and len(first) > 1
