"""The permutahedron LP by PAV, one row at a time: sort, gather, PAV, block ids.

``argmax_{y in P(w)} <x, y> - l Omega(y)`` in block form (Blondel, Teboul, Berthet and
Djolonga 2020, "Fast differentiable sorting and ranking", ICML): the isotonic problem
of :func:`implicit_topk.kernels.cpu.isotonic_pav.isotonic_pav` with ``s = sort(x)`` and
``w = sort(w)``, both descending. The rows are sorted in the kernel
(:func:`~implicit_topk.kernels.cpu.radix_sort.argsort_descending`).

Pure numpy + numba (no jax).
"""

import numpy as np
from numba import njit

from implicit_topk.kernels.cpu.isotonic_pav import KINDS, _select, pav_blocks
from implicit_topk.kernels.cpu.radix_sort import argsort_descending

@njit(cache=True)
def permutahedron_row(kind, x, xo, sort_x, w, wo, sort_w, l, a, pm1, values, ids, inverse):
    """One row of :func:`permutahedron_blocks` (float64 ``x``, ``w``, ``values``), by
    the block solver ``kind``.

    With ``sort_x``/``sort_w`` the descending orders are first written to
    ``xo``/``wo``.  ``s = x[xo]`` and ``w[wo]`` (``xo``/``wo`` of length 0: the row
    is already in order) are gathered into float64 work rows, PAV runs on them, and the block
    structure is written out: ``ids[i]`` = the block of sorted position ``i``
    (blocks are runs of consecutive positions; adjacent PAV blocks with equal
    values are one block: the merged block condition holds too), ``values[j]`` =
    the value of block ``j`` (0 past the last block), ``inverse`` = the inverse
    permutation of ``xo`` (if ``xo`` is given).  A row with a non-finite entry or
    ``l`` not in (0, inf) gets NaN values and one block per position.
    """
    n = x.shape[0]
    s = np.empty(n)
    ws = np.empty(n)
    if sort_x:
        argsort_descending(x, xo)
    if sort_w:
        argsort_descending(w, wo)
    if xo.shape[0] == 0:
        for i in range(n):
            s[i] = x[i]
    else:
        for i in range(n):
            k = xo[i]
            s[i] = x[k]
            inverse[k] = i
    if wo.shape[0] == 0:
        for i in range(n):
            ws[i] = w[i]
    else:
        for i in range(n):
            ws[i] = w[wo[i]]
    ok = l > 0.0 and l < np.inf
    for i in range(n):
        if not (np.isfinite(s[i]) and np.isfinite(ws[i])):
            ok = False
    if not ok:
        for i in range(n):
            values[i] = np.nan
            ids[i] = i
        return
    bstart, bv = np.empty(n, dtype=np.int64), np.empty(n)
    nb = pav_blocks(kind, s, ws, l, a, pm1, bstart, np.empty(n), np.empty(n), np.empty(n),
                    np.empty(n), bv)
    k = -1
    prev = 0.0
    for j in range(nb):
        if k < 0 or bv[j] != prev:  # compared in float64, before any rounding
            k += 1
            prev = bv[j]
            values[k] = prev
        i1 = bstart[j + 1] if j + 1 < nb else n
        for i in range(bstart[j], i1):
            ids[i] = k
    for j in range(k + 1, n):
        values[j] = 0.0


@njit(cache=True)
def permutahedron_rows(x, w, l, kind, a, pm1, sort_x, sort_w, values, ids, x_order,
                       x_inverse, w_order):
    """Every row: ``x``, ``w`` of shape (rows, n) or (1, n) (one row shared by all);
    ``l``, ``values``, ``ids`` one row each; ``x_order``, ``x_inverse`` (``w_order``)
    of shape (rows, n) when ``sort_x`` (``sort_w``), else (rows, 0). Returns 0."""
    rows, n = values.shape
    xs = 1 if x.shape[0] > 1 else 0
    ws = 1 if w.shape[0] > 1 else 0
    x64, w64, v64 = np.empty(n), np.empty(n), np.empty(n)
    for b in range(rows):
        for i in range(n):
            x64[i] = x[b * xs, i]
            w64[i] = w[b * ws, i]
        permutahedron_row(kind, x64, x_order[b], sort_x, w64, w_order[b], sort_w,
                          np.float64(l[b]), a, pm1, v64, ids[b], x_inverse[b])
        for i in range(n):
            values[b, i] = v64[i]
    return 0


def permutahedron_blocks(x, w, l, p, *, sort_x=True, sort_w=True, dtype=None):
    """Sorts the rows of ``x`` and ``w`` descending and solves the isotonic dual by PAV.

    Parameters
    ----------
    x : (B, n) or (1, n) float array (one row shared by all); with ``sort_x=False``
        already nonincreasing per row.
    w : (B, n) or (1, n) float array; with ``sort_w=False`` already nonincreasing.
    l : (B,) array of regularization strengths (> 0); B is its length.
    p : a p-norm exponent > 1, or ``"exp"`` (entropy).
    dtype : dtype of the returned block values (default: x's).

    Returns
    -------
    values : (B, n) block values, 0 past each row's last block.
    ids : (B, n) int32, the block of each *sorted* position (nondecreasing, from 0).
    x_order, x_inverse : int32, (B, n): the descending order of ``x`` and its
        inverse permutation (None when ``sort_x=False``).
    w_order : int32, (B, n): the descending order of ``w`` (None when
        ``sort_w=False``).
    Rows with a non-finite entry (or ``l`` not in (0, inf)) get NaN values and one
    block per position.
    """
    kind, a, pm1 = _select(p)
    if kind == "link":
        raise ValueError("permutahedron_blocks supports the p-norms and 'exp'")
    l64 = np.ascontiguousarray(np.asarray(l, dtype=np.float64).reshape(-1))
    B = l64.shape[0]
    rows = []
    for name, arr in (("x", x), ("w", w)):
        arr = np.asarray(arr)
        if arr.dtype not in (np.float32, np.float64):
            arr = arr.astype(np.float64)
        arr = np.ascontiguousarray(np.atleast_2d(arr))
        if arr.ndim != 2 or arr.shape[0] not in (1, B):
            raise ValueError(f"{name} must have shape (n,), (1, n) or ({B}, n); got {arr.shape}")
        rows.append(arr)
    x, w = rows
    n = x.shape[1]
    if w.shape[1] != n:
        raise ValueError(f"x and w rows differ in length: {x.shape} and {w.shape}")
    values = np.empty((B, n), dtype=x.dtype if dtype is None else np.dtype(dtype))
    ids = np.empty((B, n), dtype=np.int32)
    x_order = np.empty((B, n if sort_x else 0), dtype=np.int32)
    x_inverse = np.empty((B, n if sort_x else 0), dtype=np.int32)
    w_order = np.empty((B, n if sort_w else 0), dtype=np.int32)
    if B > 0 and n > 0:
        permutahedron_rows(x, w, l64, np.int32(KINDS[kind]), a, pm1, sort_x, sort_w, values, ids,
                           x_order, x_inverse, w_order)
    return (values, ids, x_order if sort_x else None, x_inverse if sort_x else None,
            w_order if sort_w else None)
