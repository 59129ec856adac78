#!/usr/bin/env python
"""Start-up as a new user meets it: import, first call (with compilation), second process.

From a ``git archive`` of ``HEAD`` unpacked in an empty temporary directory (the
package as a fresh clone has it) with an empty numba cache (``NUMBA_CACHE_DIR``), each
step in a fresh Python process:

1. ``import implicit_topk`` alone;
2. the first ``soft_topk_mask`` forward+backward (``jax.value_and_grad`` under
   ``jax.jit``) on a (64, 1000) float32 input, default solver: the CPU kernels it
   needs are compiled then;
3. the same in a second fresh process (the kernels load from numba's cache);
4. with another empty numba cache, the first call of the README's router gate
   (``soft_topk_mask(logits, 2, regularization_strength=0.5, standardize=True,
   max_support=3)`` forward+backward on (256, 8) float32 logits): the support budget's
   kernels are compiled then.

Each process reports its import time and its first call's time (``time.perf_counter``);
the wall time of each process (interpreter start included) is measured around it. The
load average and the core count are recorded. ``--json FILE`` writes the figures.

Usage::

    python benchmarks/startup.py --json benchmarks/results/cpu_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_IMPORT = """
import time
start = time.perf_counter()
import implicit_topk
print(time.perf_counter() - start, 0.0)
"""

_FIRST_CALL = """
import time
start = time.perf_counter()
import jax, jax.numpy as jnp
import implicit_topk as itk
imported = time.perf_counter()
x = jax.random.normal(jax.random.key(0), (64, 1000), jnp.float32)
w = jnp.cos(jnp.arange(1000, dtype=jnp.float32))
f = jax.jit(jax.value_and_grad(lambda z: jnp.sum(itk.soft_topk_mask(z, 10.0) * w)))
jax.block_until_ready(f(x))
print(imported - start, time.perf_counter() - imported)
"""

_FIRST_BUDGET_CALL = """
import time
start = time.perf_counter()
import jax, jax.numpy as jnp
import implicit_topk as itk
imported = time.perf_counter()
x = jax.random.normal(jax.random.key(0), (256, 8), jnp.float32)
w = jnp.cos(jnp.arange(8, dtype=jnp.float32))
f = jax.jit(jax.value_and_grad(lambda z: jnp.sum(itk.soft_topk_mask(
    z, 2, regularization_strength=0.5, standardize=True, max_support=3) * w)))
jax.block_until_ready(f(x))
print(imported - start, time.perf_counter() - imported)
"""


def _run(script: str, env: dict) -> dict:
  start = time.perf_counter()
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                        text=True, check=True)
  wall = time.perf_counter() - start
  imported, call = (float(v) for v in done.stdout.split()[-2:])
  return {"import_s": imported, "first_call_s": call, "process_wall_s": wall}


def measure() -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    tree = os.path.join(tmp, "src")
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", "HEAD"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    env = dict(os.environ, PYTHONPATH=tree, NUMBA_CACHE_DIR=os.path.join(tmp, "numba_cache"),
               JAX_PLATFORMS="cpu")
    env.pop("JAX_ENABLE_X64", None)
    load = os.getloadavg()
    steps = {"import": _run(_IMPORT, env), "first_process": _run(_FIRST_CALL, env),
             "second_process": _run(_FIRST_CALL, env)}
    env["NUMBA_CACHE_DIR"] = os.path.join(tmp, "numba_cache_budget")
    steps["first_budget_process"] = _run(_FIRST_BUDGET_CALL, env)
  return {"cores": os.cpu_count(), "machine": platform.machine(),
          "python": platform.python_version(),
          "loadavg": [load[0], os.getloadavg()[0]], "steps": steps}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", default=None, help="also write the figures to this file")
  opts = parser.parse_args()
  result = measure()
  for name, step in result["steps"].items():
    print(f"{name:20s} import {step['import_s']:6.2f} s  first call {step['first_call_s']:6.2f} s"
          f"  process {step['process_wall_s']:6.2f} s")
  print(f"{result['cores']} cores, load average {result['loadavg'][0]:.2f} before, "
        f"{result['loadavg'][1]:.2f} after")
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
