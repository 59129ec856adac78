#!/usr/bin/env python
"""Global soft magnitude pruning of an MLP whose weights are sharded over 8 host devices.

An MLP 64-128-128-10 on scikit-learn's digits is trained dense (full-batch Adam), then
pruned to 90%, 95% and 98% sparsity of its weight matrices (biases are not pruned) in
five ways:

* ``per-layer hard``: every matrix keeps its own largest ``(1 - s)`` fraction of
  entries in magnitude (one-shot, no fine-tuning);
* ``global hard``: one magnitude threshold for all matrices together, keeping
  ``k = (1 - s) n`` weights of the whole model (one-shot);
* ``per-layer hard + FT`` / ``global hard + FT``: the same masks, then fine-tuned for
  ``--ft-steps`` Adam steps with the mask fixed (pruned weights stay 0);
* ``global soft + FT`` (ours): fine-tuned for the same number of steps with the forward
  pass through ``tree_soft_topk_mag(weights, k, l)``, the soft top-k in magnitude of
  Sander et al. (2023) with **one threshold across all weight matrices**, ``l``
  annealed geometrically towards 0; then hardened: global hard magnitude pruning of
  the fine-tuned weights (exactly ``k`` nonzero weights).

Every method is evaluated at exactly the same number of nonzero weights (per-layer
methods: the same fraction per matrix, hence the same total up to rounding).

The three weight matrices live on a mesh of 8 host devices, each sharded differently:
``w1`` by columns (``P(None, "d")``), ``w2`` by rows (``P("d", None)``), ``w3``
replicated, the biases replicated. ``tree_soft_topk_mag`` never concatenates them:
every Newton step sums each leaf where it lives and adds the scalars, and the pruned
leaves keep their sharding. The script checks the compiled pruning function for
all-gathers (there are none) and prints the shardings. (The hard global baseline
concatenates and sorts all magnitudes, which all-gathers.)

Outputs ``<out>/global_pruning.{json,md}`` and the figure ``--figure``
(``docs/global_pruning.png``).

Usage::

    python examples/global_pruning.py        # < 90 s on a 2-core CPU (what the test runs)

Needs scikit-learn (the dataset) and matplotlib (the figure).
"""

from __future__ import annotations

import os

# 8 host devices; must be set before jax is imported.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import implicit_topk as itk  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (examples/_common.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPARSITIES = (0.9, 0.95, 0.98)
METHODS = ("per-layer hard", "global hard", "per-layer hard + FT", "global hard + FT",
           "global soft + FT")
WEIGHTS = ("w1", "w2", "w3")
SPECS = {"w1": P(None, "d"), "b1": P(), "w2": P("d", None), "b2": P(), "w3": P(), "b3": P()}


def init_params(key, sizes):
  params = {}
  keys = jax.random.split(key, len(sizes) - 1)
  for i, (key, fan_in, fan_out) in enumerate(zip(keys, sizes, sizes[1:]), start=1):
    params[f"w{i}"] = jax.random.normal(key, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in)
    params[f"b{i}"] = jnp.zeros(fan_out)
  return params


def shard(params, mesh):
  return {name: jax.device_put(v, NamedSharding(mesh, SPECS[name])) for name, v in params.items()}


def forward(params, x):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  h = jax.nn.relu(h @ params["w2"] + params["b2"])
  return h @ params["w3"] + params["b3"]


def cross_entropy(logits, y):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


@jax.jit
def _accuracy(params, x, y):
  return jnp.mean(jnp.argmax(forward(params, x), -1) == y)


def accuracy(params, x, y):
  return float(_accuracy(params, x, y))


# ----------------------------------------------------------------------------------
# pruning
# ----------------------------------------------------------------------------------


def weights_of(params):
  return {name: params[name] for name in WEIGHTS}


def soft_prune(params, k, l):
  """Global soft top-k in magnitude over the weight matrices (one threshold)."""
  pruned = itk.tree_soft_topk_mag(weights_of(params), k, regularization_strength=l)
  return {**params, **pruned}


