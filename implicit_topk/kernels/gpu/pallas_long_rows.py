r"""The fused kernel for rows too long to sit in one program's registers (4096 < n <= 65536).

One Pallas program per row. The row stays in memory (on a GPU: global memory, read
through L2, 256 KB for a float32 row of 65536) and every reduction the problem asks for
(:math:`\phi`, its derivatives, the bracket, the start, ``snap``, the residual) is a
``fori_loop`` over chunks of ``chunk`` entries, each chunk loaded with a dynamic slice of
the row. The iteration is the bounded one of
:mod:`implicit_topk.kernels.gpu.bounded_newton`, so the row is certified within
:func:`~implicit_topk.kernels.gpu.bounded_newton.pass_cap` passes, as in the block
kernel; the output is written chunk by chunk.

The problem's own code runs unchanged on :class:`_Chunks`, a layout whose "rows" are
lazy: ``map`` composes functions of the chunk index, reductions loop over the chunks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from implicit_topk.problems import layout as _layout

#: Entries per chunk of a long row (a power of two).
CHUNK = 2048
#: The longest row the chunked kernel takes (after padding to a power of two).
MAX_LONG_ROW = 1 << 16


@dataclasses.dataclass(frozen=True)
class _Lazy:
  """Entries of a row given chunk by chunk: ``fn(j)`` is chunk ``j``, ``(rows, chunk)``."""

  fn: Callable
  dtype: Any


def _at(value, j):
  return value.fn(j) if isinstance(value, _Lazy) else value


@dataclasses.dataclass(frozen=True, eq=False)
class _Chunks(_layout.LastAxis):
  """The last-axis layout over rows read in ``num_chunks`` chunks (inside a kernel)."""

  num_chunks: int = 1

  def dtype(self, x):
    return x.dtype

  def row_shape(self, x) -> tuple:
    raise NotImplementedError("per-row shapes come from k and l in the chunked kernel")

  def map(self, f: Callable, *entries):
    probe = jax.eval_shape(lambda: f(*[_at(e, 0) for e in entries]))
    return _Lazy(lambda j: f(*[_at(e, j) for e in entries]), probe.dtype)

  def expand(self, r, x):
    return jnp.asarray(r, x.dtype)[..., None]

  def _reduce(self, v, combine, reduce, init):
    first = reduce(_at(v, 0))
    body = lambda j, acc: combine(acc, reduce(_at(v, j)))
    del init
    return jax.lax.fori_loop(1, self.num_chunks, body, first)

  def sum(self, v):
    return self._reduce(v, jnp.add, lambda c: jnp.sum(c, axis=-1), 0)

  def max(self, v):
    return self._reduce(v, jnp.maximum, lambda c: jnp.max(c, axis=-1), None)

  def min(self, v):
    return self._reduce(v, jnp.minimum, lambda c: jnp.min(c, axis=-1), None)

  def count(self, v, dtype):
    return self.sum(self.map(lambda c: c.astype(dtype), v))

  def any(self, v):
    return self.count(v, jnp.int32) > 0


def lazy_row(ref, dtype, chunk: int):
  """Chunk ``j`` of the row block ``ref`` (``(1, n)``), in ``dtype``."""
  pl = _pallas()
  return _Lazy(lambda j: ref[:, pl.ds(j * chunk, chunk)].astype(dtype), dtype)


def write_row(ref, lazy, chunk: int, num_chunks: int) -> None:
  """Writes the lazy row ``lazy`` into the row block ``ref`` chunk by chunk."""
  pl = _pallas()

  def body(j, carry):
    ref[:, pl.ds(j * chunk, chunk)] = lazy.fn(j).astype(ref.dtype)
    return carry

  jax.lax.fori_loop(0, num_chunks, body, 0)


def _pallas():
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  return pl
