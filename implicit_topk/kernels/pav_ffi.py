r"""The PAV kernels as XLA FFI custom calls (:mod:`implicit_topk.kernels.ffi`).

Three kernel families, one target per family and dtype (float32, float64):

* ``capped_simplex``: the threshold :math:`\lambda` of the soft top-k mask,
  :math:`y_i = \mathrm{clip}(g((x_i - \lambda) / l), 0, 1)` with
  :math:`\sum_i y_i = k` (:mod:`~implicit_topk.kernels.pav_capped_simplex`);
* ``magnitude``: the threshold of the soft top-k in magnitude
  (:mod:`~implicit_topk.kernels.pav_magnitude`);
* ``permutahedron``: the PAV blocks of :math:`\arg\max_{y \in P(w)} \langle x,
  y\rangle - l\,\Omega(y)` and the sorting permutations
  (:mod:`~implicit_topk.kernels.pav_permutahedron`).

Each row is sorted, solved and written by one serial numba loop inside the handler
(XLA runs the call on its own threads; a batch-sharded input runs on each device's
rows). The configuration is in scalar attributes: the block solver ``kind`` (int32),
``a`` and ``pm1`` (float64: :math:`1 / (p - 1)` and :math:`p - 1`, or the link code),
and for the permutahedron whether ``x`` and ``w`` are given (``xsort``, ``wsort``,
int32; the missing one is the ranks :math:`(n, \dots, 1)`). Per-row ``k`` and ``l``
are arrays with the rows' shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from numba import carray, njit

from implicit_topk.kernels import ffi
from implicit_topk.kernels.isotonic_pav import KINDS, _select
from implicit_topk.kernels.pav_capped_simplex import capped_rows
from implicit_topk.kernels.pav_magnitude import _mag_select, magnitude_rows
from implicit_topk.kernels.pav_permutahedron import permutahedron_rows

_TARGET = "implicit_topk_pav_{}_{}"
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
ffi.declare(*(_TARGET.format(family, dtype.name)
              for family in ("capped_simplex", "magnitude", "permutahedron") for dtype in _DTYPES))
_A, _K, _P, _W, _X = (ord(c) for c in "akpwx")  # the attributes' first letters

_BAD_THRESHOLD = ffi.message(
    "implicit_topk PAV threshold kernel: expected x (..., n), k (...), l (...) of one "
    "float dtype, scalar attributes kind (int32), a and pm1 (float64); result lam (...)")
_BAD_PERMUTAHEDRON = ffi.message(
    "implicit_topk PAV permutahedron kernel: expected [x (..., n)], [w (..., n)], l (...) "
    "of one float dtype, scalar attributes kind, xsort, wsort (int32), a and pm1 "
    "(float64); results values (..., n), ids int32 (..., n), [x_order, x_inverse int32 "
    "(..., n)], [w_order int32 (..., n)]")


@njit(inline="always", cache=True, error_model="numpy")
def _float_attribute(at):
  return carray(ffi.typed_pointer(at, np.float64(0)), (1,))[0]


@njit(inline="always", cache=True, error_model="numpy")
def _threshold_call(frame, sample, rows_fn):
  """The handler of a threshold family: x (..., n), k (...), l (...) -> lam (...)."""
  if ffi.handler_prologue(frame):
    return ffi.null()
  code = ffi.dtype_code(sample)
  kind_at = ffi.scalar_attribute(frame, _K, ffi.INT32)
  a_at = ffi.scalar_attribute(frame, _A, ffi.FLOAT64)
  pm1_at = ffi.scalar_attribute(frame, _P, ffi.FLOAT64)
  if (ffi.count(frame, False) != 3 or ffi.count(frame, True) != 1 or kind_at == 0
      or a_at == 0 or pm1_at == 0):
    return ffi.error(frame, _BAD_THRESHOLD, ffi.ERROR_INVALID_ARGUMENT)
  xb, kb, lb = ffi.buffer(frame, False, 0), ffi.buffer(frame, False, 1), ffi.buffer(frame, False, 2)
  lamb = ffi.buffer(frame, True, 0)
  rank = ffi.buffer_rank(xb)
  if rank < 1:
    return ffi.error(frame, _BAD_THRESHOLD, ffi.ERROR_INVALID_ARGUMENT)
  n = ffi.buffer_dim(xb, rank - 1)
  rows = ffi.size(xb) // n if n > 0 else ffi.size(kb)
  ok = (ffi.buffer_dtype(xb) == code and ffi.has(kb, code, rows) and ffi.has(lb, code, rows)
        and ffi.has(lamb, code, rows))
  if not ok:
    return ffi.error(frame, _BAD_THRESHOLD, ffi.ERROR_INVALID_ARGUMENT)
  x = carray(ffi.typed_pointer(ffi.buffer_data(xb), sample), (rows, n))
  k = carray(ffi.typed_pointer(ffi.buffer_data(kb), sample), (rows,))
  l = carray(ffi.typed_pointer(ffi.buffer_data(lb), sample), (rows,))
  lam = carray(ffi.typed_pointer(ffi.buffer_data(lamb), sample), (rows,))
  kind = ffi.load32(kind_at)
  if rows_fn(x, k, l, kind, _float_attribute(a_at), _float_attribute(pm1_at), lam) != 0:
    return ffi.error(frame, ffi.KERNEL_FAILED, ffi.ERROR_INTERNAL)
  return ffi.null()


@njit(inline="always", cache=True, error_model="numpy")
def _int_buffer(frame, index, rows, n):
  """Result ``index`` as an int32 (rows, n) array."""
  return carray(ffi.typed_pointer(ffi.buffer_data(ffi.buffer(frame, True, index)),
                                  np.int32(0)), (rows, n))


@njit(inline="always", cache=True, error_model="numpy")
def _permutahedron_call(frame, sample):
  """(x if xsort, w if wsort, l) -> (values, ids, x_order, x_inverse if xsort,
  w_order if wsort)."""
  if ffi.handler_prologue(frame):
    return ffi.null()
  code = ffi.dtype_code(sample)
  kind_at = ffi.scalar_attribute(frame, _K, ffi.INT32)
  xsort_at = ffi.scalar_attribute(frame, _X, ffi.INT32)
  wsort_at = ffi.scalar_attribute(frame, _W, ffi.INT32)
  a_at = ffi.scalar_attribute(frame, _A, ffi.FLOAT64)
  pm1_at = ffi.scalar_attribute(frame, _P, ffi.FLOAT64)
  if kind_at == 0 or xsort_at == 0 or wsort_at == 0 or a_at == 0 or pm1_at == 0:
    return ffi.error(frame, _BAD_PERMUTAHEDRON, ffi.ERROR_INVALID_ARGUMENT)
  sort_x, sort_w = ffi.load32(xsort_at) != 0, ffi.load32(wsort_at) != 0
  n_args = 1 + int(sort_x) + int(sort_w)
  if (not (sort_x or sort_w) or ffi.count(frame, False) != n_args
      or ffi.count(frame, True) != 2 + 2 * int(sort_x) + int(sort_w)):
    return ffi.error(frame, _BAD_PERMUTAHEDRON, ffi.ERROR_INVALID_ARGUMENT)
  first = ffi.buffer(frame, False, 0)
  rank = ffi.buffer_rank(first)
  if rank < 1:
    return ffi.error(frame, _BAD_PERMUTAHEDRON, ffi.ERROR_INVALID_ARGUMENT)
  n = ffi.buffer_dim(first, rank - 1)
  lb = ffi.buffer(frame, False, n_args - 1)
  rows = ffi.size(first) // n if n > 0 else ffi.size(lb)
  ok = ffi.has(lb, code, rows)
  for i in range(n_args - 1):
    ok = ok and ffi.has(ffi.buffer(frame, False, i), code, rows * n)
  ok = ok and ffi.has(ffi.buffer(frame, True, 0), code, rows * n)
  for i in range(1, 2 + 2 * int(sort_x) + int(sort_w)):
    ok = ok and ffi.has(ffi.buffer(frame, True, i), ffi.INT32, rows * n)
  if not ok:
    return ffi.error(frame, _BAD_PERMUTAHEDRON, ffi.ERROR_INVALID_ARGUMENT)
  data = carray(ffi.typed_pointer(ffi.buffer_data(first), sample), (rows, n))
  l = carray(ffi.typed_pointer(ffi.buffer_data(lb), sample), (rows,))
  values = carray(ffi.typed_pointer(ffi.buffer_data(ffi.buffer(frame, True, 0)), sample),
                  (rows, n))
  ids = _int_buffer(frame, 1, rows, n)
  absent = np.empty((rows, 0), np.int32)
  x_order, x_inverse, w_order = absent, absent, absent
  if sort_x:
    x_order, x_inverse = _int_buffer(frame, 2, rows, n), _int_buffer(frame, 3, rows, n)
  if sort_w:
    w_order = _int_buffer(frame, 2 + 2 * int(sort_x), rows, n)
  kind, a, pm1 = ffi.load32(kind_at), _float_attribute(a_at), _float_attribute(pm1_at)
  ranks = np.empty((1, n))
  for i in range(n):
    ranks[0, i] = n - i
  if sort_x and sort_w:
    w = carray(ffi.typed_pointer(ffi.buffer_data(ffi.buffer(frame, False, 1)), sample),
               (rows, n))
    status = permutahedron_rows(data, w, l, kind, a, pm1, True, True, values, ids, x_order,
                                x_inverse, w_order)
  elif sort_x:
    status = permutahedron_rows(data, ranks, l, kind, a, pm1, True, False, values, ids,
                                x_order, x_inverse, w_order)
  else:
    status = permutahedron_rows(ranks, data, l, kind, a, pm1, False, True, values, ids,
                                x_order, x_inverse, w_order)
  if status != 0:
    return ffi.error(frame, ffi.KERNEL_FAILED, ffi.ERROR_INTERNAL)
  return ffi.null()


def register_targets() -> None:
  """Registers the PAV kernels' FFI targets with XLA, compiling them on the first call
  (:mod:`implicit_topk.kernels.pav_handlers`; about a minute on a cold numba cache, so
  not at import: the first use of ``solver="pav"`` does it, and
  :func:`implicit_topk.register_kernels` does it for a process that runs an exported
  function calling them)."""
  from implicit_topk.kernels import pav_handlers
  for family, handlers in pav_handlers.HANDLERS.items():
    for dtype, handler in handlers.items():
      ffi.register(_TARGET.format(family, dtype), handler)


# -- the JAX side -------------------------------------------------------------------
def _kernel_dtype(dtype):
  """The dtype the kernel computes in: float32 or float64 (narrower floats: float32)."""
  return np.dtype(dtype) if np.dtype(dtype) in _DTYPES else np.dtype(np.float32)


def _attributes(kind: str, a: float, pm1: float) -> dict:
  return {"kind": np.int32(KINDS[kind]), "a": np.float64(a), "pm1": np.float64(pm1)}


def _threshold(family, select, x, k, l, p):
  dtype = x.dtype
  compute = _kernel_dtype(dtype)
  rows = x.shape[:-1]
  per_row = lambda v: jnp.broadcast_to(jnp.asarray(v, compute), rows)
  register_targets()
  (lam,) = ffi.call(_TARGET.format(family, compute.name), (jax.ShapeDtypeStruct(rows, compute),),
                    x.astype(compute), per_row(k), per_row(l), **_attributes(*select(p)))
  return lam.astype(dtype)


def capped_simplex_threshold(x, k, l, p):
  """The mask's threshold per row of ``x`` (..., n) by PAV: shape ``x.shape[:-1]``,
  ``x``'s dtype; ``k`` and ``l`` broadcast to the rows; ``p`` a p-norm exponent or a
  link name (:func:`implicit_topk.kernels.pav_capped_simplex.capped_simplex_threshold`)."""
  return _threshold("capped_simplex", _select, x, k, l, p)


def magnitude_threshold(x, k, l, p):
  """The threshold of the top-k in magnitude per row of ``x`` (..., n) by PAV
  (:func:`implicit_topk.kernels.pav_magnitude.magnitude_threshold`)."""
  return _threshold("magnitude", _mag_select, x, k, l, p)


def permutahedron_blocks(x, w, l, p, dtype):
  """The PAV blocks of the permutahedron LP along the last axis of (R, n) arrays ``x``,
  ``w`` (None: the ranks (n, ..., 1)) with ``l`` of shape (R,): ``(values, ids)``, then
  ``(x_order, x_inverse)`` if ``x`` is given, then ``w_order`` if ``w`` is given
  (:func:`implicit_topk.kernels.pav_permutahedron.permutahedron_blocks`)."""
  compute = _kernel_dtype(dtype)
  given = [a.astype(compute) for a in (x, w) if a is not None]
  shape = given[0].shape
  ints = jax.ShapeDtypeStruct(shape, jnp.int32)
  results = ((jax.ShapeDtypeStruct(shape, compute), ints) + (ints, ints) * (x is not None)
             + (ints,) * (w is not None))
  kind, a, pm1 = _select(p)
  register_targets()
  out = ffi.call(_TARGET.format("permutahedron", compute.name), results, *given,
                 l.astype(compute), xsort=np.int32(x is not None),
                 wsort=np.int32(w is not None), **_attributes(kind, a, pm1))
  return (out[0].astype(dtype),) + tuple(out[1:])
