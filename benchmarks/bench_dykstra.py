#!/usr/bin/env python
"""``soft_topk_mask(..., solver="dykstra")`` forward+backward against the hard mask.

Times, for float32 rows of standard normal scores, ``k`` and ``p = 2``, strength 1:

* ``hard``: ``implicit_topk.hard_topk_mask`` (``lax.top_k`` + a scatter), forward, under
  ``jax.jit``: the bar the issue sets (within 20x at 1 x 1e3, k = 10);
* ``dykstra``: ``jax.jit(jax.value_and_grad)`` of ``sum(w * soft_topk_mask(x, k,
  solver="dykstra"))``, implicit derivatives, default ``tol`` / ``maxiter``;

interleaved (one call of each per round, so load changes hit both alike), median of
``--repeats`` rounds after warm-up, with the sweeps Dykstra made (``return_info``'s
``iter_num``, max over rows) and its certified residual. Prints ``os.getloadavg()``
before and after: on a shared machine compare the ratio, not the absolute times.

Usage::

    python benchmarks/bench_dykstra.py                       # 1x1000, k = 10
    python benchmarks/bench_dykstra.py --cells 1x1000 64x1000 --k 10 --repeats 21
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk as itk


def _cell(text):
  rows, n = text.lower().split("x")
  return int(rows), int(float(n))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cells", nargs="+", default=["1x1000"], type=_cell)
  parser.add_argument("--k", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=21)
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; load {os.getloadavg()}")
  for rows, n in args.cells:
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, n), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (rows, n), jnp.float32)
    hard = jax.jit(lambda x: itk.hard_topk_mask(x, args.k))
    loss = lambda x: jnp.sum(w * itk.soft_topk_mask(x, args.k, p=2.0, solver="dykstra"))
    dykstra = jax.jit(jax.value_and_grad(loss))
    contenders = {"hard fwd": hard, "dykstra fwd+bwd": dykstra}
    for fn in contenders.values():
      jax.block_until_ready(fn(x))
    times = {name: [] for name in contenders}
    for _ in range(args.repeats):
      for name, fn in contenders.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times[name].append(time.perf_counter() - start)
    _, info = itk.soft_topk_mask(x, args.k, p=2.0, solver="dykstra", return_info=True)
    median = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
    ratio = median["dykstra fwd+bwd"] / median["hard fwd"]
    print(f"{rows}x{n} k={args.k}: hard fwd {median['hard fwd']:.3f} ms, dykstra fwd+bwd "
          f"{median['dykstra fwd+bwd']:.3f} ms ({ratio:.1f}x); sweeps "
          f"{int(jnp.max(info.iter_num))}, residual {float(jnp.max(info.residual)):.2e}; "
          f"load {os.getloadavg()}", flush=True)


if __name__ == "__main__":
  main()
