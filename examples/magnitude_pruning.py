#!/usr/bin/env python
"""Magnitude pruning of a small MLP during training: soft top-k in magnitude vs hard top-k.

As in Sander et al. (2023, weight pruning), every weight matrix ``W`` of a 64-128-10 MLP
on scikit-learn's digits is replaced in the forward pass by a top-k *in magnitude* of
itself, keeping a fraction ``rho`` of its entries:

* ``soft``: ``soft_topk_mag(W, k, l=l_t * std(W), p=4/3)`` (sparse: exactly 0 below the
  threshold, exactly ``W_ij`` for clearly-kept entries, differentiable in between), with
  ``l_t`` annealed geometrically from ``--l`` to ``--l / --anneal`` so that the trained
  forward pass ends close to the hard one used at evaluation;
* ``hard-ste``: ``hard_topk_mag(W)`` forward, identity backward (straight-through);
* ``hard``: ``hard_topk_mag(W)`` with its own gradient (the mask: pruned weights get no
  gradient and can never come back);
* ``dense``: no pruning (reference).

Every model is *evaluated at equal sparsity*: the test accuracy of the network whose
weights are ``hard_topk_mag(W, k)`` (exactly ``k`` nonzero entries per matrix; biases
are not pruned). Accuracies are the mean over seeds (train/test split and
initialisation), full-batch Adam.

Outputs ``<out>/magnitude_pruning{,_quick}.{json,md,png}``.

Usage::

    python examples/magnitude_pruning.py            # 6 sparsities x 3 seeds, a few minutes on CPU
    python examples/magnitude_pruning.py --quick    # < 30 s, for the tests

Needs scikit-learn (the dataset) and matplotlib (the plot).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk as itk

KEEP = (0.5, 0.2, 0.1, 0.05, 0.02, 0.01)
METHODS = ("soft", "hard-ste", "hard", "dense")
HIDDEN = 128


def load_digits(seed):
  from sklearn.datasets import load_digits as _load
  from sklearn.model_selection import train_test_split

  data = _load()
  x = data.data.astype(np.float32) / 16.0
  x_train, x_test, y_train, y_test = train_test_split(
      x, data.target, test_size=0.3, random_state=seed, stratify=data.target)
  mean, std = x_train.mean(0), x_train.std(0) + 1e-3
  return ((x_train - mean) / std, y_train), ((x_test - mean) / std, y_test)


def init_params(key, sizes=(64, HIDDEN, 10)):
  params = []
  for key, (fan_in, fan_out) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes, sizes[1:])):
    w = jax.random.normal(key, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in)
    params.append((w, jnp.zeros(fan_out)))
  return params


def _kth_largest(a, k):
  """k-th largest entry of ``a`` (k traced): the hard threshold, no recompilation per k."""
  return jnp.take(-jnp.sort(-a.ravel()), k - 1)


def prune(w, k, method, l):
  """The forward-pass weights of ``method`` for a matrix ``w`` keeping ``k`` entries."""
  if method == "dense":
    return w
  if method == "soft":
    flat = w.ravel()
    scale = jax.lax.stop_gradient(jnp.std(flat))
    return itk.soft_topk_mag(flat, k.astype(w.dtype), regularization_strength=l * scale).reshape(w.shape)
  hard = jnp.where(jnp.abs(w) >= _kth_largest(jax.lax.stop_gradient(jnp.abs(w)), k), w, 0.0)
  if method == "hard-ste":
    return w + jax.lax.stop_gradient(hard - w)
  return hard  # "hard": the gradient is the mask


def forward(params, x):
  for i, (w, b) in enumerate(params):
    x = x @ w + b
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return x


def loss_fn(params, ks, x, y, method, l):
  pruned = [(prune(w, k, method, l), b) for (w, b), k in zip(params, ks)]
  logits = forward(pruned, x)
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def make_train_step(method, lr):
  b1, b2, eps = 0.9, 0.999, 1e-8

  @jax.jit
  def step(params, opt, ks, l, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, ks, x, y, method, l)
    m, v, t = opt
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
    params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
    return params, (m, v, t), loss

  return step


def evaluate(params, ks, x, y):
  """Test accuracy at exactly k nonzero weights per matrix (hard top-k in magnitude)."""
  pruned = [(itk.hard_topk_mag(w.ravel(), int(k)).reshape(w.shape), b)
            for (w, b), k in zip(params, ks)]
  return float(jnp.mean(jnp.argmax(forward(pruned, x), -1) == y))


def l_schedule(l, anneal, steps):
  """soft's l (relative to std(W)) per step: geometric from ``l`` down to ``l / anneal``."""
  return l * anneal ** (-np.arange(steps) / max(steps - 1, 1))


