"""Solvers for the row-wise threshold problems and the rule that picks one."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from implicit_topk import _deferred, _validation
from implicit_topk import regularizers
from implicit_topk.solvers.base import (CappedSimplexSolver, OptStep, RootState,
                                        ThresholdRootSolver)
from implicit_topk.solvers.dykstra import DykstraSolver
from implicit_topk.solvers.native import NativeSolver
from implicit_topk.solvers.pallas import PallasSolver
from implicit_topk.solvers.pav import PAVSolver
from implicit_topk.solvers.threshold import ThresholdSolver

SOLVERS = {"pav": PAVSolver, "threshold": ThresholdSolver, "dykstra": DykstraSolver,
           "native": NativeSolver, "pallas": PallasSolver}
DIFF_MODES = ("implicit", "unrolled")
# Solvers with iterations to unroll and the options each accepts.
_ITERATIVE_OPTIONS = {"threshold": ("maxiter",), "dykstra": ("tol", "maxiter")}
# Solvers whose kernels run on the CPU only (numba, called through the XLA FFI).
_CPU_ONLY = ("native", "pav")
# The platforms `auto` chooses for at lowering, and a backend name standing for each.
_PLATFORM_BACKENDS = {"cpu": "cpu", "cuda": "cuda", "rocm": "rocm", "other": "tpu"}


def auto_solver_name(problem, *, size: int | None = None, backend: str | None = None,
                     sharded: bool = False, row_length: int | None = None) -> str:
  """The default solver: the fastest exact solver that runs where the call runs.

  * CPU: ``"native"`` (a compiled kernel per row, called through the XLA FFI: exact,
    exportable, per shard on a batch-sharded input) for the top-k mask with a
    built-in regularizer and for the top-k in magnitude (every ``p``) along an
    unsplit last axis (``benchmarks/results/cpu_matrix.md``,
    ``benchmarks/bench_magnitude.py``).
  * GPU (CUDA, ROCm): ``"pallas"`` (one fused kernel per block of rows, every row
    certified inside the kernel within a proven number of passes: no host round trip)
    for rows of at most 65536 entries (``kernels.gpu.pallas_threshold.fits``) on an
    unsplit last axis.
  * everywhere else, and where the reduced axis is split over devices (``sharded``:
    ``axis_name=`` or a sharding along it), for segment and tree problems and for
    user-defined regularizers: ``"threshold"`` (sort-free Newton, pure JAX, any
    backend).

  ``size`` is accepted for compatibility and does not change the choice;
  ``row_length`` (the reduced axis' length) is needed for the GPU rule. ``backend``
  (default: the default backend) names the platform; :func:`make_solver` applies this
  rule per platform when the function is lowered (:class:`PlatformSolver`).
  """
  del size
  backend = backend or jax.default_backend()
  if sharded:
    return "threshold"
  if backend == "cpu" and _supported(problem, "native"):
    from implicit_topk.kernels.cpu import registry
    if registry.available():  # numba imports: else the pure-JAX solver
      return "native"
  if backend in ("gpu", "cuda", "rocm") and row_length is not None and _supported(problem, "pallas"):
    from implicit_topk.kernels.gpu import pallas_threshold
    if pallas_threshold.fits(row_length):
      return "pallas"
  return "threshold"


def _supported(problem, name: str) -> bool:
  try:
    problem.supports(name)
  except ValueError:
    return False
  return True


def target_platform() -> str:
  """The platform a call made here runs on: that of ``jax.default_device`` where one
  is set (``jax.default_device(jax.devices("cpu")[0])`` on a GPU machine runs on the
  CPU), else the default backend (``"cpu"``, ``"gpu"``, ``"tpu"``, ...)."""
  device = getattr(jax.config, "jax_default_device", None)
  if device is None:
    return jax.default_backend()
  if isinstance(device, str):
    return device
  return getattr(device, "platform", None) or jax.default_backend()


def _check_runs_here(name: str) -> None:
  """``ValueError`` for a CPU-only solver asked for where calls run on another backend."""
  platform = target_platform()
  if name in _CPU_ONLY and platform != "cpu":
    raise ValueError(
        f"solver={name!r} runs on the CPU only (a numba kernel called through the XLA "
        f"FFI), and calls here run on {platform!r}. Solvers that run there: 'auto' "
        "(the fused Pallas kernel on GPU where it applies, else 'threshold'), 'pallas', "
        "'threshold' and 'dykstra' (p = 2). To run this solver on the CPU of this "
        "machine, call it under jax.default_device(jax.devices('cpu')[0]).")


@dataclasses.dataclass(frozen=True)
class PlatformSolver(ThresholdRootSolver):
  r"""``solver="auto"``: one solver per platform, chosen when the function is lowered.

  Holds the solver :func:`auto_solver_name` picks for each platform (``cpu``, ``cuda``,
  ``rocm`` and every ``other`` one) and runs them under ``jax.lax.platform_dependent``:
  the StableHLO lowered for one platform holds only that platform's solver (behind a
  ``stablehlo.case`` on a constant, which the compiler folds away before anything runs:
  no host round trip), and a function exported for several platforms
  (``jax.export.export(..., platforms=("cpu", "cuda"))``) carries each, the case then
  being on the platform index that jax resolves before compiling. Each platform keeps
  its solver's own derivatives (the native derivative kernels on CPU, the Pallas
  derivative kernels on GPU). So lowering or exporting for CUDA on a
  CPU-only host gets the GPU kernel, not the CPU one. The solvers solve the same
  problem, so every platform returns the same thresholds (each to its own rounding).

  Attributes:
    cpu, cuda, rocm, other: the solver of each platform (solver objects on
      ``problem``).
    regularizer, problem, implicit_diff, implicit_diff_backend: as in
      :class:`ThresholdRootSolver`.

  Example:
    >>> import implicit_topk as itk
    >>> solver = itk.solvers.make_solver("auto", itk.problems.CappedSimplex(), row_length=64)
    >>> solver.for_platform("cuda").name, solver.for_platform("tpu").name
    ('pallas', 'threshold')
  """

  cpu: Any = None
  cuda: Any = None
  rocm: Any = None
  other: Any = None
  name = "auto"

  def for_platform(self, platform: str) -> ThresholdRootSolver:
    """The solver that runs on ``platform`` (``"cpu"``, ``"cuda"``, ``"gpu"``, ...)."""
    platform = "cuda" if platform == "gpu" else platform
    return getattr(self, platform) if platform in ("cpu", "cuda", "rocm") else self.other

  def with_layout(self, layout: Any) -> ThresholdRootSolver:
    """This solver for rows laid out by ``layout``; a layout that the kernels cannot take
    (segments, a pytree, an axis split over devices) gets ``"threshold"`` everywhere."""
    if not getattr(layout, "sortable", False):
      return ThresholdSolver(problem=self.problem.with_layout(layout),
                             implicit_diff=self.implicit_diff,
                             implicit_diff_backend=self.implicit_diff_backend)
    new = super().with_layout(layout)
    for platform in ("cpu", "cuda", "rocm", "other"):
      object.__setattr__(new, platform, getattr(self, platform).with_layout(layout))
    return new

  def _per_platform(self, method: str, *args):
    """``method`` of the solver of the platform the function is lowered for. The
    solver of the platform calls run on here (:func:`target_platform`) is traced now;
    the others are one deferred call (:func:`implicit_topk._deferred.platform_dependent`),
    traced only for a lowering for their platforms (``jax.export`` for several
    platforms, ``.lower(lowering_platforms=...)``). So a default call on a CPU does
    not trace the GPU kernel or the pure-JAX solver. A gradient lowered for a platform
    other than the one it was traced on recomputes that platform's forward pass in its
    backward pass (traced on that platform, it does not)."""
    _lower_cpu_calls_on_every_platform()
    branches = {p: getattr(getattr(self, p), method) for p in ("cpu", "cuda", "rocm")}
    return _deferred.platform_dependent(*args, here=target_platform(),
                                        default=getattr(self.other, method), **branches)

  def _solve(self, init, x, k, l):
    return self._per_platform("_solve", init, x, k, l)

  def solve_and_map(self, x, k, l):
    """Each platform's ``solve_and_map`` (its kernel and its own derivatives: the
    native derivative kernels on CPU, the Pallas kernels of
    :func:`implicit_topk.solvers.pallas.implicit_tangent` on GPU), chosen at lowering."""
    return self._per_platform("solve_and_map", x, k, l)


_CPU_CALLS_LOWERED_EVERYWHERE: list = []


def _lower_cpu_calls_on_every_platform() -> None:
  """Lets the CPU kernels' calls appear in a module lowered for several platforms.

  ``jax.lax.platform_dependent`` lowers every branch for every platform of a
  multi-platform lowering (jax 0.10, 0.11), so ``jax.export(..., platforms=("cpu",
  "cuda"))`` of the default lowers the CPU branch's kernel calls for CUDA too, where
  their primitives (:mod:`implicit_topk.kernels.cpu.ffi`) have no rule. There they are
  lowered to the same typed custom call, without building the numba handler: the branch
  is taken only on the CPU (jax resolves the platform case before compiling), and a
  CUDA program that did reach it would fail to compile naming the CPU target, never
  compute a wrong value. Lowering for the CPU keeps the kernels' own rules."""
  if _CPU_CALLS_LOWERED_EVERYWHERE:
    return
  _CPU_CALLS_LOWERED_EVERYWHERE.append(True)
  from jax.interpreters import mlir  # pylint: disable=g-import-not-at-top
  from implicit_topk.kernels.cpu import ffi  # pylint: disable=g-import-not-at-top

  def custom_call(ctx, *operands, target, results, attributes, **_):
    del results
    return jax.ffi.ffi_lowering(target)(ctx, *operands, **dict(attributes))

  for primitive in (ffi._native_call, ffi._kernel_call, ffi._linear_call):  # pylint: disable=protected-access
    for platform in ("cuda", "rocm", "tpu"):
      mlir.register_lowering(primitive, custom_call, platform=platform)


