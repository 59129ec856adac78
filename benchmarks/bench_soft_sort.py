#!/usr/bin/env python
"""Soft sort and soft rank, forward+backward: ours vs torchsort (and ott-jax), CPU or GPU.

Times forward+backward (the gradient of ``sum(w * y)``, float32, batch ``b`` rows of
length ``n``) after warm-up, the contenders of a cell interleaved (one call of each per
round, so a change in machine load hits all of them alike), median of ``--repeats``
rounds:

* ``implicit_topk.soft_sort`` / ``soft_rank`` (permutahedron LP, ``p = 2``, ``l = 1``,
  implicit derivatives), under ``jax.jit(jax.value_and_grad)``: the default solver
  (``"auto"`` = ``"pav_jax"``, pure JAX) as ``implicit_topk``, and the host numba PAV
  (``solver="pav"``) as ``implicit_topk pav``;
* ``torchsort.soft_sort`` / ``soft_rank`` (``regularization="l2"``,
  ``regularization_strength = 1``: the same operators, checked below to agree to
  rounding), ``y = op(x); (w * y).sum().backward()``, with torch's default thread
  count and with one thread; skipped if torchsort is not installed (the ``peers``
  extra: install torch first, then ``pip install --no-build-isolation torchsort``;
  without a CUDA toolkit on the PATH it builds the CPU extension only);
* ``implicit_topk.soft_topk_values`` vs ``ott.tools.soft_sort.sort(x, topk=k)``
  (``k = n / 100``; entropic optimal transport, Sinkhorn, differentiated by
  unrolling: ``implicit_diff=None``, its implicit differentiation fails on current
  jax/lineax), on cells up to ``--ott-max-size`` entries (ott is ~100x slower).

A cell that fails (out of memory) is reported as such. The load average
(``os.getloadavg()``) is printed and recorded before and after each cell: on a shared
machine compare ratios within a cell, not absolute times across runs.

Writes ``benchmarks/results/<backend>_soft_sort.{json,md}``.

Usage::

    python benchmarks/bench_soft_sort.py                  # 1x1e3, 64x1e3, 64x1e4, 1x1e5
    python benchmarks/bench_soft_sort.py --cells 64x1e4 --repeats 21
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

L = 1.0


def _jax_timer(op, x, w):
  value_and_grad = jax.jit(jax.value_and_grad(lambda x: jnp.sum(w[..., :op(x).shape[-1]] * op(x))))
  return lambda: jax.block_until_ready(value_and_grad(x))


def ours(kind, x, w, k, solver="auto"):
  import implicit_topk as itk

  ops = {"sort": lambda x: itk.soft_sort(x, regularization_strength=L, p=2.0, solver=solver),
         "rank": lambda x: itk.soft_rank(x, regularization_strength=L, p=2.0, solver=solver),
         "topk": lambda x: itk.soft_topk_values(x, k, regularization_strength=L, p=2.0, solver=solver)}
  return _jax_timer(ops[kind], jnp.asarray(x), jnp.asarray(w))


def torchsort_timer(kind, x, w, k, threads=None):
  """``threads``: torch's (OpenMP) thread count during the call; None: its default.
  (torchsort's OpenMP loop spin-waits: on a loaded machine one thread can be faster.)"""
  del k
  import torch
  import torchsort

  op = {"sort": torchsort.soft_sort, "rank": torchsort.soft_rank}[kind]
  xt = torch.tensor(x, requires_grad=True)
  wt = torch.tensor(w)

  def run():
    default = torch.get_num_threads()
    if threads is not None:
      torch.set_num_threads(threads)
    try:
      xt.grad = None
      y = op(xt, regularization="l2", regularization_strength=L)
      (wt * y).sum().backward()
      return xt.grad
    finally:
      torch.set_num_threads(default)

  return run


def ott_timer(kind, x, w, k):
  assert kind == "topk"
  from ott.tools import soft_sort

  op = lambda x: jax.vmap(lambda row: soft_sort.sort(row, topk=k, implicit_diff=None))(x)
  return _jax_timer(op, jnp.asarray(x), jnp.asarray(w))


# (operator, contender) -> timer factory
CONTENDERS = {
    ("soft_sort", "implicit_topk"): lambda *a: ours("sort", *a),
    ("soft_sort", "implicit_topk pav"): lambda *a: ours("sort", *a, solver="pav"),
    ("soft_sort", "torchsort"): lambda *a: torchsort_timer("sort", *a),
    ("soft_sort", "torchsort 1 thread"): lambda *a: torchsort_timer("sort", *a, threads=1),
    ("soft_rank", "implicit_topk"): lambda *a: ours("rank", *a),
    ("soft_rank", "implicit_topk pav"): lambda *a: ours("rank", *a, solver="pav"),
    ("soft_rank", "torchsort"): lambda *a: torchsort_timer("rank", *a),
    ("soft_rank", "torchsort 1 thread"): lambda *a: torchsort_timer("rank", *a, threads=1),
    ("soft_topk_values", "implicit_topk"): lambda *a: ours("topk", *a),
    ("soft_topk_values", "implicit_topk pav"): lambda *a: ours("topk", *a, solver="pav"),
    ("soft_topk_values", "ott-jax"): lambda *a: ott_timer("topk", *a),
}


def _have_torchsort():
  try:
    import torchsort  # noqa: F401
  except ImportError:
    return False
  return True


def check_agreement():
  """Max |ours - torchsort| on a small float32 batch (the same operators)."""
  import torch
  import torchsort

  import implicit_topk as itk

  x = np.random.default_rng(1).normal(size=(4, 50)).astype(np.float32)
  diffs = [float(np.abs(np.asarray(ours_op(jnp.asarray(x), l=L))
                        - theirs(torch.tensor(x), regularization_strength=L).numpy()).max())
           for ours_op, theirs in ((itk.soft_sort, torchsort.soft_sort),
                                   (itk.soft_rank, torchsort.soft_rank))]
  return max(diffs)


def time_cell(timers, repeats):
  """Interleaved rounds: each round calls every timer once. Median seconds per timer."""
  times = {name: [] for name in timers}
  for name, fn in timers.items():  # warm-up (compilation)
    fn()
  for _ in range(repeats):
    for name, fn in timers.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def parse_cell(text):
  b, n = text.lower().split("x")
  return int(float(b)), int(float(n))


def write_markdown(path, meta, records):
  lines = [f"# Soft sort / rank, forward+backward ({meta['backend']}, float32, p = 2, l = {L})",
           "", f"`{meta['command']}`", "",
           f"{meta['device']}; jax {meta['jax']}"
           + (f", torch {meta['torch']}, torchsort {meta['torchsort']}" if meta.get("torch") else "")
           + f"; median of {meta['repeats']} interleaved rounds.", "",
           f"max |ours - torchsort| (float32, 4 x 50): {meta.get('torchsort_max_abs_diff', 'n/a')}",
           "", "| operator | b x n | contender | ms | ratio to implicit_topk | load avg (1 min) |",
           "|---|---|---|---:|---:|---:|"]
  for r in records:
    ours_s = next((q["seconds"] for q in records if q["operator"] == r["operator"]
                   and q["batch"] == r["batch"] and q["n"] == r["n"]
                   and q["contender"] == "implicit_topk"), None)
    ms = f"{1e3 * r['seconds']:.2f}" if r["seconds"] is not None else r["status"]
    ratio = (f"{r['seconds'] / ours_s:.2f}" if r["seconds"] is not None and ours_s else "")
    lines.append(f"| {r['operator']} | {r['batch']} x {r['n']} | {r['contender']} | {ms} | "
                 f"{ratio} | {r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f} |")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cells", default="1x1e3,64x1e3,64x1e4,1x1e5",
                  help="comma-separated b x n, e.g. 64x1e4")
  ap.add_argument("--operators", default="soft_sort,soft_rank,soft_topk_values")
  ap.add_argument("--repeats", type=int, default=11)
  ap.add_argument("--ott-max-size", type=float, default=64e3,
                  help="run ott-jax only on cells with b * n <= this")
  ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
  opts = ap.parse_args(argv)
  have_torchsort = _have_torchsort()
  meta = {"backend": jax.default_backend(), "device": str(jax.devices()[0]),
          "jax": jax.__version__, "repeats": opts.repeats, "l": L, "p": 2.0,
          "command": "python benchmarks/bench_soft_sort.py "
                     + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
          "cpu_count": os.cpu_count()}
  if have_torchsort:
    import importlib.metadata

    import torch
    meta.update(torch=torch.__version__, torchsort=importlib.metadata.version("torchsort"),
                torch_threads=torch.get_num_threads(),
                torchsort_max_abs_diff=check_agreement())
    print(f"torchsort {meta['torchsort']} (torch {meta['torch']}, "
          f"{meta['torch_threads']} threads): max |ours - torchsort| = "
          f"{meta['torchsort_max_abs_diff']:.2e}")
  else:
    print("torchsort is not installed (pip install -e '.[peers]'): its rows are skipped")
  records = []
  for b, n in (parse_cell(c) for c in opts.cells.split(",")):
    k = max(1, n // 100)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(b, n)).astype(np.float32)
    w = rng.normal(size=(b, n)).astype(np.float32)
    for operator in opts.operators.split(","):
      timers, status = {}, {}
      for (op, contender), build in CONTENDERS.items():
        if op != operator:
          continue
        if contender.startswith("torchsort") and not have_torchsort:
          continue
        if contender == "ott-jax" and b * n > opts.ott_max_size:
          status[contender] = f"skipped (b * n > --ott-max-size {opts.ott_max_size:g})"
          continue
        timers[contender] = build(x, w, k)
      load_before = os.getloadavg()
      try:
        seconds = time_cell(timers, opts.repeats)
      except Exception as exc:  # noqa: BLE001 (out of memory is reported, not fatal)
        seconds = {}
        for contender in timers:
          status[contender] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
      load_after = os.getloadavg()
      for contender in list(timers) + [c for c in status if c not in timers]:
        s = seconds.get(contender)
        records.append({"operator": operator, "contender": contender, "batch": b, "n": n,
                        "k": k if operator == "soft_topk_values" else None, "seconds": s,
                        "status": f"{1e3 * s:.2f} ms" if s is not None else status[contender],
                        "load_before": load_before, "load_after": load_after})
        print(f"{operator:>16s} b={b:>3d} n={n:>7d} {contender:>18s}: {records[-1]['status']:>12s}"
              f"   load {load_before[0]:.2f} -> {load_after[0]:.2f}", flush=True)
  os.makedirs(opts.out, exist_ok=True)
  stem = os.path.join(opts.out, f"{jax.default_backend()}_soft_sort")
  with open(stem + ".json", "w") as f:
    json.dump({**meta, "records": records}, f, indent=1)
  write_markdown(stem + ".md", meta, records)
  print(f"wrote {stem}.json, {stem}.md")


if __name__ == "__main__":
  main()
