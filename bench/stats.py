"""Summary statistics shared by the benchmark scripts (bench/job.py, bench/net.py, bench/restore.py)."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 <= q <= 1) of `values`: one of the samples, never interpolated."""
    if not values:
        raise ValueError("percentile of no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside 0..1")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
