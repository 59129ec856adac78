r"""The one bridge from JAX to the compiled (numba) CPU kernels: typed XLA FFI calls.

A kernel here is a numba ``@cfunc`` that XLA calls directly as a typed FFI handler
(``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``, ``jax.ffi.include_dir()/xla/ffi/api/
c_api.h``): no ``jax.pure_callback``, no Python round trip, no GIL. The call is an
ordinary custom call in the compiled module, so it

* runs eagerly, under ``jit``, ``vmap`` (``vmap_method="broadcast_all"``: the batch
  becomes more rows), ``grad`` and ``jvp`` (the solvers differentiate implicitly; the
  kernel itself is never differentiated);
* exports with ``jax.export`` (custom calls serialize by name; pass
  :func:`export_safety_checks` as ``disabled_checks``; the importing process registers
  the targets by importing ``implicit_topk``);
* keeps a batch-sharded input sharded (the targets are registered as batch
  partitionable: each device runs the kernel on its own rows).

The handler protocol, written once (:func:`handler_prologue`, :func:`error`,
:func:`buffer_data`): the metadata query made when XLA registers the handler is
answered with the API version and no traits; the other stages than ``execute``
return at once; at ``execute`` the argument and result counts, dtypes and ranks are
checked again (the Python side checks them first with a readable ``TypeError``), and
a kernel reports failure by a nonzero status, which becomes an XLA error (a Python
``XlaRuntimeError`` / ``JaxRuntimeError``), never a crash of the process.

The kernels are compiled by numba on first import and cached on disk
(``cache=True``): later processes load them in well under a second.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Sequence

import jax
import jax.extend
from jax.interpreters import ad, batching, mlir
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

# -- the C ABI (xla/ffi/api/c_api.h, API version 0.x; all offsets for 64-bit) --------
API_MAJOR, API_MINOR = 0, 1
STAGE_EXECUTE = 3
EXTENSION_METADATA = 1
ERROR_INVALID_ARGUMENT = 3
ERROR_INTERNAL = 13
INT32, FLOAT32, FLOAT64 = 4, 11, 12  # XLA_FFI_DataType
# XLA_FFI_CallFrame: struct_size, extension_start, api, ctx, stage, args{struct_size,
# extension_start, size, types, args}, rets{...}, attrs{...}, future.
_FRAME_EXTENSION, _FRAME_API, _FRAME_STAGE, _FRAME_ARGS, _FRAME_RETS = 8, 16, 32, 40, 80
_LIST_SIZE, _LIST_POINTERS = 16, 32  # within XLA_FFI_Args / XLA_FFI_Rets
# XLA_FFI_Attrs (at 120): struct_size, extension_start, size, types, names, attrs;
# a name is an XLA_FFI_ByteSpan {ptr, len}, a scalar an XLA_FFI_Scalar {dtype, value}.
_FRAME_ATTRS, _ATTRS_SIZE, _ATTRS_TYPES, _ATTRS_NAMES, _ATTRS_VALUES = 120, 16, 24, 32, 40
ATTR_SCALAR, _SCALAR_VALUE = 3, 8
# XLA_FFI_Buffer: struct_size, extension_start, dtype, data, rank, dims.
_BUFFER_DTYPE, _BUFFER_DATA, _BUFFER_RANK, _BUFFER_DIMS = 16, 24, 32, 40
# XLA_FFI_Api: struct_size, extension_start, api_version (32 bytes), internal_api,
# XLA_FFI_Error_Create, ...
_API_ERROR_CREATE = 48
# XLA_FFI_Extension_Base: struct_size, type, next; the metadata extension adds a
# pointer to XLA_FFI_Metadata {struct_size, api_version{struct_size, extension_start,
# major, minor}, traits (uint32 at 32), state_type_id, ...}.
_EXTENSION_TYPE, _EXTENSION_METADATA = 8, 24
_METADATA_MAJOR, _METADATA_MINOR, _METADATA_TRAITS = 24, 28, 32

#: The signature of every handler: XLA_FFI_Error* (XLA_FFI_CallFrame*).
HANDLER_SIGNATURE = types.voidptr(types.voidptr)


# -- raw memory, as LLVM sees it ---------------------------------------------------
@intrinsic
def address(typingctx, pointer):
  """The integer address of a ``void*``."""
  def codegen(context, builder, signature, args):
    return builder.ptrtoint(args[0], ir.IntType(64))
  return types.int64(types.voidptr), codegen


@intrinsic
def _null(typingctx):
  def codegen(context, builder, signature, args):
    return ir.Constant(ir.IntType(8).as_pointer(), None)
  return types.voidptr(), codegen


def _loader(bits):
  @intrinsic
  def load(typingctx, addr):
    result = types.int64 if bits == 64 else types.int32

    def codegen(context, builder, signature, args):
      pointer = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
      value = builder.load(pointer)
      return builder.zext(value, ir.IntType(32)) if bits == 8 else value
    return result(types.int64), codegen
  return load


load64, load32, load8 = _loader(64), _loader(32), _loader(8)


@intrinsic
def store32(typingctx, addr, value):
  """``*(int32_t*) addr = value``."""
  def codegen(context, builder, signature, args):
    pointer = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
    builder.store(builder.trunc(args[1], ir.IntType(32)), pointer)
    return context.get_dummy_value()
  return types.void(types.int64, types.int64), codegen


@intrinsic
def typed_pointer(typingctx, addr, sample):
  """``(T*) addr`` for the numba scalar type ``T`` of ``sample`` (for ``numba.carray``)."""
  pointer_type = types.CPointer(sample)

  def codegen(context, builder, signature, args):
    return builder.inttoptr(args[0], context.get_value_type(pointer_type))
  return pointer_type(types.int64, sample), codegen


@intrinsic
def _call_error_create(typingctx, function, arguments):
  """``((XLA_FFI_Error* (*)(void*)) function)(arguments)``."""
  def codegen(context, builder, signature, args):
    void_pointer = ir.IntType(8).as_pointer()
    function_type = ir.FunctionType(void_pointer, [void_pointer])
    callee = builder.inttoptr(args[0], function_type.as_pointer())
    return builder.call(callee, [builder.inttoptr(args[1], void_pointer)])
  return types.voidptr(types.int64, types.int64), codegen


@intrinsic
def _error_arguments(typingctx):
  """The address of four int64 words (an ``XLA_FFI_Error_Create_Args``) on the stack."""
  def codegen(context, builder, signature, args):
    words = cgutils.alloca_once(builder, ir.IntType(64), size=4)
    return builder.ptrtoint(words, ir.IntType(64))
  return types.int64(), codegen


# -- the handler protocol ----------------------------------------------------------
def message(text: str) -> np.ndarray:
  """A NUL-terminated message, as a module-level constant for :func:`error`."""
  return np.frombuffer(text.encode("ascii") + b"\0", np.uint8).copy()


from numba import njit  # noqa: E402  (after the intrinsics it compiles)

#: The message of a kernel that returned a nonzero status.
KERNEL_FAILED = message("implicit_topk: a native kernel failed (nonzero status)")


def dtype_code(sample):
  """The ``XLA_FFI_DataType`` of ``sample``'s numba type (compile-time constant)."""
  raise NotImplementedError  # numba only (see the overload below)


