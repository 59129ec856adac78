"""Solvers for the capped-simplex top-k problem and the rule that picks one."""

from __future__ import annotations

import jax

from implicit_topk import _validation
from implicit_topk.solvers.base import CappedSimplexSolver, OptStep, RootState
from implicit_topk.solvers.dykstra import DykstraSolver
from implicit_topk.solvers.pav import PAVSolver
from implicit_topk.solvers.threshold import ThresholdSolver

SOLVERS = {"pav": PAVSolver, "threshold": ThresholdSolver, "dykstra": DykstraSolver}
DIFF_MODES = ("implicit", "unrolled")
# Solvers with iterations to unroll and the options each accepts.
_ITERATIVE_OPTIONS = {"threshold": ("maxiter",), "dykstra": ("tol", "maxiter")}


def auto_solver_name(regularizer) -> str:
  """The fastest exact solver for the default backend (see benchmarks/README.md).

  On CPU the numba PAV kernel wins for p = 2 and p = 4/3 (one numpy sort per row,
  then O(n)); for other p, and on GPU/TPU, the sort-free Newton threshold solver.
  """
  if jax.default_backend() != "cpu":
    return "threshold"
  exponent = getattr(regularizer, "exponent", None)
  return "pav" if exponent in (1, 3) else "threshold"


def make_solver(
    name: str,
    regularizer,
    *,
    implicit_diff_backend: str = "lax",
    diff: str = "implicit",
    tol: float | None = None,
    maxiter: int | None = None,
) -> CappedSimplexSolver:
  """Builds the solver object ``name`` ("auto", "pav", "threshold" or "dykstra").

  ``diff="unrolled"`` differentiates through the iterations of "threshold" or
  "dykstra" (``maxiter`` of them); ``tol`` is Dykstra's stopping tolerance and
  ``maxiter`` the iteration cap of the iterative solvers. ``None`` keeps the solver's
  default. Options a solver does not have raise ``ValueError``.
  """
  _validation.check_choice(name, "solver", ("auto", *SOLVERS))
  _validation.check_choice(diff, "diff", DIFF_MODES)
  if name == "auto":
    name = auto_solver_name(regularizer)
  options = {"tol": tol, "maxiter": maxiter}
  allowed = _ITERATIVE_OPTIONS.get(name, ())
  for option, value in options.items():
    if value is not None and option not in allowed:
      raise ValueError(f"`{option}` does not apply to solver={name!r} "
                       f"(solvers that take it: {[s for s, o in _ITERATIVE_OPTIONS.items() if option in o]}).")
  if diff == "unrolled" and name not in _ITERATIVE_OPTIONS:
    raise ValueError(f"diff='unrolled' needs an iterative solver ({sorted(_ITERATIVE_OPTIONS)}); "
                     f"got solver={name!r}.")
  kwargs = {key: value for key, value in options.items() if value is not None}
  return SOLVERS[name](regularizer=regularizer, implicit_diff=diff == "implicit",
                       implicit_diff_backend=implicit_diff_backend, **kwargs)


__all__ = [
    "CappedSimplexSolver", "OptStep", "RootState", "PAVSolver", "ThresholdSolver",
    "DykstraSolver", "SOLVERS", "DIFF_MODES", "auto_solver_name", "make_solver",
]
