#!/usr/bin/env python
"""What one training step pays for each loss of ``implicit_topk.losses``, on CPU.

For float32 logits ~ N(0, 1) of shape ``(batch, classes)`` and random labels it times,
as the 20th percentile of interleaved repeats (the machine is shared: the fastest calls
are the least disturbed), the loss and its gradient with respect to the logits
(``jax.value_and_grad``, ``reduction="mean"``) in two ways:

* **eager**: the function called as it is, as a training loop without ``jax.jit``
  around its step calls it;
* **jit**: ``jax.jit`` of the same function, what a jitted training step pays.

The losses: the softmax cross-entropy (the reference), ``topk_cross_entropy`` with
``p_k = [0, 0, 0, 0, 1]`` and ``[0.5, 0, 0, 0, 0.5]``, ``topk_fenchel_young_loss``
(top-1, one-hot target) and ``smooth_topk_svm_loss`` (k = 5), and the smooth top-k SVM's
one sequential part alone: the soft-maximum recursion over the classes
(``losses._soft_esp``, one ``lax.scan`` step per class) and its gradient, as a bare
``lax.scan``. Called eagerly, a bare ``lax.scan`` is traced and compiled again at every
call (its transpose too); the loss itself runs it inside one ``jax.jit``, so only its
first call compiles.

    python benchmarks/profile_losses.py                      # batch 128, 100 classes
    python benchmarks/profile_losses.py --batch 512 --classes 1000 --repeats 15
    python benchmarks/profile_losses.py --json out.json      # also write the numbers

Prints a table (ms) and the load average. Not a test: timings move with the load.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import losses


def cross_entropy(logits, labels):
  log_p = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=-1))


def contenders(k: int):
  fy = lambda s, y: losses.topk_fenchel_young_loss(s, jax.nn.one_hot(y, s.shape[-1], dtype=s.dtype), 1,
                                                   reduction="mean")
  esp = lambda s, y: sum(jnp.sum(v) for v in losses._soft_esp(  # pylint: disable=protected-access
      s, jnp.zeros(s.shape, bool), jnp.ones(s.shape[:-1], s.dtype), k))
  return {
      "softmax cross-entropy": cross_entropy,
      "topk_cross_entropy p_k=[0,0,0,0,1]": functools.partial(
          losses.topk_cross_entropy, p_k=[0, 0, 0, 0, 1], reduction="mean"),
      "topk_cross_entropy p_k=[.5,0,0,0,.5]": functools.partial(
          losses.topk_cross_entropy, p_k=[0.5, 0, 0, 0, 0.5], reduction="mean"),
      "topk_fenchel_young_loss k=1": fy,
      f"smooth_topk_svm_loss k={k}": lambda s, y: losses.smooth_topk_svm_loss(s, y, k, reduction="mean"),
      f"  its recursion alone, bare lax.scan (k={k})": esp,
  }


def time_calls(fns: dict, args, repeats: int) -> dict:
  """20th percentile (s) of ``repeats`` interleaved calls of each function; the first
  call of each (compilation) is not timed."""
  for fn in fns.values():
    jax.block_until_ready(fn(*args))
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {name: float(np.percentile(t, 20)) for name, t in times.items()}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch", type=int, default=128)
  ap.add_argument("--classes", type=int, default=100)
  ap.add_argument("--k", type=int, default=5, help="the smooth top-k SVM's k (default 5)")
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--json", default=None, help="also write the numbers to this file")
  opts = ap.parse_args(argv)

  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(opts.batch, opts.classes)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, opts.classes, size=opts.batch), jnp.int32)
  fns = {name: jax.value_and_grad(fn) for name, fn in contenders(opts.k).items()}
  load = os.getloadavg()[0]
  eager = time_calls(fns, (logits, labels), opts.repeats)
  jitted = time_calls({name: jax.jit(fn) for name, fn in fns.items()}, (logits, labels),
                      max(opts.repeats, 21))
  width = max(len(name) for name in fns)
  print(f"loss and gradient, batch {opts.batch} x {opts.classes} classes, float32, "
        f"{jax.default_backend()}, {os.cpu_count()} cores, load average {load:.2f} at start")
  print(f"{'':{width}}  {'eager (ms)':>11}  {'jit (ms)':>9}")
  for name in fns:
    print(f"{name:{width}}  {eager[name] * 1e3:11.3f}  {jitted[name] * 1e3:9.3f}")
  result = {"meta": {"batch": opts.batch, "classes": opts.classes, "k": opts.k,
                     "repeats": opts.repeats, "backend": jax.default_backend(),
                     "cpu_count": os.cpu_count(), "jax": jax.__version__,
                     "machine": platform.machine(), "loadavg_start": load,
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat()},
            "eager_s": eager, "jit_s": jitted}
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
