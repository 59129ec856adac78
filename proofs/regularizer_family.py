"""Numerical companion of proofs/regularizer_family.md.

For the built-in regularizers (p-norm p=4/3 and 2, entropy, sigmoid, Laplace):
feasibility, monotonicity, shift invariance, the l -> 0 limit, and the k = 1
reductions (softmax, sparsemax; the Laplace counterexample to seed 001's claim).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402

REGULARIZERS = (("pnorm", 4.0 / 3.0), ("pnorm", 2.0), ("entropy", None), ("sigmoid", None),
                ("laplace", None))


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def sparsemax(z):
    s = np.sort(z)[::-1]
    css = np.cumsum(s) - 1
    r = np.flatnonzero(s - css / np.arange(1, z.size + 1) > 0)[-1] + 1
    return np.maximum(z - css[r - 1] / r, 0)


def laplace_cdf(z):
    return np.where(z < 0, 0.5 * np.exp(np.minimum(z, 0)), 1 - 0.5 * np.exp(-np.maximum(z, 0)))


def main():
    itk = C.load_library()
    print("regularizer_family:")
    if itk is None:
        print("regularizer_family: OK")
        return
    import jax.numpy as jnp

    import jax

    jitted = {}

    def op(x, k, l, name, p):
        """soft_topk_mask, jit-compiled once per (regularizer, n) with k and l traced."""
        key = (name, p, len(x))
        if key not in jitted:
            kwargs = {"p": p} if name == "pnorm" else {"regularizer": name}
            jitted[key] = jax.jit(lambda x, k, l: itk.soft_topk_mask(
                x, k, regularization_strength=l, solver="threshold", **kwargs))
        return np.asarray(jitted[key](jnp.asarray(x), jnp.asarray(k, jnp.float64),
                                      jnp.asarray(l, jnp.float64)))

    rng = np.random.default_rng(7)
    count = 0
    for name, p in REGULARIZERS:
        for _ in range(20):
            n = 10
            x = np.round(rng.normal(size=n) * 2, 1)
            k = float(rng.uniform(0.2, n - 0.2))
            l = float(rng.choice([0.05, 0.5, 3.0]))
            y = op(x, k, l, name, p)
            C.check(np.all((y >= 0) & (y <= 1)) and abs(y.sum() - k) <= 1e-9 * n, f"{name}: feasibility")
            order = np.argsort(x, kind="stable")
            C.check(np.all(np.diff(y[order]) >= -1e-12), f"{name}: monotonicity")
            C.check(np.allclose(op(x + 37.5, k, l, name, p), y, atol=1e-9), f"{name}: shift")
            count += 1
        x = np.array([3.0, -1.0, 2.0, 0.5, -2.0, -3.0, -4.0, 1.5, -5.0, -6.0])
        hard = C.hard_topk_mask(x, 2)
        dists = [np.abs(op(x, 2.0, l, name, p) - hard).sum() for l in (1.0, 0.1, 0.01)]
        C.check(dists[0] >= dists[1] >= dists[2] and dists[2] <= 1e-6, f"{name}: l -> 0 {dists}")
    print(f"  feasibility, monotonicity, shift invariance on {count} instances; l -> 0 limit for all")

    for _ in range(20):
        x = rng.normal(size=10) * 3
        l = float(rng.choice([0.1, 1.0, 5.0]))
        C.check(np.allclose(op(x, 1.0, l, "entropy", None), softmax(x / l), atol=1e-12, rtol=0),
                "entropy k=1 != softmax")
        C.check(np.allclose(op(x, 1.0, l, "pnorm", 2.0), sparsemax(x / l), atol=1e-12, rtol=0),
                "p=2 k=1 != sparsemax")
    print("  k=1: entropy == softmax(x/l), p=2 == sparsemax(x/l) to 1e-12 on 20 instances each")

    y = op(np.array([2.0, 0.0]), 1.0, 1.0, "laplace", None)
    expected = np.array([1 - np.exp(-1) / 2, np.exp(-1) / 2])
    C.check(np.allclose(y, expected, atol=1e-14), f"Laplace counterexample {y}")
    C.check(np.abs(y - softmax(np.array([2.0, 0.0]))).max() > 0.06, "Laplace equals softmax?")
    flat = np.array([0.3, 0.1, -0.2, 0.0, 0.25])  # max softmax prob < 1/2
    C.check(softmax(flat).max() < 0.5, "setup")
    C.check(np.allclose(op(flat, 1.0, 1.0, "laplace", None), softmax(flat), atol=1e-12),
            "Laplace should equal softmax when max prob < 1/2")
    print(f"  Laplace k=1: x=(2,0) gives {np.round(y, 4)} (softmax {np.round(softmax(np.array([2.0, 0.0])), 4)}); "
          "equals softmax when max prob < 1/2")
    print("regularizer_family: OK")


if __name__ == "__main__":
    main()
