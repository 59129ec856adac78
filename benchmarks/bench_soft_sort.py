#!/usr/bin/env python
"""Soft top-k values (soft sort restricted to the k largest): ours vs ott-jax, CPU or GPU.

Times forward+backward (the gradient of ``sum(w * values)``) under ``jit``, after
warm-up, median of repeats, float32, batch ``b``, ``k = n / 100``, for

* ``implicit_topk.soft_topk_values`` (permutahedron LP, PAV + implicit derivatives,
  ``p = 2``, ``l = 1``): O(n log n) time, O(n) memory;
* ``ott.tools.soft_sort.sort(x, topk=k)`` (entropic optimal transport between the
  values and k + 1 target bins, Sinkhorn), differentiated by unrolling
  (``implicit_diff=None``: its implicit differentiation fails on current jax/lineax).

A cell that fails (out of memory, or beyond ``--timeout-s``) is reported as such.

Usage::

    python benchmarks/bench_soft_sort.py                     # n in 1e3..1e6, b = 64 (1 at 1e6)
    python benchmarks/bench_soft_sort.py --sizes 1e4 --batches 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def ours(n, k):
  import implicit_topk as itk

  return lambda x: itk.soft_topk_values(x, k, l=1.0, p=2.0)


def ott(n, k):
  from ott.tools import soft_sort

  def run(x):
    return jax.vmap(lambda row: soft_sort.sort(row, topk=k, implicit_diff=None))(x)

  return run


METHODS = {"implicit_topk soft_topk_values": ours, "ott-jax soft_sort.sort(topk)": ott}


def time_cell(fn, x, w, repeats):
  value_and_grad = jax.jit(jax.value_and_grad(lambda x: jnp.sum(w[..., :fn(x).shape[-1]] * fn(x))))
  jax.block_until_ready(value_and_grad(x))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(value_and_grad(x))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--sizes", default="1e3,1e4,1e5,1e6")
  ap.add_argument("--batches", default="64")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
  opts = ap.parse_args(argv)
  records = []
  for n in (int(float(s)) for s in opts.sizes.split(",")):
    for b in (int(s) for s in opts.batches.split(",")):
      b = 1 if n >= 10**6 else b
      k = max(1, n // 100)
      rng = np.random.default_rng(0)
      x = jnp.asarray(rng.normal(size=(b, n)), jnp.float32)
      w = jnp.asarray(rng.normal(size=(b, n)), jnp.float32)
      for name, build in METHODS.items():
        try:
          seconds = time_cell(build(n, k), x, w, opts.repeats)
          status = f"{1e3 * seconds:.1f} ms"
        except Exception as exc:  # noqa: BLE001 (out of memory is reported, not fatal)
          seconds, status = None, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        records.append({"method": name, "n": n, "batch": b, "k": k, "seconds": seconds,
                        "status": status})
        print(f"n={n:>8d} b={b:>3d} {name:>32s}: {status}", flush=True)
  os.makedirs(opts.out, exist_ok=True)
  path = os.path.join(opts.out, f"soft_sort_{jax.default_backend()}.json")
  with open(path, "w") as f:
    json.dump({"backend": jax.default_backend(), "device": str(jax.devices()[0]),
               "records": records}, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
