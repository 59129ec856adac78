"""Interleaved timing shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import jax


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
