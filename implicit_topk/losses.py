r"""Losses for top-k learning: top-k cross-entropy, Fenchel-Young, smooth top-k SVM, soft error.

* :func:`topk_cross_entropy`: difftopk's ``TopKCrossEntropyLoss`` (Petersen et al., ICML
  2022) on our sparse soft top-k mask (default) or on any baseline of
  :mod:`implicit_topk.baselines`.
* :func:`topk_fenchel_young_loss`: the Fenchel-Young loss of the regularized top-k LP:
  convex in the scores, gradient :math:`y^\star(\theta) - y` (sparse).
* :func:`smooth_topk_svm_loss`: the smooth top-k SVM loss (Berrada, Zisserman & Kumar,
  ICLR 2018, from Lapin et al.'s top-k SVM), difftopk's ``SmoothTopKLoss`` and
  ``SmoothHardTopKLoss``.
* :func:`soft_error_loss`: the soft 0/1 error from soft ranks (ott-jax's soft sorting tutorial's training
  example, Blondel et al. 2020).

Conventions (0.2.0): as optax's classification losses, every loss returns one value per
example by default (``reduction="none"``: the batch shape, no reduction; ``"mean"`` and
``"sum"`` remain available); the regularization strength of the operators underneath is
``regularization_strength`` (default 1.0; formerly ``l``, which still works with a
DeprecationWarning until 0.3.0); ``k`` is positional.

None of them builds an :math:`n \times n` array (the baselines selected by name in
:func:`topk_cross_entropy` may: NeuralSort, SoftSort and the full sorting networks are
quadratic by construction).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.typing import ArrayLike

from implicit_topk import _apply
from implicit_topk import _deprecation
from implicit_topk import _validation
from implicit_topk import baselines
from implicit_topk import ops
from implicit_topk import permutahedron
from implicit_topk import regularizers

TOP1_MODES = ("sm", "smce", "sort")
REDUCTIONS = ("none", "mean", "sum")

#: What ``regularizer=`` accepts: None (the p-norm), a name or a regularizer object.
RegularizerLike = Union[str, regularizers.Regularizer, None]
METHODS = ("sparse", "neuralsort", "softsort", "odd_even", "bitonic", "perturbed", "ot")


def _reduce(values: jax.Array, reduction: str) -> jax.Array:
  if reduction == "mean":
    return jnp.mean(values)
  if reduction == "sum":
    return jnp.sum(values)
  return values


def _check_labels(labels: ArrayLike, logits: jax.Array) -> jax.Array:
  labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"`labels` must be an integer array of class indices; got {labels.dtype}.")
  if labels.shape != logits.shape[:-1]:
    raise ValueError(f"`labels` must have shape {logits.shape[:-1]} (logits without the class axis); "
                     f"got {labels.shape}.")
  concrete = _validation._concrete(labels)  # pylint: disable=protected-access
  n = logits.shape[-1]
  if concrete is not None and concrete.size and not np.all((concrete >= 0) & (concrete < n)):
    raise ValueError(f"`labels` must lie in [0, {n}) (the number of classes); got {concrete!r}.")
  if concrete is None:
    # A traced label outside [0, n) reads index n, past the end, where every gather of
    # the losses fills NaN (a negative one would wrap around to the last classes).
    labels = jnp.where((labels >= 0) & (labels < n), labels, n)
  return labels


def _nan_where(bad: jax.Array, loss: jax.Array) -> jax.Array:
  """``loss`` with NaN value *and* NaN gradient in the rows where ``bad`` holds (a factor,
  not a ``where``, whose gradient would be 0 there)."""
  return loss * jnp.where(bad, jnp.nan, 1.0).astype(loss.dtype)


def _check_p_k(p_k):
  try:
    p_k = tuple(float(v) for v in p_k)
  except TypeError:
    raise TypeError(f"`p_k` must be a sequence of floats (static); got {p_k!r}.") from None
  if not p_k or any(not math.isfinite(v) or v < 0 for v in p_k) or abs(sum(p_k) - 1.0) > 1e-4:
    raise ValueError(f"`p_k` must be a nonempty list of probabilities >= 0 summing to 1 "
                     f"(P_K over k = 1..K); got {p_k!r} (sum {sum(p_k) if p_k else 0}).")
  return p_k


def _safe_log(v):
  """log(v) for v >= 0 with -inf (not NaN) value *and* finite gradients at v = 0; NaN
  stays NaN (a mask of NaN, from a traced strength out of range, must not read as 0)."""
  positive = v > 0
  return jnp.where(positive, jnp.log(jnp.where(positive, v, 1.0)),
                   jnp.where(v == 0, -jnp.inf, jnp.nan))


def _select_m(logits: jax.Array, labels: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """difftopk's hard preselection: the true class first, then the m-1 largest others."""
  n = logits.shape[-1]
  true = jnp.take_along_axis(logits, labels[..., None], axis=-1)
  others = jnp.where(jnp.arange(n) == labels[..., None], -jnp.inf, logits)
  _, idx = jax.lax.top_k(jax.lax.stop_gradient(others), m - 1)
  rest = jnp.take_along_axis(logits, idx, axis=-1)
  return jnp.concatenate([true, rest], axis=-1), jnp.zeros_like(labels)


