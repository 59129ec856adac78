"""Numerical companion of proofs/pallas_bounded_iteration.md (Proposition 17).

Checks:
  1. the ordered key map: strictly increasing on every float16 and on random float32 and
     float64 patterns, -0 == +0; the ordered midpoint lies in the bracket and equals an end
     exactly when the key width is at most 1;
  2. an independent numpy implementation of the bounded pass on step functions (Newton is
     useless: phi' = 0), jumps at floats of every magnitude, bracket [-max, max]: every row
     stops within free + 2 b passes, within one ulp of the jump;
  3. the library's kernel (interpret mode), free_passes = 0: every row certified within
     pass_cap, the mask within the float64 reference's tolerance.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402

import _proofs_common as C  # noqa: E402

INTS = {np.float16: np.int16, np.float32: np.int32, np.float64: np.int64}


def key(v, ftype):
    """kappa(v): sign and magnitude bits -> two's complement (python ints, no overflow)."""
    bits = np.asarray(v, ftype).view(INTS[ftype]).astype(object)
    top = (1 << (8 * np.dtype(ftype).itemsize - 1)) - 1
    return np.array([b if b >= 0 else -(int(b) & top) for b in np.atleast_1d(bits)], dtype=object)


def unkey(u, ftype):
    b = 8 * np.dtype(ftype).itemsize
    out = []
    for value in np.atleast_1d(u):
        value = int(value)
        bits = value if value >= 0 else ((-value) | (1 << (b - 1)))
        out.append(np.array(bits, dtype=np.uint64 if b == 64 else np.uint32 if b == 32
                            else np.uint16).view(ftype))
    return np.array(out, dtype=ftype)


