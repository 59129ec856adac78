#!/usr/bin/env python
"""Benchmark matrix: soft top-k mask (forward+backward) against the hard mask (forward).

What a user sees: in every cell (a batch x n float32 score array, standard normal, fixed
seed, and a k), it times under ``jax.jit``

* ``hard fwd``: the hard mask users would otherwise write, ``lax.top_k`` + a scatter of
  ones into zeros (what ``implicit_topk.hard_topk_mask`` does), forward only;
* ``soft <solver> p=<p>``: ``jax.grad(lambda x: sum(soft_topk_mask(x, k,
  regularization_strength=l, p=p, solver=solver) * w))`` for a fixed random cotangent
  ``w`` (forward + backward), for
  p in {4/3, 2} and solver in {auto, threshold, pav}, plus dykstra at p = 2 where
  n x batch <= 1e5.

Two modes (``--mode``): ``percall`` (default) times one jitted call from Python, so
both sides include the dispatch cost of a call; ``ingraph`` times the op as a model's
jitted step pays it: the op chained N times inside one jit (``lax.fori_loop``, each
output feeding the next input: ``z + 1e-3 * op(z)`` for the hard mask,
``z + 1e-3 * grad(sum(soft(z) * w))(z)`` for the soft ones), time / N, with
N = ``--chain`` (default 50) for cells up to 1e6 entries and proportionally fewer (at
least 5) above. Any solver name of the library is accepted (``--solvers auto,threshold,pav,native,pallas``);
one the library does not know is recorded as an error, and ``pallas`` is skipped on a
CPU backend (Pallas interpret mode there is a test path: its timings mean nothing).

Every contender of a cell is compiled and warmed up first; then the timed calls are
interleaved (round r calls every contender once, in a fixed order), each ending with
``block_until_ready``. Reported: median, min, max, IQR of >= 11 calls (fewer, never
below ``--min-repeats``, for non-default contenders whose one call takes > 1 s; a
contender whose warm call takes > 20 s is skipped). ratio = soft fwd+bwd median / hard
fwd median of the same cell. ``os.getloadavg()`` is printed and stored at the start and
per cell. A contender that raises is recorded as an error; the run goes on.

Outputs ``<out>.json`` (raw numbers + environment), ``<out>.md`` (one table, rows =
cells) and ``<out>.png`` (ratios, log axis, line at 2x). ``benchmarks/readme_table.py``
turns the JSON into the README's table. See ``benchmarks/README.md``.

Usage::

    python benchmarks/bench_topk.py                        # full matrix (~10 min, 2-core CPU)
    python benchmarks/bench_topk.py --quick --out /tmp/q   # smoke test, < 30 s
    python benchmarks/bench_topk.py --cells router --solvers auto
    python benchmarks/bench_topk.py --mode ingraph          # benchmarks/results/<backend>_matrix_ingraph
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

import _timing  # noqa: E402  (the scripts' folder is on sys.path)

HARD = "hard fwd"
DEFAULT_SOLVER = "auto"
ALL_SOLVERS = ("auto", "threshold", "pav", "dykstra")  # the default --solvers
MODES = ("percall", "ingraph")
# in graph (benchmarks/_timing.py): cells up to CHAIN_ELEMENTS entries are chained --chain
# times, fewer above (at least MIN_CHAIN); z <- z + CHAIN_STEP * op(z) links the calls
CHAIN_ELEMENTS = _timing.CHAIN_ELEMENTS
MIN_CHAIN = _timing.MIN_CHAIN
CHAIN_STEP = _timing.CHAIN_STEP
P_VALUES = ((4.0 / 3.0, "4/3"), (2.0, "2"))
DYKSTRA_MAX_ELEMENTS = 1e5   # dykstra (p = 2 only) runs where n x batch <= this
SLOW_CALL_S = 1.0            # above this, non-default contenders may get fewer repeats
HOPELESS_CALL_S = 20.0       # above this (one warm call), a contender is skipped
ROUTER_L = 0.5
DEFAULT_L = 0.1
# Environment variables that change the timings; recorded when set.
ENV_VARS = ("NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY",
            "OMP_NUM_THREADS", "XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64",
            "CUDA_VISIBLE_DEVICES")


# ----------------------------------------------------------------------------------
# The matrix
# ----------------------------------------------------------------------------------


def _fmt_n(n):
  e = math.log10(n) if n > 0 else 0
  return f"1e{int(round(e))}" if n >= 1000 and abs(e - round(e)) < 1e-9 else str(n)


def _cell(group, batch, n, k, l):
  return {"name": f"{group} {batch}x{_fmt_n(n)} k={k}", "group": group, "batch": batch,
          "n": n, "k": k, "l": l}


def default_cells():
  cells = []
  for n in (8, 64, 256):
    for k in (1, 2, 8):
      cells.append(_cell("router", 16384, n, k, ROUTER_L))
  for group, batch in (("small", 1), ("mid", 64)):
    for n in (1_000, 10_000):
      for k in (2, n // 100):
        cells.append(_cell(group, batch, n, k, DEFAULT_L))
  cells.append(_cell("large", 64, 100_000, 1_000, DEFAULT_L))
  cells.append(_cell("large", 1, 1_000_000, 10_000, DEFAULT_L))
  cells.append(_cell("large", 1, 10_000_000, 100_000, DEFAULT_L))
  return cells


def quick_cells():
  return [_cell("small", 1, 1_000, 10, DEFAULT_L)]


def custom_cells(sizes, batches):
  return [_cell("custom", b, n, max(1, n // 100), DEFAULT_L) for n in sizes for b in batches]


def contenders_for(cell, solvers):
  """[(name, solver, p) ...]; the hard mask first (solver None)."""
  out = [(HARD, None, None)]
  for solver in solvers:
    for p, p_name in P_VALUES:
      if solver == "dykstra" and p != 2.0:
        continue
      out.append((f"soft {solver} p={p_name}", solver, p))
  return out


def static_skip(cell, solver, mode="percall", backend="cpu"):
  """Reason to skip a contender without running it, or None."""
  if cell["k"] >= cell["n"]:
    return f"k = n = {cell['n']}: every entry is selected (soft_topk_mask needs k < n)"
  if solver == "dykstra" and mode == "ingraph":
    return "dykstra is not chained in graph (approximate, ~1e3x the hard mask per call)"
  if solver == "dykstra" and cell["n"] * cell["batch"] > DYKSTRA_MAX_ELEMENTS:
    return f"dykstra runs only where n x batch <= {DYKSTRA_MAX_ELEMENTS:g}"
  if solver == "pallas" and backend not in ("gpu", "cuda", "rocm"):
    return (f"pallas runs in Pallas interpret mode on a {backend} backend (a test path; "
            "its timings mean nothing)")
  return None


def chain_length(cell, chain):
  """In graph: how many times the op is chained in one jit for this cell (``chain`` up to
  ``CHAIN_ELEMENTS`` entries, proportionally fewer above, at least ``MIN_CHAIN`` unless
  ``chain`` itself is smaller)."""
  return _timing.chain_length(cell["batch"] * cell["n"], chain)


# ----------------------------------------------------------------------------------
# Contenders
# ----------------------------------------------------------------------------------


def _hard_mask(x, k):
  """What users write without this library: lax.top_k + a scatter of ones into zeros
  (the same as implicit_topk.hard_topk_mask, inlined so a library refactor cannot
  break the reference)."""
  _, idx = jax.lax.top_k(x, k)
  return jnp.put_along_axis(jnp.zeros_like(x), idx, jnp.ones((), x.dtype), axis=-1,
                            inplace=False)


def build(cell, solver, p, chain=None):
  """A jitted function of (x, w) for the contender; with ``chain`` (in graph) the op
  chained that many times in one ``lax.fori_loop``, each output feeding the next input."""
  k, l = cell["k"], cell["l"]
  if solver is None:
    op = lambda x, w: _hard_mask(x, k)
  else:
    from implicit_topk import soft_topk_mask

    def loss(x, w):
      return jnp.sum(soft_topk_mask(x, k, regularization_strength=l, p=p, solver=solver) * w)

    op = jax.grad(loss)  # gradient in x only; w is an argument, not a constant
  if chain is None:
    return jax.jit(op)
  return jax.jit(lambda x, w: _timing.chained(lambda z: op(z, w), chain)(x))


def _block(out):
  return jax.tree_util.tree_map(lambda a: a.block_until_ready(), out)


def _short_error(exc):
  msg = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
  return msg if len(msg) <= 120 else msg[:117] + "..."


def _loadavg():
  try:
    return [round(v, 2) for v in os.getloadavg()]
  except (AttributeError, OSError):  # pragma: no cover (Windows)
    return None


def _stats(samples):
  s = sorted(samples)
  q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
  med = statistics.median(s)
  return {"median_s": med, "min_s": s[0], "max_s": s[-1], "iqr_s": q[2] - q[0],
          "spread": (q[2] - q[0]) / med if med > 0 else None, "repeats": len(s)}


def run_cell(cell, contenders, opts, x, w, backend="cpu"):
  """Compiles + warms every contender, then times them interleaved. Returns records.

  In graph, every timing (samples, warm and compile included) is of one chained call;
  ``samples_s`` and the statistics are per op (divided by the chain length)."""
  chain = chain_length(cell, opts.chain) if opts.mode == "ingraph" else None
  per_op = 1.0 / (chain or 1)
  recs = []
  for name, solver, p in contenders:
    rec = {"contender": name, "solver": solver, "p": p}
    if chain is not None:
      rec["chain"] = chain
    reason = static_skip(cell, solver, opts.mode, backend) if solver is not None else (
        static_skip(cell, None) if cell["k"] > cell["n"] else None)
    if reason:
      rec["skipped"] = reason
    recs.append(rec)
  # Compile + warm up.
  fns = {}
  for rec in recs:
    if "skipped" in rec:
      continue
    try:
      fn = build(cell, rec["solver"], rec["p"], chain)
      t0 = time.perf_counter()
      out = _block(fn(x, w))
      rec["compile_s"] = time.perf_counter() - t0
      t0 = time.perf_counter()
      out = _block(fn(x, w))
      one = time.perf_counter() - t0
      rec["warm_s"] = one
      arr = np.asarray(out, np.float64)
      rec["finite"] = bool(np.all(np.isfinite(arr)))
      if rec["solver"] is None and chain is None:  # in graph the output is the chain's end
        rec["max_abs_sum_err"] = float(np.max(np.abs(arr.sum(-1) - cell["k"])))
      del out, arr
      if one > HOPELESS_CALL_S:
        rec["skipped"] = f"one warm call took {one:.1f} s > {HOPELESS_CALL_S:g} s"
        continue
      default = rec["solver"] in (None, DEFAULT_SOLVER)
      reps = opts.repeats
      if not default and one > SLOW_CALL_S:
        reps = max(opts.min_repeats, min(opts.repeats, math.ceil(opts.cell_budget / one)))
      rec["target_repeats"] = reps
      rec["samples_s"] = []
      fns[rec["contender"]] = fn
    except Exception as exc:  # record and move on (e.g. a solver mid-refactor)
      rec["error"] = _short_error(exc)
      rec["traceback"] = traceback.format_exc()
  # Interleaved timing: round r runs every contender that still needs samples once.
  live = [r for r in recs if r["contender"] in fns]
  rounds = max([r["target_repeats"] for r in live], default=0)
  for i in range(rounds):
    for rec in live:
      if "error" in rec or i >= rec["target_repeats"]:
        continue
      fn = fns[rec["contender"]]
      try:
        t0 = time.perf_counter()
        _block(fn(x, w))
        rec["samples_s"].append((time.perf_counter() - t0) * per_op)
      except Exception as exc:
        rec["error"] = f"during timing: {_short_error(exc)}"
        rec["traceback"] = traceback.format_exc()
  for rec in live:
    if rec["samples_s"]:
      rec.update(_stats(rec["samples_s"]))
  hard = next((r for r in recs if r["contender"] == HARD and "median_s" in r), None)
  for rec in recs:
    if hard is not None and "median_s" in rec:
      rec["ratio"] = rec["median_s"] / hard["median_s"]
  return recs


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


def _contender_names(cells):
  """The soft contenders in order of first appearance."""
  names = []
  for c in cells:
    for r in c["records"]:
      if r["contender"] != HARD and r["contender"] not in names:
        names.append(r["contender"])
  return names


def _cell_text(rec, default_marks=True):
  if rec is None:
    return ""
  if "skipped" in rec:
    return "skipped"
  if "error" in rec:
    return "error"
  if "median_s" not in rec:
    return "—"
  text = _fmt_ms(rec["median_s"])
  if "ratio" in rec and rec["solver"] is not None:
    ratio = _fmt_ratio(rec["ratio"])
    if default_marks and rec["solver"] == DEFAULT_SOLVER and rec["ratio"] > 2:
      ratio = f"**{ratio}**"
    text += f" ({ratio})"
  return text


def markdown(result):
  meta = result["meta"]
  cells = result["cells"]
  names = _contender_names(cells)
  ingraph = meta.get("mode") == "ingraph"
  what = (f"in graph: each op chained N times inside one jit (`lax.fori_loop`, "
          f"`z + {CHAIN_STEP:g} * op(z)`), time / N, N = {meta['options'].get('chain')} for cells "
          f"up to {CHAIN_ELEMENTS:g} entries, fewer (>= {MIN_CHAIN}) above (column `N`)"
          if ingraph else "per call: one jitted call from Python per timing")
  lines = [
      f"# implicit_topk benchmark matrix ({'in graph' if ingraph else 'per call'}) — "
      f"backend `{meta['backend']}`",
      "",
      f"- device: {meta['device']}; CPUs: {meta['cpu_count']}; {meta['platform']}",
      f"- jax {meta['jax']}, jaxlib {meta['jaxlib']}, numba {meta['numba']} "
      f"(threads: {meta['numba_threads']}), numpy {meta['numpy']}, python {meta['python']}",
      f"- git: {meta['git']}; date: {meta['date']}; wall time {meta['total_s']:.0f} s; "
      f"load average (1, 5, 15 min) {meta['loadavg_start']} at start, "
      f"{meta['loadavg_end']} at end (other processes skew timings; per cell in the JSON)",
      f"- command: `{meta['command']}`; environment: "
      + (", ".join(f"`{k}={v}`" for k, v in meta["env"].items()) or "no relevant variables set"),
      "- float32 scores ~ N(0, 1); `hard fwd` = jitted `lax.top_k` + scatter of ones "
      "(forward only); `soft <solver> p=<p>` = jitted `jax.grad` of "
      "`sum(soft_topk_mask(x, k, regularization_strength=l, p=p, solver=solver) * w)` "
      "(forward + backward); column `strength` = l.",
      f"- mode: {what}.",
      f"- each entry: median ms over interleaved repeats (>= {meta['options']['repeats']} "
      "for the hard mask and the default solver) and, in parentheses, the ratio to the "
      f"hard fwd median of the same cell; **bold**: default solver (`{DEFAULT_SOLVER}`) "
      "more than 2x the hard mask.",
      "",
      "| cell | strength | " + ("N | " if ingraph else "") + "hard fwd (ms) | "
      + " | ".join(names) + " | load 1m |",
      "|:---|---:|" + ("---:|" if ingraph else "") + "---:|" + "---:|" * len(names) + "---:|",
  ]
  notes = []
  for c in cells:
    by = {r["contender"]: r for r in c["records"]}
    row = [c["name"], f"{c['l']:g}"] + ([str(c.get("chain", ""))] if ingraph else [])
    row.append(_cell_text(by.get(HARD), False))
    for n in names:
      row.append(_cell_text(by.get(n)))
    load = c.get("loadavg")
    row.append(f"{load[0]:.2f}" if load else "")
    lines.append("| " + " | ".join(row) + " |")
    for r in c["records"]:
      if "skipped" in r and not r["skipped"].startswith(("dykstra runs only", "k = n",
                                                           "dykstra is not chained")):
        notes.append(f"- {c['name']}, {r['contender']}: skipped ({r['skipped']})")
      elif "error" in r:
        notes.append(f"- {c['name']}, {r['contender']}: error ({r['error']})")
      elif r.get("finite") is False:
        notes.append(f"- {c['name']}, {r['contender']}: non-finite output")
  lines += ["", "Skipped by rule: dykstra where n x batch > "
            f"{DYKSTRA_MAX_ELEMENTS:g}" + (" and everywhere in graph" if ingraph else "")
            + "; soft contenders where k = n."]
  if notes:
    lines += ["", "Errors and skips:", ""] + notes
  return "\n".join(lines) + "\n"


def plot(result, path_png):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cells = result["cells"]
  names = _contender_names(cells)
  fig, ax = plt.subplots(figsize=(max(9, 0.55 * len(cells) + 5), 5.5))
  markers = "os^vD<>px*"
  xs = np.arange(len(cells))
  for i, name in enumerate(names):
    pts = [(j, r["ratio"]) for j, c in enumerate(cells) for r in c["records"]
           if r["contender"] == name and "ratio" in r]
    if pts:
      j, ratio = zip(*pts)
      default = name.startswith(f"soft {DEFAULT_SOLVER} ")
      ax.plot(j, ratio, marker=markers[i % len(markers)], linestyle="none",
              markersize=8 if default else 5, label=name, alpha=0.9)
  ax.axhline(2.0, color="k", linestyle="--", linewidth=1, label="2x")
  ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
  ax.set_yscale("log")
  ax.set_xticks(xs)
  ax.set_xticklabels([c["name"] for c in cells], rotation=60, ha="right", fontsize=8)
  ax.set_ylabel("soft fwd+bwd / hard fwd (median)")
  mode = "in graph" if result["meta"].get("mode") == "ingraph" else "per call"
  ax.set_title(f"implicit_topk vs lax.top_k mask, {mode}, {result['meta']['backend']} "
               f"({result['meta']['date'][:10]})")
  ax.grid(True, which="both", axis="y", alpha=0.3)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path_png, dpi=120)
  plt.close(fig)


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


def metadata(opts, load_start):
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
      "jax": jax.__version__, "jaxlib": version("jaxlib"),
      "numba": version("numba"), "numpy": np.__version__,
      "numba_threads": _numba_threads(),
      "env": {v: os.environ[v] for v in ENV_VARS if v in os.environ},
      "git": git,
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "command": "python " + " ".join(
          [os.path.relpath(sys.argv[0], root) if sys.argv[0] else ""] + sys.argv[1:]),
      "loadavg_start": load_start,
      "loadavg_end": _loadavg(),
      "default_solver": DEFAULT_SOLVER,
      "mode": opts.mode,
      "options": {k: v for k, v in vars(opts).items()},
  }


# ----------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--solvers", default=",".join(ALL_SOLVERS),
                  help="comma-separated soft solvers, any name soft_topk_mask takes (auto, "
                  "threshold, pav, dykstra, native, pallas, ...)")
  ap.add_argument("--mode", choices=MODES, default="percall",
                  help="percall: one jitted call from Python per timing; ingraph: the op "
                  "chained --chain times inside one jit, time / chain")
  ap.add_argument("--chain", type=int, default=50,
                  help=f"in graph: chain length for cells up to {CHAIN_ELEMENTS:g} entries "
                  f"(proportionally fewer above, at least {MIN_CHAIN})")
  ap.add_argument("--cells", default=None,
                  help="comma-separated substrings; keep only cells whose name contains "
                  "one of them, e.g. 'router', 'large', '64x1e4', 'k=2'")
  ap.add_argument("--methods", default=None,
                  help="comma-separated substrings; keep only contenders whose name "
                  "contains one of them (the hard mask, the ratio's denominator, stays)")
  ap.add_argument("--repeats", type=int, default=None,
                  help="timed calls per contender (default 11; 3 with --quick); the hard "
                  "mask and the default solver always get this many")
  ap.add_argument("--min-repeats", type=int, default=5,
                  help="fewest timed calls for other contenders whose one call takes > "
                  f"{SLOW_CALL_S:g} s")
  ap.add_argument("--cell-budget", type=float, default=15.0,
                  help="seconds of timed calls aimed at for a slow (> "
                  f"{SLOW_CALL_S:g} s per call) non-default contender: its repeats are "
                  "budget / one call, clipped to [min-repeats, repeats]")
  ap.add_argument("--sizes", type=lambda s: [int(float(v)) for v in s.split(",")],
                  default=None, help="instead of the matrix: a grid of row lengths n "
                  "(with --batches; k = max(1, n // 100), l = 0.1)")
  ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")],
                  default=None, help="batch sizes of the --sizes grid (default 1)")
  ap.add_argument("--quick", action="store_true",
                  help="smoke test: one small cell (1x1e3, k=10), 3 repeats (< 30 s)")
  ap.add_argument("--out", default=None,
                  help="output path without extension (writes .md, .json, .png); an "
                  "existing directory gets <backend>_matrix[_<tag>].* inside it "
                  "(default benchmarks/results/<backend>_matrix)")
  ap.add_argument("--tag", default=None, help="suffix appended to the output stem")
  ap.add_argument("--numba-threads", type=int, default=None,
                  help="numba.set_num_threads(N) before timing (threads of the pav kernel)")
  ap.add_argument("--seed", type=int, default=0)
  opts = ap.parse_args(argv)
  if opts.repeats is None:
    opts.repeats = 3 if opts.quick else 11
  opts.repeats = max(1, opts.repeats)
  opts.min_repeats = max(1, min(opts.min_repeats, opts.repeats))
  if opts.chain < 1:
    ap.error("--chain must be >= 1")
  solvers = [s.strip() for s in opts.solvers.split(",") if s.strip()]
  from implicit_topk import solvers as library_solvers
  known = ("auto", *library_solvers.SOLVERS)
  unknown = [s for s in solvers if s not in known]
  if unknown:
    ap.error(f"--solvers: unknown {unknown}; choose from {sorted(known)}")
  # The default solvers in their usual order, then the others as given.
  opts.solvers = [s for s in ALL_SOLVERS if s in solvers] + [
      s for s in dict.fromkeys(solvers) if s not in ALL_SOLVERS]
  return opts


def output_stem(opts, backend):
  default_name = f"{backend}_matrix" + ("_ingraph" if opts.mode == "ingraph" else "")
  if opts.out is None:
    stem = os.path.join("benchmarks", "results", default_name)
  elif os.path.isdir(opts.out) or opts.out.endswith(os.sep):
    stem = os.path.join(opts.out, default_name)
  else:
    stem = opts.out
  if opts.tag:
    stem += f"_{opts.tag}"
  return stem


def select_cells(opts):
  if opts.sizes:
    cells = custom_cells(opts.sizes, opts.batches or [1])
  elif opts.quick:
    cells = quick_cells()
  else:
    cells = default_cells()
  if opts.cells:
    subs = [s.strip() for s in opts.cells.split(",") if s.strip()]
    cells = [c for c in cells if any(s in c["name"] for s in subs)]
  return cells


def main(argv=None):
  opts = parse_args(argv)
  load_start = _loadavg()
  if opts.numba_threads is not None:
    import numba
    numba.set_num_threads(opts.numba_threads)
  backend = jax.default_backend()
  cells = select_cells(opts)
  subs = [s.strip() for s in (opts.methods or "").split(",") if s.strip()]

  def keep(name):
    return name == HARD or not subs or any(s in name for s in subs)

  total = sum(1 for c in cells for name, _, _ in contenders_for(c, opts.solvers) if keep(name))
  print(f"backend={backend} device={jax.devices()[0]} mode={opts.mode} cells={len(cells)} "
        f"contenders={total} solvers={','.join(opts.solvers)} repeats={opts.repeats} "
        f"loadavg={load_start}", flush=True)
  stem = output_stem(opts, backend)
  os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)

  t_start = time.perf_counter()
  result_cells, flat, done = [], [], 0
  for cell in cells:
    # Same (seed, batch, n) -> same scores and cotangent, whatever cells are selected.
    rng = np.random.default_rng([opts.seed, cell["batch"], cell["n"]])
    x = jnp.asarray(rng.standard_normal((cell["batch"], cell["n"]), np.float32))
    w = jnp.asarray(rng.standard_normal((cell["batch"], cell["n"]), np.float32))
    _block((x, w))
    load = _loadavg()
    print(f"-- {cell['name']} (l={cell['l']:g}) loadavg={load}", flush=True)
    t_cell = time.perf_counter()
    chosen = [c for c in contenders_for(cell, opts.solvers) if keep(c[0])]
    recs = run_cell(cell, chosen, opts, x, w, backend)
    del x, w
    for r in recs:
      done += 1
      prefix = (f"[{done:3d}/{total}] {time.perf_counter() - t_start:6.1f}s "
                f"{cell['name']:<24} {r['contender']:<22}")
      if "skipped" in r:
        print(f"{prefix} skipped ({r['skipped']})", flush=True)
      elif "error" in r:
        print(f"{prefix} ERROR {r['error']}", flush=True)
      else:
        ratio = f"  ratio {_fmt_ratio(r['ratio'])}" if "ratio" in r else ""
        print(f"{prefix} median {_fmt_ms(r['median_s']):>7} ms  min "
              f"{_fmt_ms(r['min_s']):>7} ms  spread {100 * (r['spread'] or 0):4.0f}%  "
              f"reps {r['repeats']:>2}  compile {r['compile_s']:.1f}s{ratio}", flush=True)
      flat.append(dict(r, cell=cell["name"]))
    extra = {"chain": chain_length(cell, opts.chain)} if opts.mode == "ingraph" else {}
    result_cells.append(dict(cell, loadavg=load, seconds=time.perf_counter() - t_cell,
                             records=recs, **extra))

  meta = metadata(opts, load_start)
  meta["total_s"] = time.perf_counter() - t_start
  result = {"meta": meta, "cells": result_cells}
  with open(stem + ".json", "w") as f:
    json.dump(result, f, indent=1, default=str)
  with open(stem + ".md", "w") as f:
    f.write(markdown(result))
  try:
    plot(result, stem + ".png")
  except Exception as exc:  # plotting must never lose the numbers
    print(f"plot failed: {_short_error(exc)}", flush=True)
  print(f"done in {meta['total_s']:.0f}s; loadavg={meta['loadavg_end']}; wrote "
        f"{stem}.md, {stem}.json, {stem}.png", flush=True)
  return flat


if __name__ == "__main__":
  main()
