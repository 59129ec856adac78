r"""Sparse, differentiable top-k in magnitude: :func:`soft_topk_mag` and its solvers.

The hard operator keeps the k entries of largest :math:`|x_i|` with their signs,
:math:`\mathrm{topkmag}(x) = \nabla f(x)` with :math:`f(u) = \frac12 \sum_{i \le k}
|u|_{[i]}^2`. Its soft version (Sander et al. 2023, "Fast, differentiable and sparse
top-k: a convex analysis perspective", ICML, and their reference code) smooths
:math:`f` with :math:`\Psi(y) = \frac{l}{p}\sum_i |y_i|^p`, :math:`l` the
``regularization_strength``:

.. math::

    y^\star = \arg\max_{y \in \mathbb{R}^n}\ \langle x, y\rangle
              - \tfrac12 \|y\|_{(k)}^2 - \tfrac{l}{p} \sum_i |y_i|^p,
    \qquad \|y\|_{(k)}^2 = \min_{z \in [0,1]^n,\ \sum_i z_i = k} \sum_i y_i^2 / z_i

(:math:`\frac12\|\cdot\|_{(k)}^2 = f^*`, the squared k-support norm), and returns
:math:`y^\star + \nabla\Psi(y^\star)`, i.e. :math:`\mathrm{sign}(y_i)\,h(|y_i|)` with
:math:`h(y) = y + l y^{p-1}`: that is the reference's output scaling, under which
clearly-kept entries equal :math:`x_i` exactly. With :math:`s = |x|`, the solution is
a threshold map (``proofs/magnitude_threshold.md``):

.. math::

    \mathrm{soft\_topk\_mag}(x)_i = \mathrm{sign}(x_i)\,
        \min\big(s_i,\ t_i + g(t_i / l)\big), \qquad
    t_i = (s_i - \lambda)_+,\quad g(u) = u^{1/(p-1)},

with :math:`\lambda \ge 0` the root of the monotone scalar equation
:math:`\sum_i \min\big(1, g(t_i / l) / \lambda\big) = k` (the mask equation with
threshold :math:`\lambda` and strength :math:`l\lambda^{p-1}`). No :math:`h^{-1}` is
needed. The solvers find :math:`\lambda` per row and differentiate it implicitly
(:mod:`implicit_topk._implicit`) on

.. math::

    F(\lambda; x, k, l) = \sum_i \min\big(\lambda, g(t_i / l)\big) - k\lambda = 0,

whose derivative is one division per row; every other derivative is JAX autodiff of
the output map above.

The problem (:math:`F`, the output map, the bracket, the starting guess, the binary
snap) is :class:`implicit_topk.problems.Magnitude`; the solvers are the same objects as
the mask's. Solvers: ``"native"`` (CPU, the default there: a numba kernel per row,
:mod:`implicit_topk.kernels.cpu.native_magnitude`, sort-free safeguarded Newton on the few
magnitudes above :math:`h^{-1}(s_{(\lceil k\rceil)})`, exact), ``"pav"`` (numba PAV on
the reference's isotonic dual
:math:`\min_{v_1\ge\dots\ge v_n} \sum_i l\,\omega^*((s_i - v_i)/l) + w_i v_i^2 / 2`,
exact), ``"threshold"`` (pure JAX, sort-free safeguarded Newton on :math:`F`, exact)
and ``"dykstra"`` (``p = 2``: the weighted isotonic regression of
:math:`s / (1 + l w)` with weights :math:`1 + l w` by Dykstra's algorithm; approximate).
"""

from __future__ import annotations

from typing import Any, Union

import jax
from jax.typing import ArrayLike

from implicit_topk import _apply
from implicit_topk import _deprecation
from implicit_topk import problems
from implicit_topk import solvers

#: A pytree of arrays (nested tuples, lists, dicts, ... with array leaves).
PyTree = Any


