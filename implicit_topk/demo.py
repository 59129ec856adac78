"""``implicit-topk demo`` (``python -m implicit_topk demo``): a tour of the library.

Prints, on small inputs:

1. the soft top-k mask next to the hard one, with a fractional entry and the gradient
   through it (the hard mask's gradient is zero everywhere);
2. the top-k in magnitude (keep the k entries of largest absolute value);
3. a soft sort and a soft rank;
4. a top-k loss (the Fenchel-Young loss of the top-k program) and its gradient;
5. a timing table: the soft mask forward+backward against the hard ``lax.top_k`` mask
   forward, with the number of repeats, the median, the interquartile range and the load
   average (``timing=False`` skips it).

The top-k operators are those of Sander, Puigcerver, Djolonga, Peyre and Blondel (2023),
"Fast, differentiable and sparse top-k: a convex analysis perspective", ICML: the top-k
mask as a linear program over the capped simplex, regularized by a p-norm, solved
exactly and differentiated implicitly. The soft sort and rank are those of Blondel,
Teboul, Berthet and Djolonga (2020), "Fast differentiable sorting and ranking", ICML.
The whole demo runs in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import hard, losses, magnitude, ops, permutahedron

TIMING_SIZES = (1_000, 10_000, 100_000)
TIMING_BATCH = 16
TIMING_REPEATS = 15


def _fmt(a) -> str:
  return np.array2string(np.asarray(a, np.float64), precision=4, suppress_small=True,
                         floatmode="maxprec", sign=" ", max_line_width=100)


def _section(title: str) -> None:
  print(f"\n== {title} ==")


def _row(label: str, value) -> None:
  print(f"{label:<52}: {_fmt(value)}")


def mask_section() -> None:
  """Soft vs hard top-k mask, with a fractional entry and its non-zero gradient."""
  x = jnp.array([3.0, 1.0, 0.6, -1.0])
  k, strength = 2, 1.0
  _section(f"Top-{k} mask of x = {_fmt(x)}")
  _row(f"hard_topk_mask(x, {k})", hard.hard_topk_mask(x, k))
  _row(f"soft_topk_mask(x, {k}, regularization_strength={strength})",
       ops.soft_topk_mask(x, k, regularization_strength=strength))
  _row(f"soft_topk_mask(x, {k}, regularization_strength=0.1)",
       ops.soft_topk_mask(x, k, regularization_strength=0.1))
  print("The soft mask sums to k and has exact zeros and ones (it is sparse); it is the hard")
  print("mask once regularization_strength is small against the gap x[1] - x[2] = 0.4.")

  def second_entry(v, op):
    return op(v)[1]

  g_soft = jax.grad(second_entry)(x, lambda v: ops.soft_topk_mask(
      v, k, regularization_strength=strength))
  g_hard = jax.grad(second_entry)(x, lambda v: hard.hard_topk_mask(v, k))
  _row(f"d soft mask[1] / dx (strength {strength})", g_soft)
  _row("d hard mask[1] / dx", g_hard)
  print("(the soft mask[1] rises with x[1] and falls with its competitor x[2]; x[0] and x[3],")
  print(" whose mask entries are exactly 1 and 0, do not move it: the Jacobian is sparse)")


def magnitude_section() -> None:
  x = jnp.array([-4.0, 0.5, 2.0, -1.5, 1.2])
  k = 2
  _section(f"Top-{k} in magnitude of x = {_fmt(x)} (keeps signs)")
  _row(f"hard_topk_mag(x, {k})", hard.hard_topk_mag(x, k))
  _row(f"soft_topk_mag(x, {k}, regularization_strength=1.0)",
       magnitude.soft_topk_mag(x, k, regularization_strength=1.0))
  print("(soft magnitude pruning: the smallest entries are exactly 0, the largest kept, those")
  print(" near the cut shrunk toward 0)")


def sort_rank_section() -> None:
  x = jnp.array([0.3, 2.0, -1.0, 1.8])
  _section(f"Soft sort and soft rank of x = {_fmt(x)} (Blondel et al. 2020)")
  _row("jnp.sort(x)", jnp.sort(x))
  for s in (0.1, 1.0):
    _row(f"soft_sort(x, regularization_strength={s})",
         permutahedron.soft_sort(x, regularization_strength=s))
  _row("ranks (1 = smallest)", jnp.argsort(jnp.argsort(x)) + 1)
  for s in (0.1, 1.0):
    _row(f"soft_rank(x, regularization_strength={s})",
         permutahedron.soft_rank(x, regularization_strength=s))
  print("(with strength 1.0 the close values 2.0 and 1.8 get ranks 3.6 and 3.4; the soft sort")
  print(" is pulled toward the mean and keeps the sum of x)")


def loss_section() -> None:
  scores = jnp.array([[3.0, 2.0, -1.0, -2.0],
                      [0.2, 0.1, 1.5, 1.0]])
  target = jnp.array([[1.0, 1.0, 0.0, 0.0],
                      [1.0, 1.0, 0.0, 0.0]])
  k = 2
  _section("A top-k loss: topk_fenchel_young_loss (Blondel, Martins and Niculae 2020)")
  print("scores:\n" + _fmt(scores))
  _row("target top-2 mask (both rows)", target[0])
  _row("loss per example (default reduction='none')",
       losses.topk_fenchel_young_loss(scores, target, k))

  def mean_loss(s):
    return jnp.mean(losses.topk_fenchel_young_loss(s, target, k))

  grad = jax.grad(mean_loss)(scores)
  print("gradient of the mean loss w.r.t. scores = (soft_topk_mask(scores) - target) / 2:")
  print(_fmt(grad))
  print("(row 1 ranks the target first by a margin: loss and gradient exactly 0; row 2 does")
  print(" not: a gradient step (minus the gradient) raises scores 1 and 2, lowers 3 and 4)")


def _times(fn: Callable, x, repeats: int) -> np.ndarray:
  jax.block_until_ready(fn(x))  # compile and warm up
  out = np.empty(repeats)
  for i in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(x))
    out[i] = time.perf_counter() - start
  return 1e3 * out


def _stats(ms: np.ndarray) -> str:
  q1, med, q3 = np.percentile(ms, [25, 50, 75])
  return f"{med:8.2f} [{q1:7.2f}, {q3:7.2f}]"


def timing_table(sizes: Sequence[int] = TIMING_SIZES, batch: int = TIMING_BATCH,
                 repeats: int = TIMING_REPEATS):
  """Per size: (n, k, hard fwd ms, soft fwd ms, soft fwd+bwd ms) as arrays of repeats."""
  rows = []
  for n in sizes:
    k = max(1, n // 100)
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, n), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (batch, n), jnp.float32)
    hard_fwd = jax.jit(lambda x, k=k: hard.hard_topk_mask(x, k))
    soft_fwd = jax.jit(lambda x, k=k: ops.soft_topk_mask(x, k))
    soft_bwd = jax.jit(jax.value_and_grad(
        lambda x, k=k, w=w: jnp.sum(w * ops.soft_topk_mask(x, k))))
    rows.append((n, k, *(_times(f, x, repeats) for f in (hard_fwd, soft_fwd, soft_bwd))))
  return rows


def timing_section(sizes: Sequence[int] = TIMING_SIZES, batch: int = TIMING_BATCH,
                   repeats: int = TIMING_REPEATS) -> None:
  load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
  backend, kind = jax.default_backend(), jax.devices()[0].device_kind
  device = backend if kind.lower() == backend.lower() else f"{backend} ({kind})"
  _section(f"Timing on {device}, batch {batch}, k = n/100, float32, jit")
  start = time.perf_counter()
  print(f"{repeats} timed calls per cell after one warm-up call; milliseconds per call,")
  print("median [interquartile range]. hard = hard_topk_mask (lax.top_k + scatter) forward;")
  print("soft = soft_topk_mask (default solver, regularization_strength=1.0); fwd+bwd =")
  print("jax.value_and_grad of sum(w * mask) (implicit differentiation).")
  header = (f"{'n':>8} {'hard fwd':>26} {'soft fwd':>26} {'soft fwd+bwd':>26} "
            f"{'fwd+bwd/hard':>13}")
  print(header)
  for n, _, t_hard, t_fwd, t_bwd in timing_table(sizes, batch, repeats):
    ratio = np.median(t_bwd) / np.median(t_hard)
    print(f"{n:>8} {_stats(t_hard):>26} {_stats(t_fwd):>26} {_stats(t_bwd):>26} "
          f"{ratio:>12.1f}x")
  if load_before is not None:
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min): {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f} before, {load_after[0]:.2f} {load_after[1]:.2f} "
          f"{load_after[2]:.2f} after;")
    print(f"{os.cpu_count()} CPUs. Timings on a loaded machine are noisy.")
  print(f"The table took {time.perf_counter() - start:.0f} s with compilation; "
        "`implicit-topk bench` times the full matrix.")


def main(timing: bool = True) -> None:
  print("implicit_topk: sparse, differentiable top-k for JAX (Sander et al. 2023, 'Fast,")
  print("differentiable and sparse top-k: a convex analysis perspective', ICML).")
  mask_section()
  magnitude_section()
  sort_rank_section()
  loss_section()
  if timing:
    timing_section()
