#!/usr/bin/env python
"""A differentiable soft-median filter on a noisy image (seed 003's example, exact and sparse).

Grace Hopper's portrait, shipped with matplotlib (no download), in grayscale, gets 10%
salt-and-pepper noise. Every pixel is replaced by the soft median of its 3x3 neighbourhood,
``soft_quantile(patch, 0.5, regularization_strength=...)``: all 9-pixel patches of the image form one batch
(O(n log n) per patch, no n x n). As ``l -> 0`` it is the hard median filter; as ``l``
grows it tends to the mean filter. The script reports the PSNR against the clean image
and writes a figure; it also learns ``l`` by gradient descent on the PSNR, which the
hard median cannot do.

Usage::

    python examples/soft_median_filter.py            # 256 x 256, a few seconds
    python examples/soft_median_filter.py --quick    # 64 x 64, for the tests
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import implicit_topk as itk


def load_image(size):
  import matplotlib.cbook as cbook
  import matplotlib.image as mpimg

  image = mpimg.imread(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
  gray = image[..., :3].astype(np.float64).mean(axis=-1) / 255.0
  step = max(1, min(gray.shape) // size)
  return gray[::step, ::step][:size, :size]


def salt_and_pepper(image, amount, seed=0):
  rng = np.random.default_rng(seed)
  noisy = image.copy()
  hit = rng.random(image.shape) < amount
  noisy[hit] = rng.integers(0, 2, size=hit.sum()).astype(image.dtype)
  return noisy


def patches(image, radius=1):
  """(H, W, (2r+1)^2) neighbourhoods, edges padded by reflection."""
  padded = jnp.pad(image, radius, mode="reflect")
  h, w = image.shape
  size = 2 * radius + 1
  return jnp.stack([padded[i:i + h, j:j + w] for i in range(size) for j in range(size)], axis=-1)


def soft_median_filter(image, l):
  return itk.soft_quantile(patches(image), 0.5, regularization_strength=l)


def psnr(a, b):
  return 10 * jnp.log10(1.0 / jnp.mean((a - b) ** 2))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--size", type=int, default=256)
  ap.add_argument("--out", default=os.path.join("examples", "results"))
  opts = ap.parse_args(argv)
  size = 64 if opts.quick else opts.size
  clean = jnp.asarray(load_image(size))
  noisy = jnp.asarray(salt_and_pepper(np.asarray(clean), 0.1))
  results = {"noisy": noisy, "hard median": jnp.median(patches(noisy), axis=-1),
             "mean": jnp.mean(patches(noisy), axis=-1)}
  for l in (0.3, 3.0, 30.0):
    results[f"soft median l={l}"] = soft_median_filter(noisy, l)
  scores = {name: float(psnr(img, clean)) for name, img in results.items()}

  # learn l (log-parameterized) by gradient ascent on the PSNR
  loss = jax.jit(jax.value_and_grad(
      lambda log_l, noisy, clean: -psnr(soft_median_filter(noisy, jnp.exp(log_l)), clean)))
  log_l = jnp.log(3.0)
  for _ in range(5 if opts.quick else 30):
    _, grad = loss(log_l, noisy, clean)
    log_l = log_l - 0.5 * jnp.sign(grad) * jnp.minimum(jnp.abs(grad), 1.0)
  learned = float(jnp.exp(log_l))
  results[f"learned l={learned:.3g}"] = soft_median_filter(noisy, learned)
  scores[f"learned l={learned:.3g}"] = float(psnr(results[f"learned l={learned:.3g}"], clean))
  for name, value in scores.items():
    print(f"{name:>24s}: PSNR {value:6.2f} dB")

  os.makedirs(opts.out, exist_ok=True)
  stem = os.path.join(opts.out, "soft_median_filter" + ("_quick" if opts.quick else ""))
  with open(stem + ".json", "w") as f:
    json.dump({"size": size, "noise": "10% salt and pepper", "psnr_db": scores}, f, indent=1)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  shown = ["noisy", "hard median", "soft median l=0.3", "soft median l=3.0",
           "soft median l=30.0", f"learned l={learned:.3g}", "mean"]
  fig, axes = plt.subplots(1, len(shown), figsize=(3 * len(shown), 3.4))
  for ax, name in zip(axes, shown):
    ax.imshow(np.asarray(results[name]), cmap="gray", vmin=0, vmax=1)
    ax.set_title(f"{name}\n{scores[name]:.1f} dB", fontsize=9)
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(stem + ".png", dpi=90)
  print(f"wrote {stem}.json, .png")
  return scores


if __name__ == "__main__":
  main()