def soft_topk_mag(
    x: ArrayLike,
    k: ArrayLike,
    *,
    regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
    p: float = 4.0 / 3.0,
    axis: int = -1,
    solver: str = "auto",
    diff: str = "implicit",
    tol: float | None = None,
    maxiter: int | None = None,
    implicit_diff_backend: str = "lax",
    return_info: bool = False,
    where: ArrayLike | None = None,
    axis_name: Any = None,
    standardize: bool = False,
    l: ArrayLike | None = None,
) -> Union[jax.Array, tuple[jax.Array, solvers.RootState]]:
  r"""Sparse, differentiable top-k in magnitude along ``axis``.

  .. math::

      y^\star = \arg\max_{y}\ \langle x, y\rangle - \tfrac12\|y\|_{(k)}^2
                - \tfrac{l}{p}\sum_i |y_i|^p, \qquad
      \mathrm{out}_i = y^\star_i + l\,\mathrm{sign}(y^\star_i)|y^\star_i|^{p-1}
      = \mathrm{sign}(x_i)\min\big(|x_i|,\ t_i + (t_i / l)^{1/(p-1)}\big)

  where :math:`l` = ``regularization_strength``,
  :math:`\|y\|_{(k)}^2 = \min_{z\in[0,1]^n, \sum z = k}\sum_i y_i^2/z_i` (the
  squared k-support norm), :math:`t_i = (|x_i| - \lambda)_+` and the threshold
  :math:`\lambda \ge 0` solves :math:`\sum_i \min(\lambda, (t_i/l)^{1/(p-1)}) = k\lambda`
  (``proofs/magnitude_threshold.md``). This is the soft top-k in magnitude of Sander
  et al. 2023, "Fast, differentiable and sparse top-k: a convex analysis
  perspective" (ICML): ``sparse_soft_topk_mag_*`` of their reference code (its
  isotonic dual, its output scaling), for real ``k``.
  Entries with :math:`|x_i| \le \lambda` are exactly 0, clearly-kept entries equal
  :math:`x_i` exactly; the output is odd in ``x``, :math:`|\mathrm{out}_i| \le |x_i|`,
  and tends to :func:`hard_topk_mag` as ``l -> 0``. Rows with at most ``k`` nonzero
  entries are returned unchanged.

  Derivatives w.r.t. ``x``, ``k`` and ``l``: implicit function theorem on the scalar
  equation above (one division per row; Blondel et al. 2022, "Efficient and modular
  implicit differentiation", NeurIPS), JAX autodiff of the output map for the rest;
  forward and reverse mode with ``implicit_diff_backend="lax"``. Where the solution is
  binary (integer ``k``, the k-th largest magnitude clearly above the (k+1)-th), the
  output is locally ``x`` on the kept set and 0 elsewhere, and the derivative w.r.t.
  ``k`` is returned as 0.

  Args:
    x: float array (float16/bfloat16 are computed in float32 and cast back).
    k: real number or array broadcastable to the batch shape, 0 <= k <= n: ``k = n``
      returns ``x`` itself and ``k = 0`` zeros.
    regularization_strength: :math:`l`, keyword-only, finite and > 0 (default 1.0),
      a scalar or an array broadcastable to the batch shape, in units of ``x``:
      small values give :func:`hard_topk_mag`, large ones shrink more entries
      towards 0. The same name and meaning as fast-soft-sort's and torchsort's
      ``regularization_strength`` (for ``p = 2`` the regularizer is
      :math:`\frac{l}{2}\|y\|^2`); ott-jax calls the scale of its regularizer
      ``epsilon``.
    p: p-norm exponent, a static float > 1 (default 4/3: continuously
      differentiable).
    axis: the axis along which to select (default -1).
    solver: ``"auto"`` (default): ``"native"`` on CPU, else ``"threshold"``
      (and ``"pallas"`` on GPU); ``"native"`` (CPU: a numba kernel per row called
      as an XLA FFI custom call, sort-free, exact, exportable with ``jax.export``
      and batch partitionable; every ``p``), ``"threshold"`` (pure JAX, sort-free
      Newton, exact, any backend, rows split over devices), ``"pav"`` (numba PAV
      after a sort per row, exact, CPU), ``"pallas"`` (GPU) or ``"dykstra"`` (pure
      JAX, ``p = 2``, approximate: stops at ``tol``). ``"auto"`` picks
      ``"threshold"`` wherever ``axis`` is split over devices (``axis_name=`` or a
      sharding along it). Under ``jit`` with traced ``k`` or ``l``, values are not
      checked: ``l <= 0`` or ``k`` outside ``[0, n]`` give NaN.
    diff: ``"implicit"`` (default) or ``"unrolled"`` (autodiff through exactly
      ``maxiter`` iterations of ``"threshold"`` or ``"dykstra"``).
    tol: Dykstra's tolerance on the change of its dual between sweeps (default 1e-6).
    maxiter: iteration cap of ``"threshold"`` (100) or ``"dykstra"`` (10000 sweeps).
    implicit_diff_backend: ``"lax"`` or ``"jaxopt"`` (reverse mode only).
    return_info: also return the solver's ``RootState`` (``iter_num``; ``residual``
      :math:`|F(\lambda)|`), one entry per row.
    where: optional boolean array of the shape of ``x``. Entries where it is False
      are excluded: output exactly 0 (derivatives 0), never selected, and ``k``
      counts the valid entries only (``0 <= k <=`` the row's valid count, checked
      when concrete); equal to the operator on the row with those entries removed.
      (An excluded entry is solved as a 0, which the operator never keeps; so under
      ``jit`` a ``k`` above the valid count, up to the row's length, returns the valid
      entries unchanged; above the row's length it gives NaN, as without ``where``.)
    axis_name: inside :func:`jax.shard_map`, the mesh axis name (or tuple) over which
      ``axis`` is split; each Newton step then costs one ``psum`` of a few scalars
      per row, nothing is gathered, and ``k`` counts the global row. Not needed
      under ``jax.jit`` with a ``NamedSharding`` input. A name that is not a mesh axis
      of the enclosing ``shard_map`` raises ``ValueError``.
    standardize: if True, the strength is relative to the spread of the data: the
      operator solves with ``regularization_strength`` times ``s ** (2 - p)``, ``s`` the
      standard deviation of each row's finite entries over ``where`` (SoftJAX's
      ``standardize``; ``2 - p`` is the power that makes the operator equivariant), so
      that the result does not depend on the scale of ``x``: ``soft_topk_mag(c * x) =
      c * soft_topk_mag(x)`` for ``c > 0``. With ``p = 2`` the operator is equivariant
      already and ``standardize`` changes nothing. Gradients flow through the standard
      deviation (``proofs/standardized_strength.md``). Default False: the strength is
      absolute.
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0): warns with
      a ``DeprecationWarning``; passing both is a ``TypeError``.

  Returns:
    An array with the shape and dtype of ``x`` (and the ``RootState`` with
    ``return_info``). A row containing NaN gives NaN; ``|x_i| = inf`` entries are kept
    (a row with more than ``k`` of them gives NaN).

  Raises:
    TypeError: ``x`` is not a float array, or both ``regularization_strength`` and
      ``l`` are given.
    ValueError: concrete ``k`` outside ``[0, n]``, ``regularization_strength`` not
      finite and > 0, shapes that do not broadcast, an unknown ``solver``.

  Limits of floating point: a fractional entry is resolved to the ulp of
  :math:`|x_i|` (its :math:`t_i = |x_i| - \lambda`). With a strength far below the
  row's natural scale :math:`|x|^{2-p}` (nearly hard) no float threshold may satisfy
  the threshold's equation exactly, and solvers can differ by a whole entry
  (``l = 1e-30``, ``k = 3.5`` on entries of order 1); ``return_info`` reports the
  residual of such rows, and a larger strength, float64 or ``standardize=True``
  resolves them (docs/operators.md, "Floating-point limits").

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> x = jnp.array([-5., -2., 3., 1.])
    >>> itk.soft_topk_mag(x, 2, regularization_strength=1e-2)
    Array([-5., -0.,  3.,  0.], dtype=float32)
    >>> jnp.round(itk.soft_topk_mag(x, 2), 2)  # default strength 1.0
    Array([-5.  , -0.22,  2.99,  0.  ], dtype=float32)
  """
  l = _deprecation.strength(regularization_strength, l, "soft_topk_mag")
  solver_obj = solvers.make_solver(
      solver, problems.Magnitude(p), implicit_diff_backend=implicit_diff_backend, diff=diff,
      tol=tol, maxiter=maxiter, size=_apply.input_size(x), row_length=_apply.row_length(x, axis),
      sharded=axis_name is not None or _apply.reduced_axis_is_sharded(x, axis))
  return _apply.threshold_operator(solver_obj, x, k, l, axis=axis, return_info=return_info,
                                   where=where, axis_name=axis_name,
                                   standardize=2.0 - float(p) if standardize else None)