def _memberships(method, scores, ks, *, l, p, regularizer, solver, inverse_temperature, distribution,
                 art_lambda, num_samples, key, standardize=False):
  """P(j in top-k) for each k in ks: shape batch + (len(ks), n)."""
  if callable(method):
    return method(scores, ks)
  kmax = max(ks)
  if method == "sparse":
    batch = scores.shape[:-1]
    k_arr = jnp.asarray(ks, scores.dtype).reshape((len(ks),) + (1,) * len(batch))
    stacked = jnp.broadcast_to(scores, (len(ks),) + scores.shape)
    y = ops.soft_topk_mask(stacked, jnp.broadcast_to(k_arr, (len(ks),) + batch),
                           regularization_strength=l, p=p, regularizer=regularizer, solver=solver,
                           standardize=standardize)
    return jnp.moveaxis(y, 0, -2)
  tau = 1.0 / inverse_temperature
  if method == "neuralsort":
    return baselines.memberships_from_permutation(baselines.neuralsort(scores, tau=tau), ks)
  if method == "softsort":
    return baselines.memberships_from_permutation(baselines.softsort(scores, tau=tau), ks)
  if method in ("odd_even", "bitonic"):
    _, perm = baselines.sorting_network(scores, network=method, steepness=inverse_temperature,
                                        distribution=distribution, art_lambda=art_lambda, k=kmax)
    return baselines.memberships_from_permutation(perm, ks)
  if method == "perturbed":
    if key is None:
      raise ValueError("method='perturbed' needs `key` (a jax.random key for the noise).")
    return baselines.perturbed_topk_memberships(scores, ks, sigma=tau, num_samples=num_samples, key=key)
  if method == "ot":
    return jnp.stack([baselines.ot_topk_mask(scores, k, epsilon=tau) for k in ks], axis=-2)
  raise ValueError(f"`method` must be one of {list(METHODS)} or a callable; got {method!r}.")


