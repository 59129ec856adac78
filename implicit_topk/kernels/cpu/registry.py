"""Where the CPU kernels become XLA FFI targets: compiled and registered on first use.

Each target is one handler (a numba ``@cfunc`` of
:data:`implicit_topk.kernels.cpu.abi.HANDLER_SIGNATURE`) for one kernel family and
one dtype, named ``implicit_topk_<family>_<dtype>``. Nothing is compiled when
``implicit_topk`` is imported: :func:`ensure` compiles a handler when a call of it is
first traced (numba caches the machine code on disk, ``cache=True``: in
``__pycache__`` beside the source, or numba's user cache directory where that is
read-only, so a later process loads it in a fraction of a second; numba keys that cache
on each function's own file, and :mod:`~implicit_topk.kernels.cpu.cache_stamp` drops
what a changed dependency made stale). A process that
only runs an exported function traces nothing; it calls
:func:`implicit_topk.register_kernels` (with the exported function, to build just
the targets it calls).

A handler that takes more than :data:`SLOW_COMPILE_SECONDS` to build says so once
through the ``implicit_topk`` logger (a cold cache: a few seconds to a minute per
handler on two cores), so that a first call is not taken for a hung process.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
import time
from typing import Any, Callable, Iterable

import numpy as np

from implicit_topk.kernels.cpu import cache_stamp

_LOGGER = logging.getLogger("implicit_topk")
PREFIX = "implicit_topk_"
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
#: Seconds after which a handler's build is announced through the logger.
SLOW_COMPILE_SECONDS = 2.0

#: family -> (the solver that calls it, its module, the entry function per dtype).
FAMILIES = {
    "capped_simplex": ("native", "native_mask", "capped_simplex_{}"),
    **{f"capped_simplex_{direction}_{rule}": ("native", "native_derivatives",
                                              f"{direction}_{rule}_{{}}")
       for direction in ("tangent", "cotangent") for rule in ("cubic", "linear", "general")},
    "magnitude": ("native", "native_magnitude", "magnitude_{}"),
    "budget": ("native", "budget_kernel", "budget_{}"),
    **{f"budget_{direction}_{rule}": ("native", "budget_kernel", f"{direction}_{rule}_{{}}")
       for direction in ("tangent", "cotangent") for rule in ("cubic", "linear", "general")},
    "pav_capped_simplex": ("pav", "pav_ffi", "capped_simplex_{}"),
    "pav_magnitude": ("pav", "pav_ffi", "magnitude_{}"),
    "pav_permutahedron": ("pav", "pav_ffi", "permutahedron_{}"),
}
_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
_OPTIONS: dict[str, Any] = dict(cache=True, error_model="numpy", fastmath=False)
_BUILD_LOCK = threading.RLock()
_REGISTERED: set = set()
_TASKS: dict = {}
_CONTROL_REGISTERED = False


def registered_targets() -> tuple[str, ...]:
  """The names of the FFI targets registered so far."""
  return tuple(sorted(_REGISTERED))


def register_handler(name: str, handler) -> None:
  """Registers a numba ``@cfunc`` handler as the CPU FFI target ``name``, batch
  partitionable where this jax can say so."""
  import jax
  jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler.address), platform="cpu")
  partitionable = getattr(jax.ffi, "register_ffi_target_as_batch_partitionable", None)
  if partitionable is not None:
    partitionable(name)
  _REGISTERED.add(name)


def target(family: str, dtype) -> str:
  """The FFI target name of ``family``'s handler for ``dtype``."""
  return f"{PREFIX}{family}_{np.dtype(dtype).name}"


def all_targets() -> tuple[str, ...]:
  """Every CPU target this package can register."""
  return tuple(target(family, dtype) for family in FAMILIES for dtype in DTYPES)


def available() -> bool:
  """Whether the compiled kernels can be built here (numba imports)."""
  try:
    import numba  # noqa: F401
  except ImportError:
    return False
  return True