def tree_soft_topk_mag(
    params: PyTree,
    k: ArrayLike,
    *,
    regularization_strength: ArrayLike = _deprecation.DEFAULT_STRENGTH,
    p: float = 4.0 / 3.0,
    diff: str = "implicit",
    maxiter: int | None = None,
    implicit_diff_backend: str = "lax",
    return_info: bool = False,
    standardize: bool = False,
    l: ArrayLike | None = None,
) -> Union[PyTree, tuple[PyTree, solvers.RootState]]:
  r"""Soft top-k in magnitude over every entry of a pytree (global soft magnitude pruning).

  With :math:`x` all entries of all leaves of ``params``, :math:`l` =
  ``regularization_strength`` and one threshold :math:`\lambda \ge 0` for the whole
  tree,

  .. math::

      \mathrm{out}_i = \mathrm{sign}(x_i)\min\big(|x_i|,\ t_i + (t_i/l)^{1/(p-1)}\big),
      \quad t_i = (|x_i| - \lambda)_+, \quad
      \sum_i \min\big(\lambda, (t_i/l)^{1/(p-1)}\big) = k\lambda,

  i.e. :func:`soft_topk_mag` (the soft top-k in magnitude of Sander et al., 2023) on
  the concatenation of the flattened leaves, returned with the structure, shapes and
  dtypes of ``params``. Nothing is concatenated: each Newton step reduces every leaf
  on its own and adds the results, so leaves sharded differently stay where they are.
  The solver is always ``"threshold"`` (pure JAX): the one threshold of a whole
  pytree is not a row the native CPU kernel of :func:`soft_topk_mag` could take.
  Entries with :math:`|x_i| \le \lambda` are exactly 0, clearly-kept entries equal
  :math:`x_i`; as ``l -> 0`` this is global hard magnitude pruning keeping ``k``
  weights. Derivatives w.r.t. every leaf, ``k`` and ``l`` come from the implicit
  function theorem on the one scalar equation.

  Args:
    params: a pytree of float arrays (at least one leaf), e.g. a model's weights.
    k: a scalar, ``0 <= k <= n`` (the total number of entries): how many weights to
      keep, e.g. ``(1 - sparsity) * n``; need not be an integer.
    regularization_strength: :math:`l`, keyword-only, a finite scalar > 0 (default
      1.0), in units of the weights; the meaning of fast-soft-sort's and torchsort's
      ``regularization_strength`` (ott-jax's ``epsilon``), as in
      :func:`soft_topk_mag`.
    p: p-norm exponent, a static float > 1 (default 4/3).
    diff: ``"implicit"`` (default) or ``"unrolled"``.
    maxiter: iteration cap of the Newton iteration (default 100).
    implicit_diff_backend: ``"lax"`` (default; forward and reverse mode) or
      ``"jaxopt"``.
    return_info: also return the solver's ``RootState`` (scalars; default False).
    standardize: if True, the strength is relative to the spread of the data: the
      operator solves with ``regularization_strength`` times ``s ** (2 - p)``, ``s`` the
      standard deviation of the finite entries of all the leaves together (SoftJAX's
      ``standardize``; see :func:`soft_topk_mag`), so that the result does not depend on
      the scale of ``params``: ``tree_soft_topk_mag(c * params) = c *
      tree_soft_topk_mag(params)`` for ``c > 0``. Gradients flow through the standard
      deviation (``proofs/standardized_strength.md``). Default False: the strength is
      absolute.
    l: deprecated name of ``regularization_strength`` (removed in 0.3.0): warns with
      a ``DeprecationWarning``; passing both is a ``TypeError``.

  Returns:
    A pytree with the structure of ``params``, each leaf with its shape and dtype
    (and the ``RootState`` with ``return_info``).

  Raises:
    TypeError: a leaf without a floating dtype, or both ``regularization_strength``
      and ``l``.
    ValueError: an empty pytree, a non-scalar ``k`` or strength, ``k`` outside
      ``[0, n]``, ``regularization_strength`` not finite and > 0.

  Example:
    >>> import jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> params = {"w": jnp.array([[3., -1.], [0.5, -2.]]), "b": jnp.array([4., 1.])}
    >>> itk.tree_soft_topk_mag(params, 3, regularization_strength=1e-3)["w"]
    Array([[ 3., -0.],
           [ 0., -2.]], dtype=float32)
  """
  l = _deprecation.strength(regularization_strength, l, "tree_soft_topk_mag")
  solver_obj = solvers.make_solver(
      "threshold", problems.Magnitude(p), implicit_diff_backend=implicit_diff_backend,
      diff=diff, maxiter=maxiter)
  return _apply.tree_operator(solver_obj, params, k, l, name="params", return_info=return_info,
                              standardize=2.0 - float(p) if standardize else None)