@_apply.explicit_axes_as_auto
def topk_cross_entropy(
    logits: ArrayLike,
    labels: ArrayLike,
    *,
    p_k: Sequence[float],
    m: int | None = None,
    method: str | Callable[..., Any] = "sparse",
    top1_mode: str = "sm",
    regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
    p: float = 4.0 / 3.0,
    regularizer: RegularizerLike = None,
    solver: str = "auto",
    inverse_temperature: ArrayLike = 1.0,
    distribution: str = "cauchy",
    art_lambda: float = 0.25,
    num_samples: int = 100,
    key: jax.Array | None = None,
    eps: float = 1e-7,
    reduction: str = "none",
    standardize: bool = False,
    l: ArrayLike | None = None,
) -> jax.Array:
  r"""Top-k cross-entropy (Petersen et al. 2022) on a soft top-k operator, one loss per example.

  The loss of difftopk's ``TopKCrossEntropyLoss`` (Petersen, Borgelt, Kuehne and Deussen
  2022, "Differentiable top-k classification learning", ICML), by default on our sparse
  soft top-k mask :func:`~implicit_topk.soft_topk_mask`.

  With :math:`P_K` a distribution over :math:`k = 1..K` (``p_k[k-1]``) and
  :math:`q_k(j) \in [0, 1]` the soft membership of class ``j`` in the top ``k`` (the soft
  top-k mask: :math:`\sum_j q_k(j) = k`), the loss of an example with label ``c`` is

  .. math::

      \ell = -\log\big((1 - 2\epsilon)\, D_c + \epsilon\big), \qquad
      D_c = \sum_{k=1}^{K} P_K(k)\, q_k(c) \quad (\texttt{top1\_mode="sort"}),

  with the top-1 term replaced by the softmax, :math:`D_c = P_K(1)\,\mathrm{softmax}(s)_c +
  \sum_{k \ge 2} P_K(k)\, q_k(c)` (``"sm"``, difftopk's default, more stable), or the
  top-1 part taken as a separate cross-entropy, :math:`\ell = P_K(1)\,\mathrm{CE}(s, c) +
  (\sum_{k\ge2} P_K(k))\,(-\log((1-2\epsilon) D'_c + \epsilon))`,
  :math:`D'_c = \sum_{k\ge 2} P_K(k)\, q_k(c)` (``"smce"``). So ``p_k = [1, 0, ...]`` with
  ``"sm"`` or ``"smce"`` is the softmax cross-entropy (exactly with ``eps=0``; with the
  default ``eps`` the two differ by less than :math:`2\epsilon/D_c`).

  ``m`` (difftopk's cost cut): only the true class and the ``m - 1`` largest other
  logits (picked by ``lax.top_k``, a hard choice, no gradient through the choice) are
  relaxed, and the softmax of ``"sm"``/``"smce"`` is over those ``m`` too (as in difftopk).

  Exact zeros: the sparse operator gives :math:`q_k(c) = 0` exactly when class ``c`` is
  below the threshold. Everything is computed in log space: :math:`\log D_c` is
  :math:`-\infty` there (never NaN, gradients finite), and the :math:`\epsilon` floor
  (difftopk's 1e-7) caps the loss at :math:`-\log\epsilon \approx 16.1`; where
  :math:`D_c = 0` the loss is locally constant (gradient exactly 0: the label is outside
  every relaxed top-k, as with a hard top-k). With ``top1_mode="sm"`` and ``p_k[0] > 0``
  the softmax term keeps :math:`D_c > 0` and a gradient always flows; that is the only
  setting where ``eps=0`` is accepted (otherwise the loss could be :math:`+\infty`).
  With an absolute strength the relaxed top-k narrows as training sharpens the logits,
  and more labels fall out of it: for a ``p_k`` without weight on ``k = 1``, take a
  strength on the scale of the spread of the logits or ``standardize=True``
  (``docs/guides/choosing.md``, "The top-k losses", measures both).

  Non-finite inputs: a row with a ``+inf`` or NaN logit returns NaN, in every
  ``top1_mode``; its gradient is NaN too, except where the label's membership is exactly
  0 without a softmax term (no gradient flows from such a row, see above). Under ``jit``
  a traced strength out of range (see :func:`~implicit_topk.soft_topk_mask`) gives NaN.

  Where we differ from difftopk: the default operator is our sparse mask
  (``regularization_strength``, ``p``/``regularizer``, ``solver``); the membership for a sorting network is
  read from :func:`~implicit_topk.baselines.sorting_network` with ``k = K`` (difftopk's
  ``bitonic`` uses its sparse evaluation, ``odd_even`` the dense one; same values);
  difftopk's ``splitter_selection`` network is not provided; ``perturbed`` and ``ot`` are
  extra; the default ``reduction="none"`` returns one loss per example, as optax's
  classification losses (difftopk returns the mean: ``reduction="mean"``).

  Args:
    logits: float array ``(..., n)`` (classes on the last axis).
    labels: int array ``(...)`` of class indices in ``[0, n)`` (under ``jit``, a traced
      label outside it, ``-1`` included, gives NaN).
    p_k: the distribution :math:`P_K`, a static sequence of ``K`` floats >= 0 summing to 1.
    m: ``None`` or an int with ``K < m < n``.
    method: ``"sparse"`` (default: :func:`~implicit_topk.soft_topk_mask`), ``"neuralsort"``,
      ``"softsort"``, ``"odd_even"``, ``"bitonic"``, ``"perturbed"``, ``"ot"``, or a
      callable ``(scores (..., n'), ks) -> memberships (..., len(ks), n')``.
    top1_mode: ``"sm"`` (default), ``"smce"`` or ``"sort"`` (see above).
    regularization_strength: the sparse mask's :math:`l > 0` (default 1.0; ``method="sparse"``).
    p, regularizer, solver: the sparse mask's other options (default ``p = 4/3``, see
      :func:`~implicit_topk.soft_topk_mask`).
    inverse_temperature: the baselines' :math:`\beta` (difftopk's name): NeuralSort and
      SoftSort ``tau = 1/beta``, sorting networks ``steepness = beta``, perturbed
      ``sigma = 1/beta``, OT ``epsilon = 1/beta``.
    distribution, art_lambda: the sorting networks' relaxation.
    num_samples, key: the perturbed method's Monte Carlo draws and random key.
    eps: the probability floor, 0 <= eps < 0.5 (see above).
    reduction: ``"none"`` (default: one loss per example), ``"mean"`` (difftopk's) or
      ``"sum"``.
    standardize: the sparse mask's ``standardize`` (``method="sparse"``): if True, the
      strength is relative to the spread of each row of logits (times its standard
      deviation, see :func:`~implicit_topk.soft_topk_mask`), so the relaxation does not
      narrow as the logits grow. Default False: the strength is absolute.
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0).

  Returns:
    A ``jax.Array`` of ``logits``' floating dtype: the batch shape ``logits.shape[:-1]``
    (``reduction="none"``) or a scalar (``"mean"``, ``"sum"``).

  Raises:
    ValueError: ``p_k`` not a distribution, ``K >= n``, a bad ``m``, ``eps`` or
      ``method``, labels out of range, or ``method="perturbed"`` without ``key``.
    TypeError: non-integer ``labels``, or both ``regularization_strength`` and ``l``.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> logits = jnp.array([[3.0, 1.0, 0.0, -1.0], [0.0, 2.0, 1.0, 0.5]])
    >>> labels = jnp.array([1, 3])
    >>> jnp.round(itk.topk_cross_entropy(logits, labels, p_k=[0.5, 0.5]), 3)
    Array([0.587, 2.163], dtype=float32)
    >>> jnp.round(itk.topk_cross_entropy(logits, labels, p_k=[0.5, 0.5], reduction="mean"), 2)
    Array(1.37, dtype=float32)
  """
  l = _deprecation.strength(regularization_strength, l, "topk_cross_entropy")
  logits = _validation.as_float_input(logits, "logits")
  labels = _check_labels(labels, logits)
  p_k = _check_p_k(p_k)
  _validation.check_choice(top1_mode, "top1_mode", TOP1_MODES)
  _validation.check_choice(reduction, "reduction", REDUCTIONS)
  if not callable(method):
    _validation.check_choice(method, "method", METHODS)
  if standardize and method != "sparse":
    raise ValueError(f"`standardize=True` applies to the sparse mask (method='sparse'); got "
                     f"method={method!r}.")
  n = logits.shape[-1]
  kmax = len(p_k)
  if m is not None:
    if not isinstance(m, int) or not kmax < m < n:
      raise ValueError(f"`m` must be an int with K < m < n (K = len(p_k) = {kmax}, n = {n}); got {m!r}.")
  elif kmax >= n:
    raise ValueError(f"`p_k` must have fewer than n = {n} entries (K < n); got K = {kmax}.")
  eps = float(eps)
  if not 0.0 <= eps < 0.5:
    raise ValueError(f"`eps` must satisfy 0 <= eps < 0.5; got {eps!r}.")
  if eps == 0.0 and not (top1_mode == "sm" and p_k[0] > 0):
    raise ValueError("`eps=0` is allowed only with top1_mode='sm' and p_k[0] > 0 (otherwise the "
                     "probability of the label can be exactly 0 and the loss +inf).")

  dtype = _validation.compute_dtype(logits.dtype)
  scores = logits.astype(dtype)
  if m is not None:
    scores, labels = _select_m(scores, labels, m)

  first = 1 if top1_mode in ("sm", "smce") else 0
  ks = tuple(k for k in range(first + 1, kmax + 1) if p_k[k - 1] > 0)
  if ks:
    q = _memberships(method, scores, ks, l=l, p=p, regularizer=regularizer, solver=solver,
                     inverse_temperature=inverse_temperature, distribution=distribution,
                     art_lambda=art_lambda, num_samples=num_samples, key=key,
                     standardize=standardize)
    q_label = jnp.take_along_axis(q, labels[..., None, None], axis=-1)[..., 0]  # (..., len(ks))
    weights = jnp.asarray([p_k[k - 1] for k in ks], dtype)
    d_rest = jnp.sum(weights * q_label, axis=-1)
  else:
    d_rest = jnp.zeros(scores.shape[:-1], dtype)
  log_rest = _safe_log(d_rest)
  log_sm = jnp.take_along_axis(jax.nn.log_softmax(scores, axis=-1), labels[..., None], axis=-1)[..., 0]

  def nll(log_d):
    if eps == 0.0:
      return -log_d
    return -jnp.logaddexp(math.log1p(-2 * eps) + log_d, math.log(eps))

  if top1_mode == "sm":
    log_d = jnp.logaddexp(math.log(p_k[0]) + log_sm, log_rest) if p_k[0] > 0 else log_rest
    loss = nll(log_d)
  elif top1_mode == "smce":
    loss = -p_k[0] * log_sm + sum(p_k[1:]) * nll(log_rest)
  else:
    loss = nll(log_rest)
  loss = _nan_where(jnp.any(logits == jnp.inf, axis=-1), loss)
  return _reduce(loss.astype(logits.dtype), reduction)


