#!/usr/bin/env python
"""Top-k training: cross-entropy vs sparse top-k cross-entropy vs Fenchel-Young vs baselines.

A one-hidden-layer MLP on scikit-learn's digits (8x8 images, 10 classes; 30% of the
training labels replaced by random ones, so that top-5 accuracy is not trivially 1),
trained with Adam on

* softmax cross-entropy;
* our top-k cross-entropy (difftopk's loss, P_K = (1/2, 0, 0, 0, 1/2), on the sparse soft
  top-k mask, p = 4/3);
* the Fenchel-Young loss of the sparse top-1 operator (p = 4/3, k = 1, one-hot target);
* the smooth top-5 SVM loss (Berrada et al. 2018);
* the same top-k cross-entropy on two baselines: NeuralSort and an odd-even
  differentiable sorting network (Cauchy).

It reports top-1 and top-5 test accuracy and wall time (training, compile included) per
method in a table (``examples/results/topk_training.md``), JSON and a plot.

Usage::

    python examples/topk_training.py            # 40 epochs, a few minutes on CPU
    python examples/topk_training.py --quick    # 2 epochs, for the tests
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from implicit_topk import losses

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (examples/_common.py)

P_K = (0.5, 0.0, 0.0, 0.0, 0.5)


def cross_entropy(logits, labels):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def fenchel_young(logits, labels):
  return losses.topk_fenchel_young_loss(logits, jax.nn.one_hot(labels, logits.shape[-1]), 1,
                                        regularization_strength=1.0, reduction="mean")


LOSSES = {
    "softmax cross-entropy": cross_entropy,
    "top-k CE, sparse (ours)": functools.partial(losses.topk_cross_entropy, p_k=P_K, regularization_strength=1.0,
                                                 reduction="mean"),
    "Fenchel-Young, sparse top-1 (ours)": fenchel_young,
    "smooth top-5 SVM": functools.partial(losses.smooth_topk_svm_loss, k=5, tau=1.0, reduction="mean"),
    "top-k CE, NeuralSort": functools.partial(losses.topk_cross_entropy, p_k=P_K, method="neuralsort",
                                              inverse_temperature=0.5, reduction="mean"),
    "top-k CE, odd-even network": functools.partial(losses.topk_cross_entropy, p_k=P_K, method="odd_even",
                                                    inverse_temperature=2.0, distribution="cauchy",
                                                    reduction="mean"),
}


def topk_accuracy(logits, labels, k):
  _, idx = jax.lax.top_k(logits, k)
  return jnp.mean(jnp.any(idx == labels[:, None], axis=-1))


def train(loss_fn, data, epochs, batch=64, seed=0):
  _, (x_te, y_te) = data
  params, _, seconds = _common.train_mlp(loss_fn, data, epochs=epochs, sizes=(64, 32, 10),
                                         lr=5e-3, batch=batch, seed=seed)
  logits = _common.mlp(params, x_te)
  return {"top1": float(topk_accuracy(logits, y_te, 1)), "top5": float(topk_accuracy(logits, y_te, 5)),
          "seconds": seconds, "epochs": epochs}


def markdown_table(results):
  lines = ["| loss | top-1 test acc. | top-5 test acc. | wall time (s) |", "|---|---|---|---|"]
  for name, r in results.items():
    lines.append(f"| {name} | {r['top1']:.3f} | {r['top5']:.3f} | {r['seconds']:.1f} |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--epochs", type=int, default=40)
  ap.add_argument("--out", default=os.path.join("examples", "results"))
  opts = ap.parse_args(argv)
  epochs = 2 if opts.quick else opts.epochs
  data = _common.load_digits(label_noise=0.3)
  results = {}
  for name, loss_fn in LOSSES.items():
    results[name] = train(loss_fn, data, epochs)
    r = results[name]
    print(f"{name:>36s}: top-1 {r['top1']:.3f}, top-5 {r['top5']:.3f}, {r['seconds']:.1f} s")
  os.makedirs(opts.out, exist_ok=True)
  stem = os.path.join(opts.out, "topk_training" + ("_quick" if opts.quick else ""))
  with open(stem + ".json", "w") as f:
    json.dump(results, f, indent=1)
  header = (f"Digits (scikit-learn), MLP 64-32-10, {epochs} epochs of Adam, batch 64, 30% of training "
            f"labels randomized; P_K = {list(P_K)}; CPU wall time of training (compile included).\n\n")
  with open(stem + ".md", "w") as f:
    f.write(header + markdown_table(results) + "\n")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(results)
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
  pos = np.arange(len(names))
  ax1.barh(pos - 0.2, [results[n]["top1"] for n in names], 0.4, label="top-1")
  ax1.barh(pos + 0.2, [results[n]["top5"] for n in names], 0.4, label="top-5")
  ax1.set_yticks(pos, names, fontsize=8)
  ax1.set_xlabel("test accuracy")
  ax1.set_xlim(0.5, 1.0)
  ax1.legend(fontsize=8)
  ax2.barh(pos, [results[n]["seconds"] for n in names])
  ax2.set_yticks(pos, [""] * len(names))
  ax2.set_xlabel("wall time (s)")
  fig.tight_layout()
  fig.savefig(stem + ".png", dpi=110)
  print(f"wrote {stem}.json, .md, .png")
  return results


if __name__ == "__main__":
  main()
