#!/usr/bin/env python
"""Benchmark: the cost of ``max_support`` on the default soft top-k mask (CPU or GPU).

In each router cell (a batch x n float32 array, standard normal, fixed seed; k, the
budget m, the strength l and whether it is relative to each row's spread,
``standardize``) it times under ``jax.jit``

* ``hard fwd``: ``lax.top_k`` and a scatter of ones (the hard mask), forward only;
* ``soft``: ``jax.grad(lambda x: sum(soft_topk_mask(x, k, regularization_strength=l) * w))``
  (the default solver, p = 4/3) for a fixed random cotangent ``w``;
* ``soft + max_support``: the same with ``max_support=m`` (on CPU the budget's kernel,
  :mod:`implicit_topk.kernels.cpu.budget_kernel`: one pass over each row for its m+1
  largest values, two small problems on them, a pass that writes the mask; the
  derivatives in the mask derivative kernels);
* ``soft + max_support (JAX path)``: the same on the pure-JAX path that other platforms
  run (the m+1 largest values by masked maxima or ``lax.top_k``), compiled with the
  kernel switched off (``--no-jax-path`` leaves it out).

Two modes (``--mode``): ``percall`` times one jitted call from Python; ``ingraph`` the
op as a model's jitted step pays it, chained N times inside one jit (``lax.fori_loop``,
``z <- z + 1e-3 op(z)``; N = ``--chain``, default 50, for cells up to 1e6 entries and
proportionally fewer above, at least 5), the time divided by N. On a 2-core CPU a call
from Python after a pause runs up to twice slower (``_timing.interleaved``); in graph the
calls follow each other as in training.

Contenders are compiled (ahead of time) and warmed up first; the timed calls are
interleaved (round r calls every contender once, starting at the r-th: the order
rotates), each ending with ``block_until_ready``. Reported: the
median (min, max) of ``--repeats`` calls (default 11), the ratios to the hard forward
and of the budgeted call to the plain one; ``os.getloadavg()`` before and after. With
``--json FILE`` the figures are also written there.

Usage::

    python benchmarks/bench_support_budget.py                    # the router cells
    python benchmarks/bench_support_budget.py --repeats 21 --json benchmarks/results/cpu_support_budget.json
    python benchmarks/bench_support_budget.py --mode ingraph --repeats 21 --json benchmarks/results/cpu_support_budget_ingraph.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk as itk
from implicit_topk import support_budget
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


def _compiled(fn, x, chain=None, kernel=True):
  """``fn`` compiled for ``x`` (with ``chain``: chained that many times in one jit);
  ``kernel=False``: with the budget's CPU kernel switched off (the JAX path; the caches
  are cleared so that no earlier trace is reused)."""
  jax.clear_caches()
  fn = fn if chain is None else _timing.chained(fn, chain)
  with mock.patch.object(support_budget, "kernel_applies",
                         support_budget.kernel_applies if kernel else lambda *a: False):
    return jax.jit(fn).lower(x).compile()


def contenders(k, m, l, standardize, w, x, jax_path=True, chain=None):
  """name -> compiled function of x (each op chained ``chain`` times where given)."""
  soft = lambda budget: jax.grad(lambda z: jnp.sum(
      itk.soft_topk_mask(z, float(k), regularization_strength=l, max_support=budget,
                         standardize=standardize) * w))
  fns = {"hard fwd": _compiled(lambda z: hard_mask(z, k), x, chain),
         "soft": _compiled(soft(None), x, chain),
         "soft + max_support": _compiled(soft(m), x, chain)}
  if jax_path:
    fns["soft + max_support (JAX path)"] = _compiled(soft(m), x, chain, kernel=False)
  return fns


def time_cell(batch, n, k, m, l, standardize, repeats, jax_path=True, chain=None):
  """Median, min and max seconds per contender (per op in a chain), interleaved."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(batch, n)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(batch, n)), jnp.float32)
  times = _timing.interleaved(contenders(k, m, l, standardize, w, x, jax_path, chain), x,
                              repeats)
  per_op = 1.0 / (chain or 1)
  return {name: tuple(t * per_op for t in v) for name, v in times.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cells", default=",".join(str(i) for i in range(len(CELLS))),
                      help="comma-separated indices into CELLS")
  parser.add_argument("--repeats", type=int, default=11)
  parser.add_argument("--json", default=None, help="also write the figures to this file")
  parser.add_argument("--no-jax-path", action="store_true",
                      help="leave out the budget's pure-JAX path")
  parser.add_argument("--mode", choices=("percall", "ingraph"), default="percall",
                      help="one jitted call per timing, or the op chained in one jit")
  parser.add_argument("--chain", type=int, default=50,
                      help="in graph: chain length for cells up to 1e6 entries")
  opts = parser.parse_args()
  load_start = os.getloadavg()
  print(f"# {platform.node()} {jax.default_backend()} jax {jax.__version__}, "
        f"{opts.mode}, load average {load_start[0]:.2f}")
  print("| cell | hard fwd | soft fwd+bwd | + max_support | soft / hard | budgeted / hard "
        "| budgeted / soft | JAX path / soft |")
  print("|---|---|---|---|---|---|---|---|")
  records = []
  for index in (int(i) for i in opts.cells.split(",")):
    batch, n, k, m, l, standardize = CELLS[index]
    chain = _timing.chain_length(batch * n, opts.chain) if opts.mode == "ingraph" else None
    t = time_cell(batch, n, k, m, l, standardize, opts.repeats, not opts.no_jax_path, chain)
    hard, soft, budget = (t[name][0] for name in ("hard fwd", "soft", "soft + max_support"))
    jax_path = t.get("soft + max_support (JAX path)")
    jax_ratio = f"{jax_path[0] / soft:.2f}x" if jax_path else "-"
    label = f"l={l}{' std' if standardize else ''}"
    print(f"| {batch}x{n} k={k} m={m} {label} | {hard * 1e3:.3f} ms | {soft * 1e3:.3f} ms | "
          f"{budget * 1e3:.3f} ms | {soft / hard:.2f}x | {budget / hard:.2f}x | "
          f"{budget / soft:.2f}x | {jax_ratio} |", flush=True)
    records.append({"batch": batch, "n": n, "k": k, "max_support": m, "l": l,
                    "standardize": standardize, "chain": chain,
                    "seconds": {name: list(v) for name, v in t.items()}})
  load_end = os.getloadavg()
  print(f"load average before {load_start[0]:.2f}, after {load_end[0]:.2f}")
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump({"backend": jax.default_backend(), "jax": jax.__version__,
                 "mode": opts.mode, "repeats": opts.repeats,
                 "loadavg": [load_start[0], load_end[0]],
                 "cells": records}, f, indent=1)


if __name__ == "__main__":
  main()
