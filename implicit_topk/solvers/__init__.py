"""Solvers for the capped-simplex top-k problem and the rule that picks one."""

from __future__ import annotations

import jax

from implicit_topk import _validation
from implicit_topk.solvers.base import CappedSimplexSolver, OptStep, RootState
from implicit_topk.solvers.pav import PAVSolver
from implicit_topk.solvers.threshold import ThresholdSolver

SOLVERS = {"pav": PAVSolver, "threshold": ThresholdSolver}


def auto_solver_name(regularizer) -> str:
  """The fastest exact solver for the default backend (see benchmarks/README.md).

  On CPU the numba PAV kernel wins for p = 2 and p = 4/3 (one numpy sort per row,
  then O(n)); for other p, and on GPU/TPU, the sort-free Newton threshold solver.
  """
  if jax.default_backend() != "cpu":
    return "threshold"
  exponent = getattr(regularizer, "exponent", None)
  return "pav" if exponent in (1, 3) else "threshold"


def make_solver(name: str, regularizer, **options) -> CappedSimplexSolver:
  """Builds the solver object ``name`` ("auto", "pav" or "threshold")."""
  _validation.check_choice(name, "solver", ("auto", *SOLVERS))
  if name == "auto":
    name = auto_solver_name(regularizer)
  return SOLVERS[name](regularizer=regularizer, **options)


__all__ = [
    "CappedSimplexSolver", "OptStep", "RootState", "PAVSolver", "ThresholdSolver",
    "SOLVERS", "auto_solver_name", "make_solver",
]
