"""Solvers for the row-wise threshold problems and the rule that picks one."""

from __future__ import annotations

import jax

from implicit_topk import _validation
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


def auto_solver_name(problem, *, size: int | None = None, backend: str | None = None,
                     sharded: bool = False, row_length: int | None = None) -> str:
  """The default solver: the fastest exact solver that runs where the call runs.

  * CPU: ``"native"`` (a compiled kernel per row, called through the XLA FFI: exact,
    exportable, per shard on a batch-sharded input) for the top-k mask with a
    built-in regularizer and for the top-k in magnitude (every ``p``) along an
    unsplit last axis (``benchmarks/results/cpu_matrix.md``,
    ``benchmarks/bench_magnitude.py``).
  * GPU (CUDA, ROCm): ``"pallas"`` (one fused kernel per block of rows, certified per
    row, the threshold solver for the rows it cannot certify) for rows of at most
    ``kernels.gpu.pallas_threshold.MAX_ROW_LENGTH`` entries on an unsplit last axis.
  * everywhere else, and where the reduced axis is split over devices (``sharded``:
    ``axis_name=`` or a sharding along it), for segment and tree problems and for
    user-defined regularizers: ``"threshold"`` (sort-free Newton, pure JAX, any
    backend).

  ``size`` is accepted for compatibility and does not change the choice;
  ``row_length`` (the reduced axis' length) is needed for the GPU rule.
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
  """
  name = resolve_solver_name(name, problem, diff=diff, tol=tol, maxiter=maxiter, size=size,
                             sharded=sharded, row_length=row_length)
  kwargs = {key: value for key, value in {"tol": tol, "maxiter": maxiter}.items()
            if value is not None}
  return SOLVERS[name](problem=problem, implicit_diff=diff == "implicit",
                       implicit_diff_backend=implicit_diff_backend, **kwargs)


__all__ = [
    "ThresholdRootSolver", "CappedSimplexSolver", "OptStep", "RootState", "PAVSolver",
    "ThresholdSolver", "DykstraSolver", "NativeSolver", "PallasSolver", "SOLVERS", "DIFF_MODES", "auto_solver_name",
    "resolve_solver_name", "make_solver",
]