@overload(dtype_code, inline="always")
def _dtype_code(sample):
  code = {types.float32: FLOAT32, types.float64: FLOAT64, types.int32: INT32}[sample]
  return lambda sample: code


@njit(cache=True, inline="always")
def error(frame, text, code):
  """An ``XLA_FFI_Error*`` carrying ``text`` (a :func:`message`), made by XLA's own
  ``XLA_FFI_Error_Create``; the handler returns it and XLA raises it in Python."""
  api = load64(address(frame) + _FRAME_API)
  create = load64(api + _API_ERROR_CREATE)
  arguments = _error_arguments()  # {struct_size, extension_start, message, errc}
  store64(arguments, 32)
  store64(arguments + 8, 0)
  store64(arguments + 16, text.ctypes.data)
  store64(arguments + 24, code)
  return _call_error_create(create, arguments)


@intrinsic
def store64(typingctx, addr, value):
  """``*(int64_t*) addr = value``."""
  def codegen(context, builder, signature, args):
    pointer = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
    builder.store(args[1], pointer)
    return context.get_dummy_value()
  return types.void(types.int64, types.int64), codegen


@njit(cache=True, inline="always")
def handler_prologue(frame):
  """True when the call is the metadata query or a stage other than ``execute``
  (the handler then returns NULL at once); answers the metadata query."""
  base = address(frame)
  extension = load64(base + _FRAME_EXTENSION)
  if extension != 0 and load32(extension + _EXTENSION_TYPE) == EXTENSION_METADATA:
    metadata = load64(extension + _EXTENSION_METADATA)
    store32(metadata + _METADATA_MAJOR, API_MAJOR)
    store32(metadata + _METADATA_MINOR, API_MINOR)
    store32(metadata + _METADATA_TRAITS, 0)
    return True
  return load32(base + _FRAME_STAGE) != STAGE_EXECUTE


