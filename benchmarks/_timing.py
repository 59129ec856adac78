"""Interleaved timing shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import jax


def interleaved(fns: dict, x, repeats: int) -> dict:
  """Median, min and max seconds of each ``fns[name](x)``: every function compiled and
  warmed up first, then ``repeats`` rounds that call each once (in a fixed order), each
  call ending with ``block_until_ready``."""
  for fn in fns.values():
    jax.block_until_ready(fn(x))
    jax.block_until_ready(fn(x))
  times: dict = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(x))
      times[name].append(time.perf_counter() - start)
  return {name: (statistics.median(t), min(t), max(t)) for name, t in times.items()}
