"""Tests for the numba PAV kernels (implicit_topk.kernels) against independent references.

References used here do not share code with the kernels:
  * scipy SLSQP on the isotonic problem (and on the Euclidean capped-simplex
    projection for p = 2),
  * the KKT conditions of the isotonic problem checked directly,
  * a plain numpy bisection on phi(lam) = sum clip(g((x - lam)/l), 0, 1) - k.
"""

import ast
import os
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from implicit_topk.kernels.cpu.isotonic_pav import isotonic_pav  # noqa: E402
from implicit_topk.kernels.cpu.pav_capped_simplex import capped_simplex_threshold  # noqa: E402

PS = [4.0 / 3.0, 1.5, 2.0, 3.0]
# each p selects its own numba kernel (about 10 s to compile): the fast suite keeps
# the default p = 4/3, the slow group the others
PS_FAST = PS[:1] + [pytest.param(p, marks=pytest.mark.slow) for p in PS[1:]]
EPS = np.finfo(np.float64).eps


# ----------------------------------------------------------------------------
# independent numpy references
# ----------------------------------------------------------------------------


def g(z, p):
    a = 1.0 / (p - 1.0)
    return np.sign(z) * np.abs(z) ** a


def y_from_lam(x, lam, l, p):
    x = np.asarray(x, dtype=np.float64)
    lam = np.asarray(lam, dtype=np.float64)[..., None]
    l = np.asarray(l, dtype=np.float64)[..., None]
    with np.errstate(invalid="ignore"):
        return np.clip(g((x - lam) / l, p), 0.0, 1.0)


def bisection_threshold(x, k, l, p, iters=200):
    """lam with sum clip(g((x - lam)/l), 0, 1) = k, by 200 plain halvings."""
    x = np.asarray(x, dtype=np.float64)
    lo = np.min(x) - 2.0 * l  # every y = 1  -> phi = n - k >= 0
    hi = np.max(x) + l  # every y = 0  -> phi = -k <= 0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        phi = np.sum(np.clip(g((x - mid) / l, p), 0.0, 1.0)) - k
        if phi > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def y_tol(x, lam, l, p, base=1e-10):
    """Tolerance on y implied by the unavoidable rounding of lam.

    For a = 1/(p-1) >= 1, y is Lipschitz in lam (constant a/l on y <= 1), so
    the rounding term is negligible against ``base`` for our data.  For a < 1
    (p > 2) g is only Hoelder-a at 0, and an entry sitting on the threshold
    amplifies an ulp of lam to (ulp/l)^a; account for that.
    """
    a = 1.0 / (p - 1.0)
    dz = 64 * EPS * (abs(lam) + np.max(np.abs(x))) / l
    return base + (a * dz if a >= 1 else dz ** a)


def iso_objective(v, s, w, l, p):
    q = p / (p - 1.0)  # conjugate exponent: omega*(z) = |z|^q / q
    z = (s - v) / l
    return np.sum(l * np.abs(z) ** q / q + w * v)


def iso_slsqp(s, w, l, p):
    n = s.shape[0]
    q = p / (p - 1.0)

    def fun(v):
        z = (s - v) / l
        return np.sum(l * np.abs(z) ** q / q + w * v)

    def jac(v):
        return w - g((s - v) / l, p)

    A = np.zeros((n - 1, n))
    A[np.arange(n - 1), np.arange(n - 1)] = 1.0
    A[np.arange(n - 1), np.arange(1, n)] = -1.0
    cons = [{"type": "ineq", "fun": lambda v: A @ v, "jac": lambda v: A}]
    x0 = np.sort(s - l * np.sign(w) * np.abs(w) ** (p - 1.0))[::-1].copy()
    res = minimize(fun, x0, jac=jac, constraints=cons, method="SLSQP",
                   options={"ftol": 1e-15, "maxiter": 2000})
    return res.x


