r"""A kernel call's rows split over XLA's intra-op threads (the XLA FFI thread pool).

XLA:CPU runs its own fusions on its intra-op thread pool; a custom call runs on the
one thread that called it. A handler here splits its rows into blocks
(:func:`block_rows`: at least :data:`BLOCK_ENTRIES` entries, whole :data:`ROW_ALIGN`
groups of rows for router rows, the same for every thread count) and lets helper tasks on
XLA's pool take blocks beside it (``XLA_FFI_ThreadPool_Schedule`` of
``jax.ffi.include_dir()/xla/ffi/api/c_api.h``):

1. a call of fewer than two blocks, on a pool of one thread (or none: an older XLA
   whose ``XLA_FFI_Api`` ends before the thread pool's functions), or with the limit
   :func:`set_limit` at 1, runs its rows itself, in one piece, as before;
2. otherwise the caller ``malloc``\ s a small shared state (reference count, next
   block, blocks done, block count, the call frame, a status) and schedules up to
   ``threads - 1`` helper tasks with it (a task that cannot be scheduled is dropped
   from the count);
3. the caller and the helpers take blocks with an atomic fetch-and-add on the next
   block until none is left, and count each block they finish; a helper reads the call
   frame only after it took a block (the frame lives until the caller returns, and the
   caller waits for every block taken);
4. the caller then waits (spinning, then ``sched_yield``) until every block is done: it only ever
   waits on blocks a running thread took, so a busy pool (or one that runs a task in the
   caller's thread, or never) costs time, never a deadlock; each side then drops its
   reference, and the last one ``free``\ s the state.

A block gives the same results to the bit wherever it runs and whichever blocks came
before it (each family's rows function starts each block afresh; the tests compare a
threaded call with a serial one bit for bit).

The task of a handler is a C function ``void task(void* data)``: a numba ``@cfunc``
built beside the handler (:func:`implicit_topk.kernels.cpu.registry.ensure`), whose
address is registered with LLVM under a fixed name (:func:`task_symbol`) before the
handler is compiled or loaded from numba's disk cache. The handler refers to it by that
name as a weak external (:func:`external_task`): the JIT resolves it when it loads the
handler, in each process, so no address is ever in a cache or an XLA program; a
handler loaded without its task (address 0) runs serially.

:func:`set_limit` (``IMPLICIT_TOPK_KERNEL_THREADS`` in the environment: its initial
value) caps the threads per call at run time: 1 is serial, 0 (the default) as many as
XLA's pool has. It is a process-wide word the handlers read on each call (another weak
external, :data:`CONTROL_SYMBOL`), not a compile-time constant: the cached machine code
and the compiled XLA programs do not depend on it.
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from implicit_topk.kernels.cpu import abi

# -- the C ABI (xla/ffi/api/c_api.h; offsets for 64-bit) ------------------------------
# XLA_FFI_CallFrame: struct_size, extension_start, api, ctx, ...
_FRAME_CTX = 24
# XLA_FFI_Api: struct_size, extension_start, api_version (XLA_FFI_Api_Version: 24
# bytes), internal_api, then 8-byte function pointers from 48: Error_Create,
# Error_GetMessage, Error_Destroy (64), Handler_Register, Stream_Get, Type_Register,
# ExecutionContext_Get, State_Set, State_Get, DeviceMemory_Allocate, DeviceMemory_Free,
# ThreadPool_Schedule (136), ThreadPool_NumThreads (144), ...
_API_ERROR_DESTROY = 64
_API_SCHEDULE = 136
_API_NUM_THREADS = 144
# XLA_FFI_Error_Destroy_Args: struct_size, extension_start, error.
_DESTROY_ARGS_SIZE = 24
# XLA_FFI_ThreadPool_Schedule_Args: struct_size, extension_start, ctx, task, data.
_SCHEDULE_ARGS_SIZE = 40
# XLA_FFI_ThreadPool_NumThreads_Args: struct_size, extension_start, ctx, num_threads.
_NUM_THREADS_ARGS_SIZE = 32

#: Rows per block are a multiple of this for rows of up to :data:`ALIGNED_ROW` entries
#: (the mask's lanes take router rows 64 at a time, up to the per-row kernel's one-pass
#: length): a block boundary never splits a lane block.
ROW_ALIGN = 64
ALIGNED_ROW = 512
#: A block has at least this many entries (rows times row length).
BLOCK_ENTRIES = 8192
#: Spin-wait rounds (``pause``) of the caller before it yields its thread while it waits
#: for the helpers' last blocks (a block takes tens of microseconds).
SPINS = 4000
#: The most threads a call uses (the caller and its helpers).
MAX_THREADS = 64

# the shared state: int64 words
_REFS, _NEXT, _DONE, _TOTAL, _FRAME, _STATUS, _BLOCK, _ROWS = range(8)
_STATE_WORDS = 8

#: The weak external of the process-wide control words: the run-time limit on the
#: threads per call, then counters of the threaded calls and of the blocks helpers took.
CONTROL_SYMBOL = "implicit_topk_kernel_threads"
_CONTROL = np.zeros(4, np.int64)
_LIMIT, _THREADED_CALLS, _HELPER_BLOCKS = 0, 1, 2


def task_symbol(module: str, entry: str) -> str:
  """The symbol under which the task of the handler ``entry`` of the kernel module
  ``module`` (e.g. ``native_mask``, ``capped_simplex_f32``) is registered with LLVM."""
  return f"implicit_topk_task_{module}_{entry}"


def set_limit(threads: int) -> None:
  """At most ``threads`` threads per kernel call from now on (1: serial; 0: as many as
  XLA's intra-op pool has). Takes effect at the next call, compiled or not."""
  if threads < 0:
    raise ValueError(f"threads must be >= 0, got {threads}")
  _CONTROL[_LIMIT] = threads


def limit() -> int:
  """The current limit of :func:`set_limit`."""
  return int(_CONTROL[_LIMIT])


def counters() -> tuple[int, int]:
  """(calls that ran on several threads, blocks that helper tasks ran) in this process
  so far (a diagnostic: the tests check that the helpers did take blocks)."""
  return int(_CONTROL[_THREADED_CALLS]), int(_CONTROL[_HELPER_BLOCKS])


def register_control() -> None:
  """Registers :data:`CONTROL_SYMBOL` with LLVM (before any handler is built), the
  limit from ``IMPLICIT_TOPK_KERNEL_THREADS`` where that is set."""
  import llvmlite.binding as llb
  value = os.environ.get("IMPLICIT_TOPK_KERNEL_THREADS", "").strip()
  if value:
    try:
      set_limit(int(value))
    except ValueError:
      pass
  llb.add_symbol(CONTROL_SYMBOL, _CONTROL.ctypes.data)


def register_task(module: str, entry: str, task) -> None:
  """Registers the ``@cfunc`` ``task`` as the task of the handler ``entry`` of
  ``module``."""
  import llvmlite.binding as llb
  llb.add_symbol(task_symbol(module, entry), task.address)


#: The signature of every task: void (void*).
TASK_SIGNATURE = types.void(types.voidptr)


# -- intrinsics -------------------------------------------------------------------
_I8P = ir.IntType(8).as_pointer()
_I64 = ir.IntType(64)


def _declare(module, name, return_type, argument_types):
  return cgutils.get_or_insert_function(module, ir.FunctionType(return_type, argument_types),
                                        name)


def external_task(module: str, entry: str):
  """An intrinsic ``() -> int64``: the address of the task of ``module``'s handler
  ``entry``, a weak external resolved when the JIT loads the handler (0 where it was not
  registered)."""
  name = task_symbol(module, entry)

  @intrinsic
  def task_address(typingctx):
    def codegen(context, builder, signature, args):
      return _weak_external_address(builder, name, lambda module: ir.Function(
          module, ir.FunctionType(ir.VoidType(), [_I8P]), name))
    return types.int64(), codegen
  return task_address


@intrinsic
def _control_address(typingctx):
  def codegen(context, builder, signature, args):
    return _weak_external_address(builder, CONTROL_SYMBOL, lambda module: ir.GlobalVariable(
        module, _I64, CONTROL_SYMBOL))
  return types.int64(), codegen


def _weak_external_address(builder, name, declare):
  """The address (int64) of the symbol ``name``, declared once per LLVM module by
  ``declare(module)`` as a weak external (0 where the JIT finds no such symbol)."""
  module = builder.module
  try:
    symbol = module.get_global(name)
  except KeyError:
    symbol = declare(module)
    symbol.linkage = "extern_weak"
  return builder.ptrtoint(symbol, _I64)


@intrinsic
def _malloc(typingctx, size):
  def codegen(context, builder, signature, args):
    malloc = _declare(builder.module, "malloc", _I8P, [_I64])
    return builder.ptrtoint(builder.call(malloc, [args[0]]), _I64)
  return types.int64(types.int64), codegen


@intrinsic
def _free(typingctx, addr):
  def codegen(context, builder, signature, args):
    free = _declare(builder.module, "free", ir.VoidType(), [_I8P])
    builder.call(free, [builder.inttoptr(args[0], _I8P)])
    return context.get_dummy_value()
  return types.void(types.int64), codegen


@intrinsic
def _yield(typingctx):
  def codegen(context, builder, signature, args):
    sched_yield = _declare(builder.module, "sched_yield", ir.IntType(32), [])
    builder.call(sched_yield, [])
    return context.get_dummy_value()
  return types.void(), codegen


@intrinsic
def _pause(typingctx):
  """A spin-wait hint (x86 ``pause``, ARM ``yield``; nothing elsewhere)."""
  def codegen(context, builder, signature, args):
    import llvmlite.binding as llb
    triple = llb.get_process_triple()
    if triple.startswith("x86_64"):
      builder.call(_declare(builder.module, "llvm.x86.sse2.pause", ir.VoidType(), []), [])
    elif triple.startswith("aarch64"):
      hint = _declare(builder.module, "llvm.aarch64.hint", ir.VoidType(), [ir.IntType(32)])
      builder.call(hint, [ir.Constant(ir.IntType(32), 1)])
    return context.get_dummy_value()
  return types.void(), codegen


@intrinsic
def fetch_add(typingctx, addr, value):
  """``atomic_fetch_add((int64_t*) addr, value)`` (sequentially consistent): the old
  value."""
  def codegen(context, builder, signature, args):
    pointer = builder.inttoptr(args[0], _I64.as_pointer())
    return builder.atomic_rmw("add", pointer, args[1], "seq_cst")
  return types.int64(types.int64, types.int64), codegen


@intrinsic
def atomic_load(typingctx, addr):
  """``atomic_load((int64_t*) addr)`` (sequentially consistent)."""
  def codegen(context, builder, signature, args):
    pointer = builder.inttoptr(args[0], _I64.as_pointer())
    return builder.load_atomic(pointer, "seq_cst", 8)
  return types.int64(types.int64), codegen


@intrinsic
def _words(typingctx):
  """The address of five int64 words on the stack (an API call's arguments)."""
  def codegen(context, builder, signature, args):
    words = cgutils.alloca_once(builder, _I64, size=5)
    return builder.ptrtoint(words, _I64)
  return types.int64(), codegen


@intrinsic
def _call(typingctx, function, argument):
  """``((void* (*)(void*)) function)(argument)``: the result's address."""
  def codegen(context, builder, signature, args):
    callee = builder.inttoptr(args[0], ir.FunctionType(_I8P, [_I8P]).as_pointer())
    return builder.ptrtoint(builder.call(callee, [builder.inttoptr(args[1], _I8P)]), _I64)
  return types.int64(types.int64, types.int64), codegen


@intrinsic
def _call_void(typingctx, function, argument):
  """``((void (*)(void*)) function)(argument)``."""
  def codegen(context, builder, signature, args):
    callee = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [_I8P]).as_pointer())
    builder.call(callee, [builder.inttoptr(args[1], _I8P)])
    return context.get_dummy_value()
  return types.void(types.int64, types.int64), codegen


