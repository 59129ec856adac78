"""implicit_topk: sparse, differentiable top-k operators for JAX.

Top-k (and sort, rank, quantile) as regularized linear programs over the capped simplex
and the permutahedron, solved exactly (numba PAV, a pure-JAX threshold Newton) or
approximately (Dykstra), and differentiated implicitly. The threshold operators also
run along an axis split over devices (``axis_name=``, or a sharded input under
``jax.jit``), within the ragged segments of a flat axis (:func:`segment_soft_topk_mask`),
over a whole pytree with one global threshold (:func:`tree_soft_topk_mask`,
:func:`tree_soft_topk_mag`), and on padded rows (``where=``).
"""

from implicit_topk import baselines, losses, problems
from implicit_topk.hard import hard_topk_mag, hard_topk_mask
from implicit_topk.losses import (smooth_topk_svm_loss, soft_error_loss, topk_cross_entropy,
                                  topk_fenchel_young_loss)
from implicit_topk.magnitude import soft_topk_mag, tree_soft_topk_mag
from implicit_topk.ops import segment_soft_topk_mask, soft_topk_mask, tree_soft_topk_mask
from implicit_topk.permutahedron import (permutahedron_argmax, soft_quantile, soft_rank, soft_sort,
                                         soft_topk_values)
from implicit_topk.regularizers import BinaryEntropy, Entropy, Laplace, PNorm, Regularizer
from implicit_topk.smooth_topk import grad_topk, iterative_softmax_topk
from implicit_topk.solvers import (DykstraSolver, NativeSolver, OptStep, PAVSolver, RootState,
                                   ThresholdSolver)
from implicit_topk.sparse_softmax import sparse_softmax
from implicit_topk.kernels.export import export_safety_checks


def register_kernels(exported=None) -> None:
  """Builds and registers the compiled CPU kernels with XLA, for a process that runs an
  exported function (``jax.export``) without tracing the operators itself.

  Nothing is compiled at ``import implicit_topk``: a traced call builds the kernels it
  needs on first use (numba, cached on disk: a cold cache costs seconds to a minute
  per kernel on two cores, a warm one a fraction of a second). A process that only
  deserializes and runs an exported function traces nothing, so it calls this first.

  Args:
    exported: a ``jax.export.Exported``: build only the kernels it calls. ``None``:
      every kernel (all solvers, float32 and float64).

  Example:
    >>> import implicit_topk as itk
    >>> itk.register_kernels()
    >>> "implicit_topk_pav_capped_simplex_float32" in itk.kernels.cpu.ffi.registered_targets()
    True
  """
  from implicit_topk.kernels.cpu import registry
  registry.register(None if exported is None else registry.targets_called_by(exported))


__version__ = "0.2.0"  # the one source of the version (pyproject.toml reads it)

__all__ = [
    "soft_topk_mask", "soft_topk_mag", "hard_topk_mask", "hard_topk_mag",
    "segment_soft_topk_mask", "tree_soft_topk_mask", "tree_soft_topk_mag",
    "soft_sort", "soft_rank", "soft_quantile", "soft_topk_values", "permutahedron_argmax",
    "grad_topk", "iterative_softmax_topk", "sparse_softmax",
    "topk_cross_entropy", "topk_fenchel_young_loss", "smooth_topk_svm_loss", "soft_error_loss",
    "losses", "baselines", "problems",
    "Regularizer", "PNorm", "Entropy", "BinaryEntropy", "Laplace",
    "PAVSolver", "ThresholdSolver", "DykstraSolver", "NativeSolver", "OptStep", "RootState",
    "export_safety_checks", "register_kernels",
]
