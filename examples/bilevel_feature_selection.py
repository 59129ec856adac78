#!/usr/bin/env python
r"""Bilevel feature selection: learn feature scores whose soft top-k mask picks k features.

Data: scikit-learn's breast cancer set (569 samples, 30 standardized features, binary),
split train / validation / test (50 / 25 / 25 %).

* Outer variables: scores :math:`\theta \in \mathbb{R}^{30}`; the features are multiplied
  by the mask :math:`m = \mathrm{soft\_topk\_mask}(\theta, k, l, p = 4/3)` (sparse:
  exactly 0 outside the selection, sums to ``k``).
* Inner problem: L2-regularized logistic regression on the masked training features,
  :math:`(w^\star, b^\star) = \arg\min_{w, b} \frac1N\sum_i \log(1 + e^{-y_i((x_i \circ m)^\top w + b)})
  + \frac{\alpha}{2}\|w\|^2`, solved by ``jaxopt.LBFGS`` (tol 1e-10).
* Outer loss: the validation log-loss of :math:`(w^\star, b^\star)` on the masked
  validation features. Minimized by Adam over :math:`\theta`.

The hypergradient :math:`d\,\mathrm{val}/d\theta` goes through two implicit layers: the
library's root-finding layer (the mask's threshold, implicit function theorem) and
jaxopt's (the optimality conditions of the inner problem, ``implicit_diff=True``). It is
compared, on a small case (10 features, float64), with

* (a) implicit differentiation everywhere (the default),
* (b) autodiff through unrolled iterations: ``soft_topk_mask(..., diff="unrolled")``
  (``maxiter`` threshold-Newton steps) and ``jaxopt.LBFGS(implicit_diff=False)``
  (at most ``maxiter`` L-BFGS iterations, line search included, stopping at tol), for a
  few iteration counts,
* (c) central finite differences on the outer loss,

with the relative error, the time per hypergradient (jit, after compilation) and the
temporary memory of the compiled hypergradient (XLA's ``memory_analysis``).

Then, on all 30 features:

1. ``k`` fixed (``--k``, default 5): learn :math:`\theta` by hypergradient; report the
   validation loss of the soft model and of the *hard* selection (top-k of the learned
   :math:`\theta`, logistic regression refit on those k features), against the
   univariate selections of scikit-learn's ``SelectKBest`` with the ANOVA F-score
   (``f_classif``) and with mutual information, each refit the same way.
2. ``k`` learned: a fractional :math:`k = 1 + (n - 2)\,\mathrm{sigmoid}(\kappa)` is learned
   jointly with :math:`\theta`, with the outer loss ``val + c * k`` (a cost ``c`` per
   selected feature, ``--feature-cost``): the gradient w.r.t. ``k`` comes from the
   same implicit layer. (Learning ``l`` jointly with :math:`\theta` would be redundant:
   the mask only depends on :math:`\theta / l`.)

Outputs ``<out>/bilevel_feature_selection{,_quick}.{json,md,png}``.

Usage::

    python examples/bilevel_feature_selection.py            # a few minutes on CPU
    python examples/bilevel_feature_selection.py --quick    # < 30 s, for the tests
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import jaxopt  # noqa: E402
import numpy as np  # noqa: E402

import implicit_topk as itk  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (examples/_common.py)

P = 4.0 / 3.0
ALPHA = 1e-2  # inner L2 strength
INNER_TOL = 1e-10
INNER_MAXITER = 300


# ----------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------


def load_data(seed: int, n_features: int | None = None):
  """Standardized breast cancer data split 50/25/25; labels in {-1, +1}."""
  from sklearn.datasets import load_breast_cancer
  from sklearn.model_selection import train_test_split

  data = load_breast_cancer()
  x, y = data.data.astype(np.float64), np.where(data.target == 1, 1.0, -1.0)
  names = list(data.feature_names)
  if n_features is not None:
    x, names = x[:, :n_features], names[:n_features]
  x_tr, x_rest, y_tr, y_rest = train_test_split(x, y, test_size=0.5, random_state=seed,
                                                stratify=y)
  x_va, x_te, y_va, y_te = train_test_split(x_rest, y_rest, test_size=0.5,
                                            random_state=seed, stratify=y_rest)
  mean, std = x_tr.mean(0), x_tr.std(0) + 1e-12
  split = {name: (jnp.asarray((a - mean) / std), jnp.asarray(b)) for name, (a, b) in
           dict(train=(x_tr, y_tr), val=(x_va, y_va), test=(x_te, y_te)).items()}
  return split, names


# ----------------------------------------------------------------------------------
# model: mask -> inner logistic regression -> validation loss
# ----------------------------------------------------------------------------------


def logloss(params, x, y):
  w, b = params
  return jnp.mean(jax.nn.softplus(-y * (x @ w + b)))


def inner_objective(params, mask, x, y):
  return logloss(params, x * mask, y) + 0.5 * ALPHA * jnp.sum(params[0] ** 2)


def make_inner_solver(*, implicit: bool, maxiter: int = INNER_MAXITER):
  return jaxopt.LBFGS(fun=inner_objective, tol=INNER_TOL,
                      maxiter=maxiter, implicit_diff=implicit)


def mask_of(theta, k, l, *, diff="implicit", maxiter=None):
  return itk.soft_topk_mask(theta, k, regularization_strength=l, p=P, solver="threshold", diff=diff,
                            maxiter=maxiter)


def outer_loss(theta, k, l, init, data, *, diff="implicit", mask_maxiter=None,
               inner_maxiter=INNER_MAXITER):
  """Validation log-loss of the inner solution; also returns (inner params, mask)."""
  (x_tr, y_tr), (x_va, y_va) = data
  implicit = diff == "implicit"
  m = mask_of(theta, k, l, diff=diff, maxiter=mask_maxiter)
  solver = make_inner_solver(implicit=implicit, maxiter=inner_maxiter)
  params = solver.run(init, m, x_tr, y_tr).params
  return logloss(params, x_va * m, y_va), (params, m)


def zeros_init(n):
  return (jnp.zeros(n), jnp.zeros(()))


@jax.jit
def fit_logistic(x, y):
  solver = jaxopt.LBFGS(fun=lambda p, x, y: logloss(p, x, y) + 0.5 * ALPHA * jnp.sum(p[0] ** 2),
                        tol=INNER_TOL, maxiter=1000)
  return solver.run(zeros_init(x.shape[1]), x, y).params


def evaluate_subset(cols, split):
  """Refit the inner model on the columns ``cols`` only; val/test loss and accuracy."""
  cols = np.asarray(sorted(int(c) for c in cols))
  x_tr, y_tr = split["train"]
  params = fit_logistic(x_tr[:, cols], y_tr)
  out = {"features": cols.tolist()}
  for name in ("val", "test"):
    x, y = split[name]
    out[f"{name}_loss"] = float(logloss(params, x[:, cols], y))
    w, b = params
    out[f"{name}_acc"] = float(jnp.mean(jnp.sign(x[:, cols] @ w + b) == y))
  return out


# ----------------------------------------------------------------------------------
# (a) / (b) / (c): hypergradient comparison on a small case
# ----------------------------------------------------------------------------------


def _compile(fn, *args):
  """jit + AOT-compile once: the same executable is timed and memory-analysed."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def _median_time(fn, *args, repeats=5):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _temp_bytes(compiled):
  try:
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes)
  except Exception:  # memory_analysis is not available on every backend/version
    return None


