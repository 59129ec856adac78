#!/usr/bin/env python
"""Benchmark: the cost of ``max_support`` on the default soft top-k mask (CPU or GPU).

In each router cell (a batch x n float32 array, standard normal, fixed seed; k, the
budget m, the strength l and whether it is relative to each row's spread,
``standardize``) it times under ``jax.jit``

* ``hard fwd``: ``lax.top_k`` and a scatter of ones (the hard mask), forward only;
* ``soft``: ``jax.grad(lambda x: sum(soft_topk_mask(x, k, regularization_strength=l) * w))``
  (the default solver, p = 4/3) for a fixed random cotangent ``w``;
* ``soft + max_support``: the same with ``max_support=m`` (one ``lax.top_k`` of m+1
  values and two small problems on them; no solver kernel).

Contenders are compiled and warmed up first; the timed calls are interleaved (round r
calls every contender once), each ending with ``block_until_ready``. Reported: the
median (min, max) of ``--repeats`` calls (default 11), the ratios to the hard forward
and of the budgeted call to the plain one; ``os.getloadavg()`` before and after. With
``--json FILE`` the figures are also written there.

Usage::

    python benchmarks/bench_support_budget.py                    # the router cells
    python benchmarks/bench_support_budget.py --repeats 21 --json benchmarks/results/cpu_support_budget.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk as itk
import _timing  # noqa: E402  (the scripts' folder is on sys.path)

# (batch, n, k, m, l, standardize): the router cells with a budget one or two above k; at
# l = 1 nearly every row binds (the mask at l* < l), in the README recipe (standardize,
# l = 0.5) a quarter of them, at l = 0.05 almost none (0.2%).
CELLS = ((16384, 8, 2, 3, 1.0, False), (16384, 64, 2, 4, 1.0, False),
         (16384, 256, 8, 12, 1.0, False), (64, 1000, 10, 16, 0.1, False),
         (16384, 8, 2, 3, 0.5, True), (16384, 64, 2, 4, 0.05, False))


def hard_mask(x, k):
  """The hard top-k mask: ones at the k largest entries of each row."""
  _, index = jax.lax.top_k(x, k)
  rows = jnp.arange(x.shape[0])[:, None]
  return jnp.zeros_like(x).at[rows, index].set(1.0)


def contenders(k, m, l, standardize, w):
  """name -> jitted function of x."""
  soft = lambda budget: jax.jit(jax.grad(lambda x: jnp.sum(
      itk.soft_topk_mask(x, float(k), regularization_strength=l, max_support=budget,
                         standardize=standardize) * w)))
  return {"hard fwd": jax.jit(lambda x: hard_mask(x, k)), "soft": soft(None),
          "soft + max_support": soft(m)}


def time_cell(batch, n, k, m, l, standardize, repeats):
  """Median, min and max seconds per contender, interleaved."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(batch, n)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(batch, n)), jnp.float32)
  return _timing.interleaved(contenders(k, m, l, standardize, w), x, repeats)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cells", default=",".join(str(i) for i in range(len(CELLS))),
                      help="comma-separated indices into CELLS")
  parser.add_argument("--repeats", type=int, default=11)
  parser.add_argument("--json", default=None, help="also write the figures to this file")
  opts = parser.parse_args()
  load_start = os.getloadavg()
  print(f"# {platform.node()} {jax.default_backend()} jax {jax.__version__}, "
        f"load average {load_start[0]:.2f}")
  print("| cell | hard fwd | soft fwd+bwd | + max_support | soft / hard | budgeted / hard "
        "| budgeted / soft |")
  print("|---|---|---|---|---|---|---|")
  records = []
  for index in (int(i) for i in opts.cells.split(",")):
    batch, n, k, m, l, standardize = CELLS[index]
    t = time_cell(batch, n, k, m, l, standardize, opts.repeats)
    hard, soft, budget = (t[name][0] for name in ("hard fwd", "soft", "soft + max_support"))
    label = f"l={l}{' std' if standardize else ''}"
    print(f"| {batch}x{n} k={k} m={m} {label} | {hard * 1e3:.3f} ms | {soft * 1e3:.3f} ms | "
          f"{budget * 1e3:.3f} ms | {soft / hard:.2f}x | {budget / hard:.2f}x | "
          f"{budget / soft:.2f}x |")
    records.append({"batch": batch, "n": n, "k": k, "max_support": m, "l": l,
                    "standardize": standardize,
                    "seconds": {name: list(v) for name, v in t.items()}})
  load_end = os.getloadavg()
  print(f"load average before {load_start[0]:.2f}, after {load_end[0]:.2f}")
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump({"backend": jax.default_backend(), "jax": jax.__version__,
                 "repeats": opts.repeats, "loadavg": [load_start[0], load_end[0]],
                 "cells": records}, f, indent=1)


if __name__ == "__main__":
  main()
