r"""The one bridge from JAX to the compiled (numba) CPU kernels: typed XLA FFI calls.

A kernel here is a numba ``@cfunc`` that XLA calls directly as a typed FFI handler
(``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``, ``jax.ffi.include_dir()/xla/ffi/api/
c_api.h``): no ``jax.pure_callback``, no Python round trip, no GIL. The call is an
ordinary custom call in the compiled module, so it

* runs eagerly, under ``jit``, ``vmap`` (``vmap_method="broadcast_all"``: the batch
  becomes more rows), ``grad`` and ``jvp`` (the solvers differentiate implicitly; the
  kernel itself is never differentiated);
* exports with ``jax.export`` (custom calls serialize by name; pass
  :func:`implicit_topk.export_safety_checks` as ``disabled_checks``; the process that
  runs the exported function registers the targets with
  :func:`implicit_topk.register_kernels`);
* keeps a batch-sharded input sharded (the targets are registered as batch
  partitionable: each device runs the kernel on its own rows), and a reduced axis
  split over devices split: under ``jit`` on several devices each call is
  custom-partitioned (:mod:`implicit_topk.kernels.cpu.partitioning`), so that XLA runs
  the threshold iteration with ``psum`` on each device's block where the axis is split,
  instead of gathering it for the kernel.

This module is the JAX side and imports nothing of numba: the handler protocol is
:mod:`implicit_topk.kernels.cpu.abi`, and the handlers are compiled and registered on
first use by :mod:`implicit_topk.kernels.cpu.registry`.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.extend
from jax import export
from jax._src import dispatch
from jax.interpreters import batching, mlir

from implicit_topk.kernels import linear_map
from implicit_topk.kernels.cpu import registry

# -- the Python side ------------------------------------------------------------
registered_targets = registry.registered_targets


def call(name: str, results: Sequence[jax.ShapeDtypeStruct], *args, **attributes) -> Any:
  """The registered target ``name`` on ``args`` (arrays) and ``attributes`` (NumPy
  scalars), one custom call: ``results`` give the shapes and dtypes.

  Every argument and result has the same leading (batch) axes, one row each; the
  call is batch partitionable (a sharded batch stays sharded: XLA runs it on each
  device's rows) and ``vmap`` adds a leading batch axis to every operand. Inside
  ``shard_map`` the results vary over the mesh axes the arguments vary over.
  """
  _lower_with_devices()
  return tuple(_native_call.bind(*args, target=name, results=linear_map.shaped(results),
                                 attributes=tuple(sorted(attributes.items()))))


def _abstract_eval(*args, target, results, attributes):
  """The results' avals, typed (inside ``shard_map``) as varying over the mesh axes the
  most varying argument varies over
  (:func:`implicit_topk.kernels.linear_map.varying_results`)."""
  del target, attributes
  return linear_map.varying_results(args, results)


def _lowering(ctx, *operands, target, results, attributes):
  """The custom call (:func:`_kernel_lowering`), through
  :mod:`implicit_topk.kernels.cpu.partitioning` where the program may be split over
  several devices: XLA then keeps a reduced axis split over devices split (a per-device
  form with ``psum``) instead of gathering it."""
  if not _partitions(ctx, target):
    return _kernel_lowering(ctx, *operands, target=target, results=results,
                            attributes=attributes)
  from implicit_topk.kernels.cpu import partitioning
  registry.ensure(target)
  return mlir.lower_fun(
      lambda *args: partitioning.partitioned(_kernel_call, args, target=target,
                                             results=results, attributes=attributes),
      multiple_results=True)(ctx, *operands)


def _partitions(ctx, target) -> bool:
  """Whether a call of ``target`` lowered in ``ctx`` goes through custom partitioning:
  a target with a sharded form, in a program for several devices with automatic
  (not manual) axes, not lowered for ``jax.export``."""
  from jax._src import sharding_impls
  from implicit_topk.kernels.cpu import partitioning
  module = ctx.module_context
  if getattr(module.lowering_parameters, "for_export", False):
    return False
  axis_context = module.axis_context
  if not isinstance(axis_context, sharding_impls.ShardingContext):
    return False  # shard_map (manual axes), pmap
  devices = axis_context.device_assignment
  if devices is None or len(devices) <= 1:
    return False
  return partitioning.has_sharded_form(target)


def _kernel_lowering(ctx, *operands, target, results, attributes):
  """The custom call, marked batch partitionable over the leading axes of the first
  operand (all but its last): the frontend attribute XLA's batch partitioner reads and,
  under Shardy, the sharding rule that says the same."""
  del results
  registry.ensure(target)  # built and registered when a call of it is first lowered
  batch = len(ctx.avals_in[0].shape) - 1
  extra = {"mhlo.frontend_attributes": mlir.ir_attribute({"num_batch_dims": str(batch)})}
  rule = _sharding_rule(ctx, batch)
  if rule is not None:
    extra["sdy.sharding_rule"] = rule
  lower = jax.ffi.ffi_lowering(target, extra_attributes=extra)
  return lower(ctx, *operands, **dict(attributes))


def _sharding_rule(ctx, batch):
  """Shardy's rule "... a, ..., ... -> ... b, ..." (the leading axes shared, the rest
  local); None where this jax has no Shardy or its helpers moved (then XLA keeps the
  call on replicated data: correct, not partitioned)."""
  if not jax.config.jax_use_shardy_partitioner:
    return None
  if any(export.is_symbolic_dim(d) for a in (*ctx.avals_in, *ctx.avals_out) for d in a.shape):
    return None  # symbolic shapes (jax.export): the lowering adds shape operands
  try:
    from jax._src import custom_partitioning_sharding_rule as rules
  except ImportError:
    return None
  letters = iter("abcdefghijklmnopqrstuvwxyz")

  def factors(aval):
    local = " ".join(next(letters) for _ in range(len(aval.shape) - batch))
    return ("... " + local).strip() if batch else local

  text = (", ".join(factors(a) for a in ctx.avals_in) + " -> "
          + ", ".join(factors(a) for a in ctx.avals_out))
  types_in = [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_in]
  types_out = [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out]
  return rules.sdy_sharding_rule_to_mlir(rules.str_to_sdy_sharding_rule(text), types_in,
                                         types_out)


_native_call = jax.extend.core.Primitive("implicit_topk_native_call")
_native_call.multiple_results = True
_native_call.def_abstract_eval(_abstract_eval)
_native_call.def_impl(lambda *args, **params: jax.jit(
    functools.partial(_native_call.bind, **params))(*args))
mlir.register_lowering(_native_call, _lowering, platform="cpu")

# The kernel call itself, which :mod:`implicit_topk.kernels.cpu.partitioning` binds on
# each device's block (and on whole programs it does not partition).
_kernel_call = jax.extend.core.Primitive("implicit_topk_native_kernel")
_kernel_call.multiple_results = True
_kernel_call.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_kernel_call, _kernel_lowering, platform="cpu")
batching.primitive_batchers[_native_call] = linear_map.batched(_native_call, "results")


def linear_call(name: str, transpose_name: str, results, transposed, primals, tangents,
                reference, **attributes):
  """``name`` on ``(*primals, *tangents)``: a kernel linear in ``tangents`` (e.g. a
  Jacobian-vector product), whose transpose is the kernel ``transpose_name`` on
  ``(*primals, *cotangents of the results)``, returning one cotangent per tangent
  (shapes and dtypes ``transposed``).

  ``reference(*primals, *tangents)`` is the same linear map written in JAX: the
  derivatives *of* the kernels (second-order derivatives of the operator, e.g.
  Hessian-vector products) are taken on it by autodiff, so the kernels serve the
  first order and nothing is lost at higher orders. Reverse-mode differentiation
  through a ``jax.custom_jvp`` rule that calls this transposes it with the
  ``transpose_name`` kernel (whose transpose is ``name`` again): the rules of
  :mod:`implicit_topk.kernels.linear_map`."""
  _lower_with_devices()
  return linear_map.bind(_linear_call, name, transpose_name, results, transposed, primals,
                         tangents, reference, attributes=tuple(sorted(attributes.items())))


def _linear_impl(*args, target, results, attributes, **_):
  return _native_call.bind(*args, target=target, results=results, attributes=attributes)


_linear_call = linear_map.make_primitive(
    "implicit_topk_native_linear_call", mlir.lower_fun(_linear_impl, multiple_results=True),
    platform="cpu")


_LOWERS_WITH_DEVICES: list = []


def _lower_with_devices() -> None:
  """In a process with several CPU devices, the calls are lowered with the device
  assignment in hand (as jax's own ``custom_partitioning`` is): without it the calls in
  a nested ``jit`` see no devices and could not be partitioned (:func:`_partitions`).
  Done on the first call, and only there: ``jax.export`` with shardings on an
  ``AbstractMesh`` (no devices) refuses such primitives, so a one-device process keeps
  that, its calls never being partitioned anyway."""
  if _LOWERS_WITH_DEVICES:
    return
  try:
    several = len(jax.devices("cpu")) > 1
  except RuntimeError:
    several = False
  if several:
    dispatch.prim_requires_devices_during_lowering.update((_native_call, _linear_call))
  _LOWERS_WITH_DEVICES.append(several)
