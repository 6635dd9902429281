"""Least-squares polynomial fits with the standard error of every coefficient (the scaling section's
per-unit costs; bench/scaling_fit.py predicts from them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class Fit:
    """y = coef[0] + coef[1] x + coef[2] x^2 ...; ``se`` the standard error of each coefficient."""

    coef: tuple[float, ...]
    se: tuple[float | None, ...]
    r2: float | None
    n: int

    @property
    def intercept(self) -> float:
        return self.coef[0]

    @property
    def slope(self) -> float:
        return self.coef[1]

    @property
    def slope_se(self) -> float | None:
        return self.se[1]

    def at(self, x: float) -> float:
        return sum(c * x ** k for k, c in enumerate(self.coef))

    def row(self, name: str) -> dict[str, Any]:
        """A flat record: ``name``, ``c0``.., ``c0_se``.., r2, n."""
        out: dict[str, Any] = {"fit": name, "n": self.n, "r2": self.r2}
        for k, (c, s) in enumerate(zip(self.coef, self.se)):
            out[f"c{k}"], out[f"c{k}_se"] = c, s
        return out


def fit(xs: Sequence[float], ys: Sequence[float], degree: int = 1) -> Fit:
    """Least squares of ``ys`` on a polynomial of ``xs``; raises ValueError with too few distinct xs."""
    if len(xs) != len(ys):
        raise ValueError(f"fit needs as many ys as xs, got {len(xs)} and {len(ys)}")
    if len(set(xs)) < degree + 1:
        raise ValueError(f"a degree-{degree} fit needs at least {degree + 1} distinct x values, got {len(set(xs))}")
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    design = np.vander(x, degree + 1, increasing=True)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    dof = len(x) - (degree + 1)
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float((resid ** 2).sum()) / total if total > 0 else None
    if dof <= 0:
        return Fit(tuple(map(float, coef)), (None,) * (degree + 1), r2, len(x))
    sigma2 = float((resid ** 2).sum()) / dof
    cov = sigma2 * np.linalg.inv(design.T @ design)
    return Fit(tuple(map(float, coef)), tuple(math.sqrt(max(v, 0.0)) for v in np.diag(cov)), r2, len(x))
