"""Interleaved timing shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import jax

#: In graph: ``z <- z + CHAIN_STEP * op(z)`` links the chained calls (small, so that the
#: chain's input stays in the cell's range).
CHAIN_STEP = 1e-3


#: In graph: cells up to this many entries are chained the full length, larger ones
#: proportionally fewer times, at least ``MIN_CHAIN``.
CHAIN_ELEMENTS = 1e6
MIN_CHAIN = 5


def chain_length(size: int, chain: int) -> int:
  """How many times an op on ``size`` entries is chained in one jit: ``chain`` up to
  ``CHAIN_ELEMENTS`` entries, proportionally fewer above, at least ``MIN_CHAIN`` unless
  ``chain`` itself is smaller."""
  return min(chain, max(MIN_CHAIN, int(chain * CHAIN_ELEMENTS / size))) if size else chain


def chained(op, chain: int):
  """``x -> z_chain`` with ``z_0 = x``, ``z_(i+1) = z_i + CHAIN_STEP * op(z_i)``: the op
  chained ``chain`` times in one ``lax.fori_loop``, as a jitted training step calls it
  (each call's input depends on the previous output, so none is skipped or hoisted)."""
  return lambda x: jax.lax.fori_loop(0, chain, lambda _, z: z + CHAIN_STEP * op(z), x)


def interleaved(fns: dict, x, repeats: int) -> dict:
  """Median, min and max seconds of each ``fns[name](x)``: every function compiled and
  warmed up first, then ``repeats`` rounds that call each once, each call ending with
  ``block_until_ready``. Round ``r`` starts at the ``r``-th function (the order rotates),
  so each follows every other equally often: on CPU a call right after another
  contender's ran up to 0.3 ms slower (16,384 x 8 soft mask: 0.63 ms after the budgeted
  one, 0.91 ms after the hard top-k; after a pause of 2 ms or more, about half speed
  too), which a fixed order charged to one contender."""
  for fn in fns.values():
    jax.block_until_ready(fn(x))
    jax.block_until_ready(fn(x))
  times: dict = {name: [] for name in fns}
  order = list(fns.items())
  for round_ in range(repeats):
    start_at = round_ % len(order)
    for name, fn in order[start_at:] + order[:start_at]:
      start = time.perf_counter()
      jax.block_until_ready(fn(x))
      times[name].append(time.perf_counter() - start)
  return {name: (statistics.median(t), min(t), max(t)) for name, t in times.items()}
