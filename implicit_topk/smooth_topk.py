r"""Smooth (dense) top-k operators of Jianlin Su's blog post "Softmax Sequel: Finding Smooth Approximations for Top-K" (kexue.fm, 2024): GradTopK and the iterative softmax.

Both map :math:`x \in \mathbb{R}^n` to a soft top-k mask with entries summing to
``k``; neither is sparse (in exact arithmetic every entry is > 0 for finite inputs;
in floating point the smallest ones underflow to 0).

* :func:`grad_topk` is the gradient of a smoothed sum of the k largest entries,

  .. math::

      \mathrm{grad\_topk}(x) = \nabla_u \log e_k(e^{u}) \Big|_{u = x / l},\qquad
      e_k(w) = \sum_{|S| = k} \prod_{i \in S} w_i ,

  the elementary symmetric polynomial of degree k, :math:`l` the
  ``regularization_strength`` (a temperature). It is exactly feasible
  (:math:`0 < y_i < 1`, :math:`\sum_i y_i = k`), monotone, shift invariant, tends to
  the hard top-k mask as :math:`l \to 0` and is ``softmax(x / l)`` for ``k = 1``
  (``proofs/grad_topk.md``). It is also a regularized LP over the capped simplex,
  with a non-separable regularizer: :math:`\log e_k(e^u)` is the log-partition
  function of the distribution :math:`q(S) \propto e^{\sum_{i\in S} u_i}` over
  k-subsets, so :math:`y = \arg\max_{y \in C_k} \langle u, y\rangle + H_k(y)` with
  :math:`H_k(y)` the largest entropy of a distribution over k-subsets with
  marginals :math:`y` (Fenchel duality), and :math:`y_i = P_q(i \in S)`.

* :func:`iterative_softmax_topk` is the post's first heuristic: ``k`` rounds of softmax,
  each damping what earlier rounds took. Kept as a baseline; it is not exactly a
  top-k relaxation (entries can exceed 1, and it is not monotone; see its docstring).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from implicit_topk import _apply
from implicit_topk import _deprecation
from implicit_topk import _quotient
from implicit_topk import _validation

__all__ = ["grad_topk", "iterative_softmax_topk"]


def _check_static_k(k: Any, n: int, op: str) -> int:
  """k must be a Python (or NumPy) int with 0 <= k <= n: it fixes a loop length."""
  if isinstance(k, jax.core.Tracer) or not isinstance(k, numbers.Integral) or isinstance(k, bool):
    raise TypeError(
        f"`k` must be a static Python int for {op} (it sets the length of a loop); got {_validation.shown(k)} ({type(k).__name__}).")
  _validation.check_k(int(k), n)
  return int(k)


def _positional_strength(args: tuple, regularization_strength: Any, function: str) -> Any:
  """The strength passed as the deprecated third positional argument, if any.

  Before 0.2.0 :func:`grad_topk` and :func:`iterative_softmax_topk` took the strength
  as an optional positional ``l``; it still works, with a DeprecationWarning, until
  0.3.0. Called from the public function (the warning points at its caller).
  """
  if not args:
    return regularization_strength
  if len(args) > 1:
    raise TypeError(f"{function}() takes at most 3 positional arguments (x, k and the "
                    f"deprecated positional strength) but {2 + len(args)} were given.")
  if (regularization_strength is not _deprecation.DEFAULT_STRENGTH
      and not _deprecation._equal(regularization_strength, _deprecation.DEFAULT_STRENGTH)):
    raise TypeError(f"{function}() got the strength both positionally and as "
                    f"`regularization_strength`; pass `regularization_strength` only.")
  _deprecation.warn(f"{function}(): passing the regularization strength positionally is "
                    f"deprecated and will be removed in {_deprecation.REMOVED_IN}; use "
                    f"`regularization_strength=` instead.")
  return args[0]


def _on_last_axis(fn: Callable, x: ArrayLike, k: Any, l: Any, axis: int, op: str) -> jax.Array:
  """``fn(rows, l, k)`` along ``axis``, ``l`` shaped to broadcast against the rows
  (validated; half types computed in float32)."""
  x = _validation.as_float_input(x)
  axis = _validation.canonicalize_axis(axis, x.ndim)
  _validation.check_strength(l, x.dtype)
  _validation.check_broadcast(l, x.shape[:axis] + x.shape[axis + 1:], "regularization_strength")
  k = _check_static_k(k, x.shape[axis], op)
  if x.shape[axis] == 0:  # rows of no entries (k = 0): nothing to select
    return jnp.zeros_like(x)

  def on_rows(rows):
    l_rows = jnp.asarray(l, rows.dtype)
    return fn(rows, jnp.expand_dims(l_rows, -1) if l_rows.ndim else l_rows, k)

  return _apply.apply_on_axis(on_rows, x, axis)


# ---------------------------------------------------------------------------------------
# GradTopK: log e_k by a log-space dynamic program
# ---------------------------------------------------------------------------------------


def _logaddexp(a, b):
  """log(e^a + e^b) for a, b in [-inf, inf), with finite derivatives everywhere.

  ``jnp.logaddexp`` gives a wrong tangent when both arguments are ``-inf`` (it
  returns ``t_a + t_b``) and a nonzero weight on a ``-inf`` argument next to a finite
  one in forward mode, which would leak garbage from the unreachable states of the
  dynamic program below. Here an argument equal to ``-inf`` gets weight exactly 0.
  """
  m = jax.lax.stop_gradient(jnp.maximum(a, b))
  finite = m > -jnp.inf
  m0 = jnp.where(finite, m, 0)
  s = jnp.exp(a - m0) + jnp.exp(b - m0)
  return jnp.where(finite, m0 + jnp.log(jnp.where(finite, s, 1)), -jnp.inf)


def _esp_step(log_e, u_i):
  """One item: log e_j(u_1..u_i) = logaddexp(log e_j(u_1..u_{i-1}), u_i + log e_{j-1}(..))."""
  new = _logaddexp(log_e[..., 1:], u_i[..., None] + log_e[..., :-1])
  return jnp.concatenate([log_e[..., :1], new], axis=-1), None


def _log_esp(u, k: int, center: bool = True):
  r"""``log e_k(exp(u))`` along the last axis, O(n k) time, O(k sqrt(n)) saved state.

  The carry holds :math:`\log e_j(u_1..u_i)`, ``j = 0..k`` (``-inf`` for ``j > i``).
  Every update adds positive terms (``logaddexp``): there is no subtraction, so no
  cancellation, whatever the spread of ``u`` or the size of ``k``. With ``center``
  the input is centred at its (stop-gradient) maximum, so all exponents are <= 0.

  The scan runs in ``ceil(n / T)`` blocks of ``T = ceil(sqrt(n))`` items, each block
  under :func:`jax.checkpoint`: reverse mode stores the carry at block boundaries
  (O(k n / T)) and recomputes one block at a time (O(k T)), instead of O(n k)
  residuals for a plain scan. Padding items are ``-inf`` (weight 0).
  """
  n = u.shape[-1]
  c = jnp.max(u, axis=-1, keepdims=True) if center else jnp.zeros_like(u[..., :1])
  c = jax.lax.stop_gradient(c)
  us = jnp.moveaxis(u - c, -1, 0)  # (n, *batch)
  block = max(1, math.isqrt(n - 1) + 1)
  n_blocks = -(-n // block)
  pad = n_blocks * block - n
  if pad:
    us = jnp.concatenate([us, jnp.full((pad,) + us.shape[1:], -jnp.inf, us.dtype)])
  us = us.reshape((n_blocks, block) + us.shape[1:])
  batch = u.shape[:-1]
  # *_like of the input: the carry keeps shard_map's varying axes (check_vma).
  first = jnp.zeros_like(u[..., :1])
  init = jnp.concatenate([first, jnp.broadcast_to(first - jnp.inf, batch + (k,))], axis=-1)

  @jax.checkpoint
  def run_block(log_e, u_block):
    log_e, _ = jax.lax.scan(_esp_step, log_e, u_block)
    return log_e, None

  log_e, _ = jax.lax.scan(run_block, init, us)
  return log_e[..., k] + k * c[..., 0]


@functools.partial(jax.jit, static_argnums=2)
def _grad_topk_rows(x, l, k: int):
  r"""GradTopK of the rows ``x`` at ``u = (x - t) / l``, ``t`` the k-th largest entry.

  Shift invariance makes ``t`` free; with it an entry is far from the threshold region
  when :math:`|u_i|` is large. Let :math:`c = \log(1 / \text{smallest subnormal}) +
  2 \log n + 1` (about 746 + 2 log n in float64, 104 + 2 log n in float32). An entry with
  :math:`u_i < -c` gets ``u = -inf`` (exact :math:`y_i < k e^{u_i}`), one with
  :math:`u_i > c` (one that overflows included) ``u = c`` (exact
  :math:`1 - y_i < (n - k) e^{-u_i}`): either moves every output by less than half the
  smallest subnormal. The latter are moved to the end of the scan, where they change
  no weight of the others: earlier, the carry would hold values ~c, and their rounding
  would cost the other entries ~c ulps. ``u`` is not re-centred (|u| <= c).
  """
  n = x.shape[-1]
  c = -math.log(float(jnp.finfo(x.dtype).smallest_subnormal)) + 2 * math.log(n) + 1
  t = jax.lax.top_k(jax.lax.stop_gradient(x), max(k, 1))[0][..., -1:]
  t = jnp.where(jnp.isfinite(t), t, 0)  # rows with t = +-inf are NaN below
  d = x - t  # finite, or +-inf when it overflows
  v = jax.lax.stop_gradient(d / l)
  near = jnp.abs(v) <= c
  top = v > c
  # where(near, d, 0): no 0 * inf in the derivatives of the clamped entries
  u = jnp.where(near, _quotient.quotient(jnp.where(near, d, 0), l), jnp.where(top, c, -jnp.inf))
  order = jnp.argsort(top, axis=-1, stable=True)
  u = jnp.take_along_axis(u, order, axis=-1)
  log_z, vjp = jax.vjp(lambda u: _log_esp(u, k, center=False), u)
  (y,) = vjp(jnp.ones_like(log_z))
  y = jnp.take_along_axis(y, jnp.argsort(order, axis=-1), axis=-1)
  bad = (~jnp.isfinite(log_z) | jnp.any(jnp.isnan(x) | (x == jnp.inf), axis=-1))[..., None]
  return jnp.where(bad | ~_validation.strength_in_range(l), jnp.nan, y)


@_apply.explicit_axes_as_auto
def grad_topk(x: ArrayLike, k: int, *args: ArrayLike,
              regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
              axis: int = -1, l: ArrayLike | None = None) -> jax.Array:
  r"""GradTopK: the gradient of the log-sum-exp over all k-subsets (Su, "Softmax Sequel").

  .. math::

      y = \nabla_u \log \sum_{S \subseteq [n],\ |S| = k} \exp\Big(\sum_{i \in S} u_i\Big)
      \Big|_{u = x / l},
      \qquad
      y_i = \frac{\sum_{S \ni i} e^{u_S}}{\sum_{S} e^{u_S}} = P_q(i \in S),

  with :math:`l` = ``regularization_strength``: the inclusion probabilities of the
  distribution :math:`q(S) \propto e^{u_S}` over k-subsets (GradTopK of Jianlin Su's
  blog post "Softmax Sequel: Finding Smooth Approximations for Top-K", kexue.fm,
  2024). Equivalently
  :math:`y = \arg\max_{y \in [0,1]^n,\ \sum y = k} \langle x, y\rangle + l\,H_k(y)`,
  :math:`H_k(y)` the largest entropy of a distribution over k-subsets with
  marginals :math:`y`. Properties (``proofs/grad_topk.md``): :math:`0 < y_i < 1`,
  :math:`\sum_i y_i = k` (exactly, up to rounding: entries near 1 can exceed it by
  a few ulps); :math:`x_i > x_j \Rightarrow
  y_i > y_j`; ``y(x + c) = y(x)``; :math:`\|y - \mathrm{hard}\|_\infty \le
  \max(k, n-k)\, e^{-(x_{(k)} - x_{(k+1)})/l}`, so :math:`y \to` the hard top-k mask
  as :math:`l \to 0`; ``k = 1`` gives ``softmax(x / l)``. Not sparse; smooth
  (:math:`C^\infty`), with Jacobian :math:`\mathrm{Cov}_q(1_S)/l` (symmetric PSD).

  Computation: :math:`\log e_k(e^u)` by the dynamic program
  :math:`e_j(u_{1..i}) = e_j(u_{1..i-1}) + e^{u_i} e_{j-1}(u_{1..i-1})` in log space
  (``logaddexp`` of positive terms only), then ``y`` by reverse-mode autodiff of
  that scan. The post's recursion
  :math:`Z_{k,i} = e^{x_i}(Z_{k-1} - Z_{k-1,i})` subtracts nearly equal numbers and
  returns NaN for large spreads or large k (e.g. ``100 * randn(10)``, ``k = 5``);
  this one stays finite and accurate (on that input: absolute error ~5e-16 in
  float64, ~3e-7 in float32; on ``100 * randn(30)``, ``k = 15``, relative error
  ~2e-13 in float64 vs 80-digit arithmetic; see ``tests/test_smooth_topk.py``).

  Cost per row: O(n k) time (a sequential scan of n steps over a carry of k + 1
  values; sequential in n, so slower on accelerators than the threshold operators).
  Memory: the scan runs in sqrt(n)-sized blocks under :func:`jax.checkpoint`, so
  computing ``y`` (a reverse pass) stores O(k sqrt(n)) values per row instead of
  O(n k) (measured, float32, batch 4, n = 4096, k = 256: 1.2 MiB of temporaries
  instead of 52 MiB, and no slower). Derivatives of ``y`` (second-order autodiff
  through the scan) still store O(n k) per row (56 MiB instead of 200 MiB in that
  case). Forward and reverse mode both work.

  Args:
    x: float array (float16/bfloat16 are computed in float32 and cast back).
    k: static Python int, 0 <= k <= n (``k = n``: all ones, ``k = 0``: zeros).
    *args: deprecated: the strength as a third positional argument (the signature
      before 0.2.0); warns with a ``DeprecationWarning``. At most one.
    regularization_strength: :math:`l`, the temperature, keyword-only, finite and
      > 0 (default 1.0), a scalar or an array broadcastable to the batch shape
      (``x`` without ``axis``). The name fast-soft-sort and torchsort use for their
      strength; ott-jax's ``epsilon`` (the entropic regularizer's scale) plays the
      same role: here the regularizer is :math:`-l\,H_k(y)`.
    axis: the axis along which to select (default -1).
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0): warns with
      a ``DeprecationWarning``.

  Returns:
    An array with the shape and dtype of ``x``, entries in [0, 1] (in (0, 1) before
    rounding) summing to ``k`` along ``axis``.

  Raises:
    TypeError: ``k`` is not a static Python int; the strength is given twice
      (positionally, as ``regularization_strength`` or as ``l``); more than three
      positional arguments.
    ValueError: ``k`` outside ``[0, n]``; ``regularization_strength`` not finite,
      or outside ``2^-1022 <= l < 2^1022`` for float64 input, ``2^-126 <= l < 2^126``
      for float32 and the half types (XLA reads a subnormal ``l`` or ``1 / l`` as 0).
      A traced strength cannot be checked: under ``jit`` one outside that range gives
      NaN.

  Large inputs: the row is shifted by its k-th largest entry ``t`` before dividing
  by ``l``; an entry with :math:`(x_i - t) / l` below :math:`-c` gets exactly 0, one
  above :math:`c` (overflowing included) is treated as at :math:`c`, with
  :math:`c \approx 746 + 2 \log n` in float64, :math:`104 + 2 \log n` in float32. That moves
  no output by more than the smallest subnormal, so finite inputs give the exact answer
  to rounding, e.g. the hard top-k mask when the gaps overflow ``x / l``:
  ``x = [1e300, 0, 1]``, ``k = 2``, ``l = 1e-10`` gives ``[1, 0, 1]``.

  Non-finite inputs: ``-inf`` entries get 0 (if at least ``k`` entries are finite;
  otherwise no k-subset has positive weight and the row is NaN). NaN or ``+inf``
  in a row gives a row of NaN.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([3.0, 1.0, 2.0, 0.0])
    >>> jnp.round(itk.grad_topk(x, 2, regularization_strength=0.1), 3)
    Array([1., 0., 1., 0.], dtype=float32)
    >>> jnp.round(itk.grad_topk(x, 2), 2)  # default strength 1.0
    Array([0.88, 0.31, 0.69, 0.12], dtype=float32)
  """
  regularization_strength = _positional_strength(args, regularization_strength, "grad_topk")
  l = _deprecation.strength(regularization_strength, l, "grad_topk")
  return _on_last_axis(_grad_topk_rows, x, k, l, axis, "grad_topk")


# ---------------------------------------------------------------------------------------
# Iterative softmax (the first construction of Su's "Softmax Sequel", and the weighted-softmax variant)
# ---------------------------------------------------------------------------------------


def _exclusive_cumsum(v):
  """(0, v_1, v_1 + v_2, ...): sums of the entries strictly before each index."""
  return jnp.concatenate([jnp.zeros_like(v[..., :1]), jnp.cumsum(v[..., :-1], axis=-1)], axis=-1)


def _leave_one_out_sum(v):
  """sum_{m != j} v_m for every j, without the cancellation of sum(v) - v_j."""
  prefix = _exclusive_cumsum(v)
  suffix = jnp.flip(_exclusive_cumsum(jnp.flip(v, -1)), -1)
  return prefix + suffix


def _iterative_logits(x, l, k: int):
  # u = (x - min x) / l over the entries other than -inf; those get logit -inf in every
  # round (weight exactly 0), through where()s that keep their derivatives 0, not 0 * inf.
  keep = x != -jnp.inf
  # lo keeps its derivative: the recursion is not invariant to shifts of u
  lo = jnp.min(jnp.where(keep, x, jnp.inf), axis=-1, keepdims=True)
  lo = jnp.where(lo < jnp.inf, lo, 0)
  u = _quotient.quotient(jnp.where(keep, x, lo) - lo, l)

  def body(p, _):
    return p + jax.nn.softmax(jnp.where(keep, (1 - p) * u, -jnp.inf), axis=-1), None

  p, _ = jax.lax.scan(body, jnp.zeros_like(x), None, length=k)
  return jnp.where(_validation.strength_in_range(l), p, jnp.nan)


def _iterative_weighted(x, l, k: int):
  # p <- p + w e / <w, e> with w = 1 - p and e = exp((x - max x) / l) (0 where it
  # underflows, -inf entries included). The weights are
  # updated as w <- w (Z_{-j} - p_j e_j) / Z, Z = <w, e>, Z_{-j} = sum_{m != j} w_m e_m,
  # which equals 1 - p in exact arithmetic but avoids forming 1 - p (for p_j = 1 - eps
  # that rounds to 0, which would hide the variant's true limit).
  d = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
  v = jax.lax.stop_gradient(d / l)
  gone = v < math.log(float(jnp.finfo(x.dtype).smallest_subnormal))  # e = 0 (NaN stays)
  e = jnp.where(gone, 0, jnp.exp(_quotient.quotient(jnp.where(gone, 0, d), l)))

  def body(carry, _):
    p, w = carry
    v = w * e
    z = jnp.sum(v, axis=-1, keepdims=True)
    return (p + v / z, w * (_leave_one_out_sum(v) - p * e) / z), None

  (p, _), _ = jax.lax.scan(body, (jnp.zeros_like(x), jnp.ones_like(x)), None, length=k)
  return jnp.where(_validation.strength_in_range(l), p, jnp.nan)


_VARIANTS = {"logits": jax.jit(_iterative_logits, static_argnums=2),
             "weighted": jax.jit(_iterative_weighted, static_argnums=2)}


def iterative_softmax_topk(x: ArrayLike, k: int, *args: ArrayLike,
                           regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
                           variant: str = "logits", axis: int = -1,
                           l: ArrayLike | None = None) -> jax.Array:
  r"""The iterative soft top-k of Su's "Softmax Sequel": ``k`` rounds of softmax (a baseline).

  ``variant="logits"`` (the construction of Jianlin Su's blog post "Softmax Sequel:
  Finding Smooth Approximations for Top-K", kexue.fm, 2024), with
  :math:`l` = ``regularization_strength``, :math:`u = (x - \min_i x_i) / l` and
  :math:`p^{(0)} = 0`:

  .. math::

      p^{(t)} = p^{(t-1)} + \mathrm{softmax}\big((1 - p^{(t-1)}) \odot u\big),
      \qquad t = 1, \dots, k .

  ``variant="weighted"`` (the Stack Exchange answer the post quotes):
  :math:`p^{(t)} = p^{(t-1)} + \mathrm{softmax}(x / l;\ w = 1 - p^{(t-1)})`, with
  :math:`\mathrm{softmax}(u; w)_i = w_i e^{u_i} / \sum_j w_j e^{u_j}`.

  What holds (checked in ``tests/test_smooth_topk.py``):

  * :math:`\sum_i p_i = k` by construction (each round adds a distribution), up to
    rounding; shift invariance ``p(x + c) = p(x)``; ``k = 1`` gives
    ``softmax(x / l)``.
  * ``"logits"``: tends to the hard top-k mask as :math:`l \to 0` for distinct
    entries. But entries can exceed 1 and the map is not monotone: ``x = [0, 6, 0]``,
    ``k = 2``, ``l = 1`` gives ``[0.33, 1.34, 0.33]`` (the minimum entries always get
    logit 0, so once only minima are left the largest entry is picked again), and
    ``x = [0, 5, 6]``, ``k = 2``, ``l = 1`` gives ``[0.02, 1.13, 0.84]`` (5 gets more
    than 6). So it is not a map into the capped simplex.
  * ``"weighted"``: does not converge to a top-k mask. For ``k = 2`` and
    :math:`l \to 0` it tends to 1.5 at the largest entry and 0.5 at the second
    (:math:`1 - p_{\max} \approx e^{-(x_{(1)} - x_{(2)})/l}` cancels the largest
    weight :math:`e^{x_{(1)}/l}` instead of removing it). The weights are updated
    without forming ``1 - p``, so this limit shows in floating point as long as
    :math:`e^{-(x_{(1)} - x_{(2)})/l}` does not underflow (gap / l below ~700 in
    float64, ~87 in float32); beyond that the round normalizers are 0 and the
    result is NaN. For ``k >= 3`` weights can become negative.

  Non-finite inputs and large gaps: ``-inf`` entries get exactly 0 in both variants,
  and the other entries what the recursion gives on the row without them (``"logits"``
  takes the minimum over the entries above ``-inf`` and gives ``-inf`` entries the logit
  ``-inf`` in every round); derivatives stay finite. A row of only ``-inf``, or with a
  NaN or ``+inf`` entry, is NaN. ``"logits"``: a row where :math:`(x_i - \min x) / l`
  overflows is NaN. ``"weighted"``: :math:`e^{(x_i - \max x) / l}` that underflows
  (or overflows in the subtraction) is 0.

  Cost: O(n k) time (``k`` sequential softmax passes), O(n) memory forward and
  O(n k) for reverse-mode autodiff (it is differentiated by unrolling the k rounds).
  Not sparse; smooth.

  Args:
    x: float array (float16/bfloat16 are computed in float32 and cast back).
    k: static Python int, 0 <= k <= n (the number of rounds; the method is not a
      map into the capped simplex, so ``k = n`` does not give all ones).
    *args: deprecated: the strength as a third positional argument (the signature
      before 0.2.0); warns with a ``DeprecationWarning``. At most one.
    regularization_strength: :math:`l`, the softmax temperature, keyword-only,
      finite and > 0 (default 1.0), a scalar or an array broadcastable to the batch
      shape (the name fast-soft-sort and torchsort use; ott-jax's ``epsilon``).
    variant: ``"logits"`` (default) or ``"weighted"``.
    axis: the axis along which to select (default -1).
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0): warns with
      a ``DeprecationWarning``.

  Returns:
    An array with the shape and dtype of ``x``, summing to ``k`` along ``axis``.

  Raises:
    TypeError: ``k`` is not a static Python int; the strength is given twice;
      more than three positional arguments.
    ValueError: ``k`` outside ``[0, n]``; ``regularization_strength`` not finite, or
      outside ``2^-1022 <= l < 2^1022`` for float64 input, ``2^-126 <= l < 2^126`` for
      float32 and the half types (XLA reads a subnormal ``l`` or ``1 / l`` as 0); an
      unknown ``variant``. A traced strength cannot be checked: under ``jit`` one
      outside that range gives NaN.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([0.0, 6.0, 0.0])
    >>> y = itk.iterative_softmax_topk(x, 2)  # default strength 1.0
    >>> [round(float(v), 2) for v in y]  # an entry above 1
    [0.33, 1.34, 0.33]
  """
  regularization_strength = _positional_strength(args, regularization_strength,
                                                 "iterative_softmax_topk")
  l = _deprecation.strength(regularization_strength, l, "iterative_softmax_topk")
  _validation.check_choice(variant, "variant", _VARIANTS)
  return _on_last_axis(_VARIANTS[variant], x, k, l, axis, "iterative_softmax_topk")
