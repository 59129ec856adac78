#!/usr/bin/env python
"""Implicit vs unrolled differentiation of an iterative top-k solver, measured.

For the soft top-k mask with ``p = 2`` (``y = clip((x - lam)/l, 0, 1)``, ``sum y = k``)
and two iterative solvers, Dykstra (``solver="dykstra"``: sweeps of alternating pair
projections) and the safeguarded Newton threshold solver (``solver="threshold"``), and
an iteration budget ``T`` (sweeps or Newton passes), this script measures

(a) the forward error ``max |y_T - y*|`` against the exact PAV solution;
(b) the error of the gradient of ``sum(w * y)`` w.r.t. ``x`` against the exact gradient
    (PAV + implicit differentiation), as cosine similarity and relative L2 error, for
    * implicit: the implicit function theorem at the solver's ``T``-iteration output
      (``diff="implicit"``, ``maxiter=T``), and
    * unrolled: reverse-mode autodiff through exactly ``T`` iterations
      (``diff="unrolled"``, ``maxiter=T``);
(c) the backward (value-and-grad) wall time, median of repeats after warm-up, and its
    memory: XLA's buffer assignment for the compiled function
    (``compiled.memory_analysis().temp_size_in_bytes``, the scratch memory it needs on
    top of its inputs and outputs), so the figure is measured, not estimated.

Outputs ``<out>/implicit_vs_unrolled.{json,md,png}``.

Usage::

    python examples/implicit_vs_unrolled.py            # n in {1e2, 1e3, 1e4}, T in 1..1000
    python examples/implicit_vs_unrolled.py --quick    # seconds, for the tests
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

jax.config.update("jax_enable_x64", True)

import implicit_topk as itk  # noqa: E402

BUDGETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
SIZES = (100, 1000, 10000)
SOLVERS = ("dykstra", "threshold")
MODES = ("implicit", "unrolled")


def problem(n, batch, seed):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(batch, n)))
  w = jnp.asarray(rng.normal(size=(batch, n)))
  return x, w, n / 10 + 0.5, 0.3


def mask_fn(solver, mode, budget, k, l):
  options = dict(solver=solver, diff=mode, maxiter=budget)
  if solver == "dykstra":
    options["tol"] = 0.0  # exactly `budget` sweeps in both modes
  return lambda x: itk.soft_topk_mask(x, k, regularization_strength=l, p=2.0, **options)


def timed(fn, args, repeats):
  jax.block_until_ready(fn(*args))  # warm-up (compiled already)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def gradient_errors(g, g_star):
  g, g_star = np.ravel(g), np.ravel(g_star)
  norm = np.linalg.norm(g) * np.linalg.norm(g_star)
  cosine = float(g @ g_star / norm) if norm > 0 else float("nan")
  rel_l2 = float(np.linalg.norm(g - g_star) / np.linalg.norm(g_star))
  return cosine, rel_l2


def measure(n, budget, solver, mode, batch, repeats, seed):
  x, w, k, l = problem(n, batch, seed)
  y_star = itk.soft_topk_mask(x, k, regularization_strength=l, p=2.0, solver="pav")
  g_star = jax.grad(lambda x: jnp.sum(w * itk.soft_topk_mask(x, k, regularization_strength=l, p=2.0, solver="pav")))(x)
  forward = mask_fn(solver, mode, budget, k, l)
  value_and_grad = jax.jit(jax.value_and_grad(lambda x: jnp.sum(w * forward(x))))
  compiled = value_and_grad.lower(x).compile()
  memory = compiled.memory_analysis()
  _, g = compiled(x)
  cosine, rel_l2 = gradient_errors(g, g_star)
  return {
      "n": n, "budget": budget, "solver": solver, "mode": mode, "batch": batch,
      "forward_error": float(jnp.max(jnp.abs(jax.jit(forward)(x) - y_star))),
      "grad_cosine": cosine, "grad_rel_l2": rel_l2,
      "backward_s": timed(compiled, (x,), repeats),
      "temp_bytes": int(memory.temp_size_in_bytes) if memory is not None else None,
  }


def markdown(records):
  lines = ["| solver | n | T | forward err | implicit: cos / rel L2 | unrolled: cos / rel L2 "
           "| implicit: time / memory | unrolled: time / memory |",
           "|:--|--:|--:|--:|--:|--:|--:|--:|"]
  by_key = {(r["solver"], r["n"], r["budget"], r["mode"]): r for r in records}
  for solver in SOLVERS:
    for n in sorted({r["n"] for r in records}):
      for budget in sorted({r["budget"] for r in records}):
        imp, unr = by_key.get((solver, n, budget, "implicit")), by_key.get((solver, n, budget, "unrolled"))
        if imp is None or unr is None:
          continue
        cell = lambda r: f"{r['grad_cosine']:.4f} / {r['grad_rel_l2']:.1e}"
        cost = lambda r: f"{1e3 * r['backward_s']:.2f} ms / {r['temp_bytes'] / 2**20:.2f} MiB"
        lines.append(f"| {solver} | {n:.0e} | {budget} | {imp['forward_error']:.1e} | {cell(imp)} "
                     f"| {cell(unr)} | {cost(imp)} | {cost(unr)} |")
  return "\n".join(lines) + "\n"


def plot(records, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = (("forward_error", "forward error max|y_T - y*|"),
            ("grad_rel_l2", "gradient rel. L2 error"),
            ("backward_s", "value+grad time (s)"),
            ("temp_bytes", "XLA temp memory (bytes)"))
  fig, axes = plt.subplots(len(SOLVERS), len(panels), figsize=(17, 7), squeeze=False)
  for row, solver in enumerate(SOLVERS):
    for col, (key, label) in enumerate(panels):
      ax = axes[row, col]
      for n in sorted({r["n"] for r in records}):
        for mode, style in zip(MODES, ("-", "--")):
          pts = sorted((r["budget"], r[key]) for r in records
                       if r["solver"] == solver and r["n"] == n and r["mode"] == mode)
          if not pts or (key == "forward_error" and mode == "unrolled"):
            continue
          budgets, values = zip(*pts)
          values = np.maximum(np.asarray(values, float), 1e-17)
          ax.loglog(budgets, values, style, marker="o", ms=3,
                    label=f"n={n:.0e}" + ("" if key == "forward_error" else f" {mode}"))
      ax.set_title(f"{solver}: {label}", fontsize=9)
      ax.set_xlabel("iterations T")
      ax.grid(True, which="both", alpha=0.3)
      if row == 0 and col in (0, 1):
        ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="n=100, T in {1, 10, 100}: seconds")
  ap.add_argument("--sizes", default=None, help="comma-separated n (default 100,1000,10000)")
  ap.add_argument("--budgets", default=None, help="comma-separated T (default 1..1000)")
  ap.add_argument("--batch", type=int, default=2, help="rows per problem")
  ap.add_argument("--repeats", type=int, default=5, help="timed calls per cell (median)")
  ap.add_argument("--out", default=os.path.join("examples", "results"))
  opts = ap.parse_args(argv)
  sizes = (100,) if opts.quick else SIZES
  budgets = (1, 10, 100) if opts.quick else BUDGETS
  if opts.sizes:
    sizes = tuple(int(float(s)) for s in opts.sizes.split(","))
  if opts.budgets:
    budgets = tuple(int(s) for s in opts.budgets.split(","))
  repeats = 1 if opts.quick else opts.repeats
  records = []
  for n in sizes:
    for solver in SOLVERS:
      for budget in budgets:
        for mode in MODES:
          r = measure(n, budget, solver, mode, opts.batch, repeats, seed=n)
          records.append(r)
          print(f"{solver:9s} n={n:<6d} T={budget:<5d} {mode:9s} fwd_err={r['forward_error']:.1e} "
                f"cos={r['grad_cosine']:.4f} relL2={r['grad_rel_l2']:.1e} "
                f"t={1e3 * r['backward_s']:.2f}ms mem={r['temp_bytes'] / 2**20:.2f}MiB", flush=True)
  os.makedirs(opts.out, exist_ok=True)
  stem = os.path.join(opts.out, "implicit_vs_unrolled" + ("_quick" if opts.quick else ""))
  meta = {"backend": jax.default_backend(), "jax": jax.__version__, "device": str(jax.devices()[0]),
          "dtype": "float64", "k": "n/10 + 0.5", "l": 0.3, "p": 2.0, "batch": opts.batch}
  with open(stem + ".json", "w") as f:
    json.dump({"meta": meta, "records": records}, f, indent=1)
  with open(stem + ".md", "w") as f:
    f.write(f"Backend {meta['backend']} ({meta['device']}), float64, batch {opts.batch}, "
            f"k = n/10 + 0.5, l = 0.3, p = 2. Memory: XLA temp buffer of the compiled "
            f"value-and-grad.\n\n" + markdown(records))
  plot(records, stem + ".png")
  print(f"wrote {stem}.json, .md, .png")
  return records


if __name__ == "__main__":
  main()
