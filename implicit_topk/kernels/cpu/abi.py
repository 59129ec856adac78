r"""The C side of the bridge to XLA: the typed FFI handler protocol, written in numba.

A kernel is a numba ``@cfunc`` with the signature :data:`HANDLER_SIGNATURE`
(``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``, ``jax.ffi.include_dir()/xla/ffi/api/
c_api.h``); the helpers here read its call frame (buffers, dimensions, scalar
attributes) and answer the protocol (:func:`handler_prologue`, :func:`error`). They
are plain ``@njit`` functions, called a few times per kernel call (numba's IR
inlining, ``inline="always"``, copied their IR at every call site: about 2 s more
compilation per handler on a cold cache, for no speed). The JAX side (registration, the primitives, export) is
:mod:`implicit_topk.kernels.cpu.ffi`, which imports nothing of numba.

The handler protocol: the metadata query made when XLA registers the handler is
answered with the API version and no traits; the other stages than ``execute``
return at once; at ``execute`` the argument and result counts, dtypes and ranks are
checked again (the Python side checks them first with a readable ``TypeError``), and
a kernel reports failure by a nonzero status, which becomes an XLA error (a Python
``XlaRuntimeError`` / ``JaxRuntimeError``), never a crash of the process.
"""

from __future__ import annotations

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
# XLA_FFI_Api: struct_size, extension_start, api_version (24 bytes), internal_api,
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


from numba import carray, njit  # noqa: E402  (after the intrinsics it compiles)

#: The message of a kernel that returned a nonzero status.
KERNEL_FAILED = message("implicit_topk: a native kernel failed (nonzero status)")


def dtype_code(sample):
  """The ``XLA_FFI_DataType`` of ``sample``'s numba type (compile-time constant)."""
  raise NotImplementedError  # numba only (see the overload below)


@overload(dtype_code, inline="always")
def _dtype_code(sample):
  code = {types.float32: FLOAT32, types.float64: FLOAT64, types.int32: INT32}[sample]
  return lambda sample: code


def itemsize(sample):
  """The bytes of ``sample``'s numba scalar type (compile-time constant)."""
  raise NotImplementedError  # numba only (see the overload below)


@overload(itemsize, inline="always")
def _itemsize(sample):
  size = {types.float32: 4, types.float64: 8, types.int32: 4}[sample]
  return lambda sample: size


@njit(cache=True)
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


@njit(cache=True)
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


@njit(cache=True)
def count(frame, results):
  """The number of arguments (or results)."""
  which = _FRAME_RETS if results else _FRAME_ARGS
  return load64(address(frame) + which + _LIST_SIZE)


@njit(cache=True)
def buffer(frame, results, index):
  """The address of argument (or result) ``index``'s ``XLA_FFI_Buffer``."""
  which = _FRAME_RETS if results else _FRAME_ARGS
  pointers = load64(address(frame) + which + _LIST_POINTERS)
  return load64(pointers + 8 * index)


@njit(cache=True)
def buffer_dtype(buf):
  return load32(buf + _BUFFER_DTYPE)


@njit(cache=True)
def buffer_rank(buf):
  return load64(buf + _BUFFER_RANK)


@njit(cache=True)
def buffer_dim(buf, axis):
  return load64(load64(buf + _BUFFER_DIMS) + 8 * axis)


@njit(cache=True)
def buffer_data(buf):
  return load64(buf + _BUFFER_DATA)


@njit(cache=True)
def size(buf):
  """The number of entries of a buffer (the product of its dimensions)."""
  total = 1
  for axis in range(buffer_rank(buf)):
    total *= buffer_dim(buf, axis)
  return total


@njit(cache=True)
def has(buf, code, length):
  """Whether the buffer holds ``length`` entries of dtype ``code`` (any shape)."""
  return buffer_dtype(buf) == code and size(buf) == length


@njit(cache=True)
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


@njit(cache=True)
def null():
  return _null()


@njit(inline="always", cache=True)
def span_of(frame, results, index, sample, first, length):
  """Entries ``first .. first + length - 1`` of argument (or result) ``index``, as a
  1-d array of ``sample``'s type."""
  start = buffer_data(buffer(frame, results, index)) + first * itemsize(sample)
  return carray(typed_pointer(start, sample), (length,))


@njit(inline="always", cache=True)
def rows_of(frame, results, index, sample, first, rows, n):
  """Rows ``first .. first + rows - 1`` of argument (or result) ``index`` (rows of
  ``n`` entries), as a 2-d array of ``sample``'s type."""
  start = buffer_data(buffer(frame, results, index)) + first * n * itemsize(sample)
  return carray(typed_pointer(start, sample), (rows, n))
