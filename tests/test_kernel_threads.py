"""The CPU kernels' rows split over XLA's intra-op threads
(:mod:`implicit_topk.kernels.cpu.threads`): a threaded call gives the serial call's
results to the bit, under repetition and from several Python threads at once, and a
handler loaded from numba's disk cache in a fresh process finds its task."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("numba")

from implicit_topk.kernels.cpu import ffi, native_calls, registry, threads  # noqa: E402
from implicit_topk.kernels.cpu.kinds import KINDS, PNORM  # noqa: E402

jax.config.update("jax_enable_x64", True)

_P = {"4/3": 3.0, "2": 1.0, "3": 0.5}  # p -> the kernel's a = 1 / (p - 1)


@pytest.fixture
def limit():
  """Sets the threads limit for a test and restores it after."""
  before = threads.limit()
  yield threads.set_limit
  threads.set_limit(before)


def _bits(arrays):
  return [np.asarray(a).tobytes() for a in arrays]


def _serial_and_threaded(set_limit, function, *args):
  set_limit(1)
  serial = _bits(function(*args))
  set_limit(0)
  threaded = _bits(function(*args))
  return serial, threaded


def _rows(rows, n, dtype, seed=0):
  rng = np.random.default_rng(seed + 7 * rows + n)
  x = rng.standard_normal((rows, n))
  x[::7, 0] += 3.0  # a few rows with a clear winner (binary for k = 1)
  return x.astype(dtype)


def _block(n):
  return int(threads.block_rows(10, n))


def _row_counts(n):
  """1 row, one block, just over the threaded threshold (two blocks), and a count not a
  multiple of the block."""
  block = _block(n)
  return (1, block, block + 1, 3 * block + 17)


def _mask(x, k, attributes):
  return native_calls.capped_simplex_kernel(x, k, 1.0, attributes)


def _pnorm(p):
  return {"a": np.float64(_P[p]), "kind": np.int32(PNORM)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [8, 40, 700])
def test_mask_threaded_equals_serial_to_the_bit(limit, dtype, n):
  for rows in _row_counts(n):
    x = _rows(rows, n, dtype)
    for k in (1.0, 2.0, 1.5):
      for p in ("4/3", "2"):
        serial, threaded = _serial_and_threaded(limit, jax.jit(lambda x: _mask(x, k, _pnorm(p))), x)
        assert serial == threaded, (rows, n, k, p)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [3, 8, 300, 5000])
@pytest.mark.parametrize("regularizer", ["4/3", "2", "3", "exp", "sigmoid"])
def test_mask_threaded_equals_serial_everywhere(limit, dtype, n, regularizer):
  attributes = (_pnorm(regularizer) if regularizer in _P
                else {"a": np.float64(0.0), "kind": np.int32(KINDS[regularizer])})
  mask = jax.jit(lambda x, k: _mask(x, k, attributes))
  for rows in _row_counts(n)[1:]:
    x = _rows(rows, n, dtype)
    x[1 % rows, :2] = np.inf  # rows the lanes leave to the per-row kernel
    x[2 % rows, 1] = np.nan
    for k in (1.0, 2.0, 1.5):
      serial, threaded = _serial_and_threaded(limit, mask, x, k)
      assert serial == threaded, (rows, n, k)


def _derivative_call(direction, rule, x, attributes, seed=0):
  rows, n = x.shape
  dtype = x.dtype
  rng = np.random.default_rng(seed)
  full = jax.ShapeDtypeStruct((rows, n), dtype)
  row = jax.ShapeDtypeStruct((rows,), dtype)
  y, lam, _, _, shift = native_calls.capped_simplex_kernel(x, 1.5, 1.0, attributes)
  l = np.ones(rows, dtype)
  vector = lambda: rng.standard_normal(rows).astype(dtype)
  matrix = lambda: rng.standard_normal((rows, n)).astype(dtype)
  if direction == "tangent":
    args, results = (x, lam, shift, l, matrix(), vector(), vector()), (full, row)
  else:
    args, results = (x, lam, shift, l, matrix(), vector()), (full, row, row)
  name = registry.target(f"capped_simplex_{direction}_{rule}", dtype)
  registry.ensure(name)
  return jax.jit(lambda *a: ffi.call(name, results, *a, **attributes)), args


_RULE_P = {"cubic": "4/3", "linear": "2", "general": "3"}


def _check_derivatives(limit, direction, rule, dtype, n):
  for rows in _row_counts(n):
    call, args = _derivative_call(direction, rule, _rows(rows, n, dtype), _pnorm(_RULE_P[rule]))
    serial, threaded = _serial_and_threaded(limit, call, *args)
    assert serial == threaded, (direction, rule, rows, n)


@pytest.mark.parametrize("direction", ["tangent", "cotangent"])
def test_derivatives_threaded_equal_serial_to_the_bit(limit, direction):
  _check_derivatives(limit, direction, "cubic", np.float32, 8)


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["tangent", "cotangent"])
@pytest.mark.parametrize("rule", ["cubic", "linear", "general"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [8, 256, 1000])
def test_every_derivative_kernel_threaded_equals_serial(limit, direction, rule, dtype, n):
  _check_derivatives(limit, direction, rule, dtype, n)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_magnitude_threaded_equals_serial_to_the_bit(limit, dtype):
  magnitude = jax.jit(lambda x, k: native_calls.magnitude_kernel(x, k, 1.0, 4.0 / 3.0))
  for n in (8, 300, 1000):
    for rows in _row_counts(n):
      x = _rows(rows, n, dtype)
      for k in (1.0, 2.5):
        serial, threaded = _serial_and_threaded(limit, magnitude, x, k)
        assert serial == threaded, (rows, n, k)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_budget_threaded_equals_serial_to_the_bit(limit, dtype):
  # the budget kernel (mask and per-row results), then its derivative kernels (the rule
  # PINNED: rows that bind at l = 2, rows that do not at l = 0.05; blocks of longer rows
  # whose first rows bind, and blocks whose first rows do not, tried as the plain mask)
  from implicit_topk import support_budget
  name = registry.target("budget", dtype)
  registry.ensure(name)
  attributes = {"a": np.float64(3.0), "kind": np.int32(0)}
  for n in (8, 64, 1000):
    for rows in _row_counts(n):
      x = _rows(rows, n, dtype)
      full, row = jax.ShapeDtypeStruct((rows, n), dtype), jax.ShapeDtypeStruct((rows,), dtype)
      budget = jax.jit(lambda x, k, l: ffi.call(name, (full,) + (row,) * 4, x, k, l,
                                                a=np.float64(3.0), m=np.int32(4)))
      k = np.full(rows, 1.5, dtype)
      index = np.arange(rows)  # (odd blocks of 64 rows: one row in 7 binds)
      binding = np.where(index // 64 % 2 == 0, index % 2 == 0, index % 7 == 3)
      l = np.where(binding, 2.0, 0.05).astype(dtype)
      serial, threaded = _serial_and_threaded(limit, budget, x, k, l)
      assert serial == threaded, (rows, n)
      _, lam, shift, strength, pin = support_budget._kernel_operator(4, 3.0)(x, k, l)
      rng = np.random.default_rng(n)
      tangents = (rng.standard_normal((rows, n)).astype(dtype),
                  *(rng.standard_normal(rows).astype(dtype) for _ in range(2)))
      for direction, results in (("tangent", (full, row, row)), ("cotangent", (full, row, row))):
        target = registry.target(f"budget_{direction}_cubic", dtype)
        registry.ensure(target)
        call = jax.jit(lambda *a, target=target, results=results: ffi.call(
            target, results, *a, **attributes))
        serial, threaded = _serial_and_threaded(limit, call, x, lam, shift, strength, pin,
                                                *tangents)
        assert serial == threaded, (direction, rows, n)


def _reference_and_call(dtype=np.float32, rows=16384, n=8):
  x = _rows(rows, n, dtype, seed=3)
  mask = jax.jit(lambda x: _mask(x, 1.0, _pnorm("4/3")))
  threads.set_limit(1)
  reference = _bits(mask(x))
  threads.set_limit(0)
  return mask, x, reference


def test_repeated_threaded_calls_agree_and_use_the_helpers(limit):
  mask, x, reference = _reference_and_call()
  calls, blocks = threads.counters()
  for _ in range(200):
    assert _bits(mask(x)) == reference
  calls_after, blocks_after = threads.counters()
  if calls_after == calls:
    pytest.skip("XLA's intra-op pool has a single thread here: every call ran serially")
  assert calls_after - calls == 200
  assert blocks_after > blocks  # the helper tasks took blocks


def test_concurrent_calls_from_python_threads(limit):
  mask, x, reference = _reference_and_call()
  cotangent, args = _derivative_call("cotangent", "cubic", x, _pnorm("4/3"))
  limit(1)
  cotangent_reference = _bits(cotangent(*args))
  limit(0)
  failures = []

  def work(seed):
    for i in range(30):
      if (i + seed) % 2:
        ok = _bits(mask(x)) == reference
      else:
        ok = _bits(cotangent(*args)) == cotangent_reference
      if not ok:
        failures.append((seed, i))

  workers = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
  for worker in workers:
    worker.start()
  for worker in workers:
    worker.join()
  assert not failures


def test_the_limit_is_read_at_each_call(limit):
  mask, x, reference = _reference_and_call()
  limit(1)
  calls, _ = threads.counters()
  mask(x)
  assert threads.counters()[0] == calls  # serial: no threaded call
  with pytest.raises(ValueError):
    threads.set_limit(-1)


_ROUND_TRIP = textwrap.dedent("""
    import sys
    import numpy as np, jax
    from implicit_topk.kernels.cpu import native_calls, threads
    from implicit_topk.kernels.cpu.kinds import PNORM
    attributes = {"a": np.float64(3.0), "kind": np.int32(PNORM)}
    x = np.random.default_rng(0).standard_normal((8192, 8)).astype(np.float32)
    mask = jax.jit(lambda x: native_calls.capped_simplex_kernel(x, 1.0, 1.0, attributes))
    threads.set_limit(1)
    serial = [np.asarray(a).tobytes() for a in mask(x)]
    threads.set_limit(0)
    for _ in range(50):
      assert [np.asarray(a).tobytes() for a in mask(x)] == serial
    print("calls", threads.counters()[0])
    """)


@pytest.mark.slow
def test_a_fresh_process_loads_the_cached_handler_and_its_task():
  # numba's cache of this checkout (the test run's prebuild in tests/conftest.py wrote it,
  # in other processes); where it is cold, the first process here writes it and a second
  # one must load it: either way a process runs the handler and its task from a cache
  # that another process wrote, compiling nothing
  environment = dict(os.environ, NUMBA_DEBUG_CACHE="1")
  run = lambda: subprocess.run([sys.executable, "-c", _ROUND_TRIP], env=environment,
                               capture_output=True, text=True, timeout=600)
  runs = [run()]
  if "data saved" in runs[0].stdout + runs[0].stderr:
    runs.append(run())
  for each in runs:
    assert each.returncode == 0, each.stderr[-3000:]
  last = runs[-1].stdout + runs[-1].stderr
  loaded = [line for line in last.splitlines() if "data loaded" in line]
  assert any("native_mask.capped_simplex_f32_task-" in line for line in loaded)
  assert any("native_mask.capped_simplex_f32-" in line for line in loaded)
  assert "data saved" not in last  # nothing compiled again: both came from the cache
  if (os.cpu_count() or 1) > 1:
    assert int(last.rsplit("calls", 1)[1].split()[0]) > 0  # the cached handler threads


def _struct_fields(header, name):
  import re
  body = re.search(r"struct %s \{(.*?)\};" % name, header, re.S).group(1)
  body = re.sub(r"//[^\n]*", "", body)
  return [re.split(r"[\s*]+", line.strip().rstrip(";"))[-1] if "_XLA_FFI_API_STRUCT_FIELD" not in line
          else line.split("(")[1].split(")")[0] for line in body.splitlines() if line.strip()]


def test_the_thread_pool_offsets_match_the_header():
  import pathlib
  header = (pathlib.Path(jax.ffi.include_dir()) / "xla/ffi/api/c_api.h").read_text()
  api = _struct_fields(header, "XLA_FFI_Api")
  # struct_size, extension_start, api_version (XLA_FFI_Api_Version, 24 bytes), internal_api
  assert api[:4] == ["struct_size", "extension_start", "api_version", "internal_api"]
  assert _struct_fields(header, "XLA_FFI_Api_Version") == [
      "struct_size", "extension_start", "major_version", "minor_version"]
  offset = {name: 48 + 8 * i for i, name in enumerate(api[4:])}
  assert offset["XLA_FFI_Error_Create"] == 48
  assert offset["XLA_FFI_Error_Destroy"] == threads._API_ERROR_DESTROY
  assert offset["XLA_FFI_ThreadPool_Schedule"] == threads._API_SCHEDULE
  assert offset["XLA_FFI_ThreadPool_NumThreads"] == threads._API_NUM_THREADS
  assert _struct_fields(header, "XLA_FFI_ThreadPool_Schedule_Args") == [
      "struct_size", "extension_start", "ctx", "task", "data"]
  assert threads._SCHEDULE_ARGS_SIZE == 40
  assert _struct_fields(header, "XLA_FFI_ThreadPool_NumThreads_Args") == [
      "struct_size", "extension_start", "ctx", "num_threads"]
  assert threads._NUM_THREADS_ARGS_SIZE == 32
  assert _struct_fields(header, "XLA_FFI_Error_Destroy_Args") == [
      "struct_size", "extension_start", "error"]
  assert _struct_fields(header, "XLA_FFI_CallFrame")[:4] == [
      "struct_size", "extension_start", "api", "ctx"]
  assert threads._FRAME_CTX == 24
