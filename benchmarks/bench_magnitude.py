#!/usr/bin/env python
"""Benchmark: soft top-k in magnitude (forward + backward) against the hard one (forward).

In each cell (a batch x n float32 array, standard normal, fixed seed, a k and a strength
l) it times under ``jax.jit``

* ``hard fwd``: ``lax.top_k(abs(x))`` and a scatter of ``x`` at those indices into
  zeros (the hard top-k in magnitude a user would otherwise write), forward only;
* ``soft <solver>``: ``jax.grad(lambda x: sum(soft_topk_mag(x, k,
  regularization_strength=l, solver=solver) * w))`` (p = 4/3) for a fixed random
  cotangent ``w``, for solver in {threshold, native}.

Every contender is compiled and warmed up first; the timed calls are interleaved (round
r calls every contender once, starting at the r-th: the order rotates), each ending
with ``block_until_ready``.
Reported: the median (and min, max) of ``--repeats`` calls (default 11) and the ratio
to the hard forward of the same cell; ``os.getloadavg()`` before and after.

Usage::

    python benchmarks/bench_magnitude.py              # the four cells, ~30 s on 2 cores
    python benchmarks/bench_magnitude.py --cells 0,1 --repeats 21
"""

from __future__ import annotations

import argparse
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk as itk
import _timing  # noqa: E402  (the scripts' folder is on sys.path)

CELLS = ((16384, 64, 2, 0.5), (64, 1000, 10, 0.1), (1, 10000, 100, 0.1), (64, 10000, 2, 0.1))
SOLVERS = ("threshold", "native")


def hard_topk_mag(x, k):
  """The hard top-k in magnitude: ``x`` at the k largest ``|x_i|`` of each row, else 0."""
  _, index = jax.lax.top_k(jnp.abs(x), k)
  kept = jnp.take_along_axis(x, index, axis=-1)
  rows = jnp.arange(x.shape[0])[:, None]
  return jnp.zeros_like(x).at[rows, index].set(kept)


def contenders(k, l, w):
  """name -> jitted function of x."""
  out = {"hard fwd": jax.jit(lambda x: hard_topk_mag(x, k))}
  for solver in SOLVERS:
    loss = lambda x, s=solver: jnp.sum(
        itk.soft_topk_mag(x, k, regularization_strength=l, solver=s) * w)
    out[f"soft {solver}"] = jax.jit(jax.grad(loss))
  return out


def time_cell(batch, n, k, l, repeats):
  """Median, min and max seconds per contender, interleaved."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(batch, n)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(batch, n)), jnp.float32)
  return _timing.interleaved(contenders(k, l, w), x, repeats)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cells", default=",".join(str(i) for i in range(len(CELLS))),
                      help="indices into CELLS, comma-separated")
  parser.add_argument("--repeats", type=int, default=11)
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.default_backend()} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores); float32, p = 4/3; median of {args.repeats}, interleaved")
  print(f"loadavg at start: {os.getloadavg()}")
  print(f"| cell (batch x n, k, l) | hard fwd ms | soft threshold ms (ratio) | "
        f"soft native ms (ratio) | native speed-up |")
  print("|---|---|---|---|---|")
  for index in (int(i) for i in args.cells.split(",")):
    batch, n, k, l = CELLS[index]
    result = time_cell(batch, n, k, l, args.repeats)
    hard = result["hard fwd"][0]
    threshold, native = result["soft threshold"][0], result["soft native"][0]
    print(f"| {batch}x{n}, k={k}, l={l} | {1e3 * hard:.3f} | {1e3 * threshold:.3f} "
          f"({threshold / hard:.1f}x) | {1e3 * native:.3f} ({native / hard:.1f}x) | "
          f"{threshold / native:.1f}x |", flush=True)
  print(f"loadavg at end: {os.getloadavg()}")


if __name__ == "__main__":
  main()