def run(keeps, seeds, steps, l, anneal, lr):
  steps_fns = {method: make_train_step(method, lr) for method in METHODS}
  ls = [jnp.asarray(value, jnp.float32) for value in l_schedule(l, anneal, steps)]
  results = {method: {str(keep): [] for keep in keeps} for method in METHODS}
  for seed in seeds:
    (x_train, y_train), (x_test, y_test) = load_digits(seed)
    x_train, y_train = jnp.asarray(x_train), jnp.asarray(y_train)
    x_test, y_test = jnp.asarray(x_test), jnp.asarray(y_test)
    init = init_params(jax.random.PRNGKey(seed))
    sizes = [w.size for w, _ in init]
    for method in METHODS:
      for keep in keeps:
        ks = [max(1, int(round(keep * size))) for size in sizes]
        ks_arr = [jnp.asarray(k, jnp.int32) for k in ks]
        params = init
        zeros = jax.tree.map(jnp.zeros_like, params)
        opt = (zeros, zeros, jnp.asarray(0, jnp.float32))
        for t in range(steps):
          params, opt, _ = steps_fns[method](params, opt, ks_arr, ls[t], x_train, y_train)
        results[method][str(keep)].append(evaluate(params, ks, x_test, y_test))
  return results


def write_outputs(results, keeps, meta, out, name):
  os.makedirs(out, exist_ok=True)
  summary = {m: {k: float(np.mean(v)) for k, v in r.items()} for m, r in results.items()}
  with open(os.path.join(out, f"{name}.json"), "w") as f:
    json.dump({"meta": meta, "accuracy": results, "mean": summary}, f, indent=2)
  lines = [f"# Magnitude pruning of a 64-{HIDDEN}-10 MLP on sklearn digits", "",
           f"Test accuracy at exactly k = keep x size nonzero weights per matrix (hard top-k "
           f"in magnitude at evaluation), mean over {len(meta['seeds'])} seed(s); "
           f"{meta['steps']} full-batch Adam steps (lr {meta['lr']}); soft: p = 4/3, "
           f"l = {meta['l']} x std(W) annealed geometrically to {meta['l'] / meta['anneal']:g} x std(W). "
           f"Wall time {meta['seconds']:.0f} s ({meta['backend']}).", "",
           "| keep | " + " | ".join(METHODS) + " |", "|---" * (len(METHODS) + 1) + "|"]
  for keep in keeps:
    lines.append(f"| {keep:g} | " + " | ".join(f"{summary[m][str(keep)]:.3f}" for m in METHODS) + " |")
  with open(os.path.join(out, f"{name}.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for method, style in zip(METHODS, ("o-", "s--", "^:", "k-")):
    values = [summary[method][str(k)] for k in keeps]
    ax.plot(keeps, values, style, label=method if method != "dense" else "dense (pruned at test)")
  ax.set_xscale("log")
  ax.set_xlabel("fraction of weights kept")
  ax.set_ylabel("test accuracy (hard top-k weights)")
  ax.set_title("Pruning during training, sklearn digits")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out, f"{name}.png"), dpi=120)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="2 sparsities, 1 seed, 150 steps")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--l", type=float, default=4.0, help="soft: initial l relative to std(W)")
  parser.add_argument("--anneal", type=float, default=10.0, help="soft: final l = l / anneal")
  parser.add_argument("--lr", type=float, default=3e-3)
  args = parser.parse_args(argv)
  keeps = (0.1, 0.02) if args.quick else KEEP
  seeds = (0,) if args.quick else (0, 1, 2)
  steps = args.steps or (150 if args.quick else 400)
  start = time.time()
  results = run(keeps, seeds, steps, args.l, args.anneal, args.lr)
  meta = {"keeps": keeps, "seeds": seeds, "steps": steps, "l": args.l, "anneal": args.anneal,
          "lr": args.lr,
          "seconds": time.time() - start, "backend": jax.default_backend()}
  name = "magnitude_pruning_quick" if args.quick else "magnitude_pruning"
  write_outputs(results, keeps, meta, args.out, name)
  with open(os.path.join(args.out, f"{name}.md")) as f:
    print(f.read())
  return results


if __name__ == "__main__":
  main()