def _fy_value(theta, target, y, l, regularizer):
  """L = <theta - c, y - t> + l (Omega(t) - Omega(y)), with c the mask's threshold.

  Equal to f*(theta) + l Omega(t) - <theta, t> when sum(y) = sum(t) = k, for any c. With
  c = lambda, read off the most fractional entry j of y (theta_j - l omega'(y_j); theta_j
  where y has no fractional entry or the regularizer no ``omega_prime``), an error
  delta in the mask costs (lambda - c) delta + O(delta^2) instead of lambda delta, and the
  value does not move when a constant is added to the row. An infinite score whose
  target equals y there contributes 0 (not 0 * inf = NaN).
  """
  theta_, y_ = jax.lax.stop_gradient(theta), jax.lax.stop_gradient(y)
  finite = jnp.isfinite(theta_)
  j = jnp.argmin(jnp.where(finite, jnp.abs(y_ - 0.5), jnp.inf), axis=-1, keepdims=True)
  pick = jnp.arange(theta.shape[-1]) == j  # a sum, not a gather: fine on a sharded row
  c = jnp.sum(jnp.where(pick & finite, theta_, 0.0), axis=-1, keepdims=True)
  y_j = jnp.sum(jnp.where(pick, y_, 0.0), axis=-1, keepdims=True)
  omega_prime = getattr(regularizer, "omega_prime", None)
  if omega_prime is not None:
    inside = (y_j > 0) & (y_j < 1)
    slope = omega_prime(jnp.where(inside, y_j, 0.5))
    c = c - jnp.where(inside, jax.lax.stop_gradient(l)[..., None] * slope, 0.0)
  diff = y - target
  shifted = jnp.where(~finite & (diff == 0), c, theta) - c
  omega_gap = regularizer.omega(target) - regularizer.omega(y)
  return jnp.sum(shifted * diff, axis=-1) + l * jnp.sum(omega_gap, axis=-1)


def _fy_loss(regularizer, solver):
  """The Fenchel-Young loss of a row, with Danskin's derivatives in theta and l."""

  def mask(theta, k, l):
    return ops.soft_topk_mask(theta, k, regularization_strength=l, regularizer=regularizer,
                              solver=solver)

  @jax.custom_jvp
  def loss(theta, target, k, l):
    return jnp.maximum(_fy_value(theta, target, mask(theta, k, l), l, regularizer), 0.0)

  def loss_jvp(primals, tangents):
    theta, target, k, l = primals
    d_theta, d_target, _, d_l = tangents
    y = mask(theta, k, l)
    value = functools.partial(_fy_value, theta, y=y, l=l, regularizer=regularizer)
    if isinstance(d_target, SymbolicZero):
      out, tangent = value(target), jnp.zeros(theta.shape[:-1], theta.dtype)
    else:  # dL/dt = l omega'(t) - (theta - c): the partial derivative at fixed y = y*(theta)
      out, tangent = jax.jvp(value, (target,), (d_target,))
    if not isinstance(d_theta, SymbolicZero):
      tangent = tangent + jnp.sum((y - target) * d_theta, axis=-1)
    if not isinstance(d_l, SymbolicZero):
      omega_gap = regularizer.omega(target) - regularizer.omega(y)
      tangent = tangent + jnp.sum(omega_gap, axis=-1) * d_l
    return jnp.maximum(out, 0.0), tangent

  loss.defjvp(loss_jvp, symbolic_zeros=True)
  return loss


