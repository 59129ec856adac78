#!/usr/bin/env python
r"""A sparse mixture-of-experts layer routed by ``soft_topk_mask`` (plain JAX).

Task: scikit-learn's digits (8x8 images, 10 classes); every image is a token. The model
is one MoE layer: ``E`` experts (MLPs 64 -> H -> 10, ReLU), a linear router
:math:`r = x W_r + b_r \in \mathbb{R}^E` and the output
:math:`\sum_e g_e(r)\,\mathrm{expert}_e(x)`. Two gates, each weight vector summing to 1:

* ``soft``: :math:`g = \mathrm{soft\_topk\_mask}(r, k, l, p = 4/3) / k` over the experts
  (sparse: exactly 0 for the experts below the threshold, at least ``k`` nonzero
  entries, more when the router is undecided; differentiable w.r.t. the router
  where some entry is fractional);
* ``hard``: the usual top-k + softmax gate: softmax of the ``k`` largest logits,
  0 elsewhere (GShard / Switch style; gradient through the softmax weights only).

Two ways to compute the layer, for either gate:

* ``dense``: every expert on every token (``T x E`` expert evaluations), weighted by
  the gate; exact, cost independent of the sparsity;
* ``sparse``: capacity-limited dispatch with static shapes. Each expert gets a buffer
  of ``C = ceil(capacity_factor * T * k / E)`` slots; the tokens with a nonzero gate for
  that expert are gathered into it (by decreasing gate, ``lax.top_k`` over tokens),
  the expert runs on its ``C`` slots only (``E x C`` evaluations instead of
  ``E x T``), and the weighted outputs are scattered back (``.at[].add``). Unselected
  experts are never computed for a token; assignments beyond capacity are dropped
  (reported as the drop rate).

Reported: training/test loss curves, test accuracy, the fraction of exact zeros in the
gates, nonzero experts per token, expert load (share of assignments per expert, its
coefficient of variation and max/mean), the drop rate, and throughput (tokens/s of a
jit-compiled training step and of the forward pass) for the four variants.

Outputs ``<out>/moe_router{,_quick}.{json,md,png}``.

Usage::

    python examples/moe_router.py            # a few minutes on CPU
    python examples/moe_router.py --quick    # < 30 s, for the tests
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk as itk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (examples/_common.py)

VARIANTS = ("soft/sparse", "soft/dense", "hard/sparse", "hard/dense")


# ----------------------------------------------------------------------------------
# data and parameters
# ----------------------------------------------------------------------------------


def init_params(key, d, hidden, classes, experts):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
      "router_w": jax.random.normal(k1, (d, experts), jnp.float32) / math.sqrt(d),
      "router_b": jnp.zeros((experts,), jnp.float32),
      "w1": jax.random.normal(k2, (experts, d, hidden), jnp.float32) * math.sqrt(2.0 / d),
      "b1": jnp.zeros((experts, hidden), jnp.float32),
      "w2": jax.random.normal(k3, (experts, hidden, classes), jnp.float32) / math.sqrt(hidden),
      "b2": jnp.zeros((experts, classes), jnp.float32),
  }


# ----------------------------------------------------------------------------------
# gates
# ----------------------------------------------------------------------------------


def soft_gate(logits, k, l):
  """Sparse soft top-k mask over the experts, normalized to sum 1."""
  return itk.soft_topk_mask(logits, k, regularization_strength=l, p=4.0 / 3.0, solver="threshold", axis=-1) / k


def hard_gate(logits, k):
  """Top-k + softmax: softmax over the k largest logits, 0 elsewhere."""
  values, idx = jax.lax.top_k(logits, k)
  weights = jax.nn.softmax(values, axis=-1)
  return jnp.put_along_axis(jnp.zeros_like(logits), idx, weights, axis=-1, inplace=False)


# ----------------------------------------------------------------------------------
# expert computation: dense and capacity-limited sparse dispatch
# ----------------------------------------------------------------------------------


def _expert_mlp(params, xe):
  """xe: (E, C, d) -> (E, C, classes), expert e applied to its own slots."""
  h = jax.nn.relu(jnp.einsum("ecd,edh->ech", xe, params["w1"]) + params["b1"][:, None])
  return jnp.einsum("ech,eho->eco", h, params["w2"]) + params["b2"][:, None]


def combine_dense(params, x, gates):
  """All experts on all tokens: (T, E) expert evaluations."""
  experts = params["w1"].shape[0]
  xe = jnp.broadcast_to(x[None], (experts,) + x.shape)
  ye = _expert_mlp(params, xe)  # (E, T, o)
  return jnp.einsum("te,eto->to", gates, ye), {}


def capacity(tokens, k, experts, factor):
  return int(min(tokens, math.ceil(factor * tokens * k / experts)))


def combine_sparse(params, x, gates, cap):
  """Capacity-limited dispatch: each expert computes only its ``cap`` gathered tokens.

  For expert e, the tokens with gate > 0 are ranked by gate (``lax.top_k`` over the
  token axis of ``gates.T``); the first ``cap`` are gathered, the expert runs on them,
  and ``gate * output`` is scattered back. Empty slots (fewer than ``cap`` nonzero
  gates) carry weight 0; nonzero gates beyond ``cap`` are dropped.
  """
  gt = gates.T  # (E, T)
  score = jnp.where(gt > 0, gt, -1.0)
  top, idx = jax.lax.top_k(jax.lax.stop_gradient(score), cap)  # (E, C)
  valid = top > 0
  weight = jnp.where(valid, jnp.take_along_axis(gt, idx, axis=1), 0.0)  # keeps gradient
  xe = x[idx]  # (E, C, d) gather
  ye = _expert_mlp(params, xe)  # (E, C, o): only E * C expert evaluations
  out = jnp.zeros((x.shape[0], ye.shape[-1]), ye.dtype).at[idx.reshape(-1)].add(
      (weight[..., None] * ye).reshape(-1, ye.shape[-1]))
  assigned = jnp.sum(gt > 0)
  kept = jnp.sum(valid)
  return out, {"dropped": (assigned - kept) / jnp.maximum(assigned, 1)}


def moe_forward(params, x, *, gate, compute, k, l, cap):
  logits = x @ params["router_w"] + params["router_b"]
  gates = soft_gate(logits, k, l) if gate == "soft" else hard_gate(logits, k)
  if compute == "dense":
    out, stats = combine_dense(params, x, gates)
  else:
    out, stats = combine_sparse(params, x, gates, cap)
  return out, gates, stats


def cross_entropy(logits, y):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


# ----------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------


def adam(lr, b1=0.9, b2=0.999, eps=1e-8):
  def init(params):
    z = jax.tree_util.tree_map(jnp.zeros_like, params)
    return (z, z, jnp.zeros((), jnp.int32))

  def update(grads, state, params):
    m, v, t = state
    t = t + 1
    m = jax.tree_util.tree_map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
    v = jax.tree_util.tree_map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
    new = jax.tree_util.tree_map(
        lambda p, a, b: p - lr * (a / c1) / (jnp.sqrt(b / c2) + eps), params, m, v)
    return new, (m, v, t)

  return init, update


def make_fns(variant, opts, batch):
  gate, compute = variant.split("/")
  cap = capacity(batch, opts.k, opts.experts, opts.capacity_factor)
  fwd = functools.partial(moe_forward, gate=gate, compute=compute, k=opts.k, l=opts.l,
                          cap=cap)
  opt_init, opt_update = adam(opts.lr)

  def loss_fn(params, x, y):
    out, gates, stats = fwd(params, x)
    return cross_entropy(out, y), (gates, stats)

  @jax.jit
  def train_step(params, opt_state, x, y):
    (loss, (gates, stats)), g = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
    params, opt_state = opt_update(g, opt_state, params)
    return params, opt_state, loss, stats.get("dropped", jnp.zeros(()))

  return fwd, opt_init, train_step


_EVAL_CACHE = {}


def evaluate(variant, opts, params, x, y):
  gate, compute = variant.split("/")
  cap = capacity(x.shape[0], opts.k, opts.experts, opts.capacity_factor)
  key = (variant, opts.k, opts.l, cap)
  if key not in _EVAL_CACHE:
    _EVAL_CACHE[key] = jax.jit(functools.partial(
        moe_forward, gate=gate, compute=compute, k=opts.k, l=opts.l, cap=cap))
  out, gates, stats = _EVAL_CACHE[key](params, x)
  gates = np.asarray(gates)
  nonzero = gates > 0
  load = nonzero.sum(0) / nonzero.sum()
  return dict(
      loss=float(cross_entropy(out, y)),
      acc=float(np.mean(np.asarray(out).argmax(-1) == np.asarray(y))),
      zero_frac=float(np.mean(gates == 0.0)),
      nnz_per_token=float(nonzero.sum(1).mean()),
      max_nnz_per_token=int(nonzero.sum(1).max()),
      load=load.tolist(),
      load_cv=float(load.std() / load.mean()),
      load_max_over_mean=float(load.max() / load.mean()),
      dropped=float(stats.get("dropped", 0.0)),
      finite=bool(np.all(np.isfinite(np.asarray(out)))),
  )


def train(variant, opts, train_data, test_data):
  (x_tr, y_tr), (x_te, y_te) = train_data, test_data
  params = init_params(jax.random.PRNGKey(opts.seed), x_tr.shape[1], opts.hidden, 10,
                       opts.experts)
  _, opt_init, train_step = make_fns(variant, opts, opts.batch)
  opt_state = opt_init(params)
  rng = np.random.default_rng(opts.seed)
  history = []
  any_nan = False
  t0 = time.perf_counter()
  for step in range(opts.steps):
    idx = rng.choice(len(x_tr), opts.batch, replace=False)
    params, opt_state, loss, dropped = train_step(params, opt_state, jnp.asarray(x_tr[idx]),
                                                  jnp.asarray(y_tr[idx]))
    loss = float(loss)
    any_nan |= not math.isfinite(loss)
    rec = dict(step=step, train_loss=loss, dropped=float(dropped))
    if step % opts.eval_every == 0 or step == opts.steps - 1:
      ev = evaluate(variant, opts, params, jnp.asarray(x_te), jnp.asarray(y_te))
      rec.update(test_loss=ev["loss"], test_acc=ev["acc"])
    history.append(rec)
  seconds = time.perf_counter() - t0
  final = evaluate(variant, opts, params, jnp.asarray(x_te), jnp.asarray(y_te))
  any_nan |= not final["finite"]
  return dict(history=history, final=final, train_seconds=seconds, any_nan=bool(any_nan),
              params=params)


# ----------------------------------------------------------------------------------
# throughput
# ----------------------------------------------------------------------------------


def _median_time(fn, *args, budget=1.0, max_reps=50):
  jax.block_until_ready(fn(*args))  # compile
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = time.perf_counter() - t0
  reps = int(max(3, min(max_reps, budget / max(one, 1e-6))))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def throughput(variant, opts, params, tokens, budget):
  x = jax.random.normal(jax.random.PRNGKey(1), (tokens, params["w1"].shape[1]), jnp.float32)
  y = jnp.asarray(np.random.default_rng(0).integers(0, 10, tokens))
  fwd, opt_init, train_step = make_fns(variant, opts, tokens)
  fwd_jit = jax.jit(lambda p, x: fwd(p, x)[0])
  t_fwd = _median_time(fwd_jit, params, x, budget=budget)
  t_step = _median_time(train_step, params, opt_init(params), x, y, budget=budget)
  return dict(tokens=tokens, fwd_s=t_fwd, step_s=t_step, fwd_tok_s=tokens / t_fwd,
              step_tok_s=tokens / t_step,
              expert_evals=(opts.experts * capacity(tokens, opts.k, opts.experts,
                                                    opts.capacity_factor)
                            if variant.endswith("sparse") else opts.experts * tokens))


# ----------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------


def markdown(result):
  o = result["options"]
  lines = [
      "# Sparse mixture-of-experts router: soft top-k mask vs hard top-k + softmax", "",
      f"Quick run: {o['quick']}. digits, E = {o['experts']} experts (MLP 64-{o['hidden']}-10), "
      f"k = {o['k']}, soft gate l = {o['l']} (p = 4/3), capacity factor "
      f"{o['capacity_factor']} (train capacity {result['capacity_train']} of {o['batch']} "
      f"tokens per expert), batch {o['batch']}, {o['steps']} Adam steps (lr {o['lr']}), "
      f"seed {o['seed']}. Backend {result['backend']}.", "",
      "Gate statistics on the test set (every test image is a token; load = share of the "
      "nonzero (token, expert) assignments per expert).", "",
      "| variant | test acc | test loss | exact zeros in gates | nonzero experts/token "
      "(max) | load CV | load max/mean | dropped (test) | NaN | train step tok/s "
      f"(T={result['throughput_tokens']}) | forward tok/s | expert evals/batch |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
  for v in VARIANTS:
    r, f, t = result["runs"][v], result["runs"][v]["final"], result["throughput"][v]
    lines.append(
        f"| {v} | {f['acc']:.3f} | {f['loss']:.3f} | {f['zero_frac']:.3f} | "
        f"{f['nnz_per_token']:.2f} ({f['max_nnz_per_token']}) | {f['load_cv']:.2f} | "
        f"{f['load_max_over_mean']:.2f} | {f['dropped']:.3f} | {'yes' if r['any_nan'] else 'no'} | "
        f"{t['step_tok_s']:,.0f} | {t['fwd_tok_s']:,.0f} | {t['expert_evals']:,} |")
  lines += ["", "Expert load (share of assignments, test set):", "",
            "| variant | " + " | ".join(f"e{i}" for i in range(o["experts"])) + " |",
            "|---|" + "---:|" * o["experts"]]
  for v in VARIANTS:
    lines.append(f"| {v} | " + " | ".join(f"{a:.2f}" for a in result["runs"][v]["final"]["load"])
                 + " |")
  lines.append("")
  return "\n".join(lines)


def plot(result, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  colors = dict(zip(VARIANTS, ("tab:blue", "tab:cyan", "tab:red", "tab:orange")))
  for v in VARIANTS:
    h = result["runs"][v]["history"]
    steps = [r["step"] for r in h]
    loss = np.convolve([r["train_loss"] for r in h], np.ones(5) / 5, mode="valid")
    axes[0].plot(steps[len(steps) - len(loss):], loss, label=v, color=colors[v])
    ev = [r for r in h if "test_loss" in r]
    axes[1].plot([r["step"] for r in ev], [r["test_acc"] for r in ev], label=v, color=colors[v])
  axes[0].set_xlabel("step"), axes[0].set_ylabel("train loss (moving avg 5)")
  axes[0].set_yscale("log"), axes[0].legend(fontsize=8)
  axes[1].set_xlabel("step"), axes[1].set_ylabel("test accuracy"), axes[1].legend(fontsize=8)
  e = result["options"]["experts"]
  width = 0.2
  for i, v in enumerate(VARIANTS):
    axes[2].bar(np.arange(e) + (i - 1.5) * width, result["runs"][v]["final"]["load"], width,
                label=v, color=colors[v])
  axes[2].axhline(1.0 / e, color="0.5", ls="--", lw=1)
  axes[2].set_xlabel("expert"), axes[2].set_ylabel("share of assignments (test)")
  axes[2].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small run (< 30 s) for the tests")
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--k", type=int, default=2, help="experts per token")
  ap.add_argument("--l", type=float, default=0.5, help="soft gate regularization")
  ap.add_argument("--hidden", type=int, default=128, help="expert hidden width")
  ap.add_argument("--capacity-factor", type=float, default=2.0,
                  help="expert buffer = factor * T * k / E slots (sparse dispatch)")
  ap.add_argument("--batch", type=int, default=256, help="tokens per training step")
  ap.add_argument("--steps", type=int, default=None, help="default 600 (quick: 40)")
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--eval-every", type=int, default=None, help="default steps // 20")
  ap.add_argument("--throughput-tokens", type=int, default=None,
                  help="tokens per batch for the throughput measurement "
                       "(default 4096; quick: 512)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results"), help="output directory")
  opts = ap.parse_args(argv)
  if opts.steps is None:
    opts.steps = 40 if opts.quick else 600
  if opts.eval_every is None:
    opts.eval_every = max(1, opts.steps // 20)
  if opts.throughput_tokens is None:
    opts.throughput_tokens = 512 if opts.quick else 4096
  return opts


def main(argv=None):
  opts = parse_args(argv)
  t_start = time.perf_counter()
  train_data, test_data = _common.load_digits_standardized(opts.seed)
  runs, tput = {}, {}
  for v in VARIANTS:
    run = train(v, opts, train_data, test_data)
    tput[v] = throughput(v, opts, run["params"], opts.throughput_tokens,
                         budget=0.3 if opts.quick else 2.0)
    run.pop("params")
    runs[v] = run
    f = run["final"]
    print(f"{v:<12} acc {f['acc']:.3f} loss {f['loss']:.3f} zeros {f['zero_frac']:.3f} "
          f"nnz/token {f['nnz_per_token']:.2f} load CV {f['load_cv']:.2f} dropped "
          f"{f['dropped']:.3f} | step {tput[v]['step_tok_s']:,.0f} tok/s, fwd "
          f"{tput[v]['fwd_tok_s']:,.0f} tok/s | train {run['train_seconds']:.1f}s", flush=True)
  result = dict(options=vars(opts), backend=jax.default_backend(), runs=runs,
                throughput=tput, throughput_tokens=opts.throughput_tokens,
                capacity_train=capacity(opts.batch, opts.k, opts.experts,
                                        opts.capacity_factor),
                total_s=time.perf_counter() - t_start)
  stem = _common.write_results(opts.out, "moe_router", opts.quick, result, markdown(result), plot)
  print(f"wrote {stem}.{{md,json,png}} in {result['total_s']:.0f}s")
  return result


if __name__ == "__main__":
  main()
