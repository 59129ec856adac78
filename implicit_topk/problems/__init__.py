r"""Row-wise scalar threshold problems: what every solver in :mod:`implicit_topk.solvers` solves.

Each operator here is a threshold map: for every row, one scalar :math:`\lambda` is the
root of a nonincreasing optimality function :math:`\phi(\lambda; x, k, l)`, and the
output is an elementwise map of ``x`` and :math:`\lambda`. A problem object says, for
one operator, everything a solver needs (see :class:`ThresholdProblem`); the solvers
(sort-free Newton, numba PAV, Dykstra) and the implicit derivatives are written once
for all problems.

* :class:`CappedSimplex`: the top-k mask, :math:`\max_{y \in [0,1]^n, \sum y = k}
  \langle x, y\rangle - l\,\Omega(y)` for a separable regularizer :math:`\Omega`.
* :class:`Magnitude`: the top-k in magnitude (Sander et al., 2023), with its own
  :math:`\phi` (``proofs/magnitude_threshold.md``).

Which entries form a row is the problem's ``layout``
(:mod:`implicit_topk.problems.layout`): the last axis of an array (optionally split
over a mesh axis), the segments of a flat axis, or every leaf of a pytree.
"""

from implicit_topk.problems.base import Bracket, ThresholdProblem
from implicit_topk.problems.capped_simplex import CappedSimplex
from implicit_topk.problems.layout import LastAxis, Segments, Tree
from implicit_topk.problems.magnitude import Magnitude

__all__ = ["Bracket", "ThresholdProblem", "CappedSimplex", "Magnitude", "LastAxis",
           "Segments", "Tree"]