def topk_fenchel_young_loss(scores: ArrayLike, target_mask: ArrayLike, k: ArrayLike, *,
                            regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
                            p: float = 4.0 / 3.0, regularizer: RegularizerLike = None,
                            solver: str = "auto", axis: int = -1, reduction: str = "none",
                            l: ArrayLike | None = None) -> jax.Array:
  r"""Fenchel-Young loss of the regularized top-k linear program, one loss per example.

  The Fenchel-Young loss (Blondel, Martins and Niculae 2020, "Learning with Fenchel-Young
  losses", JMLR) generated by the regularizer of :func:`~implicit_topk.soft_topk_mask`
  (:math:`l` = ``regularization_strength``):

  .. math::

      L(\theta; y) = f^*(\theta) + f(y) - \langle \theta, y\rangle, \qquad
      f(y) = l\,\Omega(y) + \iota_{C_k}(y), \quad
      f^*(\theta) = \max_{y' \in C_k} \langle\theta, y'\rangle - l\,\Omega(y'),

  with :math:`C_k = \{y \in [0,1]^n: \sum_i y_i = k\}` and :math:`\Omega(y) = \sum_i
  \omega(y_i)` (default :math:`|y_i|^p/p`). It is convex in :math:`\theta`, >= 0, zero iff
  :math:`y^\star(\theta) = y` (:math:`y^\star` = :func:`~implicit_topk.soft_topk_mask`), and

  .. math::

      \nabla_\theta L = y^\star(\theta) - y, \qquad \partial_l L = \Omega(y) - \Omega(y^\star(\theta)),

  exactly sparse where :math:`y^\star` is (Danskin's theorem; ``proofs/fenchel_young.md``).
  One mask solve per row, no :math:`n \times n` array; second derivatives (Hessian =
  the mask's Jacobian) are the implicit ones. Not differentiated w.r.t. ``k``; w.r.t.
  ``target_mask`` the derivative is :math:`l\,\omega'(y) - (\theta - \lambda)`.

  Evaluated without cancellation: as :math:`\sum_i y_i = \sum_i y^\star_i = k`,

  .. math::

      L = \langle \theta - \lambda, y^\star - y\rangle + l\,(\Omega(y) - \Omega(y^\star)),

  with :math:`\lambda` the mask's threshold (read off its most fractional entry, where
  :math:`\theta_i - \lambda = l\,\omega'(y^\star_i)`). A rounding error :math:`\delta`
  in :math:`y^\star` then enters as :math:`(\hat\lambda - \lambda)\,\delta + O(\delta^2)`
  (:math:`\hat\lambda`: the threshold as computed), not as :math:`\lambda\,\delta`:
  the value is accurate relative to
  the spread of the scores, whatever their offset or scale, and it does not change when
  a constant is added to a row. It is clamped at 0 (the exact loss is >= 0 on
  :math:`C_k`, so the clamp only removes rounding error); the derivatives above are
  unchanged by it.

  Non-finite inputs: an infinite score whose target equals the mask there (``-inf``
  with target 0, ``+inf`` with target 1) contributes nothing, as if removed from the
  row (with ``k`` reduced by the ``+inf`` entries); its gradient entry is 0. A
  ``-inf`` score with a positive target, or a ``+inf`` score with a target below 1,
  gives ``+inf``. NaN scores, and rows where the mask has no threshold (see
  :func:`~implicit_topk.soft_topk_mask`), give NaN.

  Args:
    scores: float array of any shape; ``axis`` holds the ``n`` candidates.
    target_mask: array broadcastable to ``scores``, each row in :math:`C_k` (e.g. a hard
      top-k mask, or a soft one). A row outside :math:`C_k` (an entry outside [0, 1], or
      a sum other than ``k`` beyond ``1e-6 n``) has no meaningful loss (it can be
      negative): a concrete one raises ValueError; under ``jit`` its loss and gradient
      are NaN.
    k: real, ``0 <= k <= n``, scalar or broadcastable to the batch shape (positional or
      keyword).
    regularization_strength: :math:`l > 0` (default 1.0), scalar or broadcastable to the
      batch shape; differentiable.
    p, regularizer, solver: as in :func:`~implicit_topk.soft_topk_mask` (default ``p = 4/3``).
    axis: the selection axis (default -1).
    reduction: ``"none"`` (default: one loss per example), ``"mean"`` (over the batch)
      or ``"sum"``.
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0).

  Returns:
    A ``jax.Array`` of ``scores``' floating dtype: the batch shape (``scores``' shape
    without ``axis``) with ``reduction="none"``, else a scalar.

  Raises:
    ValueError: ``k`` outside ``[0, n]``, ``regularization_strength`` outside the range of
      :func:`~implicit_topk.soft_topk_mask`, ``k``, ``regularization_strength`` or
      ``target_mask`` of a shape that does not broadcast (to the batch shape, to
      ``scores``' shape), or a concrete ``target_mask`` with a row outside :math:`C_k`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> scores = jnp.array([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0]])
    >>> target = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    >>> itk.topk_fenchel_young_loss(scores, target, 2)
    Array([0., 3.], dtype=float32)
    >>> jax.grad(lambda s: itk.topk_fenchel_young_loss(s, target, 2).sum())(scores)
    Array([[ 0.,  0.,  0.],
           [-1.,  0.,  1.]], dtype=float32)
  """
  l = _deprecation.strength(regularization_strength, l, "topk_fenchel_young_loss")
  scores = _validation.as_float_input(scores, "scores")
  axis = _validation.canonicalize_axis(axis, scores.ndim)
  n = scores.shape[axis]
  _validation.check_k(k, n)
  _validation.check_strength(l, scores.dtype)
  batch = scores.shape[:axis] + scores.shape[axis + 1:]
  for value, name in ((k, "k"), (l, "regularization_strength")):
    _validation.check_broadcast(value, batch, name, "`scores`' shape without `axis`")
  _validation.check_broadcast(target_mask, scores.shape, "target_mask", "a target per score",
                              target="the shape of `scores`")
  _validation.check_choice(reduction, "reduction", REDUCTIONS)
  reg = regularizers.resolve(regularizer, p)
  dtype = _validation.compute_dtype(scores.dtype)
  theta = jnp.moveaxis(scores, axis, -1).astype(dtype)
  target = jnp.moveaxis(jnp.broadcast_to(jnp.asarray(target_mask, dtype), scores.shape), axis, -1)
  in_set = _in_capped_simplex(target, jnp.asarray(k, dtype))
  concrete_in_set = _validation.concrete(in_set)
  if concrete_in_set is not None and not np.all(concrete_in_set):
    sums = np.asarray(target.sum(-1))
    raise ValueError("`target_mask` must have each row in the capped simplex C_k (entries in "
                     f"[0, 1] summing to k={_validation.shown(k)}); got row sums "
                     f"{_validation.shown(sums)}.")
  k = jnp.asarray(k, dtype)
  l = jnp.asarray(l, dtype)
  batch = theta.shape[:-1]  # (k and l broadcast to it once the axis is moved last)
  loss = _fy_loss(reg, solver)(theta, target, jnp.broadcast_to(jax.lax.stop_gradient(k), batch),
                               jnp.broadcast_to(l, batch))
  # A traced target outside C_k: NaN loss and gradient (a factor, so that the gradient is
  # NaN too), never a meaningless number.
  loss = _nan_where(~in_set, loss)
  return _reduce(loss.astype(scores.dtype), reduction)