def resolve_solver_name(name: str, problem, *, diff: str = "implicit", tol=None,
                        maxiter=None, size: int | None = None, sharded: bool = False,
                        row_length: int | None = None) -> str:
  """Checks the options against ``name`` *before* ``"auto"`` is resolved.

  So a call is accepted or refused the same way on every backend: ``tol`` belongs to
  ``"dykstra"`` alone (never chosen by ``"auto"``), and ``maxiter`` or
  ``diff="unrolled"`` with ``"auto"`` pick ``"threshold"`` everywhere.
  """
  _validation.check_choice(name, "solver", ("auto", *SOLVERS))
  _validation.check_choice(diff, "diff", DIFF_MODES)
  options = {"tol": tol, "maxiter": maxiter}
  if name == "auto":
    if tol is not None:
      raise ValueError("`tol` applies to solver='dykstra' only; solver='auto' never picks it.")
    if maxiter is not None or diff == "unrolled":
      return "threshold"
    return auto_solver_name(problem, size=size, sharded=sharded, row_length=row_length)
  allowed = _ITERATIVE_OPTIONS.get(name, ())
  for option, value in options.items():
    if value is not None and option not in allowed:
      raise ValueError(f"`{option}` does not apply to solver={name!r} "
                       f"(solvers that take it: {[s for s, o in _ITERATIVE_OPTIONS.items() if option in o]}).")
  if diff == "unrolled" and name not in _ITERATIVE_OPTIONS:
    raise ValueError(f"diff='unrolled' needs an iterative solver ({sorted(_ITERATIVE_OPTIONS)}); "
                     f"got solver={name!r}.")
  return name