def _parse(name: str):
  for family in FAMILIES:
    for dtype in DTYPES:
      if name == target(family, dtype):
        return family, dtype
  raise ValueError(f"{name!r} is not a target of implicit_topk "
                   f"(known: {', '.join(all_targets())}).")


def _announce(name: str, solver: str) -> None:
  _LOGGER.warning(
      "implicit_topk: compiling the CPU kernel %s (solver=%r, numba) on its first use on "
      "this machine; it is cached for later processes. solver='threshold' needs no "
      "compilation.", name, solver)


def ensure(name: str) -> None:
  """Compiles (or loads from numba's cache) and registers the target ``name``, once.

  Raises ``RuntimeError`` naming the solver and the pure-JAX alternative when numba
  is missing or the build fails."""
  if name in _REGISTERED:
    return
  family, dtype = _parse(name)
  solver, module_name, entry = FAMILIES[family]
  with _BUILD_LOCK:
    if name in _REGISTERED:
      return
    cache_stamp.refresh()  # once per process: no stale machine code from numba's cache
    handler = build_announced(name, solver,
                              lambda: _compile(module_name, entry.format(_SUFFIX[dtype])))
    register_handler(name, handler)


def _compile(module_name: str, function_name: str):
  """The numba ``@cfunc`` handler of ``function_name`` in ``kernels/cpu/<module_name>``;
  first its helper task ``<function_name>_task`` where the module has one
  (:mod:`~implicit_topk.kernels.cpu.threads`), registered with LLVM before the handler
  is compiled or loaded, so that the handler's reference to it resolves."""
  from numba import cfunc
  from implicit_topk.kernels.cpu import abi, threads
  module = importlib.import_module(f"implicit_topk.kernels.cpu.{module_name}")
  _register_control()
  task_function = getattr(module, f"{function_name}_task", None)
  if task_function is not None:
    task = cfunc(threads.TASK_SIGNATURE, **_OPTIONS)(task_function)
    _TASKS[(module_name, function_name)] = task  # kept alive with the handler
    threads.register_task(module_name, function_name, task)
  return cfunc(abi.HANDLER_SIGNATURE, **_OPTIONS)(getattr(module, function_name))


def _register_control() -> None:
  global _CONTROL_REGISTERED
  if not _CONTROL_REGISTERED:
    from implicit_topk.kernels.cpu import threads
    threads.register_control()
    _CONTROL_REGISTERED = True


def build_announced(name: str, solver: str, build: Callable[[], Any]) -> Any:
  """``build()``, announced through the ``implicit_topk`` logger when it runs past
  :data:`SLOW_COMPILE_SECONDS`; a failure becomes a ``RuntimeError`` that names the
  solver and the pure-JAX alternative."""
  timer = threading.Timer(SLOW_COMPILE_SECONDS, _announce, (name, solver))
  timer.daemon = True
  start = time.perf_counter()
  timer.start()
  try:
    handler = build()
  except Exception as error:  # a missing numba or a failed build: say what to use
    raise RuntimeError(
        f"solver={solver!r} needs the compiled CPU kernel {name!r}, which could not be "
        f"built here ({type(error).__name__}: {error}). Use solver='threshold' (pure "
        f"JAX, every backend) instead.") from error
  finally:
    timer.cancel()
  elapsed = time.perf_counter() - start
  if elapsed > SLOW_COMPILE_SECONDS:
    _LOGGER.info("implicit_topk: %s compiled in %.1f s.", name, elapsed)
  else:
    _LOGGER.debug("implicit_topk: %s loaded in %.2f s.", name, elapsed)
  return handler


def targets_called_by(exported) -> tuple[str, ...]:
  """The targets of this package that an exported function (``jax.export.Exported``)
  calls, read from its module's custom calls."""
  text = exported.mlir_module()
  known = set(all_targets())
  return tuple(sorted({name for name in re.findall(rf"{PREFIX}\w+", text) if name in known}))


def register(names: Iterable[str] | None = None) -> None:
  """Builds and registers ``names`` (default: every target)."""
  for name in (all_targets() if names is None else names):
    ensure(name)
