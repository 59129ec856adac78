"""Test configuration: float64 available everywhere (tests pick float32 explicitly), and
the Hypothesis profile.

The default profile ``derandomized`` draws the same examples on every run (a test suite
that gates a merge must not pass or fail by luck); ``HYPOTHESIS_PROFILE=explore`` draws
fresh random examples on each run, to hunt for new failures.
"""

import gc
import hashlib
import os
import re
import subprocess
import sys
import time

import jax
import pytest
from hypothesis import settings

jax.config.update("jax_enable_x64", True)

# Most of the suite's time is XLA:CPU compiling small programs. XLA:CPU's older fusion
# emitters (--xla_cpu_use_fusion_emitters=false) compile them about 35% faster
# (tests/test_soft_topk_mask.py 128 s -> 76 s); the programs are the same, and no test
# has seen a value differ. (LLVM's optimization level 0, --xla_backend_optimization_level=0,
# compiled 30% faster again but changed values: two programs that must give the same
# mask to the bit, tests/test_properties.py::test_exact_zeros_and_ones_at_threshold,
# no longer did; the tests check the code users run.) The flag is added to XLA_FLAGS
# (before any backend starts; subprocesses inherit it) where this jaxlib takes it, which
# the controller checks once in a subprocess (an unknown XLA flag aborts the process).
# The package itself sets no flag: users' programs compile as XLA chooses.
# IMPLICIT_TOPK_TEST_XLA_FLAGS=default keeps XLA's own settings.
_FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _add_fast_compile_flag():
  if os.environ.get("IMPLICIT_TOPK_TEST_XLA_FLAGS") in ("default", "checked"):
    return  # opted out, or a test worker: the controller decided
  os.environ["IMPLICIT_TOPK_TEST_XLA_FLAGS"] = "checked"
  flags = os.environ.get("XLA_FLAGS", "")
  if _FAST_COMPILE_FLAG.split("=")[0] in flags:
    return  # set by the caller: kept as it is
  env = dict(os.environ, XLA_FLAGS=f"{flags} {_FAST_COMPILE_FLAG}".strip(), JAX_PLATFORMS="cpu")
  probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, timeout=300)
  if probe.returncode == 0:
    os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]


_add_fast_compile_flag()

