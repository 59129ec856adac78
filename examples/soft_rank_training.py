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
import sys

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk as itk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (examples/_common.py)


def cross_entropy(logits, labels):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def soft_error(logits, labels, l=1.0):
  ranks = itk.soft_rank(logits, regularization_strength=l)  # 1-based, the largest logit gets C
  true_rank = jnp.take_along_axis(ranks, labels[:, None], axis=1)[:, 0]
  return jnp.mean(jax.nn.relu(logits.shape[-1] - true_rank))


LOSSES = {"cross-entropy": cross_entropy, "soft 0/1 error (soft ranks)": soft_error}


def train(loss_fn, data, epochs, batch=64, seed=0):
  _, (x_te, y_te) = data
  accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(_common.mlp(p, x_te), -1) == y_te))
  _, history, seconds = _common.train_mlp(
      loss_fn, data, epochs=epochs, sizes=(64, 64, 10), lr=1e-2, batch=batch, seed=seed,
      evaluate=lambda p: float(accuracy(p)))
  return history, seconds


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--epochs", type=int, default=60)
  ap.add_argument("--out", default=os.path.join("examples", "results"))
  opts = ap.parse_args(argv)
  epochs = 3 if opts.quick else opts.epochs
  data = _common.load_digits()
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
