"""Shared numpy/scipy reference code for the scripts in ``proofs/``.

Everything here is deliberately independent of ``implicit_topk``: plain numpy,
``scipy.optimize.brentq`` for scalar roots and ``scipy.optimize.minimize``
(SLSQP) for the constrained problems.  The scripts are run as files
(``python proofs/<name>.py``); each one puts this folder on ``sys.path`` before
importing this module, and ``load_library`` adds the project root.  The module is
named ``_proofs_common`` so that it cannot clash with another module when the
scripts run inside one pytest process.

Notation (matches the Markdown files): omega(y) = |y|^p / p with p > 1,
g = (omega')^{-1}, g(u) = sign(u) |u|^{1/(p-1)}, h(u) = clip(g(u), 0, 1),
phi(lam) = sum_i h((x_i - lam) / l) - k.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import numpy as np
from scipy.optimize import brentq, minimize

PROOFS_DIR = os.path.dirname(os.path.abspath(__file__))
PROJECT_ROOT = os.path.dirname(PROOFS_DIR)


# --------------------------------------------------------------------------
# omega, its conjugate and the link g
# --------------------------------------------------------------------------
def omega(y, p):
    return np.abs(y) ** p / p


def omega_prime(y, p):
    return np.sign(y) * np.abs(y) ** (p - 1.0)


def omega_conj(u, p):
    """omega*(u) = |u|^q / q with 1/p + 1/q = 1."""
    q = p / (p - 1.0)
    return np.abs(u) ** q / q


def g(u, p):
    """g = (omega')^{-1} = (omega*)' on the whole real line (odd, increasing)."""
    return np.sign(u) * np.abs(u) ** (1.0 / (p - 1.0))


def h(u, p):
    """clip(g(u), 0, 1): the threshold map."""
    return np.clip(g(u, p), 0.0, 1.0)


def phi(lam, x, k, l, p):
    return float(np.sum(h((x - lam) / l, p)) - k)


def primal_objective(y, x, l, p):
    """Objective of the *minimisation* form: l * sum omega(y) - <x, y>."""
    return float(l * np.sum(omega(y, p)) - np.dot(x, y))


# --------------------------------------------------------------------------
# reference solvers
# --------------------------------------------------------------------------
def bracket(x, l):
    """[lo, hi] with phi(lo) = n - k > 0 > -k = phi(hi) (omega'(0)=0, omega'(1)=1)."""
    return float(np.min(x) - l) - 1.0, float(np.max(x)) + 1.0


def threshold_solve(x, k, l, p):
    """Root of phi by Brent's method to machine precision; returns (lam, y)."""
    x = np.asarray(x, dtype=np.float64)
    lo, hi = bracket(x, l)
    lam = brentq(phi, lo, hi, args=(x, k, l, p), xtol=1e-15, rtol=4 * np.finfo(float).eps,
                 maxiter=500)
    return lam, h((x - lam) / l, p)


def slsqp_primal(x, k, l, p, tol=1e-14, y0=None):
    """Solve min_{y in [0,1]^n, sum y = k} l*sum|y|^p/p - <x,y> with SLSQP."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if y0 is None:
        y0 = np.full(n, k / n)
    res = minimize(
        lambda y: l * np.sum(np.abs(y) ** p) / p - x @ y,
        y0,
        jac=lambda y: l * omega_prime(y, p) - x,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * n,
        constraints=[{"type": "eq", "fun": lambda y: np.sum(y) - k,
                      "jac": lambda y: np.ones_like(y)}],
        options={"ftol": tol, "maxiter": 1000},
    )
    return np.clip(res.x, 0.0, 1.0), res


def brute_force_solve(x, k, l, p):
    """Exact solution by enumerating faces, no threshold/phi machinery.

    By the exchange argument (see isotonic_dual.md) the optimum is ordered like
    x, so with x sorted descending the optimum lies in the relative interior of a
    face {y_1..y_a = 1, y_{b+1}..y_n = 0}.  For every such (a, b) minimise over the
    affine set {sum of the middle = k - a} (a 1-D monotone root solve, box
    ignored); keep candidates that are feasible and return the best objective.  The
    optimum lies in the relative interior of one such face and minimises the
    objective over that face's affine hull, so it is among the candidates.
    """
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    order = np.argsort(-x, kind="stable")
    s = x[order]
    cands = []  # (objective, y)
    for a in range(0, n + 1):
        for b in range(a, n + 1):
            y = np.zeros(n)
            y[:a] = 1.0
            mid = slice(a, b)
            r = k - a
            if b == a:
                if abs(r) > 1e-12:
                    continue
            else:
                # a relative-interior point of this face has 0 < y_mid < 1, so 0 < r < b - a
                # (r = 0 or r = b - a is the smaller face with the middle fixed)
                if not (1e-12 < r < (b - a) - 1e-12):
                    continue
                sm = s[mid]
                if b - a == 1:  # one free coordinate: the sum constraint fixes it
                    y[a] = r
                    cands.append((primal_objective(y, s, l, p), y))
                    continue

                def f(mu):
                    return np.sum(g((sm - mu) / l, p)) - r

                lo, hi = np.min(sm) - 10 * l - 1.0, np.max(sm) + 10 * l + 1.0
                while f(lo) < 0:
                    lo -= 2 * (hi - lo)
                while f(hi) > 0:
                    hi += 2 * (hi - lo)
                mu = brentq(f, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)
                y[mid] = g((sm - mu) / l, p)
            if b > a and (np.min(y[mid]) <= 0.0 or np.max(y[mid]) >= 1.0):
                continue  # not in the relative interior of this face
            cands.append((primal_objective(y, s, l, p), y))
    best_y = min(cands, key=lambda c: c[0])[1]
    out = np.empty(n)
    out[order] = best_y
    return out


def hard_topk_mask(x, k):
    k = int(round(k))
    out = np.zeros(x.size)
    out[np.argsort(-x, kind="stable")[:k]] = 1.0
    return out


# --------------------------------------------------------------------------
# the library under test (optional until it exists)
# --------------------------------------------------------------------------
def load_library():
    """Return the ``implicit_topk`` module, or None if the package does not exist.

    Only a *missing* package is tolerated; if the package exists, any error while
    importing it propagates (so a broken library fails the checks).
    """
    if PROJECT_ROOT not in sys.path:
        sys.path.insert(0, PROJECT_ROOT)
    if importlib.util.find_spec("implicit_topk") is None:
        print("  [skip] implicit_topk is not importable yet: library checks skipped")
        return None
    import jax

    jax.config.update("jax_enable_x64", True)
    return importlib.import_module("implicit_topk")


_JITTED = {}


def lib_fn(itk, p, solver):
    """jit-compiled ``(x, k, l) -> soft_topk_mask(x, k, regularization_strength=l, p=p, solver=solver)``.

    k and l are traced (the library accepts arrays for both), so one compilation
    per (p, solver, n) serves every instance; eager calls cost ~0.2 s each.
    """
    import jax

    key = (p, solver)
    if key not in _JITTED:
        _JITTED[key] = jax.jit(
            lambda x, k, l: itk.soft_topk_mask(x, k, regularization_strength=l, p=p, solver=solver))
    return _JITTED[key]


def lib_mask(itk, x, k, l, p, solver="auto"):
    import jax.numpy as jnp

    f = lib_fn(itk, p, solver)
    out = f(jnp.asarray(x, dtype=jnp.float64), jnp.asarray(k, dtype=jnp.float64),
            jnp.asarray(l, dtype=jnp.float64))
    out = np.asarray(out)
    assert out.dtype == np.float64, f"library returned {out.dtype} under x64"
    return out


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)
