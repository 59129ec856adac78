"""Solvers for the row-wise threshold problems and the rule that picks one."""

from __future__ import annotations

import jax

from implicit_topk import _validation
from implicit_topk import regularizers
from implicit_topk.solvers.base import (CappedSimplexSolver, OptStep, RootState,
                                        ThresholdRootSolver)
from implicit_topk.solvers.dykstra import DykstraSolver
from implicit_topk.solvers.pav import PAVSolver
from implicit_topk.solvers.threshold import ThresholdSolver

SOLVERS = {"pav": PAVSolver, "threshold": ThresholdSolver, "dykstra": DykstraSolver}
DIFF_MODES = ("implicit", "unrolled")
# Solvers with iterations to unroll and the options each accepts.
_ITERATIVE_OPTIONS = {"threshold": ("maxiter",), "dykstra": ("tol", "maxiter")}


# Below this many input entries the host round trip of "pav" (about 0.5 ms on a 2-core
# CPU) costs more than the whole sort-free Newton solve (benchmarks/results/cpu_matrix.md:
# at 1 x 1e3 and 1 x 1e4 "threshold" is 1.4-3.8x the hard mask and "pav" 5-14x; from
# 64 x 1e3 (64000 entries) on, "pav" is the faster of the two in every cell).
PAV_MIN_SIZE = 1 << 15


def auto_solver_name(problem, *, size: int | None = None, backend: str | None = None) -> str:
  """The fastest exact solver for the problem on ``backend`` (default: JAX's default).

  The rule comes from the benchmark matrix (``benchmarks/results/cpu_matrix.md``): on
  CPU, inputs of at least ``PAV_MIN_SIZE`` entries (``size``; unknown counts as large)
  use the numba PAV kernel for the p-norms with closed-form blocks (p = 2, p = 4/3);
  everything else, and every input on GPU/TPU, uses the sort-free Newton threshold
  solver (pure JAX, no host round trip).
  """
  backend = jax.default_backend() if backend is None else backend
  if backend != "cpu" or (size is not None and size < PAV_MIN_SIZE):
    return "threshold"
  exponent = regularizers.pnorm_exponent(getattr(problem, "regularizer", None))
  return "pav" if exponent in (1, 3) else "threshold"


def resolve_solver_name(name: str, problem, *, diff: str = "implicit", tol=None,
                        maxiter=None, size: int | None = None) -> str:
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
    return auto_solver_name(problem, size=size)
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
) -> ThresholdRootSolver:
  """Builds the solver ``name`` ("auto", "pav", "threshold" or "dykstra") for ``problem``.

  ``diff="unrolled"`` differentiates through the iterations of "threshold" or
  "dykstra" (``maxiter`` of them); ``tol`` is Dykstra's stopping tolerance and
  ``maxiter`` the iteration cap of the iterative solvers. ``None`` keeps the solver's
  default. Options a solver does not have raise ``ValueError``, on every backend.
  ``size`` (the number of input entries) lets ``"auto"`` pick by size.
  """
  name = resolve_solver_name(name, problem, diff=diff, tol=tol, maxiter=maxiter, size=size)
  kwargs = {key: value for key, value in {"tol": tol, "maxiter": maxiter}.items()
            if value is not None}
  return SOLVERS[name](problem=problem, implicit_diff=diff == "implicit",
                       implicit_diff_backend=implicit_diff_backend, **kwargs)


__all__ = [
    "ThresholdRootSolver", "CappedSimplexSolver", "OptStep", "RootState", "PAVSolver",
    "ThresholdSolver", "DykstraSolver", "SOLVERS", "DIFF_MODES", "PAV_MIN_SIZE", "auto_solver_name",
    "resolve_solver_name", "make_solver",
]