def check_kkt(s, w, l, p, v, rtol=1e-9):
    """Optimality of v without PAV: v nonincreasing; with y = g((s - v)/l) the
    multipliers mu_j = sum_{i<=j} (w_i - y_i) of v_j >= v_{j+1} are >= 0, they
    vanish where v_j > v_{j+1} (block ends) and at j = n (total)."""
    s = np.asarray(s, np.float64)
    w = np.asarray(w, np.float64)
    z = (s - v) / l
    y = g(z, p)
    # rounding of v alone (half an ulp of max(|s|, |v|)) moves y_i by up to
    # cond_i: the best representable solution is only this accurate.
    dz = 4 * EPS * np.maximum(np.abs(s), np.abs(v)) / l
    cond = np.maximum(np.abs(g(z + dz, p) - y), np.abs(y - g(z - dz, p)))
    scale = 1.0 + np.sum(np.abs(w)) + np.sum(np.abs(y))
    tol = rtol * scale + np.sum(cond)
    assert np.all(np.diff(v) <= 0.0), "v must be nonincreasing"
    mu = np.cumsum(w - y)
    assert np.all(mu >= -tol), mu.min()
    assert abs(mu[-1]) <= tol, mu[-1]
    ends = np.nonzero(v[:-1] > v[1:])[0]
    if ends.size:
        assert np.max(np.abs(mu[ends])) <= tol, np.max(np.abs(mu[ends]))


def random_iso_problem(rng, n, scale=2.0):
    s = np.sort(rng.normal(0, scale, n))[::-1].copy()
    w = np.sort(rng.uniform(-1.0, 2.0, n))[::-1].copy()
    return s, w


