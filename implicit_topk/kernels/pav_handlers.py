"""The PAV kernels' FFI handlers (numba ``@cfunc``), compiled when this module is
imported: :func:`implicit_topk.kernels.pav_ffi.register_targets` imports it on first use.
"""

from __future__ import annotations

import numpy as np
from numba import cfunc

from implicit_topk.kernels import ffi
from implicit_topk.kernels.pav_capped_simplex import capped_rows
from implicit_topk.kernels.pav_ffi import _permutahedron_call, _threshold_call
from implicit_topk.kernels.pav_magnitude import magnitude_rows


@cfunc(ffi.HANDLER_SIGNATURE, cache=True, error_model="numpy")
def capped_simplex_f32(frame):
  return _threshold_call(frame, np.float32(0), capped_rows)


@cfunc(ffi.HANDLER_SIGNATURE, cache=True, error_model="numpy")
def capped_simplex_f64(frame):
  return _threshold_call(frame, np.float64(0), capped_rows)


@cfunc(ffi.HANDLER_SIGNATURE, cache=True, error_model="numpy")
def magnitude_f32(frame):
  return _threshold_call(frame, np.float32(0), magnitude_rows)


@cfunc(ffi.HANDLER_SIGNATURE, cache=True, error_model="numpy")
def magnitude_f64(frame):
  return _threshold_call(frame, np.float64(0), magnitude_rows)


@cfunc(ffi.HANDLER_SIGNATURE, cache=True, error_model="numpy")
def permutahedron_f32(frame):
  return _permutahedron_call(frame, np.float32(0))


@cfunc(ffi.HANDLER_SIGNATURE, cache=True, error_model="numpy")
def permutahedron_f64(frame):
  return _permutahedron_call(frame, np.float64(0))


#: family -> dtype name -> handler.
HANDLERS = {
    "capped_simplex": {"float32": capped_simplex_f32, "float64": capped_simplex_f64},
    "magnitude": {"float32": magnitude_f32, "float64": magnitude_f64},
    "permutahedron": {"float32": permutahedron_f32, "float64": permutahedron_f64},
}


