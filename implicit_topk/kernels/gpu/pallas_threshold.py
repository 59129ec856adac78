r"""Fused Pallas kernel for the threshold of a row-wise threshold problem.

One Pallas program per block of rows holds the whole rows in registers (or on-chip
memory) and finds, for each row, the root :math:`\lambda` of the problem's continuous,
nonincreasing optimality function, e.g. for the soft top-k mask of Sander et al.
2023 ("Fast, differentiable and sparse top-k: a convex analysis perspective", ICML)

.. math::

    \phi(\lambda) = \sum_i \mathrm{mask}\big((x_i - \lambda) / l\big) - k .

The iteration is the one of the pure-JAX threshold solver
(:func:`implicit_topk.solvers.threshold.safeguarded_newton_step`): start from the
problem's sort-free bracket and initial guess, take the Newton (or Schroeder) step
when it stays inside the bracket, else bisect, at most ``maxiter`` times. A row is
*certified* when that iteration stopped by one of its own rules (``phi == 0``, a
bracket collapsed to a few ulps of ``lam``, or a step of a few ulps with the
residual at rounding level; ``proofs/pallas_certificate.md``); the kernel returns
the finished threshold (the problem's ``snap``, the bracket's known rows), the
passes made and the certificate per row. The caller solves the rows that are not
certified by the general solver (:class:`implicit_topk.solvers.PallasSolver`).

The kernel body is the problem's own ``jax.numpy`` code (bracket, initial guess,
optimality and its derivatives by ``jax.jvp``), so one kernel serves every
regularizer and the magnitude operator. It uses only the portable subset of Pallas
(whole blocks loaded by ref indexing, elementwise ops, row reductions, ``while_loop``,
``pl.program_id`` through the block index maps) and is lowered

* on CUDA and ROCm through Triton (``jax.experimental.pallas.triton.CompilerParams``
  are passed explicitly: jax 0.10 would otherwise pick Mosaic GPU, which cannot lower
  these row reductions; jax 0.11 lowers ``pallas_call`` through Triton and warns that
  Pallas' Triton backend is deprecated);
* on every other backend (CPU, TPU) in Pallas interpret mode: the same kernel body run
  as ordinary XLA operations (correct, and slow: meant for tests).

Shapes: ``x`` is ``(batch, n)`` with ``n <= MAX_ROW_LENGTH``; the row is padded to a
power of two with the problem's ``excluded_value`` (never selected, output exactly
0, so the threshold does not change) and the batch to a multiple of the block of
rows. Accumulation is in float32 for float32, bfloat16 and float16 inputs and in
float64 for float64 inputs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk.problems import layout as _layout
from implicit_topk.solvers import threshold as _threshold

#: The longest row the kernel takes (after padding to a power of two): 4096 entries of
#: one row live in one program's registers or on-chip memory.
MAX_ROW_LENGTH = 4096
#: Target entries per program on a GPU: rows per block = this / padded row length,
#: clipped to [1, _GPU_MAX_BLOCK_ROWS] (a tuning knob until GPU timings exist).
_GPU_BLOCK_ELEMENTS = 2048
_GPU_MAX_BLOCK_ROWS = 128
#: In interpret mode one program takes up to this many entries (the batch in a few
#: programs: the grid becomes a sequential loop there).
_INTERPRET_BLOCK_ELEMENTS = 1 << 20


def _pallas():
  """``(pallas, triton CompilerParams class)``; ``ImportError`` with a clear message."""
  try:
    from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  except ImportError as exc:  # pragma: no cover (every supported jax ships Pallas)
    raise ImportError(
        "solver='pallas' needs jax.experimental.pallas, which this jax "
        f"({jax.__version__}) does not provide; use solver='threshold'.") from exc
  try:
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    params = getattr(pltriton, "CompilerParams", None) or getattr(
        pltriton, "TritonCompilerParams")
  except (ImportError, AttributeError) as exc:  # pragma: no cover
    raise ImportError(
        "solver='pallas' lowers its GPU kernel through Pallas' Triton backend "
        "(jax.experimental.pallas.triton.CompilerParams), which this jax "
        f"({jax.__version__}) does not provide; use solver='threshold'.") from exc
  return pl, params


def check_available() -> None:
  """Raises ``ImportError`` (naming ``solver='pallas'``) when Pallas is unavailable."""
  _pallas()


@dataclasses.dataclass(frozen=True)
class _BlockRows(_layout.LastAxis):
  """The last-axis layout inside a kernel: ``any`` as a count, since Triton lowers
  sums, maxima and minima of a row but not a boolean ``or`` reduction."""

  def any(self, v):
    return self.count(v, jnp.int32) > 0


_BLOCK_ROWS = _BlockRows()


def accumulation_dtype(dtype) -> np.dtype:
  """float64 for float64 input, float32 for float32, bfloat16 and float16."""
  return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def padded_length(n: int) -> int:
  """The row length the kernel works on: the next power of two (Triton blocks)."""
  return 1 << max(0, int(n) - 1).bit_length()


def fits(n: int) -> bool:
  """Whether rows of length ``n`` fit in one program (``n <= MAX_ROW_LENGTH``)."""
  return 1 <= n <= MAX_ROW_LENGTH


def block_rows(batch: int, n_padded: int, *, interpret: bool) -> int:
  """Rows per program: a power of two, at most the batch rounded up to one."""
  budget = _INTERPRET_BLOCK_ELEMENTS if interpret else _GPU_BLOCK_ELEMENTS
  rows = max(1, budget // n_padded)
  if not interpret:
    rows = min(rows, _GPU_MAX_BLOCK_ROWS)
  rows = min(rows, padded_length(max(batch, 1)))
  return 1 << (rows.bit_length() - 1)  # round down to a power of two


def solve_block(problem, x, k, l, init, *, maxiter: int):
  """The work of one program on a block of rows (plain ``jax.numpy``).

  ``x`` is ``(rows, n)``, ``k``, ``l`` and ``init`` (or ``None``) are ``(rows,)``, all in
  the accumulation dtype. Bracket and start from the problem, at most ``maxiter``
  safeguarded Newton/bisection passes (a row stops by the iteration's own rules),
  then the problem's ``snap`` and the bracket's known rows. Returns ``(lam,
  iter_num, certified)``.
  """
  problem = problem.with_layout(_BLOCK_ROWS)
  tols = _threshold.tolerances(x.dtype)
  carry, bracket = _threshold._init_carry(problem, init, x, k, l)  # pylint: disable=protected-access

  def cond(carry):
    *_, done, iter_num = carry
    pending = jnp.where(~done & (iter_num < maxiter), 1, 0)
    return jnp.sum(pending) > 0  # no boolean `any` reduction (Triton)

  def body(carry):
    return _threshold._newton_step(problem, tols, x, k, l, carry)  # pylint: disable=protected-access

  lam, _, _, _, done, iter_num = jax.lax.while_loop(cond, body, carry)
  lam = _threshold._finish(problem, lam, x, k, l, bracket)  # pylint: disable=protected-access
  return lam, iter_num, done


def _kernel(problem, maxiter, warm, *refs):
  """The program of one block of rows: load, :func:`solve_block`, store."""
  x_ref, k_ref, l_ref, *refs = refs
  init_ref = refs.pop(0) if warm else None
  lam_ref, iter_ref, certified_ref = refs
  dtype = lam_ref.dtype
  load = lambda ref: ref[...].astype(dtype)
  lam, iter_num, certified = solve_block(
      problem, load(x_ref), load(k_ref), load(l_ref),
      None if init_ref is None else load(init_ref), maxiter=maxiter)
  lam_ref[...] = lam
  iter_ref[...] = iter_num
  certified_ref[...] = certified.astype(jnp.int32)


def _varying_axes(value) -> frozenset:
  """The mesh axes ``value`` varies over inside ``shard_map(check_vma=True)``."""
  try:
    from jax._src import config  # pylint: disable=g-import-not-at-top
    if not config._check_vma.value:  # pylint: disable=protected-access
      return frozenset()
    aval = jax.typeof(value)
    vma = getattr(aval, "vma", None)
    if vma is None:
      vma = aval.manual_axis_type.varying
    return frozenset(vma)
  except Exception:  # pylint: disable=broad-except
    return frozenset()


def _row_struct(size, dtype, like):
  """``ShapeDtypeStruct((size,), dtype)`` varying over the mesh axes ``like`` varies
  over (required of ``pallas_call`` outputs inside ``shard_map(check_vma=True)``)."""
  aval = jax.typeof(like)
  for field in ("manual_axis_type", "vma"):  # jax 0.10 and later; earlier versions
    value = getattr(aval, field, None)
    if value is not None:
      try:
        return jax.ShapeDtypeStruct((size,), dtype, **{field: value})
      except TypeError:
        pass
  return jax.ShapeDtypeStruct((size,), dtype)


def _call(problem, x, k, l, init, *, maxiter, interpret, num_warps):
  """One ``pallas_call`` over the padded ``(batch, n)`` array."""
  pl, triton_params = _pallas()
  batch, n = x.shape
  dtype = accumulation_dtype(x.dtype)
  if interpret and _varying_axes(x):
    # Pallas' interpreter evaluates the kernel's jaxpr, traced without mesh axes, on
    # values that vary over them, which shard_map(check_vma=True) refuses (jax 0.10,
    # 0.11): run the same block function on the whole batch as one block instead.
    return solve_block(problem, x.astype(dtype), k, l, init, maxiter=maxiter)
  n_pad = padded_length(n)
  rows = block_rows(batch, n_pad, interpret=interpret)
  batch_pad = -(-batch // rows) * rows
  excluded = jnp.asarray(problem.excluded_value, x.dtype)
  if n_pad != n or batch_pad != batch:
    x = jnp.pad(x, ((0, batch_pad - batch), (0, n_pad - n)), constant_values=excluded)
  # Padded rows: every entry excluded and k = 0, a row answered by the bracket.
  pad_rows = lambda v, fill: jnp.pad(v, (0, batch_pad - batch), constant_values=fill)
  args = [x, pad_rows(k, 0), pad_rows(l, 1)]
  if init is not None:
    args.append(pad_rows(init, 0))
  row_spec = pl.BlockSpec(block_shape=(rows,), index_map=lambda i: (i,))
  in_specs = [pl.BlockSpec(block_shape=(rows, n_pad), index_map=lambda i: (i, 0))]
  in_specs += [row_spec] * (len(args) - 1)
  # Under shard_map the outputs vary over the mesh axes the inputs vary over.
  like = sum(jnp.zeros_like(v, dtype) if v.ndim == 1 else jnp.zeros_like(v[:, 0], dtype)
             for v in args)
  out_shape = (_row_struct(batch_pad, dtype, like), _row_struct(batch_pad, jnp.int32, like),
               _row_struct(batch_pad, jnp.int32, like))
  kernel = functools.partial(_kernel, problem, maxiter, init is not None)
  lam, iter_num, certified = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(batch_pad // rows,), in_specs=in_specs,
      out_specs=(row_spec, row_spec, row_spec), interpret=interpret,
      compiler_params=None if interpret else triton_params(num_warps=num_warps, num_stages=1),
      name="implicit_topk_threshold")(*args)
  return lam[:batch], iter_num[:batch], certified[:batch] != 0


def threshold_rows(problem, x, k, l, init=None, *, maxiter: int, interpret: bool | None = None,
                   num_warps: int | None = None):
  """Thresholds of the rows of ``x`` by the fused kernel.

  Args:
    problem: a threshold problem on the last-axis layout
      (:class:`~implicit_topk.problems.CappedSimplex`,
      :class:`~implicit_topk.problems.Magnitude`).
    x: ``(batch, n)`` float array, ``1 <= n <= MAX_ROW_LENGTH``.
    k, l: ``(batch,)`` per-row target sums and strengths.
    init: ``(batch,)`` starting thresholds, or ``None`` (the problem's guess).
    maxiter: cap on the Newton/bisection passes in the kernel, an int >= 1.
    interpret: ``None`` (default): the Triton kernel when lowered for CUDA or ROCm,
      interpret mode for any other platform (chosen per platform at lowering, so a
      function exported for several platforms gets each); ``True``/``False`` force it.
    num_warps: Triton warps per program (``None``: Triton's default).

  Returns:
    ``(lam, iter_num, certified)``, each ``(batch,)``: the finished thresholds in the
    accumulation dtype (:func:`accumulation_dtype`), int32 passes made, and bool
    certificates. Rows not certified hold the kernel's last iterate.
  """
  if x.ndim != 2 or not fits(x.shape[1]):
    raise ValueError(f"the Pallas threshold kernel takes (batch, n) rows with 1 <= n <= "
                     f"{MAX_ROW_LENGTH}; got shape {x.shape}.")
  call = functools.partial(_call, problem, maxiter=maxiter, num_warps=num_warps)
  dtype = accumulation_dtype(x.dtype)
  k, l = jnp.asarray(k, dtype), jnp.asarray(l, dtype)
  init = None if init is None else jnp.asarray(init, dtype)
  if interpret is not None:
    return call(x, k, l, init, interpret=interpret)
  return jax.lax.platform_dependent(
      x, k, l, init,
      cuda=functools.partial(call, interpret=False),
      rocm=functools.partial(call, interpret=False),
      default=functools.partial(call, interpret=True))
