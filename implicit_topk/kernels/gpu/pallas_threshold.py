r"""Fused Pallas kernel: the threshold of a row-wise threshold problem and its output.

One Pallas program per block of rows holds the whole rows in registers (or on-chip
memory), finds for each row the root :math:`\lambda` of the problem's continuous,
nonincreasing optimality function, e.g. for the soft top-k mask of Sander et al.
2023 ("Fast, differentiable and sparse top-k: a convex analysis perspective", ICML)

.. math::

    \phi(\lambda) = \sum_i \mathrm{mask}\big((x_i - \lambda) / l\big) - k ,

and writes the operator's output :math:`y_i = \mathrm{mask}((x_i - \lambda)/l)` (for
the magnitude operator :math:`\mathrm{sign}(x_i)\min(|x_i|, t_i + g(t_i/l))`), the
threshold, the row's normalization origin, the passes made, a certificate flag and the
residual :math:`|\hat\phi(\lambda)|`: one read of ``x`` and one write of ``y``.

The iteration is the bounded safeguarded Newton of
:mod:`implicit_topk.kernels.gpu.bounded_newton`: the threshold solver's step for the
first ``free_passes`` passes, then an ordered-bit-pattern bisection every other pass.
Every row stops by one of its rules within
:func:`~implicit_topk.kernels.gpu.bounded_newton.pass_cap` passes
(``proofs/pallas_bounded_iteration.md``, Proposition 17), so nothing outside the kernel
checks or repeats a row: no data-dependent ``cond`` or ``while`` at the XLA level (on
XLA:GPU each of those copies a predicate to the host). The loop inside the kernel runs
while a row of the block is pending, at most the cap.

The kernel body is the problem's own ``jax.numpy`` code (normalization, bracket,
initial guess, optimality and its derivatives by ``jax.jvp``, ``snap``, output map), so
one kernel serves every regularizer of the mask and the magnitude operator. It uses
only the portable subset of Pallas (whole blocks loaded by ref indexing, elementwise
ops, row reductions, bit casts, a ``while_loop``) and is lowered

* on CUDA and ROCm through Triton (``jax.experimental.pallas.triton.CompilerParams``
  are passed explicitly; Mosaic GPU, jax 0.11's default, is not used: it cannot be
  lowered or tested on a machine without a Hopper GPU, and these row reductions and
  bit casts have not been checked there); the custom call target is
  :data:`TRITON_TARGET`, which :func:`implicit_topk.export_safety_checks` names;
* on every other backend (CPU, TPU) in Pallas interpret mode: the same kernel body run
  as ordinary XLA operations (correct, and slow: meant for tests).

Shapes: ``x`` is ``(batch, n)``; rows of ``n <= MAX_ROW_LENGTH`` (4096) go in blocks of
rows held in registers, longer rows up to 65536 one per program, read in chunks
(:mod:`~implicit_topk.kernels.gpu.pallas_long_rows`). The row is padded to a
power of two with the problem's ``excluded_value`` (never selected, output exactly
0, so the threshold does not change) and the batch to a multiple of the block of
rows (no copy when ``n`` is a power of two and the batch a multiple of the block).
Blocks hold about ``_GPU_BLOCK_ELEMENTS`` (1024) entries with Triton's default 4 warps
(H100, jax 0.11.2, ``benchmarks/results/gpu_h100_diag_0a7bfdf.jsonl``, the kernel before
this iteration: 4 warps beat 8 by 10-30% at 16384 x 64 and 16384 x 256 and tied at
16384 x 8; 1024 entries beat 512 at 16384 x 64 and 16384 x 256 with 8 warps; the run of
``gpu_h100_diag.jsonl`` only reached 16384 x 8, where the sizes were within noise).
Accumulation is in float32 for float32, bfloat16 and float16 inputs and in float64
for float64 inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk.kernels.gpu import bounded_newton, pallas_long_rows, platform_select
from implicit_topk.problems import layout as _layout
import implicit_topk.solvers.float_range as _float_range
import implicit_topk.solvers.threshold as _threshold

#: The longest row the kernel takes (after padding to a power of two): 4096 entries of
#: one row live in one program's registers or on-chip memory.
MAX_ROW_LENGTH = 4096
#: Target entries per program on a GPU: rows per block = this / padded row length,
#: clipped to [1, _GPU_MAX_BLOCK_ROWS] (H100, jax 0.11.2: see the module docstring).
_GPU_BLOCK_ELEMENTS = 1024
_GPU_MAX_BLOCK_ROWS = 128
#: Triton warps per program (4, Triton's default, beat 8 at every measured router cell).
DEFAULT_NUM_WARPS = 4
#: The custom call target of Pallas' Triton lowering.
TRITON_TARGET = "__gpu$xla.gpu.triton"
#: jax 0.11 warns at every lowering of a Pallas Triton kernel that the backend is
#: deprecated (Mosaic GPU replaces it). The Triton lowering is this library's documented
#: choice (it runs on every CUDA GPU from sm80; Mosaic GPU needs sm90), so the warning is
#: ours to act on, not our users': :func:`_filter_triton_deprecation`.
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be removed in"
                      r" a future JAX version")


def _filter_triton_deprecation() -> None:
  """Ignores :data:`TRITON_DEPRECATION` (that message, as a ``DeprecationWarning``
  only) for the rest of the process, from the kernel's first lowering for a GPU on
  (again at each lowering: ``warnings`` keeps one copy, first). JAX emits it while
  lowering the jit around the call, after this library's code has returned, so a
  filter scoped to the call could not see it."""
  warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
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
  """Whether the kernels take rows of length ``n``: one block of rows per program up
  to ``MAX_ROW_LENGTH``, one row per program read in chunks up to
  ``pallas_long_rows.MAX_LONG_ROW`` (65536)."""
  return 1 <= n <= pallas_long_rows.MAX_LONG_ROW


def block_rows(batch: int, n_padded: int, *, interpret: bool,
               block_elements: int | None = None) -> int:
  """Rows per program: a power of two, at most the batch rounded up to one.

  ``block_elements`` (GPU only; default ``_GPU_BLOCK_ELEMENTS``): the target entries
  per program."""
  if interpret:
    budget = _INTERPRET_BLOCK_ELEMENTS
  else:
    budget = _GPU_BLOCK_ELEMENTS if block_elements is None else int(block_elements)
  rows = max(1, budget // n_padded)
  if not interpret:
    rows = min(rows, _GPU_MAX_BLOCK_ROWS)
  rows = min(rows, padded_length(max(batch, 1)))
  return 1 << (rows.bit_length() - 1)  # round down to a power of two


normalization_origin = _float_range.normalization_origin


def normalized(problem, x, origin):
  """``x`` in the coordinates the threshold is solved in (``x`` itself without a shift)."""
  return problem.shift(x, origin) if hasattr(problem, "shift") else x


def solve_block(problem, x, k, l, init, *, free_passes: int = bounded_newton.FREE_PASSES,
                layout=None):
  """The iteration of one program on a block of rows (plain ``jax.numpy``).

  ``x`` is ``(rows, n)`` (already normalized), ``k``, ``l`` and ``init`` (or ``None``)
  are ``(rows,)``, all in the accumulation dtype. Bracket and start from the problem,
  then passes of :func:`implicit_topk.solvers.threshold.newton_iteration` with
  ``free_passes`` while a row is pending, at most
  :func:`bounded_newton.pass_cap` (a row stops by its own rules before: Proposition 17),
  then the problem's ``snap`` and the bracket's known rows. Returns ``(lam, iter_num,
  certified)``; ``certified`` (stopped by a rule or answered by the bracket) holds for
  every row by construction and is returned for the tests.
  """
  problem = problem.with_layout(_BLOCK_ROWS if layout is None else layout)
  cap = bounded_newton.pass_cap(x.dtype, free_passes)
  carry, bracket = _threshold._init_carry(problem, init, x, k, l)  # pylint: disable=protected-access

  def cond(carry):
    *_, done, iter_num = carry
    pending = jnp.where(~done & (iter_num < cap), 1, 0)
    return jnp.sum(pending) > 0  # no boolean `any` reduction (Triton)

  body = _threshold.newton_iteration(problem, x, k, l, free_passes=free_passes)
  lam, _, _, _, done, iter_num = jax.lax.while_loop(cond, body, carry)
  lam = _threshold._finish(problem, lam, x, k, l, bracket)  # pylint: disable=protected-access
  return lam, iter_num, done


def fused_block(problem, x, k, l, init, *, free_passes: int, write_output: bool, layout=None):
  """All the work of one program: rescale, normalize, solve, finish, residual, output.

  Returns ``(y, lam, origin, iter_num, certified, residual, scale, binary)``. The rows
  of a problem with a shift (the mask) are first multiplied by the exact power of two
  ``scale`` (:func:`implicit_topk.solvers.float_range.scale_exponent`: rows near the
  float maximum or minimum), and ``lam`` is relative to the rescaled, normalized rows
  ``problem.shift(x * scale, origin)`` (strength ``l * scale``). ``binary`` marks rows
  that the shift by the row maximum hid a binary answer from, decided exactly
  (:func:`~implicit_topk.solvers.float_range.hidden_binary_rows`) and written as their
  exact 0/1 mask. ``y`` is ``None`` unless ``write_output`` (``binary`` is then all
  false).
  """
  layout = _BLOCK_ROWS if layout is None else layout
  block = problem.with_layout(layout)
  e = (_float_range.scale_exponent(layout, x, l) if hasattr(problem, "shift")
       else jnp.zeros_like(l, jnp.int32))
  x, l = _float_range.rescale(layout, x, l, e)
  scale = _float_range.unscale(jnp.ones_like(l), -e)
  origin = normalization_origin(block, x, l, layout)
  xn = normalized(block, x, origin)
  if init is not None:
    init = init * scale - origin
  lam, iter_num, certified = solve_block(problem, xn, k, l, init, free_passes=free_passes,
                                         layout=layout)
  residual = jnp.abs(block.optimality(lam, xn, k, l))
  binary = iter_num < 0
  y = None
  if write_output:
    y = block.primal(lam, xn, l)
    if hasattr(problem, "shift"):
      binary, top = _float_range.hidden_binary_rows(block, layout, x, xn, origin, lam, k, l)
      y = layout.map(lambda v, out, f, t: jnp.where(f > 0, _float_range.hard_mask(v, t), out),
                     x, y, layout.expand(binary, x), layout.expand(top, x))
  return y, lam, origin, iter_num, certified, residual, scale, binary


def _store(refs, outs, write_y):
  """Stores the per-row outputs of :func:`fused_block` (and ``y`` with ``write_y``)."""
  y_ref, *row_refs = refs
  y, *per_row = outs
  if y_ref is not None:
    write_y(y_ref, y)
  for ref, value in zip(row_refs, per_row):
    ref[...] = value.astype(ref.dtype)


def _kernel(problem, free_passes, warm, write_output, *refs):
  """The program of one block of rows: load, :func:`fused_block`, store."""
  x_ref, k_ref, l_ref, *refs = refs
  init_ref = refs.pop(0) if warm else None
  y_ref = refs.pop(0) if write_output else None
  dtype = refs[0].dtype
  load = lambda ref: ref[...].astype(dtype)
  outs = fused_block(problem, load(x_ref), load(k_ref), load(l_ref),
                     None if init_ref is None else load(init_ref), free_passes=free_passes,
                     write_output=write_output)

  def write_y(ref, y):
    ref[...] = y.astype(ref.dtype)
  _store([y_ref, *refs], outs, write_y)


def _long_kernel(problem, free_passes, warm, write_output, chunk, num_chunks, *refs):
  """The program of one long row: the row read in chunks (:mod:`pallas_long_rows`)."""
  x_ref, k_ref, l_ref, *refs = refs
  init_ref = refs.pop(0) if warm else None
  y_ref = refs.pop(0) if write_output else None
  dtype = refs[0].dtype
  load = lambda ref: ref[...].astype(dtype)
  layout = pallas_long_rows._Chunks(num_chunks=num_chunks)  # pylint: disable=protected-access
  x = pallas_long_rows.lazy_row(x_ref, dtype, chunk)
  outs = fused_block(problem, x, load(k_ref), load(l_ref),
                     None if init_ref is None else load(init_ref), free_passes=free_passes,
                     write_output=write_output, layout=layout)
  _store([y_ref, *refs], outs, lambda ref, y: pallas_long_rows.write_row(ref, y, chunk, num_chunks))


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


def _vary_like(outs, like):
  """``outs`` (a pytree of arrays), each marked as varying over the mesh axes ``like``
  varies over (``jax.lax.pcast(..., to="varying")`` of the axes it lacks)."""
  axes = _varying_axes(like)

  def cast(out):
    missing = tuple(sorted(axes - _varying_axes(out)))
    return jax.lax.pcast(out, missing, to="varying") if missing else out
  return jax.tree.map(cast, outs)


def _struct(shape, dtype, like):
  """``ShapeDtypeStruct(shape, dtype)`` varying over the mesh axes ``like`` varies
  over (required of ``pallas_call`` outputs inside ``shard_map(check_vma=True)``)."""
  aval = jax.typeof(like)
  for field in ("manual_axis_type", "vma"):  # jax 0.10 and later; earlier versions
    value = getattr(aval, field, None)
    if value is not None:
      try:
        return jax.ShapeDtypeStruct(shape, dtype, **{field: value})
      except TypeError:
        pass
  return jax.ShapeDtypeStruct(shape, dtype)


def blocked_call(kernel, full_args, row_args, full_dtypes, row_dtypes, *, full_fills,
                 row_fills, interpret: bool, num_warps: int | None = DEFAULT_NUM_WARPS,
                 block_elements: int | None = None, chunk: int | None = None,
                 name: str = "implicit_topk_threshold"):
  """One ``pallas_call`` of ``kernel`` over blocks of rows of ``(batch, n)`` arrays.

  ``full_args`` are ``(batch, n)`` and ``row_args`` ``(batch,)`` arrays (any ``None``
  among the row arguments is left out); the kernel gets their refs in that order, then
  the refs of the outputs: one ``(batch, n)`` array per dtype of ``full_dtypes``, then
  one ``(batch,)`` array per dtype of ``row_dtypes``. The rows are padded to
  :func:`padded_length` with ``full_fills`` (one per full argument) and the batch to a
  multiple of the block of rows (:func:`block_rows`; one row per program with
  ``chunk``) with ``full_fills`` and ``row_fills``; the outputs are sliced back. Returns
  the list of outputs."""
  pl, triton_params = _pallas()
  if not interpret:
    _filter_triton_deprecation()
  row_pairs = [(v, fill) for v, fill in zip(row_args, row_fills) if v is not None]
  batch, n = full_args[0].shape
  n_pad = padded_length(n)
  rows = 1 if chunk is not None else block_rows(batch, n_pad, interpret=interpret,
                                                 block_elements=block_elements)
  batch_pad = -(-batch // rows) * rows
  fulls = [v if (n_pad, batch_pad) == (n, batch) else
           jnp.pad(v, ((0, batch_pad - batch), (0, n_pad - n)),
                   constant_values=jnp.asarray(fill, v.dtype))
           for v, fill in zip(full_args, full_fills)]
  per_row = [v if batch_pad == batch else
             jnp.pad(v, (0, batch_pad - batch), constant_values=jnp.asarray(fill, v.dtype))
             for v, fill in row_pairs]
  row_spec = pl.BlockSpec(block_shape=(rows,), index_map=lambda i: (i,))
  full_spec = pl.BlockSpec(block_shape=(rows, n_pad), index_map=lambda i: (i, 0))
  # Under shard_map the outputs vary over the mesh axes the inputs vary over.
  like = sum(jnp.zeros_like(v[:, 0], full_args[0].dtype) for v in fulls) + sum(
      jnp.zeros_like(v, full_args[0].dtype) for v in per_row)
  out_shape = ([_struct((batch_pad, n_pad), t, like) for t in full_dtypes]
               + [_struct((batch_pad,), t, like) for t in row_dtypes])
  outs = pl.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(batch_pad // rows,),
      in_specs=[full_spec] * len(fulls) + [row_spec] * len(per_row),
      out_specs=tuple([full_spec] * len(full_dtypes) + [row_spec] * len(row_dtypes)),
      interpret=interpret,
      compiler_params=None if interpret else triton_params(num_warps=num_warps, num_stages=1),
      name=name)(*fulls, *per_row)
  return ([v[:batch, :n] for v in outs[:len(full_dtypes)]]
          + [v[:batch] for v in outs[len(full_dtypes):]])


def _call(problem, x, k, l, init, *, free_passes, interpret, num_warps, block_elements,
          write_output, chunk=None):
  """One ``pallas_call`` over the padded ``(batch, n)`` array (:func:`blocked_call`)."""
  dtype = accumulation_dtype(x.dtype)
  if interpret and _varying_axes(x):
    # Pallas' interpreter evaluates the kernel's jaxpr, traced without mesh axes, on
    # values that vary over them, which shard_map(check_vma=True) refuses (jax 0.10,
    # 0.11): run the same block function on the whole batch as one block instead.
    y, *rest = fused_block(problem, x.astype(dtype), k, l, init, free_passes=free_passes,
                           write_output=write_output)
    return (None if y is None else y.astype(x.dtype), *rest)
  n_pad = padded_length(x.shape[1])
  if chunk is None and n_pad > MAX_ROW_LENGTH:
    chunk = min(pallas_long_rows.CHUNK, n_pad)
  if chunk is None:
    kernel = functools.partial(_kernel, problem, free_passes, init is not None, write_output)
  else:  # one row per program, read in chunks
    chunk = min(int(chunk), n_pad)
    kernel = functools.partial(_long_kernel, problem, free_passes, init is not None,
                               write_output, chunk, n_pad // chunk)
  # Padded rows: every entry excluded and k = 0, a row answered by the bracket.
  # lam, origin, passes, certified, residual, scale, binary
  per_row = (dtype, dtype, jnp.int32, jnp.int32, dtype, dtype, jnp.int32)
  outs = blocked_call(
      kernel, [x], [k, l, init], [x.dtype] if write_output else [], per_row,
      full_fills=[problem.excluded_value], row_fills=[0, 1, 0], interpret=interpret,
      num_warps=num_warps, block_elements=block_elements, chunk=chunk)
  y = outs[0] if write_output else None
  lam, origin, iter_num, certified, residual, scale, binary = outs[-7:]
  return y, lam, origin, iter_num, certified != 0, residual, scale, binary != 0


def per_platform(call, args, interpret: bool | None, like=None):
  """``call(*args, interpret=...)``: with ``interpret=None`` the compiled (Triton) kernel
  where lowered for CUDA or ROCm and interpret mode on every other platform, chosen per
  platform at lowering (a function exported for several platforms gets each);
  ``True``/``False`` force it. ``args`` is a tuple of arrays, ``args[0]`` the rows.
  ``like(*args)``: arrays of the output types by cheap operations, so that neither
  kernel is traced before it is lowered (:func:`platform_select.platform_select`)."""
  if interpret is not None:
    return call(*args, interpret=interpret)
  if _varying_axes(args[0]):  # inside shard_map: interpret mode traces the block function
    # Every branch's outputs vary over x's mesh axes (cond needs equal types; the
    # interpreted block leaves the per-row outputs that do not read x unvarying).
    varying = lambda interpret: lambda *a: _vary_like(call(*a, interpret=interpret), args[0])
    return jax.lax.platform_dependent(
        *args, cuda=varying(False), rocm=varying(False), default=varying(True))
  # Each branch lowered for its own platforms only (a function exported for CPU and CUDA
  # gets the interpreted kernel on one and Triton on the other).
  compiled = functools.partial(call, interpret=False)
  return platform_select.platform_select(
      args, {"cuda": compiled, "rocm": compiled}, functools.partial(call, interpret=True),
      like=like)


def fused_rows(problem, x, k, l, init=None, *, free_passes: int = bounded_newton.FREE_PASSES,
               interpret: bool | None = None, num_warps: int | None = DEFAULT_NUM_WARPS,
               block_elements: int | None = None, write_output: bool = True,
               chunk: int | None = None):
  r"""The operator's output and thresholds of the rows of ``x`` by the fused kernel.

  Args:
    problem: a threshold problem on the last-axis layout
      (:class:`~implicit_topk.problems.CappedSimplex`,
      :class:`~implicit_topk.problems.Magnitude`).
    x: ``(batch, n)`` float array, ``1 <= n <= 65536`` (not normalized: the
      kernel normalizes as ``problem.normalize``).
    k, l: ``(batch,)`` per-row target sums and strengths.
    init: ``(batch,)`` starting thresholds (in the coordinates of ``x``), or ``None``
      (the problem's guess).
    free_passes: unconstrained Newton passes before the forced ordered bisections
      (:mod:`~implicit_topk.kernels.gpu.bounded_newton`), an int >= 0.
    interpret: ``None`` (default): the Triton kernel when lowered for CUDA or ROCm,
      interpret mode for any other platform (chosen per platform at lowering, so a
      function exported for several platforms gets each); ``True``/``False`` force it.
    num_warps: Triton warps per program (default 4; ``None``: Triton's default).
    block_elements: target entries per program on a GPU (default 1024).
    write_output: whether the kernel writes the operator's output.
    chunk: ``None`` (default): one block of rows per program for rows of at most
      ``MAX_ROW_LENGTH`` entries, one row per program read in chunks of
      ``pallas_long_rows.CHUNK`` beyond; a power of two forces the chunked kernel with
      chunks of that many entries (tests).

  Returns:
    ``(y, lam, origin, iter_num, certified, residual, scale, binary)``: the output
    ``(batch, n)`` in the dtype of ``x`` (``None`` without ``write_output``); per row,
    in the accumulation dtype (:func:`accumulation_dtype`), the threshold of the
    rescaled, normalized row ``problem.shift(x * scale, origin)`` (strength
    ``l * scale``), the normalization origin, the int32 passes, the bool certificate
    (true for every row: Proposition 17), :math:`|\hat\phi(\lambda)|`, the exact
    power of two ``scale`` (1 except near the ends of the float range:
    :func:`implicit_topk.solvers.float_range.scale_exponent`) and whether the row is a
    binary row that the shift hid, written as its exact 0/1 mask
    (:func:`~implicit_topk.solvers.float_range.hidden_binary_rows`; its derivatives
    are 0).
  """
  if x.ndim != 2 or not fits(x.shape[1]):
    raise ValueError(f"the Pallas threshold kernels take (batch, n) rows with 1 <= n <= "
                     f"{pallas_long_rows.MAX_LONG_ROW}; got shape {x.shape}.")
  if int(free_passes) != free_passes or free_passes < 0:
    raise ValueError(f"`free_passes` must be an int >= 0; got {free_passes!r}.")
  if chunk is not None and (int(chunk) != chunk or chunk < 1 or int(chunk) & (int(chunk) - 1)):
    raise ValueError(f"`chunk` must be None or a power of two >= 1; got {chunk!r}.")
  call = functools.partial(_call, problem, free_passes=int(free_passes), num_warps=num_warps,
                           block_elements=block_elements, write_output=write_output,
                           chunk=chunk)
  dtype = accumulation_dtype(x.dtype)
  k, l = jnp.asarray(k, dtype), jnp.asarray(l, dtype)
  init = None if init is None else jnp.asarray(init, dtype)
  args = (x, k, l) if init is None else (x, k, l, init)
  run = lambda x_, k_, l_, *i, interpret: call(x_, k_, l_, i[0] if i else None,
                                               interpret=interpret)
  return per_platform(run, args, interpret, like=functools.partial(
      _fused_outputs_like, write_output=write_output))


def _fused_outputs_like(x, k, *_, write_output: bool):
  """Zeros of the types :func:`fused_rows`' kernel call returns (its ``like``)."""
  row = jnp.zeros_like(k)
  count = jnp.zeros(k.shape, jnp.int32)
  flag = jnp.zeros(k.shape, bool)
  y = jnp.zeros_like(x) if write_output else None
  return y, row, row, count, flag, row, row, flag


def threshold_rows(problem, x, k, l, init=None, *, free_passes: int = bounded_newton.FREE_PASSES,
                   interpret: bool | None = None, num_warps: int | None = DEFAULT_NUM_WARPS):
  """Thresholds of the rows of ``x`` (in the coordinates of ``x``) by the fused kernel,
  without the output: ``(lam, iter_num, certified)``, each ``(batch,)``. Arguments as
  in :func:`fused_rows`."""
  _, lam, origin, iter_num, certified, _, scale, _ = fused_rows(
      problem, x, k, l, init, free_passes=free_passes, interpret=interpret,
      num_warps=num_warps, write_output=False)
  return (lam + origin) / scale, iter_num, certified