# ----------------------------------------------------------------------------
# block solvers on their own (no PAV, no final polishing)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 1e-90, 1e90])
@pytest.mark.parametrize("p", PS + [2.5])
def test_block_solver_direct(p, scale):
    """Each O(1)/Newton block solver alone returns the root of the block
    condition sum g((s_i - v)/l) = W (reference: scipy brentq on the data).
    The extreme scales exercise the rescaled Cardano path."""
    from scipy.optimize import brentq

    from implicit_topk.kernels.cpu import isotonic_pav as pk

    if p == 2.0:
        solve, a = pk._solve_p2, 1.0
    elif p == 4.0 / 3.0:
        solve, a = pk._solve_cubic, 3.0
    else:
        solve, a = pk._solve_general, 1.0 / (p - 1.0)
    rng = np.random.default_rng(int(p * 100))
    for _ in range(25):
        m = int(rng.integers(1, 40))
        s = (rng.uniform(-3, 3) + np.sort(rng.normal(size=m))[::-1]) * scale
        if rng.random() < 0.3:
            s[: m // 2] = s[0]  # ties inside the block
        W = float(rng.uniform(-1, 1) * m)
        l = float(rng.uniform(0.1, 3.0)) * scale
        mean = s.mean()
        M2 = np.sum((s - mean) ** 2)
        M3 = np.sum((s - mean) ** 3)

        def F(v):
            return np.sum(g((s - v) / l, p)) - W

        c_lo = (max(W, 0.0) / m) ** (p - 1.0) + 1.0
        c_hi = (max(-W, 0.0) / m) ** (p - 1.0) + 1.0
        lo, hi = s.min() - l * c_lo, s.max() + l * c_hi
        assert F(lo) > 0 > F(hi)
        v_ref = brentq(F, lo, hi, xtol=1e-300, rtol=4 * EPS, maxiter=500)
        v = solve(s, 0, m, float(m), W, mean, M2, M3, l, a, lo, hi)
        assert abs(v - v_ref) <= 1e-10 * (np.max(np.abs(s)) + l), (v, v_ref)


# ----------------------------------------------------------------------------
# isotonic_pav
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("p", PS_FAST)
def test_isotonic_matches_slsqp(p):
    rng = np.random.default_rng(int(1000 * p))
    B, n = 5, 8
    S = np.empty((B, n))
    W = np.empty((B, n))
    for b in range(B):
        S[b], W[b] = random_iso_problem(rng, n)
    L = rng.uniform(0.4, 2.0, B)
    V = isotonic_pav(S, W, L, p)
    assert V.shape == (B, n) and V.dtype == np.float64
    for b in range(B):
        v_ref = iso_slsqp(S[b], W[b], L[b], p)
        f_pav = iso_objective(V[b], S[b], W[b], L[b], p)
        f_ref = iso_objective(v_ref, S[b], W[b], L[b], p)
        # PAV is exactly optimal: never worse than SLSQP (which is feasible
        # only up to its tolerance) and the minimisers agree.
        assert f_pav <= f_ref + 1e-9 * (1 + abs(f_ref))
        np.testing.assert_allclose(V[b], v_ref, atol=1e-6, rtol=0)
        check_kkt(S[b], W[b], L[b], p, V[b])


@pytest.mark.parametrize("p", PS_FAST + [pytest.param(2.5, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_isotonic_kkt_random(p, dtype):
    rng = np.random.default_rng(7 + int(10 * p))
    B, n = 16, 60
    S = np.empty((B, n))
    W = np.empty((B, n))
    for b in range(B):
        S[b], W[b] = random_iso_problem(rng, n, scale=rng.choice([0.1, 1, 10]))
    S[:4] = np.round(S[:4], 1)  # ties
    S = np.sort(S.astype(dtype), axis=1)[:, ::-1]
    L = rng.choice([1e-3, 0.1, 1.0, 10.0], B)
    V = isotonic_pav(S, W, L, p)
    for b in range(B):
        check_kkt(S[b], W[b], L[b], p, V[b])


@pytest.mark.parametrize("p", PS_FAST)
def test_isotonic_unsorted_rows_still_optimal(p):
    # sortedness is only needed for the permutahedron interpretation; PAV
    # solves the isotonic problem for any data (and any w here).
    rng = np.random.default_rng(99)
    S = rng.normal(size=(6, 40))
    W = rng.normal(size=(6, 40))
    L = rng.uniform(0.05, 3.0, 6)
    V = isotonic_pav(S, W, L, p)
    for b in range(6):
        check_kkt(S[b], W[b], L[b], p, V[b])


@pytest.mark.parametrize("p", PS_FAST)
def test_isotonic_shared_w_and_singletons(p):
    rng = np.random.default_rng(3)
    B, n = 4, 30
    s = np.sort(rng.normal(size=(B, n)), axis=1)[:, ::-1].copy()
    w = np.sort(rng.uniform(-1, 1, n))[::-1].copy()
    L = np.array([0.5, 1.0, 2.0, 1e-3])
    V = isotonic_pav(s, w, L, p)  # (n,) w broadcast over rows
    V2 = isotonic_pav(s, np.broadcast_to(w, (B, n)), L, p)
    np.testing.assert_array_equal(V, V2)
    for b in range(B):
        check_kkt(s[b], w, L[b], p, V[b])
    # strongly separated data: no merges, closed-form singletons
    s_sep = np.arange(n, 0, -1, dtype=np.float64)[None] * 100.0
    v = isotonic_pav(s_sep, w, np.array([1.0]), p)[0]
    np.testing.assert_allclose(
        v, s_sep[0] - np.sign(w) * np.abs(w) ** (p - 1.0), rtol=0, atol=1e-12)


@pytest.mark.parametrize("p", [4.0 / 3.0, pytest.param(2.0, marks=pytest.mark.slow),
                               pytest.param(1.5, marks=pytest.mark.slow)])
def test_isotonic_large_offset_cancellation(p):
    """Huge common offset with a tiny spread: the O(1) moment-based solvers
    must still yield machine-precision block values (cubic: after polishing)."""
    rng = np.random.default_rng(11)
    n = 200
    s = 1e6 + np.sort(rng.uniform(0, 1e-3, n))[::-1]
    w = np.sort(rng.uniform(0, 1, n))[::-1]
    l = np.array([1e-3])
    v = isotonic_pav(s[None], w, l, p)[0]
    check_kkt(s, w, l[0], p, v)  # tolerance includes ulp(1e6)/l conditioning
    assert len(np.unique(v)) < n  # there were merges


@pytest.mark.slow
def test_isotonic_nonfinite_and_validation():
    s = np.array([[3.0, 2.0, 1.0], [3.0, np.nan, 1.0]])
    w = np.array([1.0, 0.5, 0.0])
    v = isotonic_pav(s, w, np.array([1.0, 1.0]), 2.0)
    assert np.all(np.isfinite(v[0])) and np.all(np.isnan(v[1]))
    v = isotonic_pav(s[:1], w, np.array([0.0]), 2.0)
    assert np.all(np.isnan(v))
    with pytest.raises(ValueError):
        isotonic_pav(s, w, np.ones(2), 1.0)
    v1 = isotonic_pav(s[0], w, 1.0, 4.0 / 3.0)  # 1-D convenience
    assert v1.shape == (3,)


# ----------------------------------------------------------------------------
# capped_simplex_threshold
# ----------------------------------------------------------------------------


def make_x(rng, B, n, dtype):
    x = rng.normal(0.0, 1.0, (B, n))
    x[: B // 2] = np.round(x[: B // 2], 1)  # many ties / duplicates
    x[0, : n // 2] = x[0, 0]  # a large block of exact duplicates
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [pytest.param(np.float32, marks=pytest.mark.slow), np.float64])
@pytest.mark.parametrize("l", [1e-3, 0.1, 10.0])
@pytest.mark.parametrize("p", PS_FAST)
def test_capped_against_bisection(p, l, dtype):
    rng = np.random.default_rng([int(p * 1000), int(l * 1e4), np.dtype(dtype).itemsize])
    B, n = 10, 25
    x = make_x(rng, B, n, dtype)
    k_int = rng.integers(1, n, B).astype(np.float64)
    k_real = rng.uniform(0.05, n - 0.05, B)
    x64 = x.astype(np.float64)  # exact
    for k in (k_int, k_real):
        L = np.full(B, l)
        lam = capped_simplex_threshold(x, k, L, p)
        assert lam.shape == (B,) and lam.dtype == np.float64
        assert np.all(np.isfinite(lam))
        y = y_from_lam(x64, lam, L, p)
        assert np.all((y >= 0) & (y <= 1))
        for b in range(B):
            tol = y_tol(x64[b], lam[b], l, p)
            assert abs(y[b].sum() - k[b]) <= n * tol, (b, y[b].sum(), k[b])
            lam_ref = bisection_threshold(x64[b], k[b], l, p)
            y_ref = y_from_lam(x64[b], lam_ref, l, p)
            np.testing.assert_allclose(y[b], y_ref, rtol=0, atol=tol)
        if dtype == np.float32 and l >= 0.1:
            # y evaluated entirely in float32 arithmetic
            a = np.float32(1.0 / (p - 1.0))
            z = (x - lam.astype(np.float32)[:, None]) / np.float32(l)
            y32 = np.clip(np.sign(z) * np.abs(z) ** a, 0, 1)
            np.testing.assert_allclose(y32.sum(1, dtype=np.float64), k,
                                       rtol=0, atol=1e-4)


@pytest.mark.parametrize("p", PS_FAST)
def test_capped_integer_k_binary_interval(p):
    # well separated: solution is the top-k indicator; lam is the midpoint of
    # [x_(k+1), x_(k) - l].
    x = np.array([[5.0, -1.0, 3.0, 0.0, 10.0]])
    lam = capped_simplex_threshold(x, np.array([2.0]), np.array([0.5]), p)
    assert lam[0] == pytest.approx(0.5 * (3.0 + (5.0 - 0.5)), abs=1e-14)
    y = y_from_lam(x, lam, np.array([0.5]), p)
    np.testing.assert_array_equal(y[0], [1, 0, 0, 0, 1])


@pytest.mark.slow
def test_capped_p2_matches_euclidean_projection():
    """p = 2: y is the Euclidean projection of x / l onto the capped simplex."""
    rng = np.random.default_rng(5)
    B, n = 6, 15
    x = make_x(rng, B, n, np.float64)
    k = np.concatenate([rng.integers(1, n, 3), rng.uniform(0.2, n - 0.2, 3)])
    L = np.array([1e-1, 1.0, 10.0, 0.3, 3.0, 0.05])
    lam = capped_simplex_threshold(x, k, L, 2.0)
    y = y_from_lam(x, lam, L, 2.0)
    for b in range(B):
        t = x[b] / L[b]
        res = minimize(lambda u: 0.5 * np.sum((u - t) ** 2), np.full(n, k[b] / n),
                       jac=lambda u: u - t, bounds=[(0.0, 1.0)] * n,
                       constraints=[{"type": "eq", "fun": lambda u: u.sum() - k[b],
                                     "jac": lambda u: np.ones_like(u)}],
                       method="SLSQP", options={"ftol": 1e-15, "maxiter": 1000})
        np.testing.assert_allclose(y[b], res.x, atol=1e-6, rtol=0)


@pytest.mark.parametrize("p", PS_FAST)
def test_capped_nonfinite(p):
    inf, nan = np.inf, np.nan
    l = 0.5
    x = np.array([
        [1.0, nan, 0.0, 2.0, 3.0],       # 0: NaN -> NaN
        [inf, 1.0, -inf, 0.3, 2.0],      # 1: k=2.5 -> k_f=1.5 on [1, .3, 2]
        [inf, 1.0, -inf, 0.3, 2.0],      # 2: k=1 -> k_f=0 -> max_f + l
        [inf, 1.0, -inf, 0.3, 2.0],      # 3: k=4 -> k_f=3=n_f -> min_f - 2l
        [inf, 1.0, -inf, 0.3, 2.0],      # 4: k=0 -> k_f=-1 -> NaN
        [inf, 1.0, -inf, -inf, 2.0],     # 5: k=4 -> k_f=3 > n_f=2 -> NaN
        [inf, inf, -inf, -inf, -inf],    # 6: k=2 -> k_f=0, no finite -> 0.0
        [-inf, -inf, -inf, -inf, -inf],  # 7: k=0 -> k_f=0 -> 0.0
        [inf, inf, inf, inf, inf],       # 8: k=3 -> k_f=-2 -> NaN
        [nan, inf, 1.0, 2.0, 3.0],       # 9: NaN wins
    ])
    k = np.array([2.0, 2.5, 1.0, 4.0, 0.0, 4.0, 2.0, 0.0, 3.0, 1.0])
    for dtype in (np.float64, np.float32):
        lam = capped_simplex_threshold(x.astype(dtype), k, np.full(10, l), p)
        assert np.isnan(lam[[0, 4, 5, 8, 9]]).all()
        ref1 = capped_simplex_threshold(np.array([[1.0, 0.3, 2.0]], dtype), [1.5], [l], p)
        assert lam[1] == ref1[0]
        assert lam[2] == 2.0 + l
        assert lam[3] == pytest.approx(0.3 - 2 * l, abs=1e-7)
        assert lam[6] == 0.0 and lam[7] == 0.0
        # y built with the documented convention sums to k on the valid rows
        y = y_from_lam(x, lam, np.full(10, l), p)
        for b in (1, 2, 3, 6, 7):
            atol = 1e-6 if dtype == np.float32 else 1e-12
            np.testing.assert_allclose(y[b].sum(), k[b], atol=atol)
            assert y[b][x[b] == inf].tolist() == [1.0] * int((x[b] == inf).sum())
            assert not y[b][x[b] == -inf].any()
    # invalid l -> NaN
    lam = capped_simplex_threshold(np.array([[1.0, 2.0, 3.0]] * 3), [1.0] * 3,
                                   [0.0, -1.0, nan], p)
    assert np.isnan(lam).all()


def test_capped_read_only_input_and_broadcast_args():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 50)).astype(np.float32)
    x_copy = x.copy()
    x.setflags(write=False)
    lam_ro = capped_simplex_threshold(x, np.full(4, 5.5), np.full(4, 0.1), 4.0 / 3.0)
    np.testing.assert_array_equal(x, x_copy)  # never written into
    lam_rw = capped_simplex_threshold(x_copy, 5.5, 0.1, 4.0 / 3.0)  # scalar k, l
    np.testing.assert_array_equal(lam_ro, lam_rw)
    # non-contiguous view
    xt = np.asfortranarray(x_copy)[:, ::1]
    np.testing.assert_array_equal(capped_simplex_threshold(xt, 5.5, 0.1, 4.0 / 3.0), lam_rw)
    # 1-D convenience
    assert np.ndim(capped_simplex_threshold(x_copy[0], 5.5, 0.1, 2.0)) == 0


@pytest.mark.slow
def test_capped_jax_buffer():
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 20)), dtype=jnp.float32)
    xn = np.asarray(x)  # read-only view of the jax buffer
    lam = capped_simplex_threshold(xn, np.array([3.0, 4.5, 1.0]), np.ones(3), 1.5)
    y = y_from_lam(xn, lam, np.ones(3), 1.5)
    np.testing.assert_allclose(y.sum(1), [3.0, 4.5, 1.0], atol=1e-10)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.lists(st.integers(-20, 20), min_size=2, max_size=30),
    kfrac=st.floats(0.01, 0.99),
    p=st.sampled_from(PS + [2.5, 1.2]),
    l=st.sampled_from([1e-3, 0.05, 1.0, 7.0]),
    integer_k=st.booleans(),
)
def test_capped_property(data, kfrac, p, l, integer_k):
    x = np.array(data, dtype=np.float64)[None] / 4.0  # lots of ties
    n = x.shape[1]
    k = kfrac * n
    if integer_k:
        k = float(min(max(round(k), 1), n - 1))
    lam = capped_simplex_threshold(x, [k], [l], p)
    y = y_from_lam(x, lam, [l], p)[0]
    tol = y_tol(x[0], lam[0], l, p)
    assert abs(y.sum() - k) <= n * tol
    y_ref = y_from_lam(x[0], bisection_threshold(x[0], k, l, p), l, p)
    np.testing.assert_allclose(y, y_ref, atol=tol, rtol=0)


