#!/usr/bin/env python
r"""Mixture-of-experts routers at equal expert budgets: soft top-k mask vs hard top-k.

The layer, data and training are those of ``examples/moe_router.py``: scikit-learn's
digits (every image is a token), ``E = 8`` MLP experts, a linear router, 300 Adam steps,
every expert computed on every token during training (exact: the gates alone decide the
quality, nothing is dropped). Routers compared:

* ``soft l=0.5``: ``soft_topk_mask(r, 2, regularization_strength=0.5) / 2``, absolute
  strength (the earlier recipe); the number of experts per token is not bounded;
* ``soft std``: the same with ``standardize=True`` (strength relative to each token's
  standard deviation of the router logits);
* ``soft std k=1 m=2``, ``soft std k=1.2 m=2``, ``soft std k=1.5 m=2``:
  ``standardize=True`` and ``max_support=2``: at most 2 experts per token, whatever the
  router's scale. The support bound needs ``k < m`` (a mask summing to ``k`` with ``k``
  entries is binary, with no gradient), so the budget of 2 experts is reached with
  ``k = 1`` (1 or 2 experts per token) or ``1 < k < 2`` (always 2: each entry is at most
  1);
* ``soft std k=2 m=3``, ``soft std k=2.2 m=3``, ``soft std k=2.5 m=3``: the same with
  ``max_support=3`` (2 or 3 experts per token with ``k = 2``, always 3 above);
* ``hard top-2``, ``hard top-3``: softmax over the ``k`` largest logits, 0 elsewhere
  (GShard, Lepikhin et al. 2021; Switch Transformer, Fedus et al. 2022 with ``k = 1``).

The soft gates are ``mask / k`` (each row sums to 1), ``p = 4/3``.

Reported per router, over 3 seeds (train/test split and initialisation): experts per
token (mean number of nonzero gates on the test set) at initialisation and after
training, the largest number for any token, the share of fractional mask entries
(strictly between 0 and 1), the share of tokens with two or more of them (the tokens
whose choice of experts gets a gradient: a single fractional entry is fixed by the sum),
the router's mean gradient norm during training, test loss and accuracy (mean and per seed), and the time of one jitted
training step (``T`` tokens) with dense compute and with capacity-limited sparse
dispatch sized for the router's budget: ``C = ceil(capacity_factor * T * b / E)`` slots
per expert, ``b`` the most experts a token can use (``k`` for hard top-k, ``m`` for
``max_support=m``, ``E`` for an unbounded soft gate, whose buffers must then hold every
token to drop nothing). Step times are the median of interleaved rounds (each round
times every router once, the load average of the machine is recorded).

Outputs ``<out>/router_budget{,_quick}.{json,md}``.

Usage::

    python examples/router_budget.py            # about 10 minutes on a shared 2-core CPU
    python examples/router_budget.py --quick    # 2 routers, 1 seed, 30 steps: for the tests
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk as itk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (examples/_common.py)
import moe_router  # noqa: E402  (examples/moe_router.py: the layer, Adam, dispatch)

# name -> (gate kind, k, options); budget b = the most experts a token can use.
ROUTERS = {
    "soft l=0.5": ("soft", 2, dict(l=0.5, standardize=False, max_support=None)),
    "soft std": ("soft", 2, dict(l=0.5, standardize=True, max_support=None)),
    "soft std k=1 m=2": ("soft", 1, dict(l=0.5, standardize=True, max_support=2)),
    "soft std k=1.2 m=2": ("soft", 1.2, dict(l=0.5, standardize=True, max_support=2)),
    "soft std k=1.5 m=2": ("soft", 1.5, dict(l=0.5, standardize=True, max_support=2)),
    "hard top-2": ("hard", 2, {}),
    "soft std k=2 m=3": ("soft", 2, dict(l=0.5, standardize=True, max_support=3)),
    "soft std k=2.2 m=3": ("soft", 2.2, dict(l=0.5, standardize=True, max_support=3)),
    "soft std k=2.5 m=3": ("soft", 2.5, dict(l=0.5, standardize=True, max_support=3)),
    "hard top-3": ("hard", 3, {}),
}

QUICK_ROUTERS = ("soft std k=2 m=3", "hard top-2")


def budget(name, experts):
  gate, k, o = ROUTERS[name]
  if gate == "hard":
    return k
  return o["max_support"] or experts


def gate_fn(name):
  """logits (T, E) -> (gates summing to 1 per row, the underlying mask)."""
  gate, k, o = ROUTERS[name]
  if gate == "hard":
    def hard(logits):
      g = moe_router.hard_gate(logits, k)
      return g, (g > 0).astype(g.dtype)
    return hard

  def soft(logits):
    mask = itk.soft_topk_mask(logits, k, regularization_strength=o["l"], p=4.0 / 3.0,
                              standardize=o["standardize"], max_support=o["max_support"])
    return mask / k, mask
  return soft


def forward(params, x, *, name, compute, cap):
  logits = x @ params["router_w"] + params["router_b"]
  gates, mask = gate_fn(name)(logits)
  if compute == "dense":
    out, stats = moe_router.combine_dense(params, x, gates)
  else:
    out, stats = moe_router.combine_sparse(params, x, gates, cap)
  return out, gates, mask, stats


@functools.lru_cache(maxsize=None)
def _forward_jit(name, compute, cap):
  return jax.jit(functools.partial(forward, name=name, compute=compute, cap=cap))


@functools.lru_cache(maxsize=None)
def make_step(name, lr, compute, cap):
  """The jitted training step (cached: one compilation per router, compute and capacity)."""
  _, opt_update = moe_router.adam(lr)

  def loss_fn(params, x, y):
    out, _, _, _ = forward(params, x, name=name, compute=compute, cap=cap)
    return moe_router.cross_entropy(out, y)

  @jax.jit
  def step(params, opt_state, x, y):
    loss, g = jax.value_and_grad(loss_fn)(params, x, y)
    params, opt_state = opt_update(g, opt_state, params)
    return params, opt_state, loss, jnp.linalg.norm(g["router_w"])

  return step


def capacity(tokens, b, experts, factor):
  return int(min(tokens, math.ceil(factor * tokens * b / experts)))


def gate_stats(name, opts, params, x, y):
  out, gates, mask, _ = _forward_jit(name, "dense", 0)(params, x)
  cap = capacity(x.shape[0], budget(name, opts.experts), opts.experts, opts.capacity_factor)
  _, _, _, sparse = _forward_jit(name, "sparse", cap)(params, x)
  gates, mask = np.asarray(gates), np.asarray(mask)
  nnz = (gates > 0).sum(1)
  frac = (mask > 0) & (mask < 1)
  return dict(
      loss=float(moe_router.cross_entropy(out, y)),
      acc=float(np.mean(np.asarray(out).argmax(-1) == np.asarray(y))),
      experts_per_token=float(nnz.mean()),
      max_experts_per_token=int(nnz.max()),
      fractional=float(frac.mean()),
      tokens_with_fractional=float(frac.any(1).mean()),
      # one fractional entry is fixed by the sum (k minus the entries equal to 1): the
      # mask, hence the choice of experts, has a nonzero gradient only with two or more
      tokens_with_choice_gradient=float((frac.sum(1) >= 2).mean()),
      dropped_sparse=float(sparse["dropped"]),
      finite=bool(np.all(np.isfinite(np.asarray(out)))),
  )


def train(name, opts, seed):
  (x_tr, y_tr), (x_te, y_te) = _common.load_digits_standardized(seed)
  x_te, y_te = jnp.asarray(x_te), jnp.asarray(y_te)
  params = moe_router.init_params(jax.random.PRNGKey(seed), x_tr.shape[1], opts.hidden, 10,
                                  opts.experts)
  params["router_w"] = params["router_w"] * opts.router_init_scale
  init_stats = gate_stats(name, opts, params, x_te, y_te)
  opt_init, _ = moe_router.adam(opts.lr)
  opt_state = opt_init(params)
  step = make_step(name, opts.lr, "dense", 0)
  rng = np.random.default_rng(seed)
  losses, gnorms = [], []
  for _ in range(opts.steps):
    idx = rng.choice(len(x_tr), opts.batch, replace=False)
    params, opt_state, loss, gnorm = step(params, opt_state, jnp.asarray(x_tr[idx]),
                                          jnp.asarray(y_tr[idx]))
    losses.append(float(loss))
    gnorms.append(float(gnorm))
  final = gate_stats(name, opts, params, x_te, y_te)
  return dict(init=init_stats, final=final, train_loss_first=losses[0],
              train_loss_last=float(np.mean(losses[-10:])),
              router_grad_norm=float(np.mean(gnorms)),
              any_nan=not (all(map(math.isfinite, losses)) and final["finite"])), params


def step_times(names, opts, params_by_name):
  """Median over interleaved rounds of one jitted training step, dense and sparse."""
  t = opts.timing_tokens
  x = jax.random.normal(jax.random.PRNGKey(1), (t, 64), jnp.float32)
  y = jnp.asarray(np.random.default_rng(0).integers(0, 10, t))
  fns = {}
  for name in names:
    cap = capacity(t, budget(name, opts.experts), opts.experts, opts.capacity_factor)
    for compute in ("dense", "sparse"):
      step = make_step(name, opts.lr, compute, cap)
      params = params_by_name[name]
      state = moe_router.adam(opts.lr)[0](params)
      jax.block_until_ready(step(params, state, x, y))  # compile
      fns[(name, compute)] = (step, params, state)
  times = {key: [] for key in fns}
  load = [os.getloadavg()[0]]
  for _ in range(opts.rounds):
    for key, (step, params, state) in fns.items():
      t0 = time.perf_counter()
      for _ in range(opts.reps):
        out = step(params, state, x, y)
      jax.block_until_ready(out)
      times[key].append((time.perf_counter() - t0) / opts.reps)
    load.append(os.getloadavg()[0])
  return {
      name: dict(
          dense_ms=1e3 * statistics.median(times[(name, "dense")]),
          sparse_ms=1e3 * statistics.median(times[(name, "sparse")]),
          dense_ms_all=[1e3 * v for v in times[(name, "dense")]],
          sparse_ms_all=[1e3 * v for v in times[(name, "sparse")]],
          capacity=capacity(t, budget(name, opts.experts), opts.experts, opts.capacity_factor),
          expert_evals_sparse=opts.experts * capacity(t, budget(name, opts.experts),
                                                      opts.experts, opts.capacity_factor))
      for name in names}, load


def summarize(runs):
  """Means over the seeds whose run stayed finite (``nan_seeds`` counts the others)."""
  finite = [r for r in runs if not r["any_nan"]] or runs

  def agg(path):
    return dict(mean=float(np.mean([path(r) for r in finite])),
                per_seed=[float(path(r)) for r in runs])

  return dict(
      experts_init=agg(lambda r: r["init"]["experts_per_token"]),
      experts_final=agg(lambda r: r["final"]["experts_per_token"]),
      max_experts_final=max(r["final"]["max_experts_per_token"] for r in runs),
      max_experts_init=max(r["init"]["max_experts_per_token"] for r in runs),
      fractional_init=agg(lambda r: r["init"]["fractional"]),
      fractional_final=agg(lambda r: r["final"]["fractional"]),
      tokens_fractional_final=agg(lambda r: r["final"]["tokens_with_fractional"]),
      tokens_choice_gradient_init=agg(lambda r: r["init"]["tokens_with_choice_gradient"]),
      tokens_choice_gradient_final=agg(lambda r: r["final"]["tokens_with_choice_gradient"]),
      router_grad_norm=agg(lambda r: r["router_grad_norm"]),
      test_loss=agg(lambda r: r["final"]["loss"]),
      test_acc=agg(lambda r: r["final"]["acc"]),
      dropped_sparse=agg(lambda r: r["final"]["dropped_sparse"]),
      nan_seeds=sum(1 for r in runs if r["any_nan"]),
      any_nan=any(r["any_nan"] for r in runs))


def markdown(result):
  o = result["options"]
  s, t = result["summary"], result["step_time"]
  seeds = ", ".join(map(str, o["seeds"]))
  lines = [
      "# Mixture-of-experts routers at equal expert budgets", "",
      f"Quick run: {o['quick']}. scikit-learn digits, E = {o['experts']} MLP experts "
      f"(64-{o['hidden']}-10), batch {o['batch']}, {o['steps']} Adam steps (lr {o['lr']}), "
      f"dense compute during training, seeds {seeds}, router initialisation scale "
      f"{o['router_init_scale']:g}. Soft gates: `soft_topk_mask(logits, k, "
      "regularization_strength=0.5, p=4/3, ...) / k` (default solver); hard: softmax over "
      f"the k largest logits. Backend {result['backend']}, jax {result['jax']}.", "",
      "Test set (every test image is a token). Experts per token: mean number of nonzero "
      "gates (largest for any token in brackets). Fractional: share of mask entries "
      "strictly between 0 and 1. Choice gradient: share of tokens with two or more fractional "
      "entries (with one, its value is fixed by the sum and the mask is locally constant: the "
      "choice of experts gets no gradient), at init -> at the end. Router grad norm: mean "
      "over training of the norm of the router weights' gradient. Loss and accuracy: mean "
      "over the seeds, then per seed. NaN: seeds whose training produced a non-finite loss "
      "(the means leave them out).", "",
      "| router | budget b | experts/token at init | experts/token at end | fractional "
      "init -> end | choice gradient init -> end | router grad norm | test loss | "
      "test loss per seed | test acc | test acc per seed | NaN |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|"]
  for name in result["routers"]:
    r = s[name]
    b = result["budget"][name]
    lines.append(
        f"| {name} | {b if b < o['experts'] else 'none'} | "
        f"{r['experts_init']['mean']:.2f} ({r['max_experts_init']}) | "
        f"{r['experts_final']['mean']:.2f} ({r['max_experts_final']}) | "
        f"{100 * r['fractional_init']['mean']:.0f}% -> {100 * r['fractional_final']['mean']:.0f}% | "
        f"{100 * r['tokens_choice_gradient_init']['mean']:.0f}% -> "
        f"{100 * r['tokens_choice_gradient_final']['mean']:.0f}% | "
        f"{r['router_grad_norm']['mean']:.3f} | {r['test_loss']['mean']:.3f} | "
        + " / ".join(f"{v:.3f}" for v in r["test_loss"]["per_seed"]) + " | "
        f"{r['test_acc']['mean']:.3f} | "
        + " / ".join(f"{v:.3f}" for v in r["test_acc"]["per_seed"]) + " | "
        f"{r['nan_seeds']} of {len(r['test_loss']['per_seed'])} |")
  if not t:
    lines.append("")
    return "\n".join(lines)
  load = result["load_average"]
  lines += [
      "", f"One jitted training step on T = {o['timing_tokens']} tokens (median of "
      f"{o['rounds']} interleaved rounds of {o['reps']} steps; 1-minute load average "
      f"{min(load):.1f} to {max(load):.1f} on {os.cpu_count()} cores). Sparse: capacity "
      f"factor {o['capacity_factor']}, C = ceil({o['capacity_factor']} T b / E) slots per "
      "expert (T when the budget is unbounded); dropped: share of the nonzero test gates "
      "beyond capacity with the trained router.", "",
      "| router | dense step (ms) | sparse step (ms) | slots per expert C | expert evaluations "
      "(sparse) | dropped (test, sparse) |",
      "|---|---:|---:|---:|---:|---:|"]
  for name in result["routers"]:
    r = t[name]
    lines.append(f"| {name} | {r['dense_ms']:.1f} | {r['sparse_ms']:.1f} | {r['capacity']} | "
                 f"{r['expert_evals_sparse']:,} | {100 * s[name]['dropped_sparse']['mean']:.1f}% |")
  lines.append("")
  return "\n".join(lines)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small run (< 30 s) for the tests")
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--hidden", type=int, default=128)
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--steps", type=int, default=None, help="default 300 (quick: 30)")
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (quick: 0)")
  ap.add_argument("--router-init-scale", type=float, default=1.0,
                  help="router weights ~ N(0, scale^2 / d) (Switch Transformer uses 0.1 x its "
                       "default initialisation scale)")
  ap.add_argument("--no-timing", action="store_true", help="skip the step timings")
  ap.add_argument("--capacity-factor", type=float, default=1.25)
  ap.add_argument("--timing-tokens", type=int, default=None, help="default 4096 (quick: 256)")
  ap.add_argument("--rounds", type=int, default=None, help="default 15 (quick: 3)")
  ap.add_argument("--reps", type=int, default=3, help="steps per router per round")
  ap.add_argument("--routers", nargs="+", default=None, choices=list(ROUTERS),
                  help="default: all (quick: %s)" % ", ".join(QUICK_ROUTERS))
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results"))
  opts = ap.parse_args(argv)
  opts.steps = opts.steps or (30 if opts.quick else 300)
  opts.seeds = opts.seeds or ([0] if opts.quick else [0, 1, 2])
  opts.timing_tokens = opts.timing_tokens or (256 if opts.quick else 4096)
  opts.rounds = opts.rounds or (3 if opts.quick else 15)
  return opts


def rewrite_markdown(json_path):
  """Recomputes the summary and the Markdown table of a result file (no training)."""
  import json
  with open(json_path) as f:
    result = json.load(f)
  result["summary"] = {n: summarize(result["runs"][n]) for n in result["routers"]}
  with open(json_path, "w") as f:
    json.dump(result, f, indent=1, default=float)
  with open(json_path[:-len(".json")] + ".md", "w") as f:
    f.write(markdown(result))


def main(argv=None):
  opts = parse_args(argv)
  names = opts.routers or list(QUICK_ROUTERS if opts.quick else ROUTERS)
  t_start = time.perf_counter()
  runs = {name: [] for name in names}
  last_params = {}
  for seed in opts.seeds:
    for name in names:
      run, params = train(name, opts, seed)
      runs[name].append(run)
      last_params[name] = params
      f = run["final"]
      print(f"seed {seed} {name:<20} experts/token {run['init']['experts_per_token']:.2f} -> "
            f"{f['experts_per_token']:.2f} (max {f['max_experts_per_token']}) fractional "
            f"{f['fractional']:.2f} loss {f['loss']:.3f} acc {f['acc']:.3f}", flush=True)
  times, load = ({}, []) if opts.no_timing else step_times(names, opts, last_params)
  for name in times:
    print(f"{name:<20} step dense {times[name]['dense_ms']:.1f} ms sparse "
          f"{times[name]['sparse_ms']:.1f} ms (C = {times[name]['capacity']})")
  result = dict(options=vars(opts), backend=jax.default_backend(), jax=jax.__version__,
                routers=names, definitions={n: [ROUTERS[n][0], ROUTERS[n][1], ROUTERS[n][2]]
                                            for n in names},
                budget={n: budget(n, opts.experts) for n in names},
                runs=runs, summary={n: summarize(runs[n]) for n in names},
                step_time=times, load_average=load, cpu_count=os.cpu_count(),
                total_s=time.perf_counter() - t_start)
  text = markdown(result)
  stem_name = "router_budget" + (f"_init{opts.router_init_scale:g}"
                                 if opts.router_init_scale != 1.0 else "")
  stem = _common.write_results(opts.out, stem_name, opts.quick, result, text)
  print(text)
  print(f"wrote {stem}.{{md,json}} in {result['total_s']:.0f}s")
  return result


if __name__ == "__main__":
  main()