@njit(cache=True, inline="always")
def count(frame, results):
  """The number of arguments (or results)."""
  which = _FRAME_RETS if results else _FRAME_ARGS
  return load64(address(frame) + which + _LIST_SIZE)


@njit(cache=True, inline="always")
def buffer(frame, results, index):
  """The address of argument (or result) ``index``'s ``XLA_FFI_Buffer``."""
  which = _FRAME_RETS if results else _FRAME_ARGS
  pointers = load64(address(frame) + which + _LIST_POINTERS)
  return load64(pointers + 8 * index)


@njit(cache=True, inline="always")
def buffer_dtype(buf):
  return load32(buf + _BUFFER_DTYPE)


@njit(cache=True, inline="always")
def buffer_rank(buf):
  return load64(buf + _BUFFER_RANK)


@njit(cache=True, inline="always")
def buffer_dim(buf, axis):
  return load64(load64(buf + _BUFFER_DIMS) + 8 * axis)


@njit(cache=True, inline="always")
def buffer_data(buf):
  return load64(buf + _BUFFER_DATA)


@njit(cache=True, inline="always")
def size(buf):
  """The number of entries of a buffer (the product of its dimensions)."""
  total = 1
  for axis in range(buffer_rank(buf)):
    total *= buffer_dim(buf, axis)
  return total


@njit(cache=True, inline="always")
def has(buf, code, length):
  """Whether the buffer holds ``length`` entries of dtype ``code`` (any shape)."""
  return buffer_dtype(buf) == code and size(buf) == length


@njit(cache=True, inline="always")
def scalar_attribute(frame, initial, code):
  """The address of the value of the scalar attribute whose name starts with the
  byte ``initial`` and whose dtype is ``code``, or 0 when there is none."""
  attrs = address(frame) + _FRAME_ATTRS
  for i in range(load64(attrs + _ATTRS_SIZE)):
    if load32(load64(attrs + _ATTRS_TYPES) + 4 * i) != ATTR_SCALAR:
      continue
    name = load64(load64(load64(attrs + _ATTRS_NAMES) + 8 * i))  # ByteSpan.ptr
    scalar = load64(load64(attrs + _ATTRS_VALUES) + 8 * i)
    if load8(name) == initial and load32(scalar) == code:
      return load64(scalar + _SCALAR_VALUE)
  return 0


@njit(cache=True, inline="always")
def null():
  return _null()


# -- the Python side ------------------------------------------------------------
_REGISTERED: set = set()
_LOCK = threading.Lock()


