#!/usr/bin/env python
r"""A strength schedule for pruning with ``soft_topk_mag(..., standardize=True)``.

Magnitude pruning of a 64-128-10 MLP on scikit-learn's digits to 5% of the weights of
each matrix. Every seed first trains the dense network (``--pretrain`` full-batch Adam
steps); then every method fine-tunes the same weights for ``--steps`` steps with the
pruning in the forward pass, and is evaluated at exactly ``k`` nonzero weights per
matrix (``hard_topk_mag``; biases are not pruned):

* ``soft, l = a -> b``: each matrix ``W`` is replaced by ``soft_topk_mag(W.ravel(), k,
  regularization_strength=l_t, standardize=True)`` (p = 4/3), ``l_t`` geometric from
  ``a`` at the first step to ``b`` at the last, ``l_t = a (b / a) ** (t / (T - 1))``;
  ``soft, l = c``: constant;
* ``straight-through``: ``hard_topk_mag(W)`` forward, identity backward;
* ``fixed mask``: the ``k`` largest weights of the pretrained matrix are kept, the
  others set to 0 once, and the kept weights fine-tuned (gradient through the mask);
* ``dense``: no pruning (the accuracy ceiling; evaluated unpruned).

With ``standardize=True`` the operator solves with ``l * std(W) ** (2 - p)``: the
strength is relative to the spread of the matrix and the same schedule applies at any
scale of the weights. Recorded every ``--eval-every`` steps: the density of the weights
the forward pass uses (nonzero entries of the soft output over all pruned weights; 5%
for the hard methods), and the test accuracy at exactly ``k`` nonzero weights.

Outputs ``<out>/pruning_schedule{,_quick}.{json,md,png}``.

Usage::

    python examples/pruning_schedule.py            # 3 seeds, a few minutes on a CPU
    python examples/pruning_schedule.py --quick    # 1 seed, fewer steps: for the tests
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk as itk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (examples/_common.py)
import magnitude_pruning as mp  # noqa: E402  (examples/magnitude_pruning.py: data, MLP)

# name -> (kind, first strength, last strength)
METHODS = {
    "soft, l = 0.4": ("soft", 0.4, 0.4),
    "soft, l = 0.05": ("soft", 0.05, 0.05),
    "soft, l = 1 -> 0.05": ("soft", 1.0, 0.05),
    "soft, l = 0.4 -> 0.02": ("soft", 0.4, 0.02),
    "soft, l = 2 -> 0.02": ("soft", 2.0, 0.02),
    "straight-through": ("ste", None, None),
    "fixed mask": ("fixed", None, None),
    "dense": ("dense", None, None),
}
QUICK_METHODS = ("soft, l = 0.4", "soft, l = 1 -> 0.05", "straight-through", "fixed mask")


def geometric(first, last, steps):
  """Strength per step, geometric from ``first`` to ``last`` (constant if equal)."""
  return first * (last / first) ** (np.arange(steps) / max(steps - 1, 1))


def _hard(w, k):
  thresh = mp._kth_largest(jax.lax.stop_gradient(jnp.abs(w)), k)  # pylint: disable=protected-access
  return jnp.where(jnp.abs(w) >= thresh, w, 0.0)


def pruned_weights(params, ks, masks, kind, l):
  """The weights the forward pass uses."""
  out = []
  for (w, b), k, mask in zip(params, ks, masks):
    if kind == "soft":
      w = itk.soft_topk_mag(w.ravel(), k.astype(w.dtype), regularization_strength=l,
                            standardize=True).reshape(w.shape)
    elif kind == "ste":
      w = w + jax.lax.stop_gradient(_hard(w, k) - w)
    elif kind == "fixed":
      w = w * mask
    out.append((w, b))
  return out


def make_step(kind, lr):
  b1, b2, eps = 0.9, 0.999, 1e-8

  def loss_fn(params, ks, masks, l, x, y):
    logits = mp.forward(pruned_weights(params, ks, masks, kind, l), x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

  @jax.jit
  def step(params, opt, ks, masks, l, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, ks, masks, l, x, y)
    m, v, t = opt
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
    params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
    return params, (m, v, t), loss

  return step


def make_probe(kind):
  @jax.jit
  def probe(params, ks, masks, l, x, y):
    used = pruned_weights(params, ks, masks, kind, l)
    nonzero = sum(jnp.sum(w != 0) for w, _ in used)
    hard = [(_hard(w, k), b) for (w, b), k in zip(params, ks)] if kind != "dense" else params
    if kind == "fixed":
      hard = used
    acc = jnp.mean(jnp.argmax(mp.forward(hard, x), -1) == y)
    acc_used = jnp.mean(jnp.argmax(mp.forward(used, x), -1) == y)
    return nonzero, acc, acc_used

  return probe


def adam_state(params):
  zeros = jax.tree.map(jnp.zeros_like, params)
  return (zeros, zeros, jnp.asarray(0, jnp.float32))


def run(names, seeds, opts):
  steps_fns = {kind: make_step(kind, opts.lr) for kind in ("soft", "ste", "fixed", "dense")}
  probes = {kind: make_probe(kind) for kind in ("soft", "ste", "fixed", "dense")}
  results = {name: [] for name in names}
  for seed in seeds:
    (x_tr, y_tr), (x_te, y_te) = mp.load_digits(seed)
    x_tr, y_tr, x_te, y_te = map(jnp.asarray, (x_tr, y_tr, x_te, y_te))
    params = mp.init_params(jax.random.PRNGKey(seed))
    sizes = [w.size for w, _ in params]
    ks_int = [max(1, int(round(opts.keep * s))) for s in sizes]
    ks = [jnp.asarray(k, jnp.int32) for k in ks_int]
    ones = [jnp.ones_like(w) for w, _ in params]
    opt = adam_state(params)
    for _ in range(opts.pretrain):
      params, opt, _ = steps_fns["dense"](params, opt, ks, ones, jnp.float32(1.0), x_tr, y_tr)
    pretrained = params
    for name in names:
      kind, first, last = METHODS[name]
      strengths = (geometric(first, last, opts.steps) if kind == "soft"
                   else np.ones(opts.steps))
      masks = ([(_hard(w, k) != 0).astype(w.dtype) for (w, _), k in zip(pretrained, ks)]
               if kind == "fixed" else ones)
      params, opt = pretrained, adam_state(pretrained)
      history = []
      for t in range(opts.steps + 1):
        if t % opts.eval_every == 0 or t == opts.steps:
          l = jnp.float32(strengths[min(t, opts.steps - 1)])
          nonzero, acc, acc_used = probes[kind](params, ks, masks, l, x_te, y_te)
          history.append(dict(step=t, strength=float(l) if kind == "soft" else None,
                              density=float(nonzero) / sum(sizes), test_acc=float(acc),
                              test_acc_forward=float(acc_used)))
        if t < opts.steps:
          params, opt, _ = steps_fns[kind](params, opt, ks, masks, jnp.float32(strengths[t]),
                                           x_tr, y_tr)
      densities = [h["density"] for h in history]
      results[name].append(dict(seed=seed, history=history, final_acc=history[-1]["test_acc"],
                                density_start=densities[0], density_max=max(densities),
                                density_end=densities[-1]))
      print(f"seed {seed} {name:<24} density {densities[0]:.3f} -> max {max(densities):.3f} "
            f"-> {densities[-1]:.3f}; test acc at k {history[-1]['test_acc']:.3f}", flush=True)
  return results


CALIBRATION_STRENGTHS = (2.0, 1.0, 0.4, 0.2, 0.1, 0.05, 0.02, 0.01)
CALIBRATION_KEEPS = (0.2, 0.1, 0.05, 0.02, 0.01)


def calibrate(seed, opts):
  """Density of soft_topk_mag(W, keep * size, l, standardize=True) over l and keep, for
  the pretrained 64 x 128 matrix and for Gaussian noise of the same size (no training)."""
  (x_tr, y_tr), _ = mp.load_digits(seed)
  params = mp.init_params(jax.random.PRNGKey(seed))
  step = make_step("dense", opts.lr)
  ones = [jnp.ones_like(w) for w, _ in params]
  ks = [jnp.asarray(1, jnp.int32)] * len(params)
  opt = adam_state(params)
  for _ in range(opts.pretrain):
    params, opt, _ = step(params, opt, ks, ones, jnp.float32(1.0), jnp.asarray(x_tr),
                          jnp.asarray(y_tr))
  mats = {"pretrained W1": params[0][0].ravel(),
          "Gaussian": jax.random.normal(jax.random.PRNGKey(seed), (params[0][0].size,))}
  table = {}
  for name, w in mats.items():
    table[name] = {}
    for keep in CALIBRATION_KEEPS:
      k = keep * w.size
      table[name][str(keep)] = {
          str(l): float(jnp.mean(itk.soft_topk_mag(w, k, regularization_strength=l,
                                                   standardize=True) != 0))
          for l in CALIBRATION_STRENGTHS}
  return table


def markdown(result):
  o = result["options"]
  lines = [
      "# A strength schedule for soft magnitude pruning with `standardize=True`", "",
      f"Quick run: {o['quick']}. MLP 64-128-10 on scikit-learn digits, keep {o['keep']:g} of "
      f"each weight matrix ({result['k']} of {result['sizes']} weights). Dense pretraining "
      f"{o['pretrain']} full-batch Adam steps, then {o['steps']} fine-tuning steps per method "
      f"(lr {o['lr']}), seeds {', '.join(map(str, o['seeds']))}. Soft: `soft_topk_mag(W.ravel(), "
      "k, regularization_strength=l_t, standardize=True)`, p = 4/3, `l_t` geometric from the "
      "first to the last value. Density: nonzero weights used by the forward pass over all "
      "pruned weights (target "
      f"{o['keep']:.0%}). Accuracy: test set, at exactly k nonzero weights per matrix (hard "
      f"top-k in magnitude; the dense row unpruned). Wall time {result['seconds']:.0f} s "
      f"({result['backend']}).", "",
      "| method | density at start of fine-tuning | largest density | final density | "
      "test acc (mean) | test acc per seed |",
      "|---|---:|---:|---:|---:|---|"]
  for name in result["methods"]:
    runs = result["runs"][name]
    mean = lambda key: float(np.mean([r[key] for r in runs]))  # noqa: E731
    lines.append(
        f"| {name} | {mean('density_start'):.1%} | {mean('density_max'):.1%} | "
        f"{mean('density_end'):.1%} | {mean('final_acc'):.3f} | "
        + " / ".join(f"{r['final_acc']:.3f}" for r in runs) + " |")
  soft = [n for n in result["methods"] if METHODS[n][0] == "soft"]
  if soft:
    steps = [h["step"] for h in result["runs"][soft[0]][0]["history"]]
    marks = sorted({steps[0], steps[len(steps) // 4], steps[len(steps) // 2],
                    steps[3 * len(steps) // 4], steps[-1]})
    lines += ["", "Density during fine-tuning (mean over seeds) / test accuracy at k:", "",
              "| method | " + " | ".join(f"step {s}" for s in marks) + " |",
              "|---|" + "---:|" * len(marks)]
    for name in soft + [n for n in result["methods"] if n not in soft and n != "dense"]:
      runs = result["runs"][name]
      cells = []
      for s in marks:
        i = steps.index(s)
        d = np.mean([r["history"][i]["density"] for r in runs])
        a = np.mean([r["history"][i]["test_acc"] for r in runs])
        cells.append(f"{d:.1%} / {a:.3f}")
      lines.append(f"| {name} | " + " | ".join(cells) + " |")
  cal = result.get("calibration")
  if cal:
    lines += ["", "Density / target of `soft_topk_mag(w, keep * w.size, regularization_strength=l, "
              "standardize=True)` (p = 4/3) at a fixed matrix: the pretrained 64 x 128 matrix "
              f"(seed {o['seeds'][0]}) and Gaussian noise of the same size:", "",
              "| matrix | keep | " + " | ".join(f"l = {l:g}" for l in CALIBRATION_STRENGTHS) + " |",
              "|---|---:|" + "---:|" * len(CALIBRATION_STRENGTHS)]
    for name, by_keep in cal.items():
      for keep, by_l in by_keep.items():
        lines.append(f"| {name} | {float(keep):.0%} | " + " | ".join(
            f"{by_l[str(l)] / float(keep):.2f}" for l in CALIBRATION_STRENGTHS) + " |")
  lines.append("")
  return "\n".join(lines)


def plot(result, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  for name in result["methods"]:
    if name == "dense":
      continue
    runs = result["runs"][name]
    steps = [h["step"] for h in runs[0]["history"]]
    dens = np.mean([[h["density"] for h in r["history"]] for r in runs], axis=0)
    acc = np.mean([[h["test_acc"] for h in r["history"]] for r in runs], axis=0)
    axes[0].plot(steps, 100 * dens, label=name)
    axes[1].plot(steps, acc, label=name)
  axes[0].axhline(100 * result["options"]["keep"], color="0.5", ls="--", lw=1)
  axes[0].set_yscale("log"), axes[0].set_xlabel("fine-tuning step")
  axes[0].set_ylabel("density of the forward weights (%)"), axes[0].legend(fontsize=7)
  axes[1].set_xlabel("fine-tuning step"), axes[1].set_ylabel("test accuracy at k")
  axes[1].set_ylim(0.5, 1.0), axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="1 seed, 4 methods, fewer steps")
  ap.add_argument("--keep", type=float, default=0.05)
  ap.add_argument("--pretrain", type=int, default=None, help="default 200 (quick: 100)")
  ap.add_argument("--steps", type=int, default=None, help="default 300 (quick: 60)")
  ap.add_argument("--eval-every", type=int, default=None, help="default 10 (quick: 20)")
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--seeds", type=int, nargs="+", default=None)
  ap.add_argument("--methods", nargs="+", default=None, choices=list(METHODS))
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results"))
  opts = ap.parse_args(argv)
  opts.pretrain = opts.pretrain or (100 if opts.quick else 200)
  opts.steps = opts.steps or (60 if opts.quick else 300)
  opts.eval_every = opts.eval_every or (20 if opts.quick else 10)
  opts.seeds = opts.seeds or ([0] if opts.quick else [0, 1, 2])
  names = opts.methods or list(QUICK_METHODS if opts.quick else METHODS)
  start = time.time()
  runs = run(names, opts.seeds, opts)
  calibration = calibrate(opts.seeds[0], opts)
  sizes = [64 * 128, 128 * 10]
  result = dict(options=vars(opts), methods=names, runs=runs, sizes=sizes,
                calibration=calibration,
                k=[max(1, int(round(opts.keep * s))) for s in sizes],
                definitions={n: list(METHODS[n]) for n in names},
                seconds=time.time() - start, backend=jax.default_backend(), jax=jax.__version__)
  text = markdown(result)
  stem_name = "pruning_schedule" + (f"_keep{opts.keep:g}" if opts.keep != 0.05 else "")
  stem = _common.write_results(opts.out, stem_name, opts.quick, result, text, plot)
  print(text)
  print(f"wrote {stem}.{{md,json,png}}")
  return result


if __name__ == "__main__":
  main()
