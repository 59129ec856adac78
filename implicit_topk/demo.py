"""The README's first command: the seed examples, a gradient and a timing table."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import hard
from implicit_topk import ops


def _seed_values():
  """The (2, 3, 4) integer batch of the reference README (legacy threefry stream)."""
  previous = jax.config.jax_threefry_partitionable
  jax.config.update("jax_threefry_partitionable", False)
  try:
    values = (5 * jax.random.normal(jax.random.PRNGKey(2), (2, 3, 4), jnp.float32)).astype(jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(2), (10,), jnp.float32)
  finally:
    jax.config.update("jax_threefry_partitionable", previous)
  return values.astype(jnp.float32), x


def _median_time(fn, *args, repeats=5):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def timing_table(sizes=(1_000, 10_000, 100_000), batch=64):
  """Rows (n, hard ms, soft fwd ms, soft fwd+bwd ms) on the default backend, float32."""
  rows = []
  for n in sizes:
    k = max(1, n // 100)
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, n), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (batch, n), jnp.float32)
    hard_fn = jax.jit(lambda x: hard.hard_topk_mask(x, k) * x)
    soft_fn = jax.jit(lambda x: ops.soft_topk_mask(x, k))
    grad_fn = jax.jit(jax.grad(lambda x: jnp.sum(w * ops.soft_topk_mask(x, k))))
    rows.append((n, *(1e3 * _median_time(f, x) for f in (hard_fn, soft_fn, grad_fn))))
  return rows


def main(timing: bool = True) -> None:
  np.set_printoptions(precision=6, suppress=True)
  values = jnp.array([-5.0, -2.0, 3.0, 1.0])
  print("== Top-2 of", values, "(l = 1e-2, p = 4/3) ==")
  print("soft top-k mask, PAV      :", ops.soft_topk_mask(values, 2, l=1e-2, solver="pav"))
  print("soft top-k mask, threshold:", ops.soft_topk_mask(values, 2, l=1e-2, solver="threshold"))
  print("hard top-k mask           :", hard.hard_topk_mask(values, 2))
  print("hard top-k in magnitude   :", hard.hard_topk_mag(values, 2))
  print("(the reference prints 0.99999714 where the exact value is 1)")

  batch, x = _seed_values()
  print("\n== Batched (2, 3, 4) input, top-2 along the last axis ==")
  print(batch)
  print("soft top-k mask (l = 1e-2):\n", ops.soft_topk_mask(batch, 2, l=1e-2))
  print("soft top-k mask (l = 5, smoother):\n", ops.soft_topk_mask(batch, 2, l=5.0))

  k, l = 4, 0.5

  def soft_f(x):
    out = ops.soft_topk_mask(x, k, l=l) + ops.soft_topk_mask(x**2, k, l=l)
    return (out**2).mean()

  def hard_f(x):
    out = hard.hard_topk_mask(x, k) + hard.hard_topk_mask(x**2, k)
    return (out**2).mean()

  print("\n== Gradients (k = 4, l = 0.5) ==")
  print("x                :", x)
  print("grad of hard_f   :", jax.grad(hard_f)(x))
  print("grad of soft_f   :", jax.jit(jax.grad(soft_f))(x))
  print("jvp (forward mode) along ones:", jax.jvp(soft_f, (x,), (jnp.ones_like(x),))[1])

  if timing:
    print(f"\n== Timing on {jax.default_backend()}, batch 64, k = n/100, float32, "
          "median ms (jit, after warm-up) ==")
    print(f"{'n':>8} {'hard top_k mask':>16} {'soft fwd':>10} {'soft fwd+bwd':>13}")
    for n, t_hard, t_fwd, t_bwd in timing_table():
      print(f"{n:>8} {t_hard:>16.2f} {t_fwd:>10.2f} {t_bwd:>13.2f}")
