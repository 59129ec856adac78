r"""How XLA splits a native kernel call over devices: the reduced axis stays split.

A native kernel (:mod:`implicit_topk.kernels.cpu.ffi`) needs whole rows. Registered
only as batch partitionable, XLA runs it on each device's rows and *gathers* the
reduced (last) axis of its operands when that axis is split over devices: under
``jax.jit`` with ``NamedSharding(mesh, P(None, "d"))`` on an Auto mesh the trace cannot
see the split, so nothing at trace time can avoid it, and a gather of an axis that was
split because it does not fit on one device fails for memory at scale.

So each call of a target with a sharded form goes through
:func:`jax.experimental.custom_partitioning`: the decision is taken when XLA partitions
the program and knows every operand's sharding.

* Reduced axis split over mesh axes ``A`` (and the batch axes split or not): each
  device runs the pure-JAX equivalent of the kernel on its block, the threshold
  iteration of :class:`~implicit_topk.solvers.ThresholdSolver` on a
  :class:`~implicit_topk.problems.layout.LastAxis` layout with ``axis_name=A``: every
  row reduction is a ``psum``/``pmax``/``pmin`` of per-row scalars over ``A``, and no
  entry of ``x`` leaves its device. The derivative kernels' maps (the implicit
  function theorem, :mod:`implicit_topk.solvers.mask_tangent`) are two row sums,
  ``psum``'d the same way.
* Reduced axis whole on each device: the kernel itself on each device's rows (batch
  axes split as they come), as before.

The per-row results (thresholds, passes, residuals) are the same on every device of
``A``; the full-shaped ones keep ``x``'s sharding. The rule for Shardy's propagation
says so: the batch axes and the reduced axis ``n`` are factors shared by every
full-shaped operand and result, so a split of ``n`` reaches the call instead of being
undone before it.

Not partitioned this way (the kernel call as before, batch partitionable): a single
device (the common case: custom partitioning is inlined there), calls inside
``shard_map`` (manual axes: the operator's ``axis_name=`` is the route there),
``jax.export`` (the exported module must hold only stable custom calls), and the
targets without a sharded form (the PAV kernels, which sort whole rows).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from implicit_topk.kernels.cpu.kinds import ENTROPY, LAPLACE, PNORM, SIGMOID


# -- the per-device forms of the kernels, the reduced axis split over `axis` --------
def _regularizer(kind: int, a: float):
  """The regularizer of the mask kernel's attributes ``(kind, a)``."""
  from implicit_topk import regularizers
  if kind == PNORM:
    return regularizers.PNorm(1.0 + 1.0 / a)
  return {ENTROPY: regularizers.Entropy, SIGMOID: regularizers.BinaryEntropy,
          LAPLACE: regularizers.Laplace}[kind]()


def _threshold_solver(problem):
  from implicit_topk.solvers.threshold import ThresholdSolver
  return ThresholdSolver(problem=problem)


def _capped_simplex(axis, attributes, x, k, l):
  """``(mask, lam, passes, residual, shift)`` as the mask kernel returns them (``lam +
  shift`` the threshold of ``x``, or for float64 rows at the ends of the float range
  of ``x 2^-E`` with strength ``l 2^-E``, the kernel's exact rescaling), by the
  threshold iteration with ``psum`` over ``axis``; the rows normalized as
  :meth:`CappedSimplex.normalize` does."""
  from implicit_topk.problems import CappedSimplex
  from implicit_topk.problems.layout import LastAxis
  problem = CappedSimplex(_regularizer(int(attributes["kind"]), float(attributes["a"])),
                          layout=LastAxis(axis))
  layout = problem.layout
  x, l, _ = _scaled(axis, x, l)
  top = layout.max(jnp.where(jnp.isfinite(x), x, -jnp.inf))
  far = jnp.abs(top) * np.sqrt(np.finfo(x.dtype).eps) > l
  shift = jnp.where(jnp.isfinite(top) & far, top, jnp.zeros_like(top))
  rows = problem.shift(x, shift)
  step = _threshold_solver(problem).run(None, rows, k, l)
  mask = problem.primal(step.params, rows, l)
  return (mask, step.params, step.state.iter_num.astype(jnp.int32),
          step.state.residual.astype(x.dtype), shift)


