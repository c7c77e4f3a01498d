"""What the fuzz targets share: their hypothesis settings and the count of inputs each one ran
(printed in pytest's summary by conftest.py). See conftest.py for how to run longer."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, seed, settings

INPUTS: Counter[str] = Counter()


def fuzz(default_examples: int) -> Callable[[Any], Any]:
    """Settings for one target: `default_examples` inputs (or FUZZ_EXAMPLES), derandomized unless FUZZ_SEED
    picks other inputs, no deadline (the machines are shared and slow), no example database."""
    chosen = os.environ.get("FUZZ_SEED")
    configured = settings(
        max_examples=int(os.environ.get("FUZZ_EXAMPLES") or default_examples),
        derandomize=chosen is None,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )

    def apply(test: Any) -> Any:
        test = configured(test)
        return seed(int(chosen))(test) if chosen is not None else test

    return apply
