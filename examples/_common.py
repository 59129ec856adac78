"""Shared pieces of the examples: the digits data, a plain-JAX MLP, Adam, result files.

The examples import this module by path (``sys.path`` gets the examples folder), so
they run as scripts (``python examples/<name>.py``) and under ``runpy`` in the tests.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def load_digits(seed=0, label_noise=0.0, train_fraction=0.7):
  """scikit-learn's digits in [0, 1], shuffled and split; ``label_noise`` of the
  training labels replaced by uniform random classes."""
  from sklearn.datasets import load_digits as sklearn_digits

  data = sklearn_digits()
  x = (data.data / 16.0).astype(np.float32)
  y = data.target.astype(np.int32)
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(y))
  x, y = x[order], y[order]
  split = int(train_fraction * len(y))
  y_train = y[:split].copy()
  if label_noise > 0:
    flip = rng.random(split) < label_noise
    y_train[flip] = rng.integers(0, 10, size=int(flip.sum()))
  return (x[:split], y_train), (x[split:], y[split:])


def load_digits_standardized(seed):
  """scikit-learn's digits, a stratified 70/30 split, features standardized by the
  training set's mean and standard deviation."""
  from sklearn.datasets import load_digits as sklearn_digits
  from sklearn.model_selection import train_test_split

  data = sklearn_digits()
  x = data.data.astype(np.float32) / 16.0
  x_tr, x_te, y_tr, y_te = train_test_split(x, data.target, test_size=0.3,
                                            random_state=seed, stratify=data.target)
  mean, std = x_tr.mean(0), x_tr.std(0) + 1e-3
  return ((x_tr - mean) / std, y_tr), ((x_te - mean) / std, y_te)


def init_mlp(key, sizes):
  """Weights ~ N(0, 1/fan_in), zero biases."""
  params = []
  for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
    key, sub = jax.random.split(key)
    params.append((jax.random.normal(sub, (fan_in, fan_out)) / np.sqrt(fan_in), jnp.zeros(fan_out)))
  return params


def mlp(params, x):
  """ReLU hidden layers, linear output."""
  for w, b in params[:-1]:
    x = jax.nn.relu(x @ w + b)
  w, b = params[-1]
  return x @ w + b


def adam_init(params):
  zeros = jax.tree.map(jnp.zeros_like, params)
  return (zeros, zeros, 0)


def adam(grads, state, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
  """One Adam step: returns (updates to add, new state)."""
  m, v, t = state
  t = t + 1
  m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
  v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
  updates = jax.tree.map(lambda m, v: -lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps), m, v)
  return updates, (m, v, t)


def write_results(out, name, quick, result, markdown_text=None, plot=None, figure=None):
  """Writes ``<out>/<name>[_quick].json`` (and ``.md``, and ``.png`` via ``plot(result,
  path)`` when matplotlib is available, at ``figure`` if given); returns the path stem."""
  os.makedirs(out, exist_ok=True)
  stem = os.path.join(out, name + ("_quick" if quick else ""))
  with open(stem + ".json", "w") as f:
    json.dump(result, f, indent=1, default=float)
  if markdown_text is not None:
    with open(stem + ".md", "w") as f:
      f.write(markdown_text)
  if plot is not None:
    try:
      if figure is not None:
        os.makedirs(os.path.dirname(figure) or ".", exist_ok=True)
      plot(result, figure or stem + ".png")
    except ImportError:
      print("matplotlib not installed: no figure")
  return stem


def train_mlp(loss_fn, data, *, epochs, sizes, lr, batch=64, seed=0, evaluate=None):
  """Minibatch Adam on ``loss_fn(logits, labels)``; ``evaluate(params)`` after each epoch.

  Returns ``(params, history of evaluate's values, wall seconds of training)``.
  """
  (x_tr, y_tr), _ = data
  params = init_mlp(jax.random.PRNGKey(seed), sizes)
  state = adam_init(params)

  @jax.jit
  def step(params, state, xb, yb):
    grads = jax.grad(lambda p: loss_fn(mlp(p, xb), yb))(params)
    updates, state = adam(grads, state, lr=lr)
    return jax.tree.map(jnp.add, params, updates), state

  rng = np.random.default_rng(seed)
  history, seconds = [], 0.0
  for _ in range(epochs):
    start = time.perf_counter()
    order = rng.permutation(len(y_tr))
    for i in range(0, len(order) - batch + 1, batch):
      idx = order[i:i + batch]
      params, state = step(params, state, x_tr[idx], y_tr[idx])
    jax.block_until_ready(params)
    seconds += time.perf_counter() - start
    if evaluate is not None:
      history.append(evaluate(params))
  return params, history, seconds