def _magnitude(axis, attributes, x, k, l):
  """``(lam, passes, residual)`` as the magnitude kernel returns them."""
  from implicit_topk.problems import Magnitude
  from implicit_topk.problems.layout import LastAxis
  problem = Magnitude(p=1.0 + 1.0 / float(attributes["a"]), layout=LastAxis(axis))
  step = _threshold_solver(problem).run(None, x, k, l)
  return (step.params, step.state.iter_num.astype(jnp.int32),
          step.state.residual.astype(x.dtype))


def _scaled(axis, x, l):
  """``(x f, l f, f)`` with ``f = 2^-E`` per row, the mask kernel's exact rescaling of
  float64 rows (:func:`implicit_topk.solvers.mask_tangent.row_scale`, the maximum
  ``pmax``'d over ``axis``); ``f`` is 1 for other dtypes."""
  from implicit_topk.problems.layout import LastAxis
  from implicit_topk.solvers import mask_tangent
  f = mask_tangent.row_scale(x, l, LastAxis(axis))
  if f is None:
    return x, l, jnp.ones_like(l)
  return x * f[..., None], l * f, f


def _slopes(attributes, x, lam, shift, l):
  from implicit_topk.solvers import mask_tangent
  return mask_tangent.slopes(int(attributes["kind"]), float(attributes["a"]), x, lam, shift, l)


def _tangent(axis, attributes, x, lam, shift, l, x_dot, k_dot, l_dot):
  """``(y_dot, lam_dot)``: :func:`implicit_topk.solvers.mask_tangent.tangent` with its
  row sums ``psum``'d over ``axis``; NaN rows as the tangent kernel gives them."""
  x, l, f = _scaled(axis, x, l)
  x_dot, l_dot = x_dot * f[..., None], l_dot * f
  d, dz = _slopes(attributes, x, lam, shift, l)
  total = jax.lax.psum(d.sum(-1), axis)
  moved = jax.lax.psum((d * x_dot - dz * l_dot[..., None]).sum(-1), axis)
  rate = jnp.where(total > 0, (moved - k_dot) / jnp.where(total > 0, total, 1), 0)
  rate = jnp.where(jnp.isnan(lam), jnp.nan, rate)
  y_dot = d * (x_dot - rate[..., None]) - dz * l_dot[..., None]
  return y_dot, rate


def _cotangent(axis, attributes, x, lam, shift, l, y_bar, lam_bar):
  """``(x_bar, k_bar, l_bar)``: the transpose of :func:`_tangent` (as the cotangent
  kernel computes it: ``c = (lam_bar - sum d y_bar) / sum d``, ``x_bar = d (y_bar +
  c)``, ``k_bar = -c``, ``l_bar = -sum d z (y_bar + c)``, in the coordinates of
  :func:`_scaled`, ``x_bar`` and ``l_bar`` then times ``f``), row sums ``psum``'d."""
  x, l, f = _scaled(axis, x, l)
  d, dz = _slopes(attributes, x, lam, shift, l)
  total = jax.lax.psum(d.sum(-1), axis)
  weighted = jax.lax.psum((d * y_bar).sum(-1), axis)
  c = jnp.where(total > 0, (lam_bar - weighted) / jnp.where(total > 0, total, 1), 0)
  c = jnp.where(jnp.isnan(lam), jnp.nan, c)
  g = y_bar + c[..., None]
  x_bar = jnp.where(jnp.isnan(c)[..., None], jnp.nan, d * g * f[..., None])
  l_bar = -jax.lax.psum((dz * g).sum(-1), axis) * f
  return x_bar, -c, jnp.where(jnp.isnan(c), jnp.nan, l_bar)


def _sharded_forms() -> dict[str, Callable]:
  forms: dict[str, Callable] = {"capped_simplex": _capped_simplex, "magnitude": _magnitude}
  for rule in ("cubic", "linear", "general"):
    forms[f"capped_simplex_tangent_{rule}"] = _tangent
    forms[f"capped_simplex_cotangent_{rule}"] = _cotangent
  return forms


#: target family -> its per-device form on a split reduced axis
#: ``(axis, attributes, *operands) -> results``.
SHARDED_FORMS = _sharded_forms()


def has_sharded_form(target: str) -> bool:
  """Whether the target ``target`` has a per-device form for a split reduced axis."""
  return _family(target) in SHARDED_FORMS


