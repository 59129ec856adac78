#!/usr/bin/env python
"""Wall-clock benchmark of the soft top-k mask against the usual baselines.

For each problem size ``n`` and batch size ``b`` it times, under ``jax.jit`` and after
warm-up, the forward pass and the forward+backward pass (the gradient of
``sum(y * w)`` for a fixed random ``w``) of

* ``soft_topk_mask`` with ``solver="pav"`` and ``solver="threshold"``, ``p = 4/3`` and
  ``p = 2``, and ``solver="dykstra"`` (``p = 2``, ``tol = 1e-6``) (``l = 0.1``,
  ``k = max(1, n // 100)``, float32);
* the hard mask users would otherwise write: ``jax.lax.top_k`` + a scatter of ones
  (its gradient is zero, so the backward pass is timed on ``x * mask``);
* ``jnp.sort`` along the last axis (a lower bound for any sort-based method);
* ``jaxopt.projection.projection_box_section`` (the exact ``p = 2`` problem, the
  projection of ``x / l`` onto ``{0 <= y <= 1, sum(y) = k}``, solved by bisection with
  implicit differentiation), ``vmap``-ed over rows.

Each time is the median of repeated calls (``block_until_ready``), and is also reported
relative to the hard mask at the same ``(n, b)``. Results go to ``--out`` as
``<backend>.md`` (Markdown table), ``<backend>.json`` (raw numbers) and
``<backend>.png`` (fwd+bwd time vs n, log-log, one panel per batch size), where
``<backend>`` is ``jax.default_backend()``. See ``benchmarks/README.md``.

Usage::

    PYTHONPATH=. python benchmarks/bench_topk.py            # full grid
    PYTHONPATH=. python benchmarks/bench_topk.py --quick    # smoke run, < 1 minute
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp

L_REG = 0.1
DEFAULT_SIZES = (100, 1_000, 10_000, 100_000, 1_000_000)
DEFAULT_BATCHES = (1, 64)
QUICK_SIZES = (100, 10_000)
QUICK_BATCHES = (1, 8)
# Cells with more than this many elements are skipped unless --full-grid: by default
# that drops only (n=1e6, batch=64), which takes minutes and ~GBs on a small CPU box.
DEFAULT_MAX_ELEMENTS = 10_000_000
HARD = "hard (top_k+scatter)"
# Environment variables that change the timings; recorded when set.
ENV_VARS = ("NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY",
            "OMP_NUM_THREADS", "XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64",
            "CUDA_VISIBLE_DEVICES")


# ----------------------------------------------------------------------------------
# Methods. Each builder takes (n, k) and returns (forward, loss): forward(x) -> array,
# loss(x, w) -> scalar whose gradient in x is the "backward" that we time.
# ----------------------------------------------------------------------------------


def _hard_mask(x, k):
  """What users write without this library: lax.top_k + a scatter of ones."""
  _, idx = jax.lax.top_k(jax.lax.stop_gradient(x), k)
  return jnp.put_along_axis(jnp.zeros_like(x), idx, jnp.ones((), x.dtype), axis=-1,
                            inplace=False)


def build_hard(n, k):
  def forward(x):
    return _hard_mask(x, k)

  def loss(x, w):
    # The mask itself has zero gradient; x * mask has the usual straight-through-free
    # gradient (w * mask), so there is a backward pass to time.
    return jnp.sum(x * _hard_mask(x, k) * w)

  return forward, loss


def build_sort(n, k):
  def forward(x):
    return jnp.sort(x, axis=-1)

  def loss(x, w):
    return jnp.sum(jnp.sort(x, axis=-1) * w)

  return forward, loss


def make_soft_builder(solver, p, op="soft_topk_mask"):
  def build(n, k):
    import implicit_topk as itk

    def forward(x):
      return getattr(itk, op)(x, k, l=L_REG, p=p, solver=solver)

    def loss(x, w):
      return jnp.sum(forward(x) * w)

    return forward, loss

  return build


def build_jaxopt(n, k):
  from jaxopt.projection import projection_box_section

  def project_row(row):
    dtype = row.dtype
    hyper = (jnp.zeros(n, dtype), jnp.ones(n, dtype), jnp.ones(n, dtype),
             jnp.asarray(k, dtype))
    return projection_box_section(row / L_REG, hyper)

  def forward(x):
    flat = x.reshape(-1, n)
    return jax.vmap(project_row)(flat).reshape(x.shape)

  def loss(x, w):
    return jnp.sum(forward(x) * w)

  return forward, loss


METHODS = {
    HARD: build_hard,
    "jnp.sort": build_sort,
    "soft pav p=4/3": make_soft_builder("pav", 4.0 / 3.0),
    "soft pav p=2": make_soft_builder("pav", 2.0),
    "soft threshold p=4/3": make_soft_builder("threshold", 4.0 / 3.0),
    "soft threshold p=2": make_soft_builder("threshold", 2.0),
    "soft dykstra p=2 (tol 1e-6)": make_soft_builder("dykstra", 2.0),
    "soft mag pav p=4/3": make_soft_builder("pav", 4.0 / 3.0, "soft_topk_mag"),
    "soft mag threshold p=4/3": make_soft_builder("threshold", 4.0 / 3.0, "soft_topk_mag"),
    "jaxopt box_section p=2": build_jaxopt,
}
# Methods whose output is a mask summing to k along the last axis (sanity column).
MASK_METHODS = {m for m in METHODS if m != "jnp.sort" and "mag" not in m}
# Methods too slow for large cells: Dykstra needs thousands of sweeps when blocks are
# long (examples/implicit_vs_unrolled.py); skipped above this n x batch.
SLOW_METHODS = {"soft dykstra p=2 (tol 1e-6)": 1e5}
# --solvers selects among the soft solvers; the baselines always run.
SOLVER_OF = {
    "soft pav p=4/3": "pav", "soft pav p=2": "pav",
    "soft threshold p=4/3": "threshold", "soft threshold p=2": "threshold",
    "soft dykstra p=2 (tol 1e-6)": "dykstra",
    "soft mag pav p=4/3": "pav", "soft mag threshold p=4/3": "threshold",
}


# ----------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------


def _block(out):
  return jax.tree_util.tree_map(lambda a: a.block_until_ready(), out)


def time_fn(fn, args, *, max_repeats, min_repeats, budget_s):
  """Compiles + warms ``fn(*args)``; returns (median s, all samples, compile s, output).

  The number of timed calls is ``budget_s / (one call)`` clipped to
  ``[min_repeats, max_repeats]``, so slow cells (large n) use fewer repeats.
  """
  t0 = time.perf_counter()
  out = _block(fn(*args))  # compile + first run
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  _block(fn(*args))  # warm-up (caches, thread pools, numba dispatch)
  one = time.perf_counter() - t0
  reps = int(min(max_repeats, max(min_repeats, budget_s / max(one, 1e-9))))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    _block(fn(*args))
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples), samples, compile_s, out


def _short_error(exc):
  msg = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
  return msg if len(msg) <= 90 else msg[:87] + "..."


def run_cell(name, n, batch, k, x, w, opts):
  rec = {"method": name, "n": n, "batch": batch, "k": k}
  try:
    forward, loss = METHODS[name](n, k)
    fwd = jax.jit(forward)
    fwd_bwd = jax.jit(jax.value_and_grad(loss))
    kw = dict(max_repeats=opts.repeats, min_repeats=opts.min_repeats,
              budget_s=opts.cell_budget)
    t_f, s_f, c_f, y = time_fn(fwd, (x,), **kw)
    t_b, s_b, c_b, (_, g) = time_fn(fwd_bwd, (x, w), **kw)
    rec.update(fwd_s=t_f, fwd_bwd_s=t_b, fwd_samples=s_f, fwd_bwd_samples=s_b,
               compile_fwd_s=c_f, compile_fwd_bwd_s=c_b)
    y = np.asarray(y, np.float64)
    g = np.asarray(g, np.float64)
    rec["finite"] = bool(np.all(np.isfinite(y)) and np.all(np.isfinite(g)))
    if name in MASK_METHODS:
      rec["max_abs_sum_err"] = float(np.max(np.abs(y.sum(-1) - k)))
      rec["nnz_frac"] = float(np.mean(y > 0))
  except Exception as exc:  # record and keep going (e.g. the numba kernel is missing)
    rec["error"] = _short_error(exc)
    rec["traceback"] = traceback.format_exc()
  return rec


# ----------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------


def _fmt_ms(s):
  ms = s * 1e3
  if ms >= 100:
    return f"{ms:.0f}"
  if ms >= 10:
    return f"{ms:.1f}"
  if ms >= 1:
    return f"{ms:.2f}"
  return f"{ms:.3f}"


def _fmt_ratio(r):
  return f"{r:.0f}x" if r >= 100 else (f"{r:.1f}x" if r >= 10 else f"{r:.2f}x")


def _fmt_n(n):
  e = math.log10(n)
  return f"1e{int(round(e))}" if abs(e - round(e)) < 1e-9 else str(n)


def add_ratios(records):
  base = {(r["n"], r["batch"]): r for r in records if r["method"] == HARD and "error" not in r}
  for r in records:
    b = base.get((r["n"], r["batch"]))
    if b is not None and "error" not in r:
      r["fwd_ratio"] = r["fwd_s"] / b["fwd_s"]
      r["fwd_bwd_ratio"] = r["fwd_bwd_s"] / b["fwd_bwd_s"]


def markdown(records, meta):
  lines = [
      f"# implicit_topk benchmark — backend `{meta['backend']}`",
      "",
      f"- device: {meta['device']}; CPUs: {meta['cpu_count']}; {meta['platform']}",
      f"- jax {meta['jax']}, jaxlib {meta['jaxlib']}, jaxopt {meta['jaxopt']}, "
      f"numba {meta['numba']} (threads: {meta['numba_threads']}), numpy {meta['numpy']}, python {meta['python']}",
      f"- git: {meta['git']}; date: {meta['date']}; wall time {meta['total_s']:.0f} s; "
      f"1-min load average {meta['loadavg_1m_start']} at start, "
      f"{meta['loadavg_1m_end']} at end (other processes on the machine skew timings)",
      f"- command: `{meta['command']}`; environment: "
      + (", ".join(f"`{k}={v}`" for k, v in meta["env"].items()) or "no relevant variables set"),
      f"- float32, l = {L_REG}, k = max(1, n // 100); time = median over repeats after "
      f"warm-up, in ms; ratio = time / time of `{HARD}` at the same (n, batch).",
      f"- skipped cells (n x batch > {meta['max_elements']:g}): "
      f"{', '.join(meta['skipped']) or 'none'}",
      "",
      "| n | batch | k | method | fwd (ms) | fwd+bwd (ms) | fwd / hard | fwd+bwd / hard "
      "| max\\|Σy−k\\| | reps fwd/bwd |",
      "|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in records:
    head = f"| {_fmt_n(r['n'])} | {r['batch']} | {r['k']} | {r['method']} "
    if "error" in r:
      lines.append(head + f"| ERROR: {r['error']} | | | | | |")
      continue
    ratio_f = _fmt_ratio(r["fwd_ratio"]) if "fwd_ratio" in r else "—"
    ratio_b = _fmt_ratio(r["fwd_bwd_ratio"]) if "fwd_bwd_ratio" in r else "—"
    err = f"{r['max_abs_sum_err']:.1e}" if "max_abs_sum_err" in r else "—"
    if not r.get("finite", True):
      err += " (non-finite!)"
    lines.append(
        head + f"| {_fmt_ms(r['fwd_s'])} | {_fmt_ms(r['fwd_bwd_s'])} | {ratio_f} | "
        f"{ratio_b} | {err} | {len(r['fwd_samples'])}/{len(r['fwd_bwd_samples'])} |")

  # Compact summary: fwd+bwd ratio to the hard mask, one row per method.
  cells = sorted({(r["batch"], r["n"]) for r in records})
  methods = [m for m in METHODS if any(r["method"] == m for r in records)]
  by_key = {(r["method"], r["n"], r["batch"]): r for r in records}
  lines += ["", "## Summary: fwd+bwd time relative to the hard mask", "",
            "| method | " + " | ".join(f"b={b}, n={_fmt_n(n)}" for b, n in cells) + " |",
            "|:---|" + "---:|" * len(cells)]
  for m in methods:
    row = []
    for b, n in cells:
      r = by_key.get((m, n, b))
      if r is None:
        row.append("")
      elif "error" in r:
        row.append("error")
      else:
        row.append(_fmt_ratio(r["fwd_bwd_ratio"]) if "fwd_bwd_ratio" in r else "—")
    lines.append(f"| {m} | " + " | ".join(row) + " |")
  return "\n".join(lines) + "\n"


def plot(records, path_png, backend):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  batches = sorted({r["batch"] for r in records})
  fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 5),
                           squeeze=False, sharey=True)
  markers = "os^vD<>px*"
  for ax, b in zip(axes[0], batches):
    for i, m in enumerate(METHODS):
      pts = sorted((r["n"], r["fwd_bwd_s"] * 1e3) for r in records
                   if r["method"] == m and r["batch"] == b and "error" not in r)
      if pts:
        ns, ts = zip(*pts)
        ax.plot(ns, ts, marker=markers[i % len(markers)], label=m,
                linewidth=2.5 if m == HARD else 1.5,
                linestyle="--" if m in (HARD, "jnp.sort") else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("n (row length)")
    ax.set_title(f"batch = {b}, fwd+bwd, {backend}")
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].set_ylabel("median time (ms)")
  axes[0][-1].legend(fontsize=8, loc="upper left")
  fig.suptitle("k = n/100, l = 0.1, float32")
  fig.tight_layout()
  fig.savefig(path_png, dpi=120)
  plt.close(fig)


def _loadavg():
  try:
    return round(os.getloadavg()[0], 2)
  except (AttributeError, OSError):  # pragma: no cover (Windows)
    return None


_LOAD_START = None


def _numba_threads():
  try:
    import numba
    try:
      layer = numba.threading_layer()  # only known once a parallel kernel has run
    except ValueError:
      layer = "not initialized"
    return f"{numba.get_num_threads()} ({layer})"
  except Exception as exc:  # pragma: no cover
    return f"unavailable ({type(exc).__name__})"


def metadata(opts, skipped):
  def version(dist):
    try:
      from importlib import metadata as importlib_metadata
      return importlib_metadata.version(dist)
    except Exception as exc:  # pragma: no cover
      return f"unavailable ({type(exc).__name__})"

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "implicit_topk"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
    git = f"{sha}{' + uncommitted changes in implicit_topk/' if dirty else ''}" or "unknown"
  except Exception:
    git = "unknown"
  dev = jax.devices()[0]
  return {
      "backend": jax.default_backend(),
      "device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')} x{len(jax.devices())}",
      "cpu_count": os.cpu_count(),
      "platform": platform.platform(),
      "python": platform.python_version(),
      "jax": jax.__version__, "jaxlib": version("jaxlib"), "jaxopt": version("jaxopt"),
      "numba": version("numba"), "numpy": np.__version__,
      "numba_threads": _numba_threads(),
      "env": {v: os.environ[v] for v in ENV_VARS if v in os.environ},
      "git": git,
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "command": "python " + " ".join(
          [os.path.relpath(sys.argv[0], root) if sys.argv[0] else ""] + sys.argv[1:]),
      "loadavg_1m_start": _LOAD_START,
      "loadavg_1m_end": _loadavg(),
      "max_elements": opts.max_elements,
      "skipped": skipped,
      "options": vars(opts),
  }


# ----------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--sizes", type=lambda s: [int(float(v)) for v in s.split(",")],
                  default=None, help="comma-separated row lengths n, e.g. 1e2,1e3 "
                  f"(default {','.join(map(str, DEFAULT_SIZES))})")
  ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")],
                  default=None, help="comma-separated batch sizes "
                  f"(default {','.join(map(str, DEFAULT_BATCHES))})")
  ap.add_argument("--repeats", type=int, default=None,
                  help="max timed calls per measurement (default 30; 5 with --quick)")
  ap.add_argument("--min-repeats", type=int, default=3,
                  help="min timed calls per measurement")
  ap.add_argument("--cell-budget", type=float, default=None,
                  help="target seconds of timed calls per measurement; repeats = "
                  "budget / one call, clipped to [min-repeats, repeats] "
                  "(default 1.5; 0.2 with --quick)")
  ap.add_argument("--solvers", default="pav,threshold,dykstra",
                  help="comma-separated soft solvers to run (pav, threshold, dykstra); "
                  "the baselines (hard, sort, jaxopt) always run")
  ap.add_argument("--methods", default=None,
                  help="comma-separated substrings; run only methods whose name "
                  "contains one of them (the hard baseline always runs)")
  ap.add_argument("--max-elements", type=float, default=DEFAULT_MAX_ELEMENTS,
                  help="skip (n, batch) cells with n * batch above this")
  ap.add_argument("--full-grid", action="store_true",
                  help="do not skip any cell (includes n=1e6, batch=64)")
  ap.add_argument("--quick", action="store_true",
                  help=f"smoke run: sizes {QUICK_SIZES}, batches {QUICK_BATCHES}, few "
                  "repeats; files get a '_quick' suffix")
  ap.add_argument("--out", default=os.path.join("benchmarks", "results"),
                  help="output directory")
  ap.add_argument("--tag", default=None,
                  help="suffix of output file names (<backend>_<tag>.md); "
                  "default '' or 'quick' with --quick")
  ap.add_argument("--numba-threads", type=int, default=None,
                  help="numba.set_num_threads(N) for the pav kernel (default: numba's "
                  "default, all cores); on a busy small machine N=1 avoids losing "
                  "scheduler time slices in the parallel kernel")
  ap.add_argument("--seed", type=int, default=0)
  opts = ap.parse_args(argv)
  if opts.sizes is None:
    opts.sizes = list(QUICK_SIZES if opts.quick else DEFAULT_SIZES)
  if opts.batches is None:
    opts.batches = list(QUICK_BATCHES if opts.quick else DEFAULT_BATCHES)
  if opts.repeats is None:
    opts.repeats = 5 if opts.quick else 30
  if opts.cell_budget is None:
    opts.cell_budget = 0.2 if opts.quick else 1.5
  if opts.tag is None:
    opts.tag = "quick" if opts.quick else ""
  if opts.full_grid:
    opts.max_elements = float("inf")
  opts.min_repeats = max(1, min(opts.min_repeats, opts.repeats))
  solvers = {s.strip() for s in opts.solvers.split(",") if s.strip()}
  unknown = solvers - {"pav", "threshold", "dykstra"}
  if unknown:
    ap.error(f"unknown solvers {sorted(unknown)}; choose from pav, threshold, dykstra")
  opts.solvers = sorted(solvers)
  return opts


def selected_methods(opts):
  names = [m for m in METHODS if SOLVER_OF.get(m, None) in (None, *opts.solvers)]
  if opts.methods:
    subs = [s.strip() for s in opts.methods.split(",") if s.strip()]
    names = [m for m in names if m == HARD or any(s in m for s in subs)]
  return names


def main(argv=None):
  global _LOAD_START
  opts = parse_args(argv)
  _LOAD_START = _loadavg()
  if opts.numba_threads is not None:
    import numba
    numba.set_num_threads(opts.numba_threads)
  backend = jax.default_backend()
  methods = selected_methods(opts)
  cells, skipped = [], []
  for n in opts.sizes:
    for b in opts.batches:
      if n * b > opts.max_elements:
        skipped.append(f"n={_fmt_n(n)} batch={b}")
      else:
        cells.append((n, b))
  total = len(cells) * len(methods)
  print(f"backend={backend} device={jax.devices()[0]} methods={len(methods)} "
        f"cells={len(cells)} skipped={skipped or 'none'}", flush=True)

  os.makedirs(opts.out, exist_ok=True)
  stem = backend + (f"_{opts.tag}" if opts.tag else "")
  records = []
  key = jax.random.PRNGKey(opts.seed)
  t_start = time.perf_counter()
  i = 0
  for n, b in cells:
    k = max(1, n // 100)
    kx, kw, key = jax.random.split(key, 3)
    x = jax.random.normal(kx, (b, n), jnp.float32)
    w = jax.random.normal(kw, (b, n), jnp.float32)
    for name in methods:
      i += 1
      if name in SLOW_METHODS and n * b > SLOW_METHODS[name]:
        print(f"[{i:3d}/{total}] skip {name} at n={_fmt_n(n)} batch={b} "
              f"(n x batch > {SLOW_METHODS[name]:g})", flush=True)
        continue
      rec = run_cell(name, n, b, k, x, w, opts)
      records.append(rec)
      prefix = (f"[{i:3d}/{total}] {time.perf_counter() - t_start:6.1f}s "
                f"n={_fmt_n(n):>4} batch={b:<3} k={k:<5} {name:<24}")
      if "error" in rec:
        print(f"{prefix} ERROR {rec['error']}", flush=True)
      else:
        print(f"{prefix} fwd {_fmt_ms(rec['fwd_s']):>7} ms  fwd+bwd "
              f"{_fmt_ms(rec['fwd_bwd_s']):>7} ms  (compile "
              f"{rec['compile_fwd_s'] + rec['compile_fwd_bwd_s']:.1f}s, reps "
              f"{len(rec['fwd_samples'])}/{len(rec['fwd_bwd_samples'])})", flush=True)
    del x, w

  add_ratios(records)
  meta = metadata(opts, skipped)
  meta["total_s"] = time.perf_counter() - t_start
  md_path = os.path.join(opts.out, stem + ".md")
  with open(md_path, "w") as f:
    f.write(markdown(records, meta))
  with open(os.path.join(opts.out, stem + ".json"), "w") as f:
    json.dump({"meta": meta, "records": records}, f, indent=1, default=str)
  png_path = os.path.join(opts.out, stem + ".png")
  try:
    plot(records, png_path, backend)
  except Exception as exc:  # plotting must never lose the numbers
    print(f"plot failed: {_short_error(exc)}", flush=True)
  print(f"done in {meta['total_s']:.0f}s; wrote {md_path}, {stem}.json, {stem}.png "
        f"in {opts.out}", flush=True)
  return records


if __name__ == "__main__":
  main()