def _in_capped_simplex(target: jax.Array, k: jax.Array) -> jax.Array:
  """Per row (last axis): entries in [-1e-9, 1 + 1e-9] and a sum within 1e-6 n of k."""
  n = target.shape[-1]
  entries_ok = jnp.all((target >= -1e-9) & (target <= 1 + 1e-9), axis=-1)
  sums = jax.lax.stop_gradient(target).sum(-1)
  return entries_ok & (jnp.abs(sums - k) <= 1e-6 * n)


def _log_zero(dtype, k):
  """A finite stand-in for log(0): sums of k + 2 of them stay finite (-inf would give NaN tangents)."""
  return float(jnp.finfo(dtype).min) / (4 * (k + 2))


@jax.custom_jvp
def _soft_gap(gap, tau):
  """tau log(1 + exp(-gap / tau)) for gap >= 0: in [0, tau log 2], no overflow for any tau > 0.

  Its derivatives, -sigmoid(-r) in gap and log(1 + e^-r) + r sigmoid(-r) in tau (r =
  gap / tau), are written out: autodiff of gap / tau in tau forms gap tau^-2, which
  overflows for tiny tau (then inf * 0 = NaN).
  """
  return tau * jnp.log1p(jnp.exp(-gap / tau))


@_soft_gap.defjvp
def _soft_gap_jvp(primals, tangents):
  gap, tau = primals
  d_gap, d_tau = tangents
  r = gap / tau
  e = jnp.exp(-r)
  sig = e / (1 + e)
  r_sig = jnp.where(e > 0, jnp.where(e > 0, r, 0.0) * sig, 0.0)  # r sigmoid(-r) -> 0 as r -> inf
  return tau * jnp.log1p(e), -sig * d_gap + (jnp.log1p(e) + r_sig) * d_tau


def _soft_max(a, b, tau):
  """tau logaddexp(a / tau, b / tau), computed in the units of a and b.

  The gap is max - min, not |a - b|: at a tie its derivative is 0 (max and min split a
  tie's derivative in halves; abs takes one side), so the derivative is sigmoid(0) = 1/2.
  """
  high, low = jnp.maximum(a, b), jnp.minimum(a, b)
  return high + _soft_gap(jnp.where(high == low, 0.0, high - low), tau)  # -inf - -inf: 0


def _soft_esp(x, skip, tau, k):
  """E_j = tau log e_j(exp(x / tau)) over the entries not skipped, j = k-1 and k (e_j: the
  elementary symmetric polynomials), by a DP in the units of x: O(nk), no overflow.

  E_j is defined once j entries are in; before, it is masked out (no finite stand-in
  for log 0, which would not stay negligible against tau log 2 for a huge tau).
  """
  j = jnp.arange(k + 1)
  counts = jnp.cumsum(~skip, axis=-1) - ~skip  # entries in before each column
  init = jnp.zeros_like(x[..., :1]) + jnp.zeros(k + 1, x.dtype)  # E_0 = 0; the rest unset
  tau = tau[..., None]

  def step(e, inputs):
    xi, skip_i, count = inputs
    shifted = jnp.concatenate([e[..., :1], e[..., :-1] + xi[..., None]], axis=-1)  # E_{j-1} + x_i
    old = j <= count[..., None]  # E_j defined before this entry
    new = (j >= 1) & (j <= count[..., None] + 1)  # E_{j-1} defined
    both = jnp.where(old & new, _soft_max(e, shifted, tau), jnp.where(new, shifted, e))
    return jnp.where(skip_i[..., None], e, both), None

  inputs = tuple(jnp.moveaxis(v, -1, 0) for v in (x, skip, counts))
  e, _ = jax.lax.scan(step, init, inputs)
  return e[..., k - 1], e[..., k]