def register(name: str, handler: Any) -> None:
  """Registers a numba ``@cfunc`` handler as the CPU FFI target ``name`` (once),
  batch partitionable where this jax can say so."""
  with _LOCK:
    if name in _REGISTERED:
      return
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler.address), platform="cpu")
    partitionable = getattr(jax.ffi, "register_ffi_target_as_batch_partitionable", None)
    if partitionable is not None:
      partitionable(name)
    _REGISTERED.add(name)


def registered_targets() -> tuple[str, ...]:
  """The names of the FFI targets registered so far."""
  return tuple(sorted(_REGISTERED))


def export_safety_checks() -> list:
  """What ``jax.export.export`` must be told to serialize calls of these kernels:
  ``disabled_checks=implicit_topk.export_safety_checks()``.

  ``jax.export`` refuses custom calls that JAX itself does not promise to keep
  (its compatibility guarantees name only JAX's own). These kernels are found by
  name in the process that runs the exported function, which registers them by
  importing ``implicit_topk``; the same version of the package on both sides is
  the safe pairing.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import implicit_topk as itk
    >>> f = jax.jit(lambda x: itk.soft_topk_mask(x, 1.5))
    >>> x = jnp.array([[3.0, 1.0, 2.0]])
    >>> exported = jax.export.export(f, disabled_checks=itk.export_safety_checks())(x)
    >>> jax.export.deserialize(exported.serialize()).call(x)
    Array([[1. , 0. , 0.5]], dtype=float32)
  """
  from jax import export
  names = sorted(_DECLARED | _REGISTERED)
  return [export.DisabledSafetyCheck.custom_call(name) for name in names]


_DECLARED: set = set()


def declare(*names: str) -> None:
  """Declares target names before their kernels are compiled and registered (so that
  :func:`export_safety_checks` names them even before their first use)."""
  _DECLARED.update(names)


def call(name: str, results: Sequence[jax.ShapeDtypeStruct], *args, **attributes) -> Any:
  """The registered target ``name`` on ``args`` (arrays) and ``attributes`` (NumPy
  scalars), one custom call: ``results`` give the shapes and dtypes.

  Every argument and result has the same leading (batch) axes, one row each; the
  call is batch partitionable (a sharded batch stays sharded: XLA runs it on each
  device's rows) and ``vmap`` adds a leading batch axis to every operand. Inside
  ``shard_map`` the results vary over the mesh axes the arguments vary over.
  """
  if name not in _REGISTERED:
    raise RuntimeError(f"The native kernel {name!r} is not registered (import implicit_topk).")
  avals = tuple(jax.core.ShapedArray(r.shape, r.dtype) for r in results)
  return tuple(_native_call.bind(*args, target=name, results=avals,
                                 attributes=tuple(sorted(attributes.items()))))


def _abstract_eval(*args, target, results, attributes):
  """The results' avals, typed (inside ``shard_map``) as varying over the mesh axes the
  most varying argument varies over: one value per shard, as the kernel computes them
  (a cast after the call would transpose to a sum over devices)."""
  del target, attributes
  base = max(args, key=lambda a: len(_aval_axes(a)), default=None)
  if base is None or not _aval_axes(base):
    return results
  return tuple(base.update(shape=r.shape, dtype=r.dtype, weak_type=False) for r in results)


def _aval_axes(aval) -> frozenset:
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _lowering(ctx, *operands, target, results, attributes):
  """The custom call, marked batch partitionable over the leading axes of the first
  operand (all but its last): the frontend attribute XLA's batch partitioner reads and,
  under Shardy, the sharding rule that says the same."""
  del results
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