# JAX's persistent compilation cache, shared by the test workers and by later runs (the
# slow group after the default run, in CI): a program that two workers compile, or that
# both groups compile, is compiled once (XLA:CPU executables load from disk). Tracing
# and lowering still run in every process, so the tests see the same programs; only
# XLA's compilation of an identical module is skipped. Its key holds the jax version,
# the module and the compile options. IMPLICIT_TOPK_TEST_JAX_CACHE=off turns it off,
# or names another directory.
_JAX_CACHE = os.environ.get(
    "IMPLICIT_TOPK_TEST_JAX_CACHE",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"))
if _JAX_CACHE != "off":
  jax.config.update("jax_compilation_cache_dir", _JAX_CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

settings.register_profile("derandomized", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))


# Every executable XLA compiles for the CPU keeps about three memory mappings (its JIT
# code and data) until JAX's caches drop it, and JAX caches every jitted function and
# every eager operation it has compiled. A test worker that runs a few thousand tests
# (the slow group: hypothesis sweeps compile at each new shape) reaches Linux's limit of
# 65,530 mappings per process (vm.max_map_count), after which XLA's next compilation
# cannot map its code and the worker dies with a segmentation fault inside
# ``backend_compile_and_load``. Seen twice at 93% of the slow group, once in CI. The
# caches are cleared when a test leaves the process above this many mappings.
_MAPPINGS_LIMIT = 20_000


def _memory_mappings():
  """The number of memory mappings of this process (None where /proc is absent)."""
  try:
    with open("/proc/self/maps", "rb") as maps:
      return maps.read().count(b"\n")
  except OSError:
    return None


@pytest.fixture(autouse=True)
def _release_compiled_code():
  yield
  mappings = _memory_mappings()
  if mappings is not None and mappings > _MAPPINGS_LIMIT:
    jax.clear_caches()
    gc.collect()


# The default run (README: `python -m pytest -q`) checks the default solvers. The numba
# PAV kernels (solver="pav") are XLA custom calls compiled on their first use and cached
# on disk (a cold cache: seconds per kernel); their thorough checks (long rows,
# every p, sweeps against references) are in the slow group, which CI runs too: the
# tests whose node id names "pav" (other than "pav_jax"), and those listed here.
_USES_PAV = (
    "tests/test_dykstra.py::test_dykstra_non_finite_inputs_follow_the_documented_rules",
    "tests/test_magnitude.py::test_matches_slsqp_on_the_reference_isotonic_dual",
    "tests/test_magnitude.py::test_matches_brent_on_the_threshold_equation",
    "tests/test_permutahedron_solvers.py::test_jit_and_vmap",
    "tests/test_permutahedron_solvers.py::test_blocks_match_the_host_on_distinct_values",
    "tests/test_permutahedron_solvers.py::test_float32_and_float64_match_the_host",
    "tests/test_permutahedron_solvers.py::test_three_d_inputs_along_each_axis",
    "tests/test_permutahedron_solvers.py::test_non_finite_rows_give_nan_as_the_host",
    "tests/test_properties.py::test_forced_zeros_condition_is_not_vacuous",
    "tests/test_soft_topk_mask.py::test_matches_scipy_slsqp_on_small_problems",
    "tests/test_soft_topk_mask.py::test_solution_is_exactly_sparse_and_exactly_one_at_the_top",
    "tests/test_seed_and_hard.py::test_seed_1d_examples",
    "tests/test_seed_and_hard.py::test_seed_differentiability_example",
)


# The API-convention tests (tests/test_api_*.py) repeat each check once per public
# function; the default run keeps these representatives, the slow group runs them all.
_API_REPRESENTATIVES = frozenset({"soft_topk_mask", "grad_topk", "soft_sort",
                                  "topk_fenchel_young_loss"})


# The default run (README's test command, meant to take five minutes on 2 cores) checks
# every public operator's contract: each test function once, at one parametrized case
# (default_run_trimmed), outside the modules below, which check one implementation in
# depth (the CPU kernels' internals and their sharded forms, the Pallas kernels in
# interpret mode and their CUDA lowering, export and start-up, the support budget's
# kernels, fuzzing and float-range sweeps). The other cases and those modules run in
# the slow group. CI runs both, every one of these cases (they are not sampled: see
# sampled_sweeps_dropped).
_IN_DEPTH_MODULES = tuple(f"tests/{name}.py::" for name in (
    "test_native_solver", "test_native_first_row", "test_native_lanes",
    "test_native_magnitude", "test_native_partitioning", "test_kernel_threads",
    "test_pallas_solver", "test_gpu_lowering", "test_startup_and_export",
    "test_support_budget", "test_segment_support_budget", "test_explicit_mesh",
    "test_near_binary_and_where", "test_extremes_float_range", "test_fuzz",
    "test_sort_scaling"))
# and these, the default run's longest (finite differences of every entry, Jacobians of
# every transformation, export), whose subjects its other tests check more cheaply
_DEFAULT_RUN_LEAVES = (
    "tests/test_permutahedron_solvers.py::test_gradients_match_finite_differences",
    "tests/test_transforms.py::test_jacobians_agree",
    "tests/test_transforms.py::test_grad_matches_finite_differences",
    "tests/test_transforms.py::JitMatchesEagerTest::",
    "tests/test_permutahedron_solvers.py::test_default_call_exports",
)
_LEFT_TO_THE_SLOW_GROUP = pytest.StashKey[bool]()


def default_run_trimmed(items):
  """The tests of the default run's modules that it leaves to the slow group (above):
  of a parametrized test, every case but the first with ``solver="auto"`` (the default),
  or but the first where none has it."""
  cases_of, trimmed = {}, []
  for item in items:
    if item.get_closest_marker("slow") is not None:
      continue
    if item.nodeid.startswith(_IN_DEPTH_MODULES + _DEFAULT_RUN_LEAVES):
      trimmed.append(item)
    elif getattr(item, "callspec", None) is not None:
      cases_of.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
  for cases in cases_of.values():
    kept = next((c for c in cases if c.callspec.params.get("solver") == "auto"), cases[0])
    trimmed += [case for case in cases if case is not kept]
  return trimmed


def pytest_collection_modifyitems(config, items):
  for item in items:
    uses_pav = "pav" in item.nodeid.replace("pav_jax", "")
    if uses_pav or item.nodeid.startswith(_USES_PAV):
      item.add_marker(pytest.mark.slow)
    callspec = getattr(item, "callspec", None)
    name = callspec.params.get("name") if callspec is not None else None
    if (item.nodeid.startswith("tests/test_api_") and isinstance(name, str)
        and name not in _API_REPRESENTATIVES):
      item.add_marker(pytest.mark.slow)
  for item in default_run_trimmed(items):
    item.add_marker(pytest.mark.slow)
    item.stash[_LEFT_TO_THE_SLOW_GROUP] = True
  if os.environ.get("IMPLICIT_TOPK_TEST_SWEEPS") == "sampled":
    dropped = sampled_sweeps_dropped(items)
    if dropped:
      items[:] = [item for item in items if id(item) not in {id(d) for d in dropped}]
      config.hook.pytest_deselected(items=dropped)


# CI (.ci/run, IMPLICIT_TOPK_TEST_SWEEPS=sampled) runs every test of the default run,
# every test that the default run leaves to the slow group (default_run_trimmed) and
# every test function of the slow group, but of each slow parametrized sweep of
# SWEEP_MIN_CASES cases or more only a quarter of the cases: those first by a hash of their
# id, plus as many as needed for every value of every parameter to keep a case (each
# solver, dtype, p, ... is still run). The choice is fixed (the same cases on every run
# and worker). `python -m pytest -q -m slow` runs every case. Not sampled: the proof
# scripts and the docstring examples (each case is a different proposition or page).
SWEEP_MIN_CASES = 3
SWEEP_SHARE = 4  # a quarter
_NOT_SAMPLED = ("tests/test_proofs.py::", "tests/test_docs.py::")


def _stable_value(value):
  """A text for a parameter's value that is the same in every process (no addresses)."""
  return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def sampled_sweeps_dropped(items):
  """The slow parametrized cases that a sampled run leaves out (see above)."""
  sweeps = {}
  for item in items:
    callspec = getattr(item, "callspec", None)
    if (callspec is not None and item.get_closest_marker("slow") is not None
        and not item.nodeid.startswith(_NOT_SAMPLED)
        and not item.stash.get(_LEFT_TO_THE_SLOW_GROUP, False)):
      sweeps.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
  dropped = []
  for cases in sweeps.values():
    if len(cases) < SWEEP_MIN_CASES:
      continue
    ranked = sorted(cases, key=lambda item: hashlib.sha256(item.nodeid.encode()).hexdigest())
    values = lambda item: {(k, _stable_value(v)) for k, v in item.callspec.params.items()}
    kept = ranked[:-(-len(cases) // SWEEP_SHARE)]
    covered = set().union(*map(values, kept))
    for item in ranked[len(kept):]:
      if values(item) <= covered:
        dropped.append(item)
      else:
        covered |= values(item)
  return dropped


# numba compiles each CPU kernel on its first use (cache=True: machine code on disk, beside
# the source). With a cold cache (CI, a fresh clone) the test workers would each compile
# the kernels their first tests call, the same ones at the same time: the controller
# builds them first, once, in parallel processes (the default run: the default solver's
# kernels; `-m slow`: every kernel), so that the workers load them from disk.
# IMPLICIT_TOPK_TEST_WARM_KERNELS=off skips it.
# The default run calls the forward kernels of the mask and the magnitude operator and the
# mask's cotangent kernels (reverse mode); forward mode's tangent kernels are built by
# the few tests that call them, on first use.
_DEFAULT_RUN_KERNELS = ("capped_simplex_float", "capped_simplex_cotangent_", "magnitude_float")


def _kernels_to_warm(config):
  from implicit_topk.kernels.cpu import registry
  if not registry.available():
    return ()
  selection = " ".join((config.getoption("markexpr", "") or "").split())
  every = "slow" in selection and selection != "not slow"  # `-m slow`, `-m "slow or not slow"`
  names = registry.all_targets()
  if not every:
    names = tuple(n for n in names if n.startswith(
        tuple(registry.PREFIX + f for f in _DEFAULT_RUN_KERNELS)))
  return names


_BUILD_SCRIPT = """
import sys
from implicit_topk.kernels.cpu import registry
for line in sys.stdin:
  registry.register([line.strip()])
  print(line.strip(), flush=True)
"""


def build_in_processes(names, processes):
  """Builds the CPU kernels ``names`` in ``processes`` processes, each taking the next
  name as it finishes one (so that no process is left with the long ones: a static
  split of the default run's kernels left one process 70 s more than the other).
  Returns the last lines of the error output of the processes that failed."""
  import select
  import tempfile
  pending = list(names)
  logs = [tempfile.TemporaryFile("w+") for _ in range(processes)]
  running = [subprocess.Popen([sys.executable, "-c", _BUILD_SCRIPT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=log, text=True) for log in logs]

  def hand_next(process):
    try:
      if pending:
        process.stdin.write(pending.pop(0) + "\n")
        process.stdin.flush()
      else:
        process.stdin.close()
    except BrokenPipeError:  # it failed: its error output says why
      pass

  for process in running:
    hand_next(process)
  waiting = {process.stdout: process for process in running}
  while waiting:
    for out in select.select(list(waiting), [], [])[0]:
      if out.readline():  # it built one
        hand_next(waiting[out])
      else:  # it exited
        del waiting[out]
  failures = []
  for process, log in zip(running, logs):
    if process.wait() != 0:
      log.seek(0)
      failures.append(log.read()[-2000:])
    log.close()
  return failures


def pytest_sessionstart(session):
  config = session.config
  if hasattr(config, "workerinput") or os.environ.get("IMPLICIT_TOPK_TEST_WARM_KERNELS") == "off":
    return
  if config.getoption("collectonly", False):
    return
  names = _kernels_to_warm(config)
  if not names:
    return
  # once, here: the build processes below then find numba's cache in step with the sources
  from implicit_topk.kernels.cpu import cache_stamp
  cache_stamp.refresh()
  processes = max(1, min(os.cpu_count() or 1, len(names)))
  # the forward kernels cost most (20-60 s each on a cold cache, a second from numba's
  # cache): first, the derivative kernels (families *_tangent_*, *_cotangent_*) last
  is_derivative = lambda name: "_tangent_" in name or "_cotangent_" in name
  ordered = sorted(names, key=lambda name: (is_derivative(name), name))
  start = time.perf_counter()
  failures = build_in_processes(ordered, processes)
  if failures:  # the tests that need the kernels will report it
    sys.stderr.write("conftest: building the CPU kernels failed:\n" + failures[0] + "\n")
  elapsed = time.perf_counter() - start
  if elapsed > 5.0:
    sys.stderr.write(f"conftest: {len(names)} CPU kernels built in {elapsed:.0f} s "
                     f"({processes} processes)\n")
