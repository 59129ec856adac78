#!/usr/bin/env python
"""Choosing P_K and the strength of the top-k cross-entropy, on 100 classes.

difftopk's top-k cross-entropy (Petersen, Borgelt, Kuehne and Deussen, 2022,
"Differentiable top-k classification learning", ICML), as
``implicit_topk.topk_cross_entropy`` on the sparse soft top-k mask, gives an example
exactly zero loss gradient when its label is outside the relaxed top-k of every ``k``
with ``P_K(k) > 0``: the sparse mask is exactly 0 there. This script measures how often
that happens and what it costs, on a synthetic 100-class problem (Gaussian classes in
32 dimensions, close enough that top-1 accuracy stays far from 1), a linear classifier
trained with full-batch Adam, against the softmax cross-entropy:

* ``P_K = (0, 0, 0, 0, 1)`` (top-5 only) at strengths 1 (the default) and 10, and at
  strengths 1 and 5 with ``standardize=True`` (the strength relative to each row's
  standard deviation);
* ``P_K = (0.5, 0, 0, 0, 0.5)`` (difftopk's mix of top-1 and top-5) at the default
  strength.

For each it reports the test top-1 and top-5 accuracy and the share of training
examples whose label has zero membership in the relaxed top-5 (no gradient from the
top-5 term), at the start and at the end of training; mean over 3 seeds. It also
reports how many classes have a nonzero top-5 mask for standard normal logits at a few
relative strengths (``standardize=True``), a guide for choosing one.

Usage::

    python examples/topk_loss_strength.py            # a few minutes on a busy 2-core CPU
    python examples/topk_loss_strength.py --quick    # a few steps, for the tests
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk as itk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (examples/_common.py)

CLASSES, DIM, TRAIN, TEST, K = 100, 32, 5000, 5000, 5
SPREAD, LR = 0.4, 0.1
# (name, P_K, strength, standardize)
CONFIGS = [
    ("softmax cross-entropy", None, None, False),
    ("P_K = (0,0,0,0,1), strength 1 (default)", (0, 0, 0, 0, 1), 1.0, False),
    ("P_K = (0,0,0,0,1), strength 10", (0, 0, 0, 0, 1), 10.0, False),
    ("P_K = (0,0,0,0,1), strength 1, standardize=True", (0, 0, 0, 0, 1), 1.0, True),
    ("P_K = (0,0,0,0,1), strength 5, standardize=True", (0, 0, 0, 0, 1), 5.0, True),
    ("P_K = (0.5,0,0,0,0.5), strength 1", (0.5, 0, 0, 0, 0.5), 1.0, False),
]


def make_data(seed):
  """Gaussian classes: means ~ N(0, SPREAD^2 I) in DIM dimensions, unit noise."""
  rng = np.random.default_rng(seed)
  means = rng.normal(size=(CLASSES, DIM)) * SPREAD
  def draw(count):
    y = rng.integers(0, CLASSES, size=count)
    return (means[y] + rng.normal(size=(count, DIM))).astype(np.float32), y.astype(np.int32)
  return draw(TRAIN), draw(TEST)


def cross_entropy(logits, labels):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def loss_fn(p_k, strength, standardize):
  if p_k is None:
    return cross_entropy
  return functools.partial(itk.topk_cross_entropy, p_k=p_k, regularization_strength=strength,
                           standardize=standardize, reduction="mean")


def accuracy(logits, labels, k):
  _, idx = jax.lax.top_k(logits, k)
  return float(jnp.mean(jnp.any(idx == labels[:, None], axis=-1)))


def no_gradient_share(logits, labels, strength, standardize=False):
  """Share of examples whose label is exactly outside the relaxed top-5."""
  q = itk.soft_topk_mask(logits, float(K), regularization_strength=strength, standardize=standardize)
  return float(jnp.mean(jnp.take_along_axis(q, labels[:, None], axis=1) == 0))


def run(name, p_k, strength, standardize, data, steps, seed):
  (x, y), (x_te, y_te) = data
  key = jax.random.key(seed)
  params = (jax.random.normal(key, (DIM, CLASSES)) * 0.01, jnp.zeros(CLASSES))
  loss = loss_fn(p_k, strength, standardize)
  objective = lambda params: loss(x @ params[0] + params[1], y)

  @jax.jit
  def step(params, state):
    grads = jax.grad(objective)(params)
    updates, state = _common.adam(grads, state, lr=LR)
    return jax.tree.map(jnp.add, params, updates), state

  share_strength = strength if strength is not None else 1.0
  start_share = no_gradient_share(x @ params[0] + params[1], y, share_strength, standardize)
  state = _common.adam_init(params)
  t0 = time.perf_counter()
  for _ in range(steps):
    params, state = step(params, state)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - t0
  logits = x_te @ params[0] + params[1]
  return {"method": name, "seed": seed, "top1": accuracy(logits, y_te, 1),
          "top5": accuracy(logits, y_te, K), "seconds": seconds,
          "no_grad_start": start_share,
          "no_grad_end": no_gradient_share(x @ params[0] + params[1], y, share_strength, standardize)}


def normal_support(strengths=(1.0, 2.0, 5.0), rows=1000):
  """Mean number of classes with a nonzero top-5 mask, for standard normal logits over
  the classes, at each relative strength (``standardize=True``)."""
  x = jax.random.normal(jax.random.key(0), (rows, CLASSES))
  return {f"{s:g}": float(jnp.mean(jnp.sum(itk.soft_topk_mask(x, float(K), regularization_strength=s,
                                                                standardize=True) > 0, axis=-1)))
          for s in strengths}


def summarize(records):
  rows = []
  for name, p_k, strength, standardize in CONFIGS:
    mine = [r for r in records if r["method"] == name]
    mean = lambda key: float(np.mean([r[key] for r in mine]))
    rows.append({"method": name, "p_k": p_k, "strength": strength, "standardize": standardize,
                 "top1": mean("top1"),
                 "top5": mean("top5"), "no_grad_start": mean("no_grad_start"),
                 "no_grad_end": mean("no_grad_end"), "seeds": len(mine)})
  return rows


def markdown(result):
  lines = [f"Linear classifier, {CLASSES} Gaussian classes in {DIM} dimensions, "
           f"{TRAIN} training and {TEST} test points, {result['steps']} full-batch Adam steps "
           f"(learning rate {LR:g}); mean of {result['seeds']} seeds. 'no gradient': share of training "
           "examples whose label has exactly zero membership in the relaxed top-5 at that "
           "strength (for the cross-entropy: at strength 1), at the start / end of training.",
           "",
           "| loss | test top-1 | test top-5 | no gradient, start | no gradient, end |",
           "|:---|---:|---:|---:|---:|"]
  for r in result["summary"]:
    lines.append(f"| {r['method']} | {r['top1']:.3f} | {r['top5']:.3f} | "
                 f"{r['no_grad_start']:.0%} | {r['no_grad_end']:.0%} |")
  support = ", ".join(f"{v:.0f} at {s}" for s, v in result["normal_support"].items())
  lines += ["", f"Classes of {CLASSES} with a nonzero top-{K} mask for standard normal logits, "
            f"by relative strength (`standardize=True`): {support}."]
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="20 steps, one seed (for the tests)")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
  opts = ap.parse_args(argv)
  steps, seeds = (20, 1) if opts.quick else (opts.steps, opts.seeds)
  records = []
  for seed in range(seeds):
    data = make_data(seed)
    for name, p_k, strength, standardize in CONFIGS:
      records.append(run(name, p_k, strength, standardize, data, steps, seed))
      r = records[-1]
      print(f"seed {seed} {name:50s} top-1 {r['top1']:.3f} top-5 {r['top5']:.3f} "
            f"no gradient {r['no_grad_start']:.0%} -> {r['no_grad_end']:.0%} ({r['seconds']:.1f} s)")
  result = {"steps": steps, "seeds": seeds, "records": records, "summary": summarize(records),
            "normal_support": normal_support()}
  text = markdown(result)
  print(text)
  _common.write_results(opts.out, "topk_loss_strength", opts.quick, result, text)
  return result


if __name__ == "__main__":
  main()
