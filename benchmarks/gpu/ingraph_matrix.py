# One prepared GPU run (adapted from ../shared/gpu-h100/ingraph_matrix.py, the H100 run of 2026-11-27):
# correctness of solver="pallas" compiled, in-graph matrix (hard, auto, threshold, pallas, and the
# fused prototype where ../shared/gpu-h100/proto_pallas_mask.py is importable; the magnitude
# operator; max_support against the plain mask at the router cells), per-call router
# cells, soft_sort/soft_rank scaling, dykstra per call.
# Writes JSON lines to $OUT/gpu.jsonl as it goes. Usage (repository root):
#   python benchmarks/gpu/ingraph_matrix.py [deadline_s]
import json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp

T0 = time.time()
DEADLINE = float(sys.argv[1]) if len(sys.argv) > 1 else 400.0
OUT = os.environ.get("OUT", ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
for _shared in ("../shared/gpu-h100", "shared/gpu-h100"):
    sys.path.insert(0, os.path.join(os.getcwd(), _shared))
import implicit_topk as itk
try:  # the measurement aid of ../shared/gpu-h100 (not part of the project)
    from proto_pallas_mask import make as proto_make
except ImportError:
    proto_make = None


def hard_mask(x, k):
    _, i = jax.lax.top_k(x, k)
    return jnp.zeros_like(x).at[jnp.arange(x.shape[0])[:, None], i].set(1.0)

LOG = open(os.path.join(OUT, "gpu.jsonl"), "a")
def emit(**r):
    r["t"] = round(time.time() - T0, 1)
    LOG.write(json.dumps(r) + "\n"); LOG.flush()
    print(json.dumps(r), flush=True)
def left():
    return DEADLINE - (time.time() - T0)

dev = jax.devices()[0]
emit(what="env", device=dev.device_kind, platform=dev.platform, jax=jax.__version__, itk=getattr(itk, "__version__", "?"))

# ---------------- A. compiled pallas vs independent float64 reference ----------------
try:
    try:  # an independent float64 reference: the project's tests/references.py
        sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
        import references as _R
        ref_mask = lambda row, k, l, p: (np.asarray(_R.soft_topk_mask(row, k, l, p)),)
    except ImportError:
        from refs import ref_mask
    rng = np.random.default_rng(0)
    errs = {}
    for (B, n, k, l, p) in [(64, 8, 2.0, 0.5, 4/3), (64, 64, 2.0, 0.5, 4/3), (64, 256, 8.0, 0.5, 4/3), (16, 1000, 10.0, 0.1, 4/3), (64, 64, 2.5, 2.0, 2.0), (8, 4096, 40.0, 0.1, 4/3)]:
        x = rng.standard_normal((B, n)).astype(np.float32)
        x[0, :3] = x[0, 0]  # ties
        y = np.asarray(itk.soft_topk_mask(jnp.asarray(x), k, regularization_strength=l, p=p, solver="pallas"))
        ref = np.stack([ref_mask(r.astype(np.float64), k, l, p)[0] for r in x])
        errs[f"{B}x{n} k={k} l={l} p={p:.3g}"] = float(np.abs(y - ref).max())
    lowered = jax.jit(lambda z: itk.soft_topk_mask(z, 2.0, regularization_strength=0.5)).lower(jnp.zeros((16384, 64))).as_text()
    emit(what="pallas_correctness", max_abs_err=errs, auto_uses_triton=("triton" in lowered.lower()))
except Exception as e:
    emit(what="pallas_correctness", error=f"{type(e).__name__}: {str(e)[:400]}")

# ---------------- B. in graph ----------------
N = 50
def chain(op):
    def f(x):
        return jax.lax.fori_loop(0, N, lambda i, z: z + 1e-3 * op(z), x)
    return jax.jit(f)
def chain_grad(op, w):
    g = jax.grad(lambda z: (op(z) * w).sum())
    def f(x):
        return jax.lax.fori_loop(0, N, lambda i, z: z + 1e-3 * g(z), x)
    return jax.jit(f)
def timed(f, x, reps=9, per=N):
    jax.block_until_ready(f(x)); ts = []
    for _ in range(reps):
        t = time.perf_counter(); jax.block_until_ready(f(x)); ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / per * 1e6

cells = [(16384, 8, 1, 0.5), (16384, 8, 2, 0.5), (16384, 64, 1, 0.5), (16384, 64, 2, 0.5), (16384, 64, 8, 0.5),
         (16384, 256, 1, 0.5), (16384, 256, 2, 0.5), (16384, 256, 8, 0.5),
         (64, 1000, 10, 0.1), (64, 10000, 100, 0.1), (1, 1000, 10, 0.1), (1, 10000, 100, 0.1), (64, 100000, 1000, 0.1)]
if os.environ.get("SMOKE"): cells = [(64, 8, 2, 0.5), (4, 1000, 10, 0.1)]; N = 3
for B, n, k, l in cells:
    if left() < 95: emit(what="ingraph_stop", reason="deadline"); break
    x = jax.random.normal(jax.random.PRNGKey(0), (B, n)); w = jax.random.normal(jax.random.PRNGKey(1), (B, n))
    ops = {"auto": lambda z: itk.soft_topk_mask(z, k, regularization_strength=l),
           "threshold": lambda z: itk.soft_topk_mask(z, k, regularization_strength=l, solver="threshold"),
           "pallas": lambda z: itk.soft_topk_mask(z, k, regularization_strength=l, solver="pallas")}
    # MATRIX_OPS=auto,threshold: a subset (a short GPU lease)
    ops = {a: b for a, b in ops.items() if a in os.environ.get("MATRIX_OPS", ",".join(ops)).split(",")}
    r = {}
    try: r["hard fwd"] = timed(chain(lambda z: hard_mask(z, k)), x)
    except Exception as e: r["hard fwd"] = f"{type(e).__name__}: {str(e)[:200]}"
    for name, op in ops.items():
        if name == "pallas" and n > 4096: continue
        try:
            r[name + " fwd"] = timed(chain(op), x)
            r[name + " fb"] = timed(chain_grad(op, w), x)
        except Exception as e:
            r[name] = f"{type(e).__name__}: {str(e)[:300]}"
    if n <= 1024 and proto_make is not None:
        try:
            pm = proto_make(k, l, True); r["proto fb"] = timed(chain_grad(pm, w), x)
        except Exception as e:
            r["proto"] = f"{type(e).__name__}: {str(e)[:200]}"
    h = r.get("hard fwd")
    ratios = {a: round(b / h, 3) for a, b in r.items() if isinstance(b, float) and isinstance(h, float)}
    emit(what="ingraph", cell=f"{B}x{n} k={k} l={l}", us=r, ratio=ratios)

# magnitude in graph (p = 4/3): auto vs threshold vs a hard top-k in magnitude
for B, n, k in [(16384, 64, 2), (64, 1000, 10)]:
    if left() < 75: break
    x = jax.random.normal(jax.random.PRNGKey(0), (B, n)); w = jax.random.normal(jax.random.PRNGKey(1), (B, n))
    def hard_mag(z):
        _, idx = jax.lax.top_k(jnp.abs(z), k)
        m = jnp.zeros_like(z).at[jnp.arange(z.shape[0])[:, None], idx].set(1.0)
        return z * m
    r = {"hard fwd": timed(chain(hard_mag), x)}
    for name in ("auto", "threshold"):
        try: r[name + " fb"] = timed(chain_grad(lambda z: itk.soft_topk_mag(z, k, regularization_strength=0.5, solver=name), w), x)
        except Exception as e: r[name] = f"{type(e).__name__}: {str(e)[:200]}"
    h = r["hard fwd"]
    emit(what="ingraph_mag", cell=f"{B}x{n} k={k}", us=r, ratio={a: round(b / h, 3) for a, b in r.items() if isinstance(b, float)})

# max_support in graph (issue: the budget at the plain mask's cost): the cells of
# benchmarks/bench_support_budget.py, forward+backward of the plain and the budgeted mask
budget_cells = [(16384, 8, 2, 3, 1.0, False), (16384, 64, 2, 4, 1.0, False),
                (16384, 256, 8, 12, 1.0, False), (16384, 8, 2, 3, 0.5, True),
                (16384, 64, 2, 4, 0.05, False)]
if os.environ.get("SMOKE"): budget_cells = [(64, 8, 2, 3, 1.0, False)]
for B, n, k, m, l, std in budget_cells:
    if left() < 65: emit(what="ingraph_budget_stop", reason="deadline"); break
    x = jax.random.normal(jax.random.PRNGKey(0), (B, n)); w = jax.random.normal(jax.random.PRNGKey(1), (B, n))
    r = {}
    try: r["hard fwd"] = timed(chain(lambda z: hard_mask(z, k)), x)
    except Exception as e: r["hard fwd"] = f"{type(e).__name__}: {str(e)[:200]}"
    for name, budget in (("plain", None), ("max_support", m)):
        op = lambda z, budget=budget: itk.soft_topk_mask(z, k, regularization_strength=l,
                                                         standardize=std, max_support=budget)
        try: r[name + " fb"] = timed(chain_grad(op, w), x)
        except Exception as e: r[name] = f"{type(e).__name__}: {str(e)[:300]}"
    h, p = r.get("hard fwd"), r.get("plain fb")
    emit(what="ingraph_budget", cell=f"{B}x{n} k={k} m={m} l={l}{' std' if std else ''}", us=r,
         ratio={a: round(b / h, 3) for a, b in r.items() if isinstance(b, float) and isinstance(h, float)},
         budget_over_plain=(round(r["max_support fb"] / p, 3)
                            if isinstance(r.get("max_support fb"), float) and isinstance(p, float) else None))

# ---------------- C. per call, router cells ----------------
def per_call(f, *a, reps=21):
    jax.block_until_ready(f(*a)); ts = []
    for _ in range(reps):
        t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6
for B, n, k, l in [(16384, 8, 2, 0.5), (16384, 64, 2, 0.5), (16384, 256, 8, 0.5), (64, 1000, 10, 0.1)]:
    if left() < 55: break
    x = jax.random.normal(jax.random.PRNGKey(0), (B, n)); w = jax.random.normal(jax.random.PRNGKey(1), (B, n))
    hard = jax.jit(lambda z: hard_mask(z, k))
    fb = jax.jit(jax.grad(lambda z: (itk.soft_topk_mask(z, k, regularization_strength=l) * w).sum()))
    h = per_call(hard, x); s = per_call(fb, x)
    emit(what="percall", cell=f"{B}x{n} k={k}", hard_us=h, auto_fb_us=s, ratio=round(s / h, 3))

# ---------------- D. soft_sort / soft_rank scaling, dykstra ----------------
for n in (1000, 10000, 30000, 100000):
    if left() < 25: break
    x = jax.random.normal(jax.random.PRNGKey(0), (1, n)); w = jax.random.normal(jax.random.PRNGKey(1), (1, n))
    r = {}
    for name, op in (("sort", itk.soft_sort), ("rank", itk.soft_rank)):
        try:
            g = jax.jit(jax.grad(lambda z: (op(z, regularization_strength=1.0) * w).sum()))
            r[name + " fb ms"] = per_call(g, x, reps=7) / 1e3
        except Exception as e:
            r[name] = f"{type(e).__name__}: {str(e)[:200]}"
    hs = jax.jit(lambda z: jnp.sort(z)); r["jnp.sort ms"] = per_call(hs, x, reps=7) / 1e3
    emit(what="sort_rank", n=n, **r)
if left() > 12:
    try:
        x = jax.random.normal(jax.random.PRNGKey(0), (1, 1000)); w = jax.random.normal(jax.random.PRNGKey(1), (1, 1000))
        g = jax.jit(jax.grad(lambda z: (itk.soft_topk_mask(z, 10, regularization_strength=0.1, p=2.0, solver="dykstra") * w).sum()))
        hard = jax.jit(lambda z: hard_mask(z, 10))
        d = per_call(g, x, reps=5); h = per_call(hard, x)
        emit(what="dykstra", cell="1x1000 k=10 p=2", fb_ms=d / 1e3, hard_us=h, ratio=round(d / h, 1))
    except Exception as e:
        emit(what="dykstra", error=f"{type(e).__name__}: {str(e)[:300]}")
emit(what="done")