@jax.jit
def _global_hard_masks(params, k):
  flat = jnp.concatenate([jnp.abs(params[n]).ravel() for n in WEIGHTS])  # all-gathers
  threshold = -jnp.sort(-flat)[k - 1]
  return {n: jnp.abs(params[n]) >= threshold for n in WEIGHTS}


def global_hard_masks(params, k):
  """One magnitude threshold for all matrices: the k-th largest |w| of the model."""
  return _global_hard_masks(weights_of(params), jnp.asarray(k, jnp.int32))


@jax.jit
def _per_layer_hard_masks(params, keeps):
  return {n: jnp.abs(params[n]) >= -jnp.sort(-jnp.abs(params[n]).ravel())[keeps[n] - 1]
          for n in WEIGHTS}


def per_layer_hard_masks(params, sparsity):
  """Every matrix keeps its own (1 - sparsity) fraction of largest magnitudes."""
  keeps = {n: jnp.asarray(max(1, int(round((1 - sparsity) * params[n].size))), jnp.int32)
           for n in WEIGHTS}
  return _per_layer_hard_masks(weights_of(params), keeps)


def apply_masks(params, masks):
  return {name: (v * masks[name] if name in masks else v) for name, v in params.items()}


def nonzeros(params):
  return int(sum(int(np.count_nonzero(np.asarray(params[n]))) for n in WEIGHTS))


# ----------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------


def adam_step(params, grads, opt, lr, b1=0.9, b2=0.999, eps=1e-8):
  m, v, t = opt
  t = t + 1
  m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
  v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
  scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
  params = jax.tree.map(lambda p, a, b: p - scale * a / (jnp.sqrt(b) + eps), params, m, v)
  return params, (m, v, t)


def adam_init(params):
  zeros = jax.tree.map(jnp.zeros_like, params)
  return (zeros, zeros, jnp.asarray(0.0, jnp.float32))


@jax.jit
def dense_step(params, opt, x, y, lr):
  loss, grads = jax.value_and_grad(lambda p: cross_entropy(forward(p, x), y))(params)
  params, opt = adam_step(params, grads, opt, lr)
  return params, opt, loss


@jax.jit
def masked_step(params, opt, masks, x, y, lr):
  loss, grads = jax.value_and_grad(
      lambda p: cross_entropy(forward(apply_masks(p, masks), x), y))(params)
  params, opt = adam_step(params, grads, opt, lr)
  return apply_masks(params, masks), opt, loss


@jax.jit
def soft_step(params, opt, k, l, x, y, lr):
  loss, grads = jax.value_and_grad(
      lambda p: cross_entropy(forward(soft_prune(p, k, l), x), y))(params)
  params, opt = adam_step(params, grads, opt, lr)
  return params, opt, loss


