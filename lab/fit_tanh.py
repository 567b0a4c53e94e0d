"""Lab: the coefficients of the CPU soft-cap's polynomial tanh (tanh_near_zero in
cpp/cpu/row_math.cpp): tanh(y) = y + y^3 P(y^2) on |y| <= LIMIT, P fitted
by iteratively reweighted least squares towards the smallest largest error, then the
error of the float32 Horner evaluation against float64 tanh, which the kernel's comment cites.
  python lab/fit_tanh.py [--limit 1.0] [--terms 6]
"""

from __future__ import annotations

import argparse

import numpy as np


def fit(limit: float, terms: int, rounds: int = 30) -> np.ndarray:
    """P's coefficients, lowest power first, for tanh's absolute error on [0, limit]."""
    nodes = limit / 2 * (1 + np.cos(np.pi * (np.arange(4000) + 0.5) / 4000))
    y = np.concatenate([nodes, np.linspace(1e-4, limit, 4000)])
    z = y * y
    target = (np.tanh(y) - y) / (y * z)
    powers = np.stack([z**i for i in range(terms)], 1)
    weight = y * z  # tanh's error is P's error times y^3
    coef = np.linalg.lstsq(powers * weight[:, None], target * weight, rcond=None)[0]
    for _ in range(rounds):
        err = np.abs(powers @ coef - target) * weight
        weight = weight * (1 + 50 * err / err.max())
        coef = np.linalg.lstsq(powers * weight[:, None], target * weight, rcond=None)[0]
    return coef


def float32_error(coef: np.ndarray, limit: float) -> float:
    """The largest absolute error of the kernel's float32 evaluation on [-limit, limit]."""
    y = np.linspace(-limit, limit, 2_000_001, dtype=np.float32)
    z = y * y
    c = coef.astype(np.float32)
    p = np.full_like(z, c[-1])
    for a in c[-2::-1]:
        p = p * z + a
    th = (y * z) * p + y
    return float(np.abs(th.astype(np.float64) - np.tanh(y.astype(np.float64))).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=1.0)
    parser.add_argument("--terms", type=int, default=6)
    args = parser.parse_args()
    coef = fit(args.limit, args.terms)
    print("coefficients of P (z^0 first):", ", ".join(f"{np.float32(c)!r}f".replace("np.float32(", "").replace(")", "")
                                                       for c in coef))
    print(f"float32 error on |y| <= {args.limit}: {float32_error(coef, args.limit):.3g}")


if __name__ == "__main__":
    main()