# -- XLA's thread pool -------------------------------------------------------------
@njit(cache=True)
def _api_function(frame, offset):
  """The ``XLA_FFI_Api`` function pointer at ``offset``, or 0 where this XLA's API
  struct is too short to have it."""
  api = abi.load64(abi.address(frame) + abi._FRAME_API)
  if api == 0 or abi.load64(api) < offset + 8:  # struct_size
    return 0
  return abi.load64(api + offset)


@njit(cache=True)
def _destroy(frame, error):
  destroy = _api_function(frame, _API_ERROR_DESTROY)
  if destroy != 0:
    arguments = _words()
    abi.store64(arguments, _DESTROY_ARGS_SIZE)
    abi.store64(arguments + 8, 0)
    abi.store64(arguments + 16, error)
    _call_void(destroy, arguments)


@njit(cache=True)
def pool_threads(frame):
  """The threads of XLA's intra-op pool for this call (1 where there is none, or where
  this XLA cannot say)."""
  function = _api_function(frame, _API_NUM_THREADS)
  if function == 0:
    return 1
  arguments = _words()
  out = arguments + 32
  abi.store64(out, 1)
  abi.store64(arguments, _NUM_THREADS_ARGS_SIZE)
  abi.store64(arguments + 8, 0)
  abi.store64(arguments + 16, abi.load64(abi.address(frame) + _FRAME_CTX))
  abi.store64(arguments + 24, out)
  error = _call(function, arguments)
  if error != 0:
    _destroy(frame, error)
    return 1
  return max(abi.load64(out), 1)


