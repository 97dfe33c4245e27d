"""Numbers as the run report writes them: significant digits, percentages, durations."""
from __future__ import annotations

import math


def sig(x, digits: int = 3) -> str:
    """``x`` rounded to ``digits`` significant digits, in plain notation ("1.01", "0.0812", "12,300");
    "-" for None / NaN."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    x = float(x)
    if x == 0:
        return "0"
    decimals = digits - 1 - math.floor(math.log10(abs(x)))
    r = round(x, decimals)
    if r != 0 and math.floor(math.log10(abs(r))) != math.floor(math.log10(abs(x))):  # 9.996 -> 10.0
        decimals -= 1
        r = round(x, decimals)
    return f"{int(round(r)):,}" if decimals <= 0 else f"{r:.{decimals}f}"


def pct(share) -> str:
    """A share as a percentage of 3 significant digits, without trailing zeros ("12%", "8.12%")."""
    if share is None or (isinstance(share, float) and not math.isfinite(share)):
        return "-"
    s = sig(100.0 * share)
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s + "%"


def seconds(s) -> str:
    """A duration in words ("2 h 5 min", "3 min 20 s", "12.5 s"); "-" for None."""
    if s is None:
        return "-"
    if s >= 3600:
        return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"
    if s >= 120:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{sig(s)} s"
