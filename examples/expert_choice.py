#!/usr/bin/env python
"""Expert-choice routing with a soft top-k over tokens sharded across 8 host devices.

Expert-choice routing (Zhou et al., 2022, "Mixture-of-Experts with Expert Choice
Routing") turns the usual routing around: instead of every token choosing its top-k
experts (token choice: GShard, Switch Transformer), every expert chooses its top-``c``
tokens of the batch, ``c = T k / E`` (``T`` tokens, ``E`` experts, ``k`` experts per
token on average). Each expert then processes exactly ``c`` tokens: the load is
balanced by construction, no token is dropped for lack of capacity, and a token may
be picked by several experts or by none.

Here the selection over the token axis is ``soft_topk_mask(scores.T, c, axis=-1)``:
sparse (exactly 0 for the tokens an expert does not take), summing to ``c`` per expert,
differentiable w.r.t. the router scores. The token axis is sharded over 8 host devices
(``jax.jit`` with ``NamedSharding(mesh, P("d", None))``): each Newton step of the
operator all-reduces a few scalars per expert, the tokens stay where they are.

Synthetic task (the same data for every variant): ``d = 16`` features from ``M = 8``
Gaussian clusters with Zipf frequencies (1/1, 1/2, ..., 1/8: the first cluster has 37%
of the tokens), target ``y = A_m x`` with a random 4 x 16 map ``A_m`` per cluster, MSE.
The model is one mixture-of-experts layer: router ``S = softmax(x W_r)`` over
``E = 8`` experts, experts MLPs 16-32-4, output ``sum_e G[e, t] S[t, e] f_e(x_t)``.
Variants (``k = 2`` experts per token, the same compute ``E c = T k``):

* ``expert choice, soft`` (ours): ``G = soft_topk_mask(S.T, c, l, p = 4/3)`` along the
  sharded token axis;
* ``expert choice, soft, per sequence`` (ours): the batch packs 8 sequences of random
  lengths; every expert takes ``c_s = len_s k / E`` tokens of every sequence
  ``s`` with ``segment_soft_topk_mask`` (ragged, no padding);
* ``expert choice, hard``: ``lax.top_k`` of each expert's scores over the tokens (a
  sort of the whole token axis: XLA gathers it);
* ``token choice top-2``: each token takes its 2 best experts, gate = score, expert
  capacity ``T k / E`` (capacity factor 1), tokens beyond it dropped in batch order;
* ``token choice top-2 + aux loss``: the same with the load-balancing loss of the
  Switch Transformer (Fedus et al., 2021), coefficient ``--aux``.

Reported on held-out batches: the demand per expert (token choice: the tokens whose
top-2 contains it, before capacity; expert choice: ``c``), tokens per expert (nonzero
gates, after capacity) and their max/mean, the share of tokens routed to no expert ("unrouted": dropped or not chosen),
the gate mass per expert (``sum_t G[e, t]``: ``c`` exactly for expert choice), test MSE, and the number of
all-gathers in each compiled training step.

Outputs ``<out>/expert_choice.{json,md}`` and the figure ``--figure``
(``docs/expert_choice.png``).

Usage::

    python examples/expert_choice.py       # < 90 s on a 2-core CPU (what the test runs)
"""

from __future__ import annotations

import os

# 8 host devices; must be set before jax is imported.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import implicit_topk as itk  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (examples/_common.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("expert choice, soft", "expert choice, soft, per sequence", "expert choice, hard",
            "token choice top-2", "token choice top-2 + aux loss")
D, OUT, CLUSTERS, SEQUENCES = 16, 4, 8, 8


# ----------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------