# ----------------------------------------------------------------------------
# scale / misc
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("p", [4.0 / 3.0, pytest.param(2.0, marks=pytest.mark.slow)])
def test_large_row(p):
    rng = np.random.default_rng(0)
    n = 1_000_000
    x = rng.normal(size=(1, n)).astype(np.float32)
    k, l = 1000.5, 0.1
    capped_simplex_threshold(x[:, :100], [10.5], [l], p)  # compile / load
    t0 = time.perf_counter()
    lam = capped_simplex_threshold(x, [k], [l], p)
    dt = time.perf_counter() - t0
    print(f"\n[pav_kernels] capped_simplex_threshold n=1e6 p={p:.4g}: {dt * 1e3:.1f} ms")
    y = y_from_lam(x, lam, [l], p)
    assert abs(y.sum() - k) <= 1e-8 * k


@pytest.mark.slow
def test_general_p_medium_row_with_big_block():
    # l large: every entry is fractional -> one block spanning the row
    # (worst case O(n * block size) for general p); must still be exact.
    rng = np.random.default_rng(1)
    n = 3000
    x = rng.normal(size=(1, n))
    lam = capped_simplex_threshold(x, [n / 2 + 0.25], [100.0], 1.5)
    y = y_from_lam(x, lam, [100.0], 1.5)
    assert np.all((y > 0) & (y < 1))
    assert abs(y.sum() - (n / 2 + 0.25)) <= 1e-9


@pytest.mark.parametrize("name", ["isotonic_pav", "pav_capped_simplex", "pav_magnitude",
                                  "pav_permutahedron", "radix_sort", "pav_ffi",
                                  "native_threshold", "native_mask", "native_lanes",
                                  "native_magnitude", "native_derivatives",
                                  "abi", "kinds", "ordered_bits"])
def test_module_does_not_import_jax(name):
    import importlib

    mod = importlib.import_module(f"implicit_topk.kernels.cpu.{name}")
    tree = ast.parse(open(mod.__file__).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    assert not any(n.split(".")[0] in ("jax", "jaxlib") for n in names), names
    assert not any(n.startswith("implicit_topk.") and not n.startswith("implicit_topk.kernels.")
                   for n in names), names
    assert "implicit_topk.kernels.cpu.ffi" not in names
    assert not any(n.endswith((".registry", ".native_calls", ".pav_calls")) for n in names)
