"""The one bridge from JAX to the numba kernels (:mod:`implicit_topk.solvers.pav_kernels`).

Every host computation goes through :func:`call`: one ``jax.pure_callback`` for the
whole batch, the kernel module loaded (and numba's threading layer chosen) once, and
the kernels never entered concurrently.

numba's default OpenMP threading layer spin-waits: on a loaded 2-core machine every
call then costs ~8 ms (``benchmarks/results/cpu_pav_workqueue.md``). The workqueue
layer does not, but must never be entered from two threads at once, hence the lock.
A user's explicit ``NUMBA_THREADING_LAYER`` is respected.

Host callbacks cannot be serialized by ``jax.export`` and pull a sharded input to one
device; the pure-JAX solvers have neither limitation.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

import jax
import numpy as np

_KERNEL_LOCK = threading.Lock()


def kernels():
  """The numba kernel module (compiled on first use, cached on disk)."""
  import numba
  if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"
  from implicit_topk.solvers import pav_kernels
  return pav_kernels


def call(host_fn: Callable, result_shape, *args):
  """``host_fn(kernels, *numpy_args)`` on the host, under the kernel lock.

  Args:
    host_fn: takes the kernel module and the arguments as NumPy arrays; returns NumPy
      arrays matching ``result_shape``.
    result_shape: a ``jax.ShapeDtypeStruct`` or a tuple of them.
    *args: JAX arrays; a ``vmap`` over the call broadcasts them (one call per batch).
  """

  def locked(*numpy_args):
    module = kernels()
    with _KERNEL_LOCK:
      return host_fn(module, *(np.asarray(a) for a in numpy_args))

  results = jax.pure_callback(locked, result_shape, *args, vmap_method="broadcast_all")
  from implicit_topk.kernels import ffi
  return jax.tree.map(lambda out: ffi.varying_like(out, args), results)
