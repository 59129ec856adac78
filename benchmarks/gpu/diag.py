# Where the fused kernel's time goes on a GPU, in graph (adapted from ../shared/gpu-h100/diag.py
# for the kernel without a fallback): passes per row (mean / max), the kernel alone
# (pallas_threshold.fused_rows, which also writes the mask), forward and forward+backward of the
# default, block sizes (entries per program), num_warps, and free Newton passes before the
# ordered bisections. Writes JSON lines to $OUT/diag.jsonl.
# Usage (repository root): python benchmarks/gpu/diag.py [deadline_s]
import json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
T0 = time.time(); DEADLINE = float(sys.argv[1]) if len(sys.argv) > 1 else 200
OUT = os.environ.get("OUT", ".")
import implicit_topk as itk
from implicit_topk import _apply
from implicit_topk.kernels.gpu import pallas_threshold as PT
from implicit_topk.solvers.pallas import PallasSolver
from implicit_topk.problems import CappedSimplex, Magnitude
LOG = open(os.path.join(OUT, "diag.jsonl"), "a")
def emit(**r):
    r["t"] = round(time.time() - T0, 1); LOG.write(json.dumps(r) + "\n"); LOG.flush(); print(json.dumps(r), flush=True)
N = 50
def chain(op):
    return jax.jit(lambda x: jax.lax.fori_loop(0, N, lambda i, z: z + 1e-3 * op(z), x))
def chain_grad(op, w):
    g = jax.grad(lambda z: (op(z) * w).sum())
    return jax.jit(lambda x: jax.lax.fori_loop(0, N, lambda i, z: z + 1e-3 * g(z), x))
def timed(f, x, reps=9):
    jax.block_until_ready(f(x)); ts = []
    for _ in range(reps):
        t = time.perf_counter(); jax.block_until_ready(f(x)); ts.append(time.perf_counter() - t)
    return round(float(np.median(ts)) / N * 1e6, 1)
def attempt(r, key, fn):
    try: r[key] = fn()
    except Exception as e: r[key] = f"{type(e).__name__}: {str(e)[:160]}"
dev = jax.devices()[0]
emit(what="env", device=dev.device_kind, platform=dev.platform, jax=jax.__version__)
CELLS = [("mask", 64, 8, 2, 0.5), ("mag", 8, 64, 2, 0.5)] if os.environ.get("DIAG_SMOKE") else [("mask", 16384, 8, 1, 0.5), ("mask", 16384, 8, 2, 0.5), ("mask", 16384, 64, 1, 0.5),
         ("mask", 16384, 64, 2, 0.5), ("mask", 16384, 64, 8, 0.5), ("mask", 16384, 256, 1, 0.5),
         ("mask", 16384, 256, 2, 0.5), ("mask", 16384, 256, 8, 0.5), ("mask", 64, 1000, 10, 0.1),
         ("mag", 16384, 64, 2, 0.5), ("mag", 64, 1000, 10, 0.5)]
for kind, B, n, k, l in CELLS:
    if time.time() - T0 > DEADLINE: break
    x = jax.random.normal(jax.random.PRNGKey(0), (B, n)); w = jax.random.normal(jax.random.PRNGKey(1), (B, n))
    public = itk.soft_topk_mask if kind == "mask" else itk.soft_topk_mag
    prob = CappedSimplex(itk.PNorm(4 / 3)) if kind == "mask" else Magnitude(4 / 3)
    op = lambda z: public(z, k, regularization_strength=l)
    r = {}
    _, info = public(x, k, regularization_strength=l, return_info=True)
    it = np.asarray(info.iter_num); r["passes mean/max"] = [round(float(it.mean()), 2), int(it.max())]
    kk = jnp.full((B,), float(k)); ll = jnp.full((B,), float(l))
    attempt(r, "kernel only (writes y)", lambda: timed(chain(lambda z: PT.fused_rows(prob, z, kk, ll)[0]), x))
    attempt(r, "fwd", lambda: timed(chain(op), x)); attempt(r, "fb", lambda: timed(chain_grad(op, w), x))
    for be in (512, 1024, 2048):
        s = PallasSolver(problem=prob, block_elements=be)
        f = lambda z, s=s: _apply.threshold_operator(s, z, k, l, axis=-1)
        attempt(r, f"fb block {be}", lambda: timed(chain_grad(f, w), x))
    for nw in (2, 4, 8):
        s = PallasSolver(problem=prob, num_warps=nw)
        f = lambda z, s=s: _apply.threshold_operator(s, z, k, l, axis=-1)
        attempt(r, f"fwd warps {nw}", lambda: timed(chain(f), x))
    for free in (0, 16) if os.environ.get("DIAG_FREE") else ():
        s = PallasSolver(problem=prob, free_passes=free)
        f = lambda z, s=s: _apply.threshold_operator(s, z, k, l, axis=-1)
        attempt(r, f"fwd free {free}", lambda: timed(chain(f), x))
    hard = (lambda z: itk.hard_topk_mask(z, k)) if kind == "mask" else (
        lambda z: jnp.where(jnp.abs(z) >= jax.lax.top_k(jnp.abs(z), k)[0][..., -1:], z, 0.0))
    attempt(r, "hard fwd", lambda: timed(chain(hard), x))
    emit(cell=f"{kind} {B}x{n} k={k} l={l}", us=r)
emit(what="done")
