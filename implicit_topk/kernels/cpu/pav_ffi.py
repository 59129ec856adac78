r"""The PAV kernels as XLA FFI custom calls (:mod:`implicit_topk.kernels.cpu.ffi`).

Three kernel families, one target per family and dtype (float32, float64):

* ``capped_simplex``: the threshold :math:`\lambda` of the soft top-k mask,
  :math:`y_i = \mathrm{clip}(g((x_i - \lambda) / l), 0, 1)` with
  :math:`\sum_i y_i = k` (:mod:`~implicit_topk.kernels.cpu.pav_capped_simplex`);
* ``magnitude``: the threshold of the soft top-k in magnitude
  (:mod:`~implicit_topk.kernels.cpu.pav_magnitude`);
* ``permutahedron``: the PAV blocks of :math:`\arg\max_{y \in P(w)} \langle x,
  y\rangle - l\,\Omega(y)` and the sorting permutations
  (:mod:`~implicit_topk.kernels.cpu.pav_permutahedron`).

Each row is sorted, solved and written by one serial numba loop inside the handler
(XLA runs the call on its own threads; a batch-sharded input runs on each device's
rows). The configuration is in scalar attributes: the block solver ``kind`` (int32),
``a`` and ``pm1`` (float64: :math:`1 / (p - 1)` and :math:`p - 1`, or the link code),
and for the permutahedron whether ``x`` and ``w`` are given (``xsort``, ``wsort``,
int32; the missing one is the ranks :math:`(n, \dots, 1)`). Per-row ``k`` and ``l``
are arrays with the rows' shape.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from implicit_topk.kernels.cpu import abi
from implicit_topk.kernels.cpu.pav_capped_simplex import capped_rows
from implicit_topk.kernels.cpu.pav_magnitude import magnitude_rows
from implicit_topk.kernels.cpu.pav_permutahedron import permutahedron_rows

_A, _K, _P, _W, _X = (ord(c) for c in "akpwx")  # the attributes' first letters

_BAD_THRESHOLD = abi.message(
    "implicit_topk PAV threshold kernel: expected x (..., n), k (...), l (...) of one "
    "float dtype, scalar attributes kind (int32), a and pm1 (float64); result lam (...)")
_BAD_PERMUTAHEDRON = abi.message(
    "implicit_topk PAV permutahedron kernel: expected [x (..., n)], [w (..., n)], l (...) "
    "of one float dtype, scalar attributes kind, xsort, wsort (int32), a and pm1 "
    "(float64); results values (..., n), ids int32 (..., n), [x_order, x_inverse int32 "
    "(..., n)], [w_order int32 (..., n)]")


@njit(inline="always", cache=True, error_model="numpy")
def _float_attribute(at):
  return carray(abi.typed_pointer(at, np.float64(0)), (1,))[0]


@njit(inline="always", cache=True, error_model="numpy")
def _threshold_call(frame, sample, rows_fn):
  """The handler of a threshold family: x (..., n), k (...), l (...) -> lam (...)."""
  if abi.handler_prologue(frame):
    return abi.null()
  code = abi.dtype_code(sample)
  kind_at = abi.scalar_attribute(frame, _K, abi.INT32)
  a_at = abi.scalar_attribute(frame, _A, abi.FLOAT64)
  pm1_at = abi.scalar_attribute(frame, _P, abi.FLOAT64)
  if (abi.count(frame, False) != 3 or abi.count(frame, True) != 1 or kind_at == 0
      or a_at == 0 or pm1_at == 0):
    return abi.error(frame, _BAD_THRESHOLD, abi.ERROR_INVALID_ARGUMENT)
  xb, kb, lb = abi.buffer(frame, False, 0), abi.buffer(frame, False, 1), abi.buffer(frame, False, 2)
  lamb = abi.buffer(frame, True, 0)
  rank = abi.buffer_rank(xb)
  if rank < 1:
    return abi.error(frame, _BAD_THRESHOLD, abi.ERROR_INVALID_ARGUMENT)
  n = abi.buffer_dim(xb, rank - 1)
  rows = abi.size(xb) // n if n > 0 else abi.size(kb)
  ok = (abi.buffer_dtype(xb) == code and abi.has(kb, code, rows) and abi.has(lb, code, rows)
        and abi.has(lamb, code, rows))
  if not ok:
    return abi.error(frame, _BAD_THRESHOLD, abi.ERROR_INVALID_ARGUMENT)
  x = carray(abi.typed_pointer(abi.buffer_data(xb), sample), (rows, n))
  k = carray(abi.typed_pointer(abi.buffer_data(kb), sample), (rows,))
  l = carray(abi.typed_pointer(abi.buffer_data(lb), sample), (rows,))
  lam = carray(abi.typed_pointer(abi.buffer_data(lamb), sample), (rows,))
  kind = abi.load32(kind_at)
  if rows_fn(x, k, l, kind, _float_attribute(a_at), _float_attribute(pm1_at), lam) != 0:
    return abi.error(frame, abi.KERNEL_FAILED, abi.ERROR_INTERNAL)
  return abi.null()


@njit(inline="always", cache=True, error_model="numpy")
def _int_buffer(frame, index, rows, n):
  """Result ``index`` as an int32 (rows, n) array."""
  return carray(abi.typed_pointer(abi.buffer_data(abi.buffer(frame, True, index)),
                                  np.int32(0)), (rows, n))


@njit(inline="always", cache=True, error_model="numpy")
def _permutahedron_call(frame, sample):
  """(x if xsort, w if wsort, l) -> (values, ids, x_order, x_inverse if xsort,
  w_order if wsort)."""
  if abi.handler_prologue(frame):
    return abi.null()
  code = abi.dtype_code(sample)
  kind_at = abi.scalar_attribute(frame, _K, abi.INT32)
  xsort_at = abi.scalar_attribute(frame, _X, abi.INT32)
  wsort_at = abi.scalar_attribute(frame, _W, abi.INT32)
  a_at = abi.scalar_attribute(frame, _A, abi.FLOAT64)
  pm1_at = abi.scalar_attribute(frame, _P, abi.FLOAT64)
  if kind_at == 0 or xsort_at == 0 or wsort_at == 0 or a_at == 0 or pm1_at == 0:
    return abi.error(frame, _BAD_PERMUTAHEDRON, abi.ERROR_INVALID_ARGUMENT)
  sort_x, sort_w = abi.load32(xsort_at) != 0, abi.load32(wsort_at) != 0
  n_args = 1 + int(sort_x) + int(sort_w)
  if (not (sort_x or sort_w) or abi.count(frame, False) != n_args
      or abi.count(frame, True) != 2 + 2 * int(sort_x) + int(sort_w)):
    return abi.error(frame, _BAD_PERMUTAHEDRON, abi.ERROR_INVALID_ARGUMENT)
  first = abi.buffer(frame, False, 0)
  rank = abi.buffer_rank(first)
  if rank < 1:
    return abi.error(frame, _BAD_PERMUTAHEDRON, abi.ERROR_INVALID_ARGUMENT)
  n = abi.buffer_dim(first, rank - 1)
  lb = abi.buffer(frame, False, n_args - 1)
  rows = abi.size(first) // n if n > 0 else abi.size(lb)
  ok = abi.has(lb, code, rows)
  for i in range(n_args - 1):
    ok = ok and abi.has(abi.buffer(frame, False, i), code, rows * n)
  ok = ok and abi.has(abi.buffer(frame, True, 0), code, rows * n)
  for i in range(1, 2 + 2 * int(sort_x) + int(sort_w)):
    ok = ok and abi.has(abi.buffer(frame, True, i), abi.INT32, rows * n)
  if not ok:
    return abi.error(frame, _BAD_PERMUTAHEDRON, abi.ERROR_INVALID_ARGUMENT)
  data = carray(abi.typed_pointer(abi.buffer_data(first), sample), (rows, n))
  l = carray(abi.typed_pointer(abi.buffer_data(lb), sample), (rows,))
  values = carray(abi.typed_pointer(abi.buffer_data(abi.buffer(frame, True, 0)), sample),
                  (rows, n))
  ids = _int_buffer(frame, 1, rows, n)
  absent = np.empty((rows, 0), np.int32)
  x_order, x_inverse, w_order = absent, absent, absent
  if sort_x:
    x_order, x_inverse = _int_buffer(frame, 2, rows, n), _int_buffer(frame, 3, rows, n)
  if sort_w:
    w_order = _int_buffer(frame, 2 + 2 * int(sort_x), rows, n)
  kind, a, pm1 = abi.load32(kind_at), _float_attribute(a_at), _float_attribute(pm1_at)
  ranks = np.empty((1, n))
  for i in range(n):
    ranks[0, i] = n - i
  if sort_x and sort_w:
    w = carray(abi.typed_pointer(abi.buffer_data(abi.buffer(frame, False, 1)), sample),
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
    return abi.error(frame, abi.KERNEL_FAILED, abi.ERROR_INTERNAL)
  return abi.null()


# -- the handlers' entry points, one per family and dtype (compiled as ``@cfunc`` on
#    first use by :mod:`implicit_topk.kernels.cpu.registry`) -------------------------
def capped_simplex_f32(frame):
  return _threshold_call(frame, np.float32(0), capped_rows)


def capped_simplex_f64(frame):
  return _threshold_call(frame, np.float64(0), capped_rows)


def magnitude_f32(frame):
  return _threshold_call(frame, np.float32(0), magnitude_rows)


def magnitude_f64(frame):
  return _threshold_call(frame, np.float64(0), magnitude_rows)


def permutahedron_f32(frame):
  return _permutahedron_call(frame, np.float32(0))


def permutahedron_f64(frame):
  return _permutahedron_call(frame, np.float64(0))