def run(opts):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  (x_tr, y_tr), (x_te, y_te) = _common.load_digits_standardized(opts.seed)
  x_tr, y_tr, x_te, y_te = map(jnp.asarray, (x_tr, y_tr, x_te, y_te))
  params = shard(init_params(jax.random.PRNGKey(opts.seed), (64, opts.hidden, opts.hidden, 10)),
                 mesh)
  n_weights = sum(params[n].size for n in WEIGHTS)
  lr = jnp.asarray(opts.lr, jnp.float32)
  ft_lr = jnp.asarray(opts.ft_lr, jnp.float32)

  start = time.perf_counter()
  opt = adam_init(params)
  for _ in range(opts.steps):
    params, opt, loss = jax.block_until_ready(dense_step(params, opt, x_tr, y_tr, lr))
  dense = dict(test_acc=accuracy(params, x_te, y_te), train_loss=float(loss),
               seconds=time.perf_counter() - start)
  print(f"dense: test acc {dense['test_acc']:.3f} ({opts.steps} steps, "
        f"{dense['seconds']:.1f} s), {n_weights} weights")

  # The soft pruning step on its own: no all-gather of any leaf, shardings kept.
  scale = float(jnp.std(jnp.concatenate([params[n].ravel() for n in WEIGHTS])))
  f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
  prune_fn = jax.jit(lambda p, k, l: {**p, **itk.tree_soft_topk_mag(weights_of(p), k, regularization_strength=l)})
  prune_fn = prune_fn.lower(params, f32(1000.0), f32(0.1 * scale)).compile()
  hlo = prune_fn.as_text()
  pruned = prune_fn(params, f32(1000.0), f32(0.1 * scale))
  sharding_check = dict(
      all_gather_in_prune_hlo="all-gather" in hlo,
      all_reduce_in_prune_hlo="all-reduce" in hlo,
      shardings={n: str(pruned[n].sharding.spec) for n in WEIGHTS},
      input_shardings={n: str(params[n].sharding.spec) for n in WEIGHTS})
  print(f"tree_soft_topk_mag on the sharded weights: all-gather in compiled HLO: "
        f"{sharding_check['all_gather_in_prune_hlo']}, all-reduce: "
        f"{sharding_check['all_reduce_in_prune_hlo']}; output shardings "
        f"{sharding_check['shardings']}")

  ls = [jnp.asarray(opts.l * scale * opts.anneal ** (-t / max(opts.ft_steps - 1, 1)), jnp.float32)
        for t in range(opts.ft_steps)]
  results = {m: {} for m in METHODS}
  for sparsity in opts.sparsities:
    k = int(round((1 - sparsity) * n_weights))
    masks = {"per-layer hard": per_layer_hard_masks(params, sparsity),
             "global hard": global_hard_masks(params, k)}
    for name, m in masks.items():
      pruned = apply_masks(params, m)
      results[name][str(sparsity)] = dict(test_acc=accuracy(pruned, x_te, y_te),
                                          nonzeros=nonzeros(pruned))
      ft, ft_opt = pruned, adam_init(pruned)
      t0 = time.perf_counter()
      for _ in range(opts.ft_steps):
        ft, ft_opt, _ = jax.block_until_ready(masked_step(ft, ft_opt, m, x_tr, y_tr, ft_lr))
      results[name + " + FT"][str(sparsity)] = dict(test_acc=accuracy(ft, x_te, y_te),
                                                    nonzeros=nonzeros(ft),
                                                    seconds=time.perf_counter() - t0)
    soft, soft_opt = params, adam_init(params)
    kk = jnp.asarray(float(k), jnp.float32)
    t0 = time.perf_counter()
    for t in range(opts.ft_steps):
      soft, soft_opt, _ = jax.block_until_ready(
          soft_step(soft, soft_opt, kk, ls[t], x_tr, y_tr, ft_lr))
    soft_seconds = time.perf_counter() - t0
    soft_sparse_frac = 1 - nonzeros(prune_fn(soft, kk, ls[-1])) / n_weights
    hard = apply_masks(soft, global_hard_masks(soft, k))
    results["global soft + FT"][str(sparsity)] = dict(
        test_acc=accuracy(hard, x_te, y_te), nonzeros=nonzeros(hard), seconds=soft_seconds,
        soft_test_acc=accuracy(prune_fn(soft, kk, ls[-1]), x_te, y_te),
        soft_sparsity=soft_sparse_frac,
        per_layer_kept={n: int(np.count_nonzero(np.asarray(hard[n]))) for n in WEIGHTS})
    row = " | ".join(f"{m} {results[m][str(sparsity)]['test_acc']:.3f}" for m in METHODS)
    times = ", ".join(f"{m} {results[m][str(sparsity)]['seconds']:.1f} s" for m in METHODS
                      if "FT" in m)
    print(f"sparsity {sparsity:.0%} (k = {k}): {row}; fine-tuning {times}", flush=True)
  return dict(dense=dense, results=results, n_weights=int(n_weights), sharding=sharding_check,
              layer_sizes={n: int(params[n].size) for n in WEIGHTS})


# ----------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------