def _rel(a, b):
  a, b = np.concatenate([np.ravel(v) for v in a]), np.concatenate([np.ravel(v) for v in b])
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def gradient_check(seed: int, n_features: int, k: float, l: float, unrolled_iters,
                   fd_eps: float = 1e-5):
  """Hypergradient w.r.t. (theta, k, l): implicit vs unrolled vs finite differences."""
  split, _ = load_data(seed, n_features)
  data = (split["train"], split["val"])
  theta = jnp.asarray(np.random.default_rng(seed).normal(0.0, 0.5, n_features))
  init = zeros_init(n_features)
  k, l = jnp.asarray(float(k)), jnp.asarray(float(l))

  def value(th, kk, ll, diff="implicit", mask_maxiter=None, inner_maxiter=INNER_MAXITER):
    return outer_loss(th, kk, ll, init, data, diff=diff, mask_maxiter=mask_maxiter,
                      inner_maxiter=inner_maxiter)[0]

  # (c) central finite differences, coordinate by coordinate
  f_aux = jax.jit(lambda th, kk, ll: outer_loss(th, kk, ll, init, data))
  f = lambda *a: f_aux(*a)[0]  # noqa: E731
  base = (theta, k, l)
  m = f_aux(*base)[1][1]
  fd = []
  for which in range(3):
    arg = np.asarray(base[which], np.float64)
    g = np.zeros_like(arg)
    for idx in np.ndindex(arg.shape):
      plus, minus = arg.copy(), arg.copy()
      plus[idx] += fd_eps
      minus[idx] -= fd_eps
      args_p, args_m = list(base), list(base)
      args_p[which], args_m[which] = jnp.asarray(plus), jnp.asarray(minus)
      g[idx] = (float(f(*args_p)) - float(f(*args_m))) / (2 * fd_eps)
    fd.append(g)
  t0 = time.perf_counter()
  # timing of FD is the cost of 2 * (n + 2) loss evaluations
  for _ in range(2 * (n_features + 2)):
    jax.block_until_ready(f(*base))
  fd_time = time.perf_counter() - t0

  rows = []
  grad_a, compile_a = _compile(jax.grad(value, argnums=(0, 1, 2)), *base)
  g_a = grad_a(*base)
  rows.append(dict(method="(a) implicit (mask) + implicit (jaxopt LBFGS)", iters="to tol",
                   rel_err_theta=_rel([g_a[0]], [fd[0]]), rel_err_k=_rel([g_a[1]], [fd[1]]),
                   rel_err_l=_rel([g_a[2]], [fd[2]]), rel_err_all=_rel(g_a, fd),
                   time_ms=1e3 * _median_time(grad_a, *base), compile_s=compile_a,
                   temp_bytes=_temp_bytes(grad_a)))
  for iters in unrolled_iters:
    grad_b, compile_b = _compile(jax.grad(functools.partial(
        value, diff="unrolled", mask_maxiter=iters, inner_maxiter=iters), argnums=(0, 1, 2)),
        *base)
    g_b = grad_b(*base)
    rows.append(dict(method="(b) unrolled (mask Newton + LBFGS)", iters=iters,
                     rel_err_theta=_rel([g_b[0]], [fd[0]]), rel_err_k=_rel([g_b[1]], [fd[1]]),
                     rel_err_l=_rel([g_b[2]], [fd[2]]), rel_err_all=_rel(g_b, fd),
                     time_ms=1e3 * _median_time(grad_b, *base), compile_s=compile_b,
                     temp_bytes=_temp_bytes(grad_b)))
  rows.append(dict(method=f"(c) central finite differences (eps {fd_eps:g})",
                   iters=f"{2 * (n_features + 2)} solves", rel_err_theta=0.0, rel_err_k=0.0,
                   rel_err_l=0.0, rel_err_all=0.0, time_ms=1e3 * fd_time, compile_s=None,
                   temp_bytes=None))
  info = dict(n_features=n_features, k=float(k), l=float(l), fd_eps=fd_eps,
              mask=np.asarray(m).round(4).tolist(),
              n_fractional=int(np.sum((np.asarray(m) > 0) & (np.asarray(m) < 1))),
              val_loss=float(f(*base)), grad_fd_theta=fd[0].tolist(),
              grad_fd_k=float(fd[1]), grad_fd_l=float(fd[2]),
              grad_implicit_theta=np.asarray(g_a[0]).tolist())
  return rows, info