@_apply.explicit_axes_as_auto
def smooth_topk_svm_loss(scores: ArrayLike, labels: ArrayLike, k: int, *, tau: ArrayLike = 1.0,
                         alpha: ArrayLike = 1.0, mode: str = "smooth", thresh: float = 1e3,
                         reduction: str = "none") -> jax.Array:
  r"""Smooth top-k SVM loss (Berrada et al. 2018), one loss per example.

  Berrada, Zisserman and Kumar 2018, "Smooth loss functions for deep top-k
  classification" (ICLR): a smoothing of the top-k multiclass SVM loss of Lapin, Hein
  and Schiele 2016 ("Loss functions for top-k error: analysis and insights", CVPR), as
  difftopk's ``SmoothTopKLoss`` / ``SmoothHardTopKLoss``.

  With :math:`\mathcal{Y}_k` the k-subsets of classes, :math:`\mathcal{Y}_k^c` those
  containing the label ``c``, and :math:`\bar s_S = \frac1k\sum_{j\in S} s_j`:

  .. math::

      L_{k,\tau}(s, c) = \tau \log \sum_{S \in \mathcal{Y}_k}
          \exp\Big(\frac{\alpha [c \notin S] + \bar s_S}{\tau}\Big)
        - \tau \log \sum_{S \in \mathcal{Y}_k^c} \exp\Big(\frac{\bar s_S}{\tau}\Big),

  evaluated as :math:`\tau\,\mathrm{softplus}((E_k + \alpha - E_{k-1} - s_c/k)/\tau)` with
  :math:`E_j = \tau \log e_j` and :math:`e_j` the elementary symmetric polynomials of
  :math:`\exp(s_{j'}/(k\tau))` over the classes :math:`j' \ne c` (a DP, :math:`O(nk)`, whose
  every step is a soft maximum :math:`\max(a, b) + \tau\log(1 + e^{-|a - b|/\tau})`: all
  in the units of the scores, so no :math:`s/\tau` is formed and nothing overflows,
  however small :math:`\tau`). As :math:`\tau \to 0` it tends to the hard top-k SVM
  loss :math:`L_0 = \max(0,\ \frac1k\sum \mathrm{top}_k(s_{\ne c} + \alpha) -
  \frac1k(\sum\mathrm{top}_{k-1}(s_{\ne c}) + s_c))`; for every :math:`\tau`,
  :math:`|L_{k,\tau} - L_0| \le \tau \log\binom{n}{k}`.

  ``mode="smooth_hard"`` (``SmoothHardTopKLoss``) uses the hard loss for the rows where the
  k-th and (k+1)-th largest scores differ by at least :math:`k\tau\log(\mathrm{thresh})`
  (there the smooth one is that close to it; the choice is not differentiated).

  Args:
    scores: float array ``(..., n)`` (classes on the last axis).
    labels: int array ``(...)`` of class indices in ``[0, n)`` (under ``jit``, a traced
      label outside it, ``-1`` included, gives NaN).
    k: a Python int, ``1 <= k < n`` (positional or keyword).
    tau: temperature (default 1.0), a scalar or an array broadcastable to the batch
      shape ``scores.shape[:-1]`` (one per example), with ``tiny <= tau < 1 / tiny``
      (``tiny``: the smallest normal number of the compute dtype, float32 for half
      inputs; XLA reads a subnormal ``tau`` as 0). Over that whole range the value and
      the derivatives (in ``scores``, ``tau`` and ``alpha``) are finite for finite
      scores; a tiny ``tau`` gives the hard loss up to :math:`\tau\log\binom{n}{k}`.
    alpha: the margin (default 1.0), finite, a scalar or an array broadcastable to the
      batch shape.
    mode: ``"smooth"`` (default) or ``"smooth_hard"``.
    thresh: the switch of ``"smooth_hard"``, ``1 < thresh <= inf`` (default 1e3, difftopk's).
    reduction: ``"none"`` (default: one loss per example), ``"mean"`` (difftopk's) or
      ``"sum"``.

  Returns:
    A ``jax.Array`` of ``scores``' floating dtype: shape ``scores.shape[:-1]`` with
    ``reduction="none"``, else a scalar.

  Raises:
    TypeError: a non-integer ``k`` or ``labels``.
    ValueError: ``k`` outside ``[1, n)``, ``tau`` outside ``[tiny, 1 / tiny)``, a
      non-finite ``alpha``, a ``tau`` or ``alpha`` whose shape does not broadcast to
      the batch shape, ``thresh <= 1``, or labels out of range.

  Non-finite inputs: ``-inf`` scores of classes other than the label drop out (the
  loss of the row without them) while at least ``k`` other classes stay finite (with
  ``k - 1`` the loss is 0, with fewer NaN); a ``-inf`` label score gives ``+inf``, a
  ``+inf`` label score 0. A row with a ``+inf`` score of another class returns NaN, for
  every ``k``, with NaN in its gradient, as does a row with a NaN score. Under ``jit`` a
  traced ``tau`` is not checked: one outside ``[tiny, 1 / tiny)`` (zero, subnormal or negative) gives NaN.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> scores = jnp.array([[3.0, 1.0, 0.0, -1.0], [0.0, 2.0, 1.0, 0.5]])
    >>> jnp.round(itk.smooth_topk_svm_loss(scores, jnp.array([1, 2]), 2, tau=0.1), 4)
    Array([0.5013, 0.7579], dtype=float32)
  """
  scores = _validation.as_float_input(scores, "scores")
  labels = _check_labels(labels, scores)
  n = scores.shape[-1]
  _validation.check_k(k, n, integer=True, allow_zero=False, allow_n=False)
  batch = scores.shape[:-1]
  for value, name in ((tau, "tau"), (alpha, "alpha")):  # per example: no class axis
    _validation.check_broadcast(value, batch, name, "`scores`' shape without the class axis")
  _validation.check_strength(tau, scores.dtype, "tau")
  concrete_alpha = _validation.concrete(alpha)
  if concrete_alpha is not None and not np.all(np.isfinite(concrete_alpha)):
    raise ValueError(f"`alpha` must be finite; got {_validation.shown(alpha)}.")
  _validation.check_choice(mode, "mode", ("smooth", "smooth_hard"))
  _validation.check_choice(reduction, "reduction", REDUCTIONS)
  try:
    thresh = float(thresh)
  except (TypeError, ValueError):
    raise TypeError(f"`thresh` must be a real number > 1; got "
                    f"{_validation.shown(thresh)}.") from None
  if not thresh > 1:  # log(thresh) > 0: the gap below which the smooth loss is kept
    raise ValueError(f"`thresh` must satisfy 1 < thresh <= inf; got {_validation.shown(thresh)}.")
  dtype = _validation.compute_dtype(scores.dtype)
  loss = _smooth_topk_svm(scores.astype(dtype), labels,
                          jnp.broadcast_to(jnp.asarray(tau, dtype), batch),
                          jnp.broadcast_to(jnp.asarray(alpha, dtype), batch),
                          k=int(k), mode=mode, thresh=thresh)
  return _reduce(loss.astype(scores.dtype), reduction)