class Task:
  """Zipf-weighted Gaussian clusters, one linear target map per cluster."""

  def __init__(self, seed):
    rng = np.random.default_rng(seed)
    self.means = rng.normal(size=(CLUSTERS, D)).astype(np.float32)
    self.maps = (rng.normal(size=(CLUSTERS, OUT, D)) / np.sqrt(D)).astype(np.float32)
    freq = 1.0 / np.arange(1, CLUSTERS + 1)
    self.freq = freq / freq.sum()

  def batch(self, rng, tokens):
    cluster = rng.choice(CLUSTERS, size=tokens, p=self.freq)
    x = self.means[cluster] + rng.normal(size=(tokens, D)).astype(np.float32)
    y = np.einsum("tod,td->to", self.maps[cluster], x)
    # SEQUENCES packed sequences of random lengths (>= 8 tokens each)
    cuts = np.sort(rng.choice(np.arange(1, tokens // 8), SEQUENCES - 1, replace=False)) * 8
    lengths = np.diff(np.concatenate([[0], cuts, [tokens]]))
    segment_ids = np.repeat(np.arange(SEQUENCES), lengths).astype(np.int32)
    return x.astype(np.float32), y.astype(np.float32), segment_ids


# ----------------------------------------------------------------------------------
# model and routers
# ----------------------------------------------------------------------------------


def init_params(key, experts, hidden):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
      "router": jax.random.normal(k1, (D, experts)) * 0.1 / np.sqrt(D),
      "w1": jax.random.normal(k2, (experts, D, hidden)) * np.sqrt(2.0 / D),
      "b1": jnp.zeros((experts, hidden)),
      "w2": jax.random.normal(k3, (experts, hidden, OUT)) / np.sqrt(hidden),
      "b2": jnp.zeros((experts, OUT)),
  }


def experts_forward(params, x):
  """Every expert on every token (E, T, OUT); the gates are sparse, the compute dense
  (a capacity-buffer dispatch, as in examples/moe_router.py, computes only E c)."""
  h = jax.nn.relu(jnp.einsum("td,edh->eth", x, params["w1"]) + params["b1"][:, None])
  return jnp.einsum("eth,eho->eto", h, params["w2"]) + params["b2"][:, None]


def route(variant, scores, segment_ids, *, k, l):
  """Gates G (E, T) >= 0 of one batch, from router probabilities ``scores`` (T, E)."""
  tokens, experts = scores.shape
  c = tokens * k / experts
  if variant == "expert choice, soft":
    # The token axis is split over devices under jit with automatic sharding, which the
    # default solver cannot see when it is chosen: the threshold solver reduces across
    # devices (one all-reduce of a few scalars per Newton pass) instead of gathering.
    return itk.soft_topk_mask(scores.T, c, regularization_strength=l, axis=-1,
                              solver="threshold")
  if variant == "expert choice, soft, per sequence":
    lengths = jax.ops.segment_sum(jnp.ones_like(segment_ids, scores.dtype), segment_ids,
                                  num_segments=SEQUENCES)
    return itk.segment_soft_topk_mask(scores.T, segment_ids, lengths * k / experts,
                                      num_segments=SEQUENCES, regularization_strength=l, axis=-1)
  if variant == "expert choice, hard":
    _, idx = jax.lax.top_k(scores.T, int(round(c)))  # (E, c): a sort over all tokens
    return jnp.zeros((experts, tokens), scores.dtype).at[
        jnp.arange(experts)[:, None], idx].set(1.0)
  # token choice: top-k experts per token, capacity T k / E per expert, batch order
  _, idx = jax.lax.top_k(scores, k)
  chosen = jnp.sum(jax.nn.one_hot(idx, experts, dtype=scores.dtype), axis=1)  # (T, E)
  position = jnp.cumsum(chosen, axis=0) * chosen  # 1-based slot in the expert's buffer
  capacity = int(round(c))
  return (chosen * (position <= capacity)).T


def aux_balance_loss(scores, gates):
  """Switch Transformer load-balancing loss: E * sum_e f_e P_e (1 when balanced)."""
  experts = scores.shape[1]
  chosen = (jnp.argmax(scores, axis=1)[:, None] == jnp.arange(experts)).astype(scores.dtype)
  return experts * jnp.sum(jnp.mean(chosen, 0) * jnp.mean(scores, 0))


def forward(params, x, segment_ids, *, variant, k, l):
  scores = jax.nn.softmax(x @ params["router"], axis=-1)  # (T, E)
  gates = route(variant, scores, segment_ids, k=k, l=l)  # (E, T)
  weights = gates * scores.T  # expert-choice and token-choice gate: the router score
  out = jnp.einsum("et,eto->to", weights, experts_forward(params, x))
  return out, scores, gates


def loss_fn(params, x, y, segment_ids, *, variant, k, l, aux):
  out, scores, gates = forward(params, x, segment_ids, variant=variant, k=k, l=l)
  loss = jnp.mean(jnp.sum((out - y) ** 2, -1))
  total = loss + (aux * aux_balance_loss(scores, gates) if variant.endswith("aux loss") else 0.0)
  return total, loss


def make_step(variant, opts):
  fn = functools.partial(loss_fn, variant=variant, k=opts.k, l=opts.l, aux=opts.aux)
  b1, b2, eps, lr = 0.9, 0.999, 1e-8, opts.lr

  @jax.jit
  def step(params, opt, x, y, segment_ids):
    (_, loss), grads = jax.value_and_grad(fn, has_aux=True)(params, x, y, segment_ids)
    m, v, t = opt
    t = t + 1
    m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
    scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
    params = jax.tree.map(lambda p, a, b: p - scale * a / (jnp.sqrt(b) + eps), params, m, v)
    return params, (m, v, t), loss

  return step


def route_variant(variant):
  return "token choice top-2" if variant.startswith("token choice") else variant


# ----------------------------------------------------------------------------------
# run
# ----------------------------------------------------------------------------------


def run(opts):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  tok = NamedSharding(mesh, P("d", None))
  tok1 = NamedSharding(mesh, P("d"))
  rep = NamedSharding(mesh, P())
  task = Task(opts.seed)

  def put(batch):
    x, y, s = batch
    return jax.device_put(x, tok), jax.device_put(y, tok), jax.device_put(s, tok1)

  train_rng = np.random.default_rng(opts.seed + 1)
  train_batches = [put(task.batch(train_rng, opts.tokens)) for _ in range(opts.batches)]
  test_rng = np.random.default_rng(opts.seed + 2)
  test_batches = [put(task.batch(test_rng, opts.tokens)) for _ in range(opts.test_batches)]
  init = jax.device_put(init_params(jax.random.PRNGKey(opts.seed), opts.experts, opts.hidden),
                        rep)

  results = {}
  for variant in VARIANTS:
    start = time.perf_counter()
    step = make_step(variant, opts)
    params = init
    zeros = jax.tree.map(jnp.zeros_like, params)
    opt = (zeros, zeros, jnp.asarray(0.0, jnp.float32))
    x0, y0, s0 = train_batches[0]
    compiled = step.lower(params, opt, x0, y0, s0).compile()
    hlo = compiled.as_text()
    gathers = len(re.findall(r"all-gather[-a-z]*\(", hlo))
    reduces = len(re.findall(r"all-reduce[-a-z]*\(", hlo))
    losses = []
    for t in range(opts.steps):
      x, y, s = train_batches[t % len(train_batches)]
      # one step at a time: many in-flight programs with collectives can starve the
      # host-device threads of a small machine (XLA CPU rendezvous timeout)
      params, opt, loss = jax.block_until_ready(compiled(params, opt, x, y, s))
      losses.append(float(loss))
    evaluate = jax.jit(functools.partial(forward, variant=route_variant(variant), k=opts.k,
                                         l=opts.l))
    mse, per_expert, mass, unrouted, demand, out_sharding = [], [], [], [], [], None
    for x, y, s in test_batches:
      out, scores, gates = evaluate(params, x, s)
      if variant.startswith("token choice"):  # tokens asking for each expert, before capacity
        top = np.argsort(-np.asarray(scores), axis=1)[:, :opts.k]
        demand.append(np.bincount(top.ravel(), minlength=opts.experts))
      else:  # an expert's demand is its capacity
        demand.append(np.asarray(gates).sum(1))
      out_sharding = str(gates.sharding.spec)
      g = np.asarray(gates)
      mse.append(float(np.mean(np.sum((np.asarray(out) - np.asarray(y)) ** 2, -1))))
      per_expert.append((g > 0).sum(1))
      mass.append(g.sum(1))
      unrouted.append(float(np.mean((g > 0).sum(0) == 0)))
    per_expert = np.mean(per_expert, 0)
    results[variant] = dict(
        train_loss=losses, test_mse=float(np.mean(mse)),
        tokens_per_expert=per_expert.tolist(),
        load_max_over_mean=float(per_expert.max() / per_expert.mean()),
        load_cv=float(per_expert.std() / per_expert.mean()),
        mask_mass_per_expert=np.mean(mass, 0).tolist(),
        demand_per_expert=np.mean(demand, 0).tolist(),
        demand_max_over_mean=float(np.max(np.mean(demand, 0)) / np.mean(demand)),
        assignments_dropped=float(1 - np.sum(per_expert) / np.sum(np.mean(demand, 0))),
        unrouted=float(np.mean(unrouted)),
        all_gathers=gathers, all_reduces=reduces, gate_sharding=out_sharding,
        seconds=time.perf_counter() - start)
    r = results[variant]
    print(f"{variant:<34} test MSE {r['test_mse']:.3f} | tokens/expert max/mean "
          f"{r['load_max_over_mean']:.2f} (min {per_expert.min():.0f}, max {per_expert.max():.0f})"
          f" | demand max/mean {r['demand_max_over_mean']:.2f} | unrouted {r['unrouted']:.3f} | train step: {gathers} all-gather, {reduces} "
          f"all-reduce | {r['seconds']:.1f} s", flush=True)
  return dict(results=results, capacity=opts.tokens * opts.k / opts.experts,
              cluster_freq=task.freq.tolist())


# ----------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------


def markdown(result):
  o = result["options"]
  lines = [
      "# Expert-choice routing with a soft top-k over sharded tokens", "",
      f"Synthetic regression (d = {D}, {CLUSTERS} Gaussian clusters with Zipf frequencies, one "
      f"linear map per cluster), one MoE layer with E = {o['experts']} experts (MLP "
      f"{D}-{o['hidden']}-{OUT}), k = {o['k']} experts per token, batch T = {o['tokens']} tokens "
      f"sharded over {result['devices']} host devices (`P(\"d\", None)`), expert capacity "
      f"c = T k / E = {result['capacity']:g}; {o['steps']} Adam steps (lr {o['lr']}) over "
      f"{o['batches']} training batches; soft mask l = {o['l']}, p = 4/3; aux loss "
      f"coefficient {o['aux']}. Statistics on {o['test_batches']} held-out batches. Seed "
      f"{o['seed']}; wall time {result['seconds']:.0f} s ({result['backend']}).", "",
      "| routing | test MSE | final train loss | demand max/mean | tokens per expert "
      "(min / max) | max/mean | gate mass per expert | tokens routed to no expert | "
      "all-gathers in train step |",
      "|---|---:|---:|---:|---|---:|---|---:|---:|"]
  for v in VARIANTS:
    r = result["results"][v]
    tpe = r["tokens_per_expert"]
    mass = r["mask_mass_per_expert"]
    tail = float(np.mean(r["train_loss"][-10:]))
    lines.append(
        f"| {v} | {r['test_mse']:.3f} | {tail:.3f} | {r['demand_max_over_mean']:.2f} | "
        f"{min(tpe):.1f} / {max(tpe):.1f} | {r['load_max_over_mean']:.2f} | "
        f"{min(mass):.2f} - {max(mass):.2f} | {r['unrouted']:.3f} | {r['all_gathers']} |")
  lines += ["", "Tokens per expert (held-out batches, nonzero gates after capacity):", "",
            "| routing | " + " | ".join(f"e{i}" for i in range(o["experts"])) + " |",
            "|---|" + "---:|" * o["experts"]]
  for v in VARIANTS:
    lines.append(f"| {v} | " + " | ".join(f"{a:.1f}" for a in
                                          result["results"][v]["tokens_per_expert"]) + " |")
  lines.append("")
  return "\n".join(lines)


def plot(result, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  o = result["options"]
  width = 0.8 / len(VARIANTS)
  for i, v in enumerate(VARIANTS):
    r = result["results"][v]
    loss = np.convolve(r["train_loss"], np.ones(10) / 10, mode="valid")
    axes[0].plot(np.arange(len(loss)) + 9, loss, label=v)
    axes[1].bar(np.arange(o["experts"]) + (i - (len(VARIANTS) - 1) / 2) * width,
                r["tokens_per_expert"], width, label=v)
  axes[0].set_yscale("log"), axes[0].set_xlabel("step")
  axes[0].set_ylabel("train MSE (moving average 10)"), axes[0].legend(fontsize=7)
  axes[1].axhline(result["capacity"], color="0.4", ls="--", lw=1, label="capacity T k / E")
  axes[1].set_xlabel("expert"), axes[1].set_ylabel("tokens per expert (held out)")
  axes[1].set_ylim(0, 1.6 * result["capacity"])
  axes[1].legend(fontsize=7, ncol=2, loc="upper center")
  fig.suptitle(f"Expert choice vs token choice, T = {o['tokens']} tokens over 8 devices",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--k", type=int, default=2, help="experts per token (on average)")
  ap.add_argument("--hidden", type=int, default=32)
  ap.add_argument("--tokens", type=int, default=512, help="tokens per batch (8 | tokens)")
  ap.add_argument("--steps", type=int, default=150)
  ap.add_argument("--batches", type=int, default=20, help="distinct training batches")
  ap.add_argument("--test-batches", type=int, default=4)
  ap.add_argument("--lr", type=float, default=1e-2)
  ap.add_argument("--l", type=float, default=0.005, help="soft mask regularization")
  ap.add_argument("--aux", type=float, default=0.01, help="load-balancing loss coefficient")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=os.path.join(ROOT, "examples", "results"))
  ap.add_argument("--figure", default=os.path.join(ROOT, "docs", "expert_choice.png"))
  opts = ap.parse_args(argv)
  start = time.perf_counter()
  result = run(opts)
  result.update(options=vars(opts), seconds=time.perf_counter() - start,
                backend=jax.default_backend(), devices=jax.device_count())
  text = markdown(result)
  _common.write_results(opts.out, "expert_choice", False, result, text, plot, figure=opts.figure)
  print(text)
  summary = {v: {key: r[key] for key in ("test_mse", "load_max_over_mean", "unrouted",
                                         "demand_max_over_mean",
                                         "all_gathers", "tokens_per_expert",
                                         "mask_mass_per_expert")}
             for v, r in result["results"].items()}
  summary["_capacity"] = result["capacity"]
  print(f"RESULT_JSON {json.dumps(summary)}")
  return result


if __name__ == "__main__":
  main()