def _family(target: str) -> str | None:
  """The kernel family of a target name ``implicit_topk_<family>_<dtype>``
  (:func:`implicit_topk.kernels.cpu.registry.target`)."""
  from implicit_topk.kernels.cpu import registry
  if not target.startswith(registry.PREFIX):
    return None
  return target[len(registry.PREFIX):].rsplit("_", 1)[0]


# -- the custom partitioning -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Call:
  """One kernel call, the static part: ``kernel(*operands, target=, results=,
  attributes=)`` binds the kernel itself (results given as avals); ``ranks`` holds
  the rank of every operand and ``result_ranks`` that of every result (the first
  operand is ``x``, of rank ``batch + 1``)."""
  target: str
  results: tuple
  attributes: tuple
  kernel: Any
  ranks: tuple
  result_ranks: tuple

  @property
  def batch(self) -> int:
    return self.ranks[0] - 1


def _kernel(call: Call, *operands):
  return tuple(call.kernel.bind(*operands, target=call.target, results=call.results,
                                attributes=call.attributes))


def _factors(call: Call, rank: int) -> str:
  letters = [f"b{i}" for i in range(call.batch)]
  return " ".join(letters + (["n"] if rank == call.batch + 1 else []))


def _sharding_rule(call: Call, mesh, operand_types, result_types) -> str:
  """Shardy's rule: batch factors ``b0 b1 ...`` shared by every operand and result,
  and the reduced factor ``n`` by every full-shaped one."""
  del mesh, operand_types, result_types
  return (", ".join(_factors(call, r) for r in call.ranks) + " -> "
          + ", ".join(_factors(call, r) for r in call.result_ranks))


def _spec(sharding, ndim: int) -> tuple:
  spec = tuple(getattr(sharding, "spec", None) or ())
  return spec + (None,) * (ndim - len(spec))


def _axis_size(mesh, entry) -> int:
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[name] for name in names)


def _partition(call: Call, mesh, operand_shapes, result_shapes):
  """XLA's callback: the operands' and results' shardings this call runs on, and the
  per-device function. The batch axes keep ``x``'s sharding; the reduced axis keeps
  it too where the target has a sharded form and the axis splits evenly, else it is
  made whole (XLA gathers it: the kernel's behaviour before)."""
  x = operand_shapes[0]
  ndim = len(x.shape)
  spec = _spec(x.sharding, ndim) if isinstance(x.sharding, NamedSharding) else (None,) * ndim
  batch, reduced = spec[:-1], spec[-1]
  form = SHARDED_FORMS.get(_family(call.target) or "")
  if reduced is not None and (form is None or x.shape[-1] % _axis_size(mesh, reduced)):
    reduced = None
  full, row = NamedSharding(mesh, P(*batch, reduced)), NamedSharding(mesh, P(*batch))
  pick = lambda shape: full if len(shape.shape) == ndim else row
  operand_shardings = tuple(pick(s) for s in operand_shapes)
  result_shardings = tuple(pick(s) for s in result_shapes)

  def per_device(*operands):
    local = operands[0].shape
    if reduced is None:
      results = tuple(jax.core.ShapedArray(local if r.ndim == ndim else local[:-1], r.dtype)
                      for r in call.results)
      return tuple(_kernel(dataclasses.replace(call, results=results), *operands))
    return tuple(form(reduced, dict(call.attributes), *operands))

  return mesh, per_device, result_shardings, operand_shardings


_partitioned = custom_partitioning(_kernel, static_argnums=(0,))
# Shardy reads `sharding_rule`; GSPMD (jax_use_shardy_partitioner=False) propagates
# with `infer_sharding_from_operands`.
_partitioned.def_partition(
    _partition, sharding_rule=_sharding_rule,
    infer_sharding_from_operands=lambda call, mesh, operands, results: _partition(
        call, mesh, operands, results)[2],
    propagate_user_sharding=None)


def partitioned(kernel, operands, *, target, results, attributes):
  """``kernel.bind(*operands, target=, results=, attributes=)`` as one custom-partitioned
  call (traced at lowering; see the module docstring)."""
  call = Call(target, tuple(results), tuple(attributes), kernel,
              tuple(o.ndim for o in operands), tuple(len(r.shape) for r in results))
  return _partitioned(call, *operands)
