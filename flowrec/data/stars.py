"""The rating scale of each MovieLens release, as GroupLens's READMEs state it.

100K and 1M rate in whole stars, 1 to 5; 10M, 20M, 25M, 32M and ml-latest in half stars, 0.5 to 5.
A rating off its release's scale (0, 6, -3, 4.5 in whole stars, nan) is no MovieLens rating: read
as one, it became a label (rating >= 4) without a word.

Example:
    >>> off_scale(np.array([1.0, 4.5, 0.0, 5.0, np.nan]), "1M").tolist()
    [False, True, True, False, True]
    >>> off_scale(np.array([0.5, 4.5, 0.0, 5.5]), "20M+").tolist()
    [False, False, True, True]
    >>> scale_text("10M")
    'half stars 0.5 to 5'
"""
from __future__ import annotations

import numpy as np

STAR_STEP = {"100K": 1.0, "1M": 1.0, "10M": 0.5, "20M+": 0.5}  # stars: the step of each release's ratings
TOP_STARS = 5.0  # every release's highest rating


def off_scale(ratings: np.ndarray, release: str) -> np.ndarray:
    """Which of `ratings` (float64) are no rating of `release`'s scale (nan included)."""
    step = STAR_STEP[release]
    with np.errstate(invalid="ignore"):
        steps = ratings / step
        on = np.isfinite(ratings) & (ratings >= step) & (ratings <= TOP_STARS) & (steps == np.floor(steps))
    return ~on


def scale_text(release: str) -> str:
    """`release`'s scale in words."""
    step = STAR_STEP[release]
    return f"whole stars 1 to {TOP_STARS:g}" if step == 1.0 else f"half stars {step:g} to {TOP_STARS:g}"