@njit(cache=True)
def _schedule(frame, task, data):
  """Whether XLA took the task ``task(data)`` for its pool."""
  function = _api_function(frame, _API_SCHEDULE)
  if function == 0:
    return False
  arguments = _words()
  abi.store64(arguments, _SCHEDULE_ARGS_SIZE)
  abi.store64(arguments + 8, 0)
  abi.store64(arguments + 16, abi.load64(abi.address(frame) + _FRAME_CTX))
  abi.store64(arguments + 24, task)
  abi.store64(arguments + 32, data)
  error = _call(function, arguments)
  if error != 0:
    _destroy(frame, error)
    return False
  return True


@njit(cache=True)
def block_rows(rows, n):
  """Rows per block for rows of ``n`` entries: at least :data:`BLOCK_ENTRIES` entries,
  in whole :data:`ROW_ALIGN` groups of rows for rows of up to :data:`ALIGNED_ROW`
  entries (the same whatever the threads)."""
  wanted = (BLOCK_ENTRIES + max(n, 1) - 1) // max(n, 1)
  if n > ALIGNED_ROW:
    return wanted
  return max((wanted + ROW_ALIGN - 1) // ROW_ALIGN, 1) * ROW_ALIGN


@njit(cache=True)
def thread_limit():
  """The run-time limit of :func:`set_limit` (0 where it is not registered)."""
  at = _control_address()
  return atomic_load(at + 8 * _LIMIT) if at != 0 else 0


@njit(cache=True)
def _count(which):
  at = _control_address()
  if at != 0:
    fetch_add(at + 8 * which, 1)


@njit(cache=True)
def start(frame, rows, block, task):
  """The shared state of a threaded call of ``rows`` rows in blocks of ``block``, with
  its helpers scheduled; 0 where the call is to run serially."""
  blocks = (rows + block - 1) // block
  if blocks < 2 or task == 0:
    return 0
  wanted = thread_limit()
  if wanted == 1:
    return 0
  threads = pool_threads(frame)
  if wanted > 1:
    threads = min(threads, wanted)
  threads = min(threads, blocks, MAX_THREADS)
  if threads < 2:
    return 0
  state = _malloc(8 * _STATE_WORDS)
  if state == 0:
    return 0
  abi.store64(state + 8 * _REFS, threads)
  abi.store64(state + 8 * _NEXT, 0)
  abi.store64(state + 8 * _DONE, 0)
  abi.store64(state + 8 * _TOTAL, blocks)
  abi.store64(state + 8 * _FRAME, abi.address(frame))
  abi.store64(state + 8 * _STATUS, 0)
  abi.store64(state + 8 * _BLOCK, block)
  abi.store64(state + 8 * _ROWS, rows)
  _count(_THREADED_CALLS)
  for _ in range(threads - 1):
    if not _schedule(frame, task, state):
      fetch_add(state + 8 * _REFS, -1)  # nobody will: this reference is the caller's
  return state


@njit(cache=True)
def claim(state):
  """The next block's rows ``(r0, r1)``, or ``(0, 0)`` when every block is taken."""
  b = fetch_add(state + 8 * _NEXT, 1)
  total = abi.load64(state + 8 * _TOTAL)
  if b >= total:
    return 0, 0
  block = abi.load64(state + 8 * _BLOCK)
  return b * block, min((b + 1) * block, abi.load64(state + 8 * _ROWS))


@njit(cache=True)
def finished(state, status):
  """Records one block done (with its ``status``: nonzero is a failure)."""
  if status != 0:
    fetch_add(state + 8 * _STATUS, 1)
  fetch_add(state + 8 * _DONE, 1)


@intrinsic
def _as_pointer(typingctx, addr):
  def codegen(context, builder, signature, args):
    return builder.inttoptr(args[0], _I8P)
  return types.voidptr(types.int64), codegen


@njit(cache=True)
def frame_of(state):
  """The call frame (to read only while holding a block of it)."""
  return _as_pointer(abi.load64(state + 8 * _FRAME))


@njit(cache=True)
def release(state):
  """Drops one reference to the state; the last one frees it."""
  if fetch_add(state + 8 * _REFS, -1) == 1:
    _free(state)


@njit(cache=True)
def finish(state):
  """The caller's end of a threaded call: waits for every block, releases the state
  and returns the number of failed blocks."""
  total = abi.load64(state + 8 * _TOTAL)
  spins = 0
  while atomic_load(state + 8 * _DONE) < total:
    spins += 1
    if spins < SPINS:  # the blocks left are short: spin (a yield can lose a time slice)
      _pause()
    else:
      _yield()
  failed = atomic_load(state + 8 * _STATUS)
  release(state)
  return failed


# -- the drivers: ``body(frame, r0, r1, sample, rule)`` runs rows r0 .. r1 - 1 of the
#    call and returns its status (0: done) --------------------------------------------
@njit(inline="always", cache=True)
def run_rows(frame, rows, n, task, body, sample, rule):
  """Every row of the call, in blocks over XLA's threads where there are enough rows
  (``task``: the handler's task address, :func:`external_task`); the status."""
  block = block_rows(rows, n)
  state = start(frame, rows, block, task)
  if state == 0:
    status = 0
    for r0 in range(0, rows, block):
      status |= body(frame, r0, min(r0 + block, rows), sample, rule)
    return status
  while True:
    r0, r1 = claim(state)
    if r1 <= r0:
      break
    finished(state, body(frame, r0, r1, sample, rule))
  return finish(state)


@njit(inline="always", cache=True)
def serve(data, body, sample, rule):
  """A helper task's loop (``data``: the shared state): blocks until none is left."""
  state = abi.address(data)
  while True:
    r0, r1 = claim(state)
    if r1 <= r0:
      break
    _count(_HELPER_BLOCKS)
    finished(state, body(frame_of(state), r0, r1, sample, rule))
  release(state)