# ----------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------


def adam(lr, b1=0.9, b2=0.999, eps=1e-8):
  def init(params):
    z = jax.tree_util.tree_map(jnp.zeros_like, params)
    return (z, z, 0)

  def update(grads, state, params):
    m, v, t = state
    t = t + 1
    m = jax.tree_util.tree_map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
    v = jax.tree_util.tree_map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
    new = jax.tree_util.tree_map(
        lambda p, a, b: p - lr * (a / (1 - b1 ** t)) / (jnp.sqrt(b / (1 - b2 ** t)) + eps),
        params, m, v)
    return new, (m, v, t)

  return init, update


def train(split, *, k, l, steps, lr, seed, learn_k=False, feature_cost=0.0):
  """Adam on theta (and kappa when learn_k); returns the history and the final state."""
  n = split["train"][0].shape[1]
  data = (split["train"], split["val"])
  rng = np.random.default_rng(seed)
  params = {"theta": jnp.asarray(rng.normal(0.0, 0.01, n))}
  if learn_k:
    params["kappa"] = jnp.asarray(float(np.log((k - 1) / (n - 1 - k))))

  def k_of(p):
    return 1.0 + (n - 2) * jax.nn.sigmoid(p["kappa"]) if learn_k else jnp.asarray(float(k))

  def objective(p, init):
    kk = k_of(p)
    val, (inner, m) = outer_loss(p["theta"], kk, l, init, data)
    return val + feature_cost * kk, (val, inner, m, kk)

  step_fn = jax.jit(jax.value_and_grad(objective, has_aux=True))
  opt_init, opt_update = adam(lr)
  opt_update = jax.jit(opt_update)
  opt_state = opt_init(params)
  init = zeros_init(n)
  history = []
  t0 = time.perf_counter()
  for it in range(steps):
    (obj, (val, inner, m, kk)), g = step_fn(params, init)
    init = inner  # warm start (the inner solution is not differentiated through)
    m_np = np.asarray(m)
    history.append(dict(step=it, objective=float(obj), val_loss=float(val), k=float(kk),
                        nnz=int(np.sum(m_np > 0)), n_one=int(np.sum(m_np == 1.0))))
    if it < steps - 1:
      params, opt_state = opt_update(g, opt_state, params)
  seconds = time.perf_counter() - t0
  # the last step's (params, mask, k) are consistent: the update after it is skipped
  return dict(history=history, theta=np.asarray(params["theta"]), k=float(kk),
              mask=m_np, seconds=seconds, steps=steps)