def ordered_mid(lo, hi, ftype):
    u, v = key(lo, ftype)[0], key(hi, ftype)[0]
    return unkey((u + v) // 2, ftype)[0]


def check_keys(rng):
    f16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    f16 = f16[np.isfinite(f16)]
    order = np.argsort(f16.astype(np.float64), kind="stable")
    keys = key(f16[order], np.float16)
    vals = f16[order].astype(np.float64)
    for a, b, ka, kb in zip(vals[:-1], vals[1:], keys[:-1], keys[1:]):
        assert (a < b and ka < kb) or (a == b and ka == kb), (a, b, ka, kb)
    for ftype in (np.float32, np.float64):
        ints = INTS[ftype]
        raw = rng.integers(np.iinfo(ints).min, np.iinfo(ints).max, size=20000, dtype=ints)
        vals = raw.view(ftype)
        vals = vals[np.isfinite(vals)]
        keys = key(vals, ftype)
        order = np.argsort(vals.astype(np.float64) if ftype == np.float32 else vals)
        ks = keys[order]
        vs = vals[order]
        assert all((a < b) == (ka < kb) for a, b, ka, kb in zip(vs[:-1], vs[1:], ks[:-1], ks[1:]))
        assert key(np.array([-0.0], ftype), ftype)[0] == key(np.array([0.0], ftype), ftype)[0] == 0
        big = np.finfo(ftype).max
        assert key(np.array([big], ftype), ftype)[0] < 2 ** (8 * np.dtype(ftype).itemsize - 1)
        for a, b in zip(vs[:-1:97], vs[1::97]):
            m = ordered_mid(a, b, ftype)
            assert a <= m <= b
            width = key(np.array([b], ftype), ftype)[0] - key(np.array([a], ftype), ftype)[0]
            assert (m == a or m == b) == (width <= 1), (a, b, m, width)
    print("1. keys: monotone on every float16 and 2 x 20000 random patterns; midpoint rule")


def bounded_run(jump, ftype, free):
    """phi(t) = +1 for t < jump, -1 for t > jump, 0 at jump; phi' = 0 (Newton never usable).
    Free passes bisect arithmetically (the threshold solver's choice when Newton fails)."""
    big = np.finfo(ftype).max
    lo, hi = ftype(-big), ftype(big)
    lam = ftype(0.0)
    b = 8 * np.dtype(ftype).itemsize
    for t in range(free + 2 * b + 5):
        phi = 1 if lam < jump else (-1 if lam > jump else 0)
        if phi > 0:
            lo = lam
        if phi < 0:
            hi = lam
        if phi == 0:
            return t + 1, lam
        m = ordered_mid(lo, hi, ftype)
        if m == lo or m == hi:  # R4
            return t + 1, (lo if m == lo else hi)
        forced = t >= free and (t - free) % 2 == 0
        lam = m if forced else ftype(lo / 2 + hi / 2)
    raise AssertionError(f"no stop within the cap: jump={jump!r}")


def check_adversarial(rng):
    for ftype in (np.float32, np.float64):
        b = 8 * np.dtype(ftype).itemsize
        tiny = np.finfo(ftype).smallest_subnormal
        jumps = [ftype(0.0), ftype(tiny), ftype(-tiny), np.finfo(ftype).max, -np.finfo(ftype).max,
                 ftype(1e-30), ftype(-3e-38), ftype(1.0), ftype(np.pi)]
        exps = rng.uniform(-1, 1, 40) * (np.log10(np.finfo(ftype).max) - 1)
        jumps += [ftype(s * 10.0 ** e) for s, e in zip(rng.choice([-1, 1], 40), exps)]
        for free in (0, 3, 16):
            worst = 0
            for jump in jumps:
                passes, lam = bounded_run(jump, ftype, free)
                assert passes <= free + 2 * b, (jump, passes)
                assert abs(int(key(np.array([lam], ftype), ftype)[0])
                           - int(key(np.array([jump], ftype), ftype)[0])) <= 1, (jump, lam)
                worst = max(worst, passes)
            print(f"2. {np.dtype(ftype).name} free={free}: worst {worst} passes <= cap "
                  f"{free + 2 * b} on {len(jumps)} step functions")


def check_library(rng):
    lib = C.load_library()
    import jax  # noqa: E402
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp  # noqa: E402
    from implicit_topk.kernels.gpu import bounded_newton, pallas_threshold  # noqa: E402
    from implicit_topk.problems import CappedSimplex, Magnitude  # noqa: E402
    del lib
    x = np.vstack([rng.normal(size=(4, 16)),
                   rng.normal(size=(2, 16)) * 1e-30,
                   rng.normal(size=(2, 16)) * 1e30,
                   np.where(rng.random((2, 16)) < 0.5, 1e-300, 1e300) * rng.normal(size=(2, 16))])
    k = np.array([1.0, 2.5, 7.0, 15.5, 1.0, 3.5, 2.0, 8.0, 1.5, 4.0])
    l = np.array([0.5, 1e-3, 2.0, 0.1, 1e-31, 1.0, 1e29, 1.0, 1e-3, 1e300])
    for problem in (CappedSimplex(), Magnitude()):
        for dtype in (np.float32, np.float64):
            with np.errstate(over="ignore"):  # 1e300 in float32: inf, such rows are dropped
                xd = x.astype(dtype)
                ok = np.isfinite(xd).all(axis=1) & np.isfinite(l.astype(dtype))
            _, passes, certified = pallas_threshold.threshold_rows(
                problem, jnp.asarray(xd[ok]), jnp.asarray(k[ok], dtype),
                jnp.asarray(l[ok], dtype), free_passes=0)
            cap = bounded_newton.pass_cap(dtype, 0)
            assert np.all(np.asarray(certified)), certified
            assert int(np.max(passes)) <= cap, (passes, cap)
            print(f"3. {type(problem).__name__} {np.dtype(dtype).name}: {int(ok.sum())} rows "
                  f"certified, max {int(np.max(passes))} passes <= cap {cap}")


def main():
    rng = np.random.default_rng(16)
    check_keys(rng)
    check_adversarial(rng)
    check_library(rng)
    print("pallas_bounded_iteration: OK")


if __name__ == "__main__":
    main()
