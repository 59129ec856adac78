#!/usr/bin/env python
"""Training a classifier with a soft 0/1 loss from soft ranks, against cross-entropy.

Seed 003's experiment on a dataset that ships with scikit-learn (digits, 8x8 images,
10 classes): a one-hidden-layer MLP trained with Adam (a few lines here, no optimizer
dependency) on either

* cross-entropy, or
* the soft error ``mean(relu(C - soft_rank(logits)[label]))``: ``C`` minus the soft
  (1-based, ascending) rank of the true class among the ``C`` logits, which is 0 exactly
  when the true class is ranked first by a margin (``soft_rank`` is exact and sparse in
  its derivatives: ties between logits far apart do not leak gradient).

It reports test accuracy per epoch and wall time per method, and writes a figure.

Usage::

    python examples/soft_rank_training.py            # 60 epochs, under a minute on CPU
    python examples/soft_rank_training.py --quick    # 3 epochs, for the tests
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


def load_digits(seed=0):
  from sklearn.datasets import load_digits as sklearn_digits

  data = sklearn_digits()
  x = (data.data / 16.0).astype(np.float32)
  y = data.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(y))
  x, y = x[order], y[order]
  split = int(0.7 * len(y))
  return (x[:split], y[:split]), (x[split:], y[split:])


def init_mlp(key, sizes=(64, 64, 10)):
  params = []
  for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
    key, sub = jax.random.split(key)
    params.append((jax.random.normal(sub, (fan_in, fan_out)) / np.sqrt(fan_in), jnp.zeros(fan_out)))
  return params


def mlp(params, x):
  for w, b in params[:-1]:
    x = jax.nn.relu(x @ w + b)
  w, b = params[-1]
  return x @ w + b


def cross_entropy(logits, labels):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def soft_error(logits, labels, l=1.0):
  ranks = itk.soft_rank(logits, l=l)  # 1-based, the largest logit gets C
  true_rank = jnp.take_along_axis(ranks, labels[:, None], axis=1)[:, 0]
  return jnp.mean(jax.nn.relu(logits.shape[-1] - true_rank))


LOSSES = {"cross-entropy": cross_entropy, "soft 0/1 error (soft ranks)": soft_error}


def adam(grads, state, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
  m, v, t = state
  t = t + 1
  m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
  v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
  updates = jax.tree.map(lambda m, v: -lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps), m, v)
  return updates, (m, v, t)


def train(loss_fn, data, epochs, batch=64, seed=0):
  (x_tr, y_tr), (x_te, y_te) = data
  params = init_mlp(jax.random.PRNGKey(seed))
  zeros = jax.tree.map(jnp.zeros_like, params)
  state = (zeros, zeros, 0)

  @jax.jit
  def step(params, state, xb, yb):
    grads = jax.grad(lambda p: loss_fn(mlp(p, xb), yb))(params)
    updates, state = adam(grads, state)
    return jax.tree.map(jnp.add, params, updates), state

  accuracy = jax.jit(lambda p, x, y: jnp.mean(jnp.argmax(mlp(p, x), -1) == y))
  rng = np.random.default_rng(seed)
  history, start = [], time.perf_counter()
  for _ in range(epochs):
    order = rng.permutation(len(y_tr))
    for i in range(0, len(order) - batch + 1, batch):
      idx = order[i:i + batch]
      params, state = step(params, state, x_tr[idx], y_tr[idx])
    history.append(float(accuracy(params, x_te, y_te)))
  return history, time.perf_counter() - start


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--epochs", type=int, default=60)
  ap.add_argument("--out", default=os.path.join("examples", "results"))
  opts = ap.parse_args(argv)
  epochs = 3 if opts.quick else opts.epochs
  data = load_digits()
  results = {}
  for name, loss_fn in LOSSES.items():
    history, seconds = train(loss_fn, data, epochs)
    results[name] = {"test_accuracy": history, "seconds": seconds}
    print(f"{name:>28s}: test accuracy {history[-1]:.3f} after {epochs} epochs, {seconds:.1f} s")
  os.makedirs(opts.out, exist_ok=True)
  stem = os.path.join(opts.out, "soft_rank_training" + ("_quick" if opts.quick else ""))
  with open(stem + ".json", "w") as f:
    json.dump(results, f, indent=1)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5, 3.5))
  for name, r in results.items():
    ax.plot(np.arange(1, epochs + 1), r["test_accuracy"], label=f"{name} ({r['seconds']:.0f} s)")
  ax.set_xlabel("epoch")
  ax.set_ylabel("test accuracy (digits)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(stem + ".png", dpi=110)
  print(f"wrote {stem}.json, .png")
  return results


if __name__ == "__main__":
  main()