@functools.partial(jax.jit, static_argnames=("k", "mode", "thresh"))
def _smooth_topk_svm(s, labels, tau, alpha, *, k, mode, thresh):
  """The per-example smooth top-k SVM loss, compiled once per shape and option.

  Under ``jax.jit`` this changes nothing. Called eagerly, a bare ``lax.scan`` is traced
  and compiled again at every call (its body is a new function each time), and so is
  its transpose under ``jax.grad``: that took 0.3-1 s per call on a 2-core CPU, where
  the whole loss and its gradient take a few milliseconds once compiled
  (``benchmarks/profile_losses.py``).
  """
  n = s.shape[-1]
  dtype = s.dtype
  is_label = jnp.arange(n) == labels[..., None]
  s_label = jnp.take_along_axis(s, labels[..., None], axis=-1)[..., 0]

  def smooth(tau):
    # L = softplus_tau(E_k + alpha - W), W = E_{k-1} + s_c / k, E_j = tau log e_j(exp(s_{!=c} /
    # (k tau))), all in the units of s: as tau -> 0 every soft max becomes a max.
    e_km1, e_k = _soft_esp(s / k, is_label, tau, k)
    with_label = e_km1 + s_label / k
    return _soft_max(e_k + alpha - with_label, jnp.zeros_like(with_label), tau)

  # NaN for a traced tau out of range, and for a +inf score of another class (k = 1 would
  # give +inf, k > 1 inf - inf): one rule for every k.
  bad = ~_validation.strength_in_range(tau) | jnp.any((s == jnp.inf) & ~is_label, axis=-1)
  if mode == "smooth":
    return _nan_where(bad, smooth(tau))

  others = jnp.where(is_label, _log_zero(dtype, k), s)
  top_plus, _ = jax.lax.top_k(others + alpha[..., None], k)
  max_1 = jnp.mean(top_plus, axis=-1)
  top_others, _ = jax.lax.top_k(others, k - 1) if k > 1 else (jnp.zeros(s.shape[:-1] + (0,), dtype), None)
  max_2 = (jnp.sum(top_others, axis=-1) + s_label) / k
  hard_loss = jnp.maximum(max_1 - max_2, 0.0)
  top_all, _ = jax.lax.top_k(jax.lax.stop_gradient(s), k + 1)
  use_hard = top_all[..., k - 1] - top_all[..., k] >= k * tau * math.log(thresh)
  # Rows that take the hard loss evaluate the smooth one at tau = 1 (unused): nothing
  # from the unused branch, NaN included, reaches the value or the gradient.
  loss = jnp.where(use_hard, hard_loss, smooth(jnp.where(use_hard, jnp.ones_like(tau), tau)))
  return _nan_where(bad, loss)


@_apply.explicit_axes_as_auto
def soft_error_loss(logits: ArrayLike, labels: ArrayLike, *,
                    regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
                    p: float = 2.0, regularizer: RegularizerLike = None, reduction: str = "none",
                    l: ArrayLike | None = None) -> jax.Array:
  r"""Soft 0/1 error from soft ranks, one loss per example.

  The training loss of ott-jax's soft sorting tutorial (there with the optimal-transport
  ranks of Cuturi et al. 2019), here with the exact soft ranks of Blondel et al. 2020
  ("Fast differentiable sorting and ranking", ICML):

  .. math::

      \ell(s, c) = \max\big(0,\ n - r_c(s)\big),

  with :math:`r(s)` the soft ascending ranks (1-based, the largest score gets ``n``) of
  :func:`~implicit_topk.soft_rank`: 0 exactly when the label is ranked first by a margin,
  and as :math:`l` = ``regularization_strength`` :math:`\to 0` the hard number of classes
  ranked above the label. That tutorial uses OTT's 0-based ranks and ``n - 1``; the same
  loss. :math:`O(n \log n)` per row.

  Args:
    logits: float array ``(..., n)`` (classes on the last axis).
    labels: int array ``(...)`` of class indices in ``[0, n)`` (under ``jit``, a traced
      label outside it, ``-1`` included, gives NaN).
    regularization_strength: :math:`l > 0` of :func:`~implicit_topk.soft_rank` (default 1.0).
    p, regularizer: as in :func:`~implicit_topk.soft_rank` (default ``p = 2``).
    reduction: ``"none"`` (default: one loss per example), ``"mean"`` or ``"sum"``.
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0).

  Returns:
    A ``jax.Array`` of ``logits``' floating dtype: shape ``logits.shape[:-1]`` with
    ``reduction="none"``, else a scalar; values in ``[0, n - 1]``. A row with a NaN or
    infinite logit (``-inf`` for a masked class included) has the loss NaN, as its soft
    ranks are (:func:`~implicit_topk.soft_rank`); give masked classes a finite logit
    below the others instead.

  Raises:
    TypeError: non-integer ``labels``, or both ``regularization_strength`` and ``l``.
    ValueError: labels out of range or ``regularization_strength`` outside the range of
      :func:`~implicit_topk.soft_rank`.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> logits = jnp.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    >>> itk.soft_error_loss(logits, jnp.array([0, 2]), regularization_strength=0.1)
    Array([0., 1.], dtype=float32)
  """
  l = _deprecation.strength(regularization_strength, l, "soft_error_loss")
  logits = _validation.as_float_input(logits, "logits")
  labels = _check_labels(labels, logits)
  _validation.check_choice(reduction, "reduction", REDUCTIONS)
  # ranks in the compute dtype: rounded to bfloat16 first, a rank near n would cancel in
  # n - r (299 -> 300 at n = 300: the loss 0 and its gradient 0)
  dtype = _validation.compute_dtype(logits.dtype)
  ranks = permutahedron.soft_rank(logits.astype(dtype), regularization_strength=l, p=p,
                                  regularizer=regularizer)
  true_rank = jnp.take_along_axis(ranks, labels[..., None], axis=-1)[..., 0]
  return _reduce(jax.nn.relu(logits.shape[-1] - true_rank), reduction).astype(logits.dtype)


__all__ = ["topk_cross_entropy", "topk_fenchel_young_loss", "smooth_topk_svm_loss", "soft_error_loss"]