def make_solver(
    name: str,
    problem,
    *,
    implicit_diff_backend: str = "lax",
    diff: str = "implicit",
    tol: float | None = None,
    maxiter: int | None = None,
    size: int | None = None,
    sharded: bool = False,
    row_length: int | None = None,
) -> ThresholdRootSolver:
  """Builds the solver ``name`` ("auto", "native", "pallas", "pav", "threshold" or
  "dykstra") for ``problem``; ``sharded``: the reduced axis is split over devices
  (``auto`` then picks a solver that reduces across them); ``row_length``: the
  reduced axis' length (``auto`` on GPU reads it).

  ``diff="unrolled"`` differentiates through the iterations of "threshold" or
  "dykstra" (``maxiter`` of them); ``tol`` is Dykstra's stopping tolerance and
  ``maxiter`` the iteration cap of the iterative solvers. ``None`` keeps the solver's
  default. Options a solver does not have raise ``ValueError``, on every backend.

  ``"auto"`` (without ``maxiter``, ``tol`` or ``diff="unrolled"``) returns a
  :class:`PlatformSolver`: :func:`auto_solver_name`'s choice for each platform, taken
  when the function is lowered (``"native"`` on CPU, ``"pallas"`` on CUDA and ROCm
  where it applies, ``"threshold"`` elsewhere), or that solver itself where every
  platform gets the same. ``"native"`` and ``"pav"`` run on the CPU only: asked for
  where calls run on another backend (:func:`target_platform`), they raise
  ``ValueError`` naming the solvers that run there.
  """
  auto = name == "auto" and tol is None and maxiter is None and diff == "implicit"
  name = resolve_solver_name(name, problem, diff=diff, tol=tol, maxiter=maxiter, size=size,
                             sharded=sharded, row_length=row_length)
  kwargs = {key: value for key, value in {"tol": tol, "maxiter": maxiter}.items()
            if value is not None}
  common = dict(problem=problem, implicit_diff=diff == "implicit",
                implicit_diff_backend=implicit_diff_backend)
  if not auto:
    _check_runs_here(name)
    return SOLVERS[name](**common, **kwargs)
  names = {platform: auto_solver_name(problem, backend=backend, sharded=sharded,
                                      row_length=row_length)
           for platform, backend in _PLATFORM_BACKENDS.items()}
  if len(set(names.values())) == 1:
    return SOLVERS[names["cpu"]](**common)
  return PlatformSolver(**common, **{platform: SOLVERS[n](**common) for platform, n in names.items()})


__all__ = [
    "ThresholdRootSolver", "CappedSimplexSolver", "OptStep", "RootState", "PAVSolver",
    "ThresholdSolver", "DykstraSolver", "NativeSolver", "PallasSolver", "SOLVERS", "DIFF_MODES", "auto_solver_name",
    "resolve_solver_name", "make_solver", "PlatformSolver", "target_platform",
]
