#!/usr/bin/env python
"""Soft rank, soft sort and soft top-k, forward+backward: implicit_topk vs SoftJAX.

SoftJAX (PyPI ``softjax``) declares Python >= 3.12; version 0.1.1 imports and runs on
3.11 when installed with ``pip install --ignore-requires-python --no-deps`` plus its
dependencies (equinox, jaxtyping, lineax, optimistix, ott-jax). Run this script in an
environment that has both packages.

Times forward+backward: ``jax.jit(jax.value_and_grad(lambda x: sum(w * y(x))))``, float32,
``b`` rows of length ``n``, after one warm-up call, ``block_until_ready``. The contenders
of a cell are interleaved (one call of each per round, so a change in machine load hits
all of them alike); the median of ``--repeats`` rounds is reported. The load average
(``os.getloadavg()``) is recorded before and after each cell.

Contenders per operator:

* rank / sort: ``implicit_topk.soft_rank`` / ``soft_sort`` (``p = 2``, strength 1, the
  default pure-JAX PAV solver); SoftJAX's default (``method="neuralsort"``,
  ``mode="smooth"``, ``standardize=True``; NeuralSort, O(n^2) time per row); SoftJAX's
  PAV (``method="fast_soft_sort"``, ``mode="c0"``, ``standardize=False``: the same
  operator as ours with softness mapped as in docs/softjax.md).
* top-k (``k = max(1, n // 10)``): ``implicit_topk.soft_topk_mask`` (defaults:
  ``p = 4/3``, solver ``"auto"``; returns an (..., n) mask) and
  ``implicit_topk.soft_topk_values`` (``p = 2``; the k largest soft-sorted values);
  SoftJAX's default ``top_k`` (NeuralSort; returns the k values and a dense (..., k, n)
  soft index; the loss uses the values) and ``top_k(method="fast_soft_sort", mode="c0")``
  (values only, index None). The outputs differ in kind (mask vs values): this times
  what a user of each default gets, not the same operator.

A contender whose single warm-up call (compile excluded) exceeds ``--max-call-s`` in a
cell is skipped there and reported as such. SoftJAX's NeuralSort default is O(b n^2) per
call: it is not run at all where ``b * n^2 > --max-neuralsort-bn2`` (default 1e9, which
skips 64 x 1e4).

Writes ``benchmarks/results/softjax.{json,md}``.

Usage::

    python benchmarks/bench_softjax.py                      # n in 1e2,1e3,1e4; b in 1,64
    python benchmarks/bench_softjax.py --ns 100 --batches 1 --repeats 3   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

STRENGTH = 1.0      # our regularization_strength for rank/sort/values (p = 2)
SJ_SOFTNESS = 0.1   # SoftJAX's default softness (used for its default methods)


def _loss_timer(op, x, w):
  def loss(x):
    y = op(x)
    return jnp.sum(w[..., :y.shape[-1]] * y)

  f = jax.jit(jax.value_and_grad(loss))
  return lambda: jax.block_until_ready(f(x))


def contenders(op_name, n, k):
  import implicit_topk as itk
  import softjax as sj

  # SoftJAX's PAV with the softness that reproduces our strength (docs/softjax.md):
  # rank softness = strength * (n - 1), sort softness = strength / (n - 1).
  s_rank = STRENGTH * (n - 1)
  s_sort = STRENGTH / max(n - 1, 1)
  if op_name == "rank":
    return {
        "implicit_topk soft_rank": lambda x: itk.soft_rank(x, regularization_strength=STRENGTH, p=2.0),
        "softjax rank (default: neuralsort)": lambda x: sj.rank(x, axis=-1),
        "softjax rank fast_soft_sort c0": lambda x: sj.rank(
            x, axis=-1, softness=s_rank, mode="c0", method="fast_soft_sort",
            descending=False, standardize=False),
    }
  if op_name == "sort":
    return {
        "implicit_topk soft_sort": lambda x: itk.soft_sort(x, regularization_strength=STRENGTH, p=2.0),
        "softjax sort (default: neuralsort)": lambda x: sj.sort(x, axis=-1),
        "softjax sort fast_soft_sort c0": lambda x: sj.sort(
            x, axis=-1, softness=s_sort, mode="c0", method="fast_soft_sort",
            standardize=False),
    }
  if op_name == "topk":
    return {
        "implicit_topk soft_topk_mask": lambda x: itk.soft_topk_mask(x, k),
        "implicit_topk soft_topk_values": lambda x: itk.soft_topk_values(
            x, k, regularization_strength=STRENGTH, p=2.0),
        "softjax top_k (default: neuralsort)": lambda x: sj.top_k(x, k)[0],
        "softjax top_k fast_soft_sort c0": lambda x: sj.top_k(
            x, k, softness=s_sort, mode="c0", method="fast_soft_sort", standardize=False)[0],
    }
  raise ValueError(op_name)


def machine():
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  import softjax
  import implicit_topk
  return {
      "device": str(jax.devices()[0]),
      "cpu": cpu,
      "cores": os.cpu_count(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "softjax": softjax.__version__,
      "implicit_topk": getattr(implicit_topk, "__version__", "unknown"),
  }


def run_cell(op_name, n, b, repeats, max_call_s, max_neuralsort_bn2, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(b, n)).astype(np.float32))
  w = jnp.asarray(rng.normal(size=(b, n)).astype(np.float32))
  k = max(1, n // 10)
  load_before = os.getloadavg()[0]
  timers, skipped = {}, {}
  for name, op in contenders(op_name, n, k).items():
    if "neuralsort" in name and b * n * n > max_neuralsort_bn2:
      skipped[name] = f"not run: b n^2 = {b * n * n:.1e} > {max_neuralsort_bn2:.0e} (O(n^2) per row)"
      print(f"  {op_name} b={b} n={n} {name}: {skipped[name]}", flush=True)
      continue
    t = _loss_timer(op, x, w)
    t0 = time.perf_counter()
    t()                                   # compile + first call
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    t()
    one = time.perf_counter() - t0
    if one > max_call_s:
      skipped[name] = f"one call took {one:.1f} s (> {max_call_s} s)"
      print(f"  {op_name} b={b} n={n} {name}: skipped ({skipped[name]})", flush=True)
      continue
    timers[name] = (t, compile_s)
  times = {name: [] for name in timers}
  for _ in range(repeats):
    for name, (t, _) in timers.items():
      t0 = time.perf_counter()
      t()
      times[name].append(time.perf_counter() - t0)
  load_after = os.getloadavg()[0]
  rows = []
  for name in contenders(op_name, n, k):
    row = {"op": op_name, "n": n, "b": b, "k": k if op_name == "topk" else None,
           "contender": name, "load_before": load_before, "load_after": load_after}
    if name in skipped:
      row.update(skipped=skipped[name])
    else:
      ts = times[name]
      row.update(median_ms=1e3 * statistics.median(ts), min_ms=1e3 * min(ts),
                 repeats=len(ts), compile_s=timers[name][1])
    rows.append(row)
    print(f"  {op_name:4s} b={b:<3d} n={n:<6d} {name:40s} "
          + (f"{row['median_ms']:10.2f} ms" if "median_ms" in row else row["skipped"])
          + f"   load {load_before:.2f}->{load_after:.2f}", flush=True)
  return rows


def write(rows, meta, out_dir):
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "softjax.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  lines = [
      "# implicit_topk vs SoftJAX: forward+backward (float32)",
      "",
      f"`{meta['command']}`",
      "",
      f"{meta['machine']['cpu']} ({meta['machine']['cores']} cores, {meta['machine']['device']}); "
      f"Python {meta['machine']['python']}, jax {meta['machine']['jax']}, "
      f"softjax {meta['machine']['softjax']}; median of {meta['repeats']} interleaved rounds "
      f"(jit, value_and_grad, block_until_ready). Load average (1 min) at start "
      f"{meta['load_start'][0]:.2f}, at end {meta['load_end'][0]:.2f}.",
      "",
      "rank/sort: ours `p=2`, strength 1; SoftJAX default = NeuralSort, `mode='smooth'`, "
      "softness 0.1, standardize; SoftJAX PAV = `method='fast_soft_sort', mode='c0'`, "
      "standardize=False, softness mapped to our strength 1. top-k: `k = n // 10`; ours "
      "`soft_topk_mask` (p = 4/3) returns an (b, n) mask, `soft_topk_values` the k values; "
      "SoftJAX's `top_k` returns the k values and (default method) a dense (b, k, n) soft "
      "index; the loss uses the values.",
      "",
      "| operator | b x n | contender | ms | ratio to first row | load avg (1 min) |",
      "|---|---|---|---:|---:|---:|",
  ]
  base = {}
  for r in rows:
    key = (r["op"], r["b"], r["n"])
    if key not in base and "median_ms" in r:
      base[key] = r["median_ms"]
    ms = f"{r['median_ms']:.2f}" if "median_ms" in r else f"skipped: {r['skipped']}"
    ratio = f"{r['median_ms'] / base[key]:.2f}" if "median_ms" in r and key in base else ""
    lines.append(f"| {r['op']} | {r['b']} x {r['n']} | {r['contender']} | {ms} | {ratio} | "
                 f"{r['load_before']:.2f} -> {r['load_after']:.2f} |")
  with open(os.path.join(out_dir, "softjax.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--ns", type=int, nargs="+", default=[100, 1000, 10000])
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
  ap.add_argument("--ops", nargs="+", default=["rank", "sort", "topk"])
  ap.add_argument("--repeats", type=int, default=11)
  ap.add_argument("--max-call-s", type=float, default=2.0)
  ap.add_argument("--max-neuralsort-bn2", type=float, default=1e9,
                  help="skip SoftJAX's NeuralSort default where b * n^2 exceeds this, without "
                       "calling it (64 x 1e4: 6.4e9 pairs per call)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--no-write", action="store_true")
  args = ap.parse_args()
  meta = {"command": "python " + " ".join(["benchmarks/bench_softjax.py", *sys.argv[1:]]),
          "machine": machine(), "repeats": args.repeats, "load_start": os.getloadavg()}
  print(meta, flush=True)
  rows = []
  for n in args.ns:
    for b in args.batches:
      for op in args.ops:
        rows += run_cell(op, n, b, args.repeats, args.max_call_s, args.max_neuralsort_bn2)
  meta["load_end"] = os.getloadavg()
  print("load average at end:", meta["load_end"], flush=True)
  if not args.no_write:
    write(rows, meta, args.out)


if __name__ == "__main__":
  main()