def _batched(primitive, *avals_params):
  """The vmap rule of ``primitive``: the mapped axis becomes a leading batch axis of
  every operand (broadcast where an operand is not mapped) and of every result (the
  parameters named in ``avals_params`` hold result avals and get it too)."""

  def rule(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [jax.numpy.broadcast_to(a, (size,) + a.shape) if d is None
             else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    for name in avals_params:
      params[name] = tuple(jax.core.ShapedArray((size,) + r.shape, r.dtype)
                           for r in params[name])
    outs = primitive.bind(*moved, **params)
    return outs, [0] * len(outs)

  return rule


_native_call = jax.extend.core.Primitive("implicit_topk_native_call")
_native_call.multiple_results = True
_native_call.def_abstract_eval(_abstract_eval)
_native_call.def_impl(lambda *args, **params: jax.jit(
    functools.partial(_native_call.bind, **params))(*args))
mlir.register_lowering(_native_call, _lowering, platform="cpu")
batching.primitive_batchers[_native_call] = _batched(_native_call, "results")


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
  ``transpose_name`` kernel (whose transpose is ``name`` again)."""
  for target in (name, transpose_name):
    if target not in _REGISTERED:
      raise RuntimeError(f"The native kernel {target!r} is not registered (import implicit_topk).")
  avals = lambda shapes: tuple(jax.core.ShapedArray(r.shape, r.dtype) for r in shapes)
  outs = _linear_call.bind(*primals, *tangents, target=name, transpose_target=transpose_name,
                           results=avals(results), transposed=avals(transposed),
                           attributes=tuple(sorted(attributes.items())),
                           num_primals=len(primals), reference=reference)
  return tuple(outs)


class _Transposed:
  """The transpose of a JAX linear map ``reference(*primals, *tangents)`` in its
  tangents, as ``(*primals, *cotangents) -> cotangents of the tangents``."""

  def __init__(self, reference, num_primals, tangents):
    self.reference, self.num_primals, self.tangents = reference, num_primals, tangents

  def __call__(self, *args):
    primals, cotangents = args[:self.num_primals], args[self.num_primals:]
    zeros = [jax.numpy.zeros(t.shape, t.dtype) for t in self.tangents]
    _, transpose = jax.vjp(lambda *t: self.reference(*primals, *t), *zeros)
    return tuple(transpose(tuple(cotangents)))


def _linear_impl(*args, target, results, attributes, **_):
  return _native_call.bind(*args, target=target, results=results, attributes=attributes)


def _linear_transpose(cotangents, *args, target, transpose_target, results, transposed,
                      attributes, num_primals, reference):
  primals, tangents = args[:num_primals], args[num_primals:]
  cotangents = [jax.numpy.zeros(r.shape, r.dtype) if type(c) is ad.Zero else c
                for c, r in zip(cotangents, results)]
  outs = _linear_call.bind(*primals, *cotangents, target=transpose_target,
                           transpose_target=target, results=transposed, transposed=results,
                           attributes=attributes, num_primals=num_primals,
                           reference=_Transposed(reference, num_primals, transposed))
  return [None] * num_primals + [out if ad.is_undefined_primal(t) else None
                                 for out, t in zip(outs, tangents)]


def _linear_jvp(primals, tangents, *, reference, **_):
  """Derivatives of the kernels' linear map: those of its JAX reference."""
  tangents = [jax.numpy.zeros(p.shape, p.dtype) if type(t) is ad.Zero else t
              for p, t in zip(primals, tangents)]
  outs, outs_dot = jax.jvp(lambda *a: tuple(reference(*a)), tuple(primals), tuple(tangents))
  return list(outs), list(outs_dot)


_linear_call = jax.extend.core.Primitive("implicit_topk_native_linear_call")
_linear_call.multiple_results = True
_linear_call.def_abstract_eval(
    lambda *args, results, **params: _abstract_eval(*args, target=None, results=results,
                                                    attributes=None))
_linear_call.def_impl(lambda *args, **params: jax.jit(
    functools.partial(_linear_call.bind, **params))(*args))
mlir.register_lowering(_linear_call, mlir.lower_fun(_linear_impl, multiple_results=True),
                       platform="cpu")
batching.primitive_batchers[_linear_call] = _batched(_linear_call, "results", "transposed")
ad.primitive_transposes[_linear_call] = _linear_transpose
ad.primitive_jvps[_linear_call] = _linear_jvp
