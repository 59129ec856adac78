"""Where the time of the native top-k mask goes, stage by stage, on CPU.

For each cell (float32 scores ~ N(0, 1), p = 4/3 and p = 2) it times, as medians of
interleaved repeats:

* the stages of the kernel's general per-row path, run on the same rows by the kernel's
  own numba functions (``implicit_topk.kernels.cpu.native_threshold``) and cumulated:
  the per-row prologue (finiteness and maximum), the bracket (guessed cut, gather of the
  candidates, selection of the ``ceil(k) + 1`` largest), the Newton iteration, the mask
  write. Router rows (``k <= 2``, up to 512 entries, p = 4/3 or 2) take the lanes
  instead (``implicit_topk.kernels.cpu.native_lanes``, 64 rows at a time): for those
  cells the stage columns show what the per-row path would cost, the XLA columns what
  the kernel costs;
* the kernel called through XLA (the FFI custom call under ``jax.jit``), the soft mask's
  forward, its forward + backward (the cotangent kernel), and the hard ``lax.top_k``
  mask's forward.

    python benchmarks/profile_native.py                       # the router cells
    python benchmarks/profile_native.py --cells 16384x8:1,64x1000:2 --repeats 21

Prints a table (ms) and the load average. Not a test: timings move with the load.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from numba import njit

import implicit_topk as itk
from implicit_topk.kernels.cpu import native_threshold as kernel
from implicit_topk.kernels.cpu import native_calls

STAGES = ("prologue", "bracket", "newton", "write")


@njit(cache=False)
def _stages(x, k, l, a, y, stage):
  """The kernel's p-norm path on the rows of ``x`` (origin 0: rows near 0 relative to
  ``l``), stopped after stage ``stage`` (an index into ``STAGES``)."""
  rows, n = x.shape
  work = np.empty(max(n, 1))
  scratch = np.empty(max(n, 1))
  guess = np.full(3, np.inf)
  tol = 4.0 * np.finfo(np.float32).eps
  checksum = 0.0
  for b in range(rows):
    row = x[b]
    finite = kernel._all_finite(row, n)
    top = kernel._max_of_finite(row, n)
    if stage == 0:
      checksum += top + finite
      continue
    solved, lam, lo, hi, start, k_f, count = kernel._sparse_bracket(
        row, n, k, l, a, 0.0, finite, top, work, scratch, guess)
    if stage == 1:
      checksum += lo + count
      continue
    if not solved:
      lam, _ = kernel._newton(work, count, k_f, l, kernel.PNORM, a, lo, hi, start, tol)
    if stage == 2:
      checksum += lam
      continue
    checksum += kernel._write_mask(row, n, lam, l, kernel.PNORM, a, 0.0, finite, y[b])
  return checksum


def _median_ms(calls: dict, repeats: int) -> dict:
  """Interleaved repeats of each zero-argument call; the median in ms."""
  for call in calls.values():
    call()
  times = {name: [] for name in calls}
  for _ in range(repeats):
    for name, call in calls.items():
      start = time.perf_counter()
      call()
      times[name].append(time.perf_counter() - start)
  return {name: 1e3 * float(np.median(t)) for name, t in times.items()}


def profile_cell(batch: int, n: int, k: int, l: float, p: float, repeats: int) -> dict:
  rng = np.random.default_rng([0, batch, n])
  x_np = rng.standard_normal((batch, n)).astype(np.float32)
  y_np = np.empty_like(x_np)
  x, w = jnp.asarray(x_np), jnp.asarray(rng.standard_normal((batch, n)).astype(np.float32))
  attributes = native_calls.kernel_attributes(itk.PNorm(p))
  a = float(attributes["a"])  # the mask's exponent 1 / (p - 1), as the kernel gets it
  calls = {stage: (lambda s=s: _stages(x_np, float(k), l, a, y_np, s))
           for s, stage in enumerate(STAGES)}
  kernel_call = jax.jit(lambda z: native_calls.capped_simplex_kernel(z, float(k), l, attributes)[0])
  forward = jax.jit(lambda z: itk.soft_topk_mask(z, k, regularization_strength=l, p=p))
  both = jax.jit(jax.grad(lambda z: jnp.sum(itk.soft_topk_mask(
      z, k, regularization_strength=l, p=p) * w)))
  hard = jax.jit(lambda z: jnp.zeros_like(z).at[
      jnp.arange(batch)[:, None], jax.lax.top_k(z, k)[1]].set(1.0))
  for name, f in (("kernel (XLA)", kernel_call), ("soft fwd", forward),
                  ("soft fwd+bwd", both), ("hard fwd", hard)):
    calls[name] = lambda f=f: jax.block_until_ready(f(x))
  return _median_ms(calls, repeats)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cells", default="16384x8:1,16384x8:2,16384x64:1,16384x64:2,16384x256:1",
                      help="batch x n : k, comma separated (strength 0.5 for n <= 256, else 0.1)")
  parser.add_argument("--repeats", type=int, default=11)
  args = parser.parse_args(argv)
  print(f"load average at start: {os.getloadavg()}")
  header = ["cell", "p", *STAGES, "kernel (XLA)", "soft fwd", "soft fwd+bwd", "hard fwd"]
  print("| " + " | ".join(header) + " |")
  print("|" + "---|" * len(header))
  for cell in args.cells.split(","):
    shape, k = cell.split(":")
    batch, n = (int(float(v)) for v in shape.split("x"))
    l = 0.5 if n <= 256 else 0.1
    for p in (4.0 / 3.0, 2.0):
      ms = profile_cell(batch, n, int(k), l, p, args.repeats)
      cumulative = [ms[s] for s in STAGES]
      print(f"| {batch}x{n} k={k} | {p:.3g} | "
            + " | ".join(f"{v:.2f}" for v in cumulative) + " | "
            + " | ".join(f"{ms[name]:.2f}" for name in header[6:]) + " |", flush=True)
  print(f"load average at end: {os.getloadavg()}")
  print("stage columns are cumulative: prologue, + bracket, + newton, + write (the "
        "kernel's work without the XLA call)")


if __name__ == "__main__":
  main()