def univariate_baselines(split, k):
  from sklearn.feature_selection import SelectKBest, f_classif, mutual_info_classif

  x_tr, y_tr = (np.asarray(a) for a in split["train"])
  out = {}
  for name, score in (("univariate F-score (f_classif)", f_classif),
                      ("univariate mutual information",
                       functools.partial(mutual_info_classif, random_state=0))):
    selector = SelectKBest(score, k=k).fit(x_tr, y_tr)
    out[name] = evaluate_subset(np.flatnonzero(selector.get_support()), split)
  return out


# ----------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------


def _fmt_bytes(b):
  if b is None:
    return "n/a"
  return f"{b / 1024:.1f} KiB" if b < 2 ** 20 else f"{b / 2 ** 20:.2f} MiB"


def markdown(result):
  g, gi = result["gradcheck"], result["gradcheck_info"]
  lines = [
      "# Bilevel feature selection (breast cancer, soft top-k mask + jaxopt LBFGS)", "",
      f"Quick run: {result['quick']}. Seed {result['seed']}. Inner: L2 logistic "
      f"regression (alpha = {ALPHA}), jaxopt.LBFGS tol {INNER_TOL}. Mask: "
      f"soft_topk_mask(theta, k, l, p=4/3, solver='threshold').", "",
      f"## Hypergradient check (float64, {gi['n_features']} features, k = {gi['k']}, "
      f"l = {gi['l']}; {gi['n_fractional']} fractional mask entries)", "",
      "Relative error ||g - g_fd|| / ||g_fd|| against central finite differences (c), "
      "for the gradient w.r.t. theta, k, l and all together; time per hypergradient "
      "(jit, median, after compilation); temporary buffer size of the compiled "
      "hypergradient (XLA memory_analysis).", "",
      "| method | iterations | rel. err theta | rel. err k | rel. err l | rel. err all "
      "| time (ms) | compile (s) | temp memory |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in g:
    lines.append(f"| {r['method']} | {r['iters']} | {r['rel_err_theta']:.1e} | "
                 f"{r['rel_err_k']:.1e} | {r['rel_err_l']:.1e} | {r['rel_err_all']:.1e} | "
                 f"{r['time_ms']:.2f} | "
                 f"{'-' if r['compile_s'] is None else format(r['compile_s'], '.1f')} | "
                 f"{_fmt_bytes(r['temp_bytes'])} |")
  fk = result["fixed_k"]
  lines += [
      "", f"## Feature selection, k = {fk['k']} of {result['n_features']} features "
      f"({fk['steps']} Adam steps, lr {fk['lr']}, l = {fk['l']}, {fk['seconds']:.1f} s)", "",
      "Every selection is evaluated the same way: logistic regression refit on the k "
      "selected features (train split), log-loss and accuracy on validation and test. "
      "'soft model' is the trained bilevel model itself (masked features, soft mask).", "",
      "| selection | features | val loss | val acc | test loss | test acc |",
      "|---|---|---:|---:|---:|---:|",
      f"| bilevel, soft model (mask nnz {fk['soft_nnz']}) | - | {fk['soft_val_loss']:.4f} "
      "| - | - | - |"]
  for name, r in [("bilevel (top-k of learned theta)", fk["hard"])] + list(
      fk["baselines"].items()):
    names = ", ".join(result["feature_names"][i] for i in r["features"])
    lines.append(f"| {name} | {names} | {r['val_loss']:.4f} | {r['val_acc']:.3f} | "
                 f"{r['test_loss']:.4f} | {r['test_acc']:.3f} |")
  best_base = min(fk["baselines"].items(), key=lambda kv: kv[1]["val_loss"])
  lines += ["", f"Validation loss: bilevel {fk['hard']['val_loss']:.4f} vs best univariate "
            f"({best_base[0]}) {best_base[1]['val_loss']:.4f}."]
  lk = result["learned_k"]
  lines += [
      "", f"## Learning a fractional k (outer loss val + {lk['feature_cost']} * k, "
      f"{lk['steps']} steps, init k = {lk['k_init']})", "",
      f"Final k = {lk['k']:.3f} (mask nnz {lk['nnz']}, soft val loss {lk['val_loss']:.4f}); "
      f"hard refit on the top-{lk['k_round']} features of the learned theta: val loss "
      f"{lk['hard']['val_loss']:.4f}, test acc {lk['hard']['test_acc']:.3f}.", ""]
  return "\n".join(lines)


def plot(result, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  fk, lk = result["fixed_k"], result["learned_k"]
  ax = axes[0]
  ax.plot([h["val_loss"] for h in fk["history"]], label="bilevel (soft model)")
  for name, r in fk["baselines"].items():
    ax.axhline(r["val_loss"], ls="--", lw=1, label=name, color="0.5" if "F" in name else "0.7")
  ax.axhline(fk["hard"]["val_loss"], ls=":", color="tab:red",
             label="bilevel, hard top-k refit")
  ax.set_xlabel("Adam step"), ax.set_ylabel("validation log-loss")
  ax.set_title(f"k = {fk['k']}", fontsize=9), ax.legend(fontsize=7)
  ax = axes[1]
  ax.bar(range(result["n_features"]), fk["mask"])
  ax.set_xlabel("feature"), ax.set_ylabel("final soft mask")
  ax.set_title("learned mask (exact zeros outside)", fontsize=9)
  ax = axes[2]
  ax.plot([h["k"] for h in lk["history"]], color="tab:green")
  ax.set_xlabel("Adam step"), ax.set_ylabel("k")
  ax.set_title(f"learned fractional k (cost {lk['feature_cost']} per feature)", fontsize=9)
  ax2 = ax.twinx()
  ax2.plot([h["val_loss"] for h in lk["history"]], color="tab:purple", lw=1)
  ax2.set_ylabel("validation log-loss", color="tab:purple")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small run (< 30 s) for the tests")
  ap.add_argument("--k", type=int, default=5, help="features to select")
  ap.add_argument("--l", type=float, default=0.5, help="mask regularization strength")
  ap.add_argument("--steps", type=int, default=None, help="Adam steps (default 300, quick 60)")
  ap.add_argument("--lr", type=float, default=0.05, help="Adam learning rate")
  ap.add_argument("--feature-cost", type=float, default=0.01,
                  help="cost per selected feature when k is learned")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results"), help="output directory")
  return ap.parse_args(argv)


def main(argv=None):
  opts = parse_args(argv)
  steps = opts.steps or (30 if opts.quick else 300)
  t_start = time.perf_counter()
  unrolled = (5,) if opts.quick else (5, 10, 20, 50)
  rows, info = gradient_check(opts.seed, 10, k=3.0, l=opts.l, unrolled_iters=unrolled)
  for r in rows:
    print(f"{r['method']:<50} iters={str(r['iters']):<10} rel_err={r['rel_err_all']:.2e} "
          f"time={r['time_ms']:.1f} ms mem={_fmt_bytes(r['temp_bytes'])}", flush=True)

  print(f"[{time.perf_counter() - t_start:.0f}s] gradient check done", flush=True)
  split, names = load_data(opts.seed)
  n = len(names)
  run = train(split, k=opts.k, l=opts.l, steps=steps, lr=opts.lr, seed=opts.seed)
  hard = evaluate_subset(np.argsort(-run["theta"])[:opts.k], split)
  baselines = univariate_baselines(split, opts.k)
  fixed = dict(k=opts.k, l=opts.l, lr=opts.lr, steps=steps, seconds=run["seconds"],
               history=run["history"], mask=run["mask"].tolist(),
               theta=run["theta"].tolist(), soft_val_loss=run["history"][-1]["val_loss"],
               soft_nnz=int(np.sum(run["mask"] > 0)), hard=hard, baselines=baselines)
  print(f"k={opts.k}: bilevel soft val {fixed['soft_val_loss']:.4f}, hard refit val "
        f"{hard['val_loss']:.4f} (test acc {hard['test_acc']:.3f}); " + ", ".join(
            f"{k_}: val {v['val_loss']:.4f} (test acc {v['test_acc']:.3f})"
            for k_, v in baselines.items()), flush=True)

  print(f"[{time.perf_counter() - t_start:.0f}s] fixed-k run done", flush=True)
  k_init = float(opts.k) + 0.5
  run_k = train(split, k=k_init, l=opts.l, steps=steps, lr=opts.lr, seed=opts.seed,
                learn_k=True, feature_cost=opts.feature_cost)
  k_round = max(1, int(round(run_k["k"])))
  learned = dict(k_init=k_init, feature_cost=opts.feature_cost, steps=steps, k=run_k["k"],
                 k_round=k_round, history=run_k["history"],
                 nnz=int(np.sum(run_k["mask"] > 0)),
                 val_loss=run_k["history"][-1]["val_loss"],
                 hard=evaluate_subset(np.argsort(-run_k["theta"])[:k_round], split))
  print(f"learned k: {run_k['k']:.3f} (from {k_init}), hard refit on top-{k_round}: val "
        f"{learned['hard']['val_loss']:.4f}", flush=True)

  result = dict(quick=opts.quick, seed=opts.seed, n_features=n, feature_names=names,
                gradcheck=rows, gradcheck_info=info, fixed_k=fixed, learned_k=learned,
                total_s=time.perf_counter() - t_start)
  stem = _common.write_results(opts.out, "bilevel_feature_selection", opts.quick, result, markdown(result), plot)
  print(f"wrote {stem}.{{md,json,png}} in {result['total_s']:.0f}s")
  return result


if __name__ == "__main__":
  main()