def markdown(result):
  o = result["options"]
  lines = [
      f"# Global soft magnitude pruning of a 64-{o['hidden']}-{o['hidden']}-10 MLP "
      "(sklearn digits, weights sharded over 8 host devices)", "",
      f"Dense: {o['steps']} full-batch Adam steps (lr {o['lr']}), test accuracy "
      f"{result['dense']['test_acc']:.3f}; {result['n_weights']} weights "
      f"({', '.join(f'{n} {s}' for n, s in result['layer_sizes'].items())}), biases not pruned. "
      f"Fine-tuning (+ FT): {o['ft_steps']} full-batch Adam steps (lr {o['ft_lr']}); soft: "
      f"`tree_soft_topk_mag` over the three matrices (one threshold), p = 4/3, l = {o['l']} "
      f"x std(weights) annealed to {o['l'] / o['anneal']:g} x std(weights), then hardened "
      f"(global hard magnitude pruning). Test accuracy at exactly k = (1 - sparsity) x "
      f"{result['n_weights']} nonzero weights. Seed {o['seed']}; wall time "
      f"{result['seconds']:.0f} s ({result['backend']}, {result['devices']} devices).", "",
      "| sparsity | k | " + " | ".join(METHODS) + " |",
      "|---|---:|" + "---:|" * len(METHODS)]
  for s in o["sparsities"]:
    r = {m: result["results"][m][str(s)] for m in METHODS}
    lines.append(f"| {s:.0%} | {r['global hard']['nonzeros']} | "
                 + " | ".join(f"{r[m]['test_acc']:.3f}" for m in METHODS) + " |")
  lines += ["", "Weights kept per matrix by the hardened global soft pruning "
            f"(sizes {', '.join(f'{n} {s}' for n, s in result['layer_sizes'].items())}):", "",
            "| sparsity | " + " | ".join(WEIGHTS) + " |", "|---|" + "---:|" * len(WEIGHTS)]
  for s in o["sparsities"]:
    kept = result["results"]["global soft + FT"][str(s)]["per_layer_kept"]
    lines.append(f"| {s:.0%} | " + " | ".join(str(kept[n]) for n in WEIGHTS) + " |")
  sc = result["sharding"]
  lines += ["", f"Sharding: input {sc['input_shardings']}, pruned output {sc['shardings']}; "
            f"all-gather in the compiled `tree_soft_topk_mag`: {sc['all_gather_in_prune_hlo']}.",
            ""]
  return "\n".join(lines)


def plot(result, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  sparsities = result["options"]["sparsities"]
  fig, ax = plt.subplots(figsize=(5.5, 3.8))
  styles = {"per-layer hard": "v:", "global hard": "s:", "per-layer hard + FT": "v--",
            "global hard + FT": "s--", "global soft + FT": "o-"}
  for m in METHODS:
    ax.plot([100 * s for s in sparsities],
            [result["results"][m][str(s)]["test_acc"] for s in sparsities], styles[m], label=m)
  ax.axhline(result["dense"]["test_acc"], color="0.5", lw=1, label="dense")
  ax.axhline(0.1, color="0.8", lw=1, ls=":", label="chance")
  ax.set_xlabel("sparsity of the weight matrices (%)")
  ax.set_ylabel("test accuracy")
  ax.set_title("Global pruning, MLP on digits, 8 devices", fontsize=10)
  ax.set_xticks([100 * s for s in sparsities])
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="lower left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--hidden", type=int, default=128)
  ap.add_argument("--steps", type=int, default=200, help="dense training steps")
  ap.add_argument("--ft-steps", type=int, default=60, help="fine-tuning steps")
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--ft-lr", type=float, default=3e-3)
  ap.add_argument("--l", type=float, default=0.5, help="soft: initial l relative to std")
  ap.add_argument("--anneal", type=float, default=20.0, help="soft: final l = l / anneal")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=os.path.join(ROOT, "examples", "results"))
  ap.add_argument("--figure", default=os.path.join(ROOT, "docs", "global_pruning.png"))
  opts = ap.parse_args(argv)
  opts.sparsities = list(SPARSITIES)
  start = time.perf_counter()
  result = run(opts)
  result.update(options=vars(opts), seconds=time.perf_counter() - start,
                backend=jax.default_backend(), devices=jax.device_count())
  text = markdown(result)
  _common.write_results(opts.out, "global_pruning", False, result, text, plot, figure=opts.figure)
  print(text)
  print(f"RESULT_JSON {json.dumps({m: {s: v['test_acc'] for s, v in r.items()} for m, r in result['results'].items()})}")
  return result


if __name__ == "__main__":
  main()
