"""Small statistics shared by the benchmark's processes."""
from __future__ import annotations


def percentile(values, q: float):
    """Linear-interpolated percentile (q in 0..100) of the values, or None when empty."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    pos = (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)
