"""implicit_topk: sparse, differentiable top-k operators for JAX.

Top-k as a regularized linear program over the capped simplex, solved exactly (numba
PAV or a pure-JAX threshold Newton) and differentiated implicitly.
"""

from implicit_topk.hard import hard_topk_mag, hard_topk_mask
from implicit_topk.magnitude import soft_topk_mag
from implicit_topk.ops import soft_topk_mask
from implicit_topk.regularizers import PNorm
from implicit_topk.solvers import DykstraSolver, OptStep, PAVSolver, RootState, ThresholdSolver

__version__ = "0.1.0"

__all__ = [
    "soft_topk_mask", "soft_topk_mag", "hard_topk_mask", "hard_topk_mag", "PNorm",
    "PAVSolver", "ThresholdSolver", "DykstraSolver", "OptStep", "RootState",
]
