"""Smoke test of the benchmark matrix (benchmarks/bench_topk.py --quick, per call and in
graph) and of benchmarks/readme_table.py (the README blocks it rewrites)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

# the tests share the module's benchmark runs: one worker runs them all (pyproject:
# --dist loadgroup), so each benchmark runs once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("bench_matrix")]

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_topk.py"
TABLE = ROOT / "benchmarks" / "readme_table.py"


def _run(args, **kw):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env,
                        capture_output=True, text=True, **kw)


def _bench(tmp_path_factory, *options):
  """Runs the bench with ``options``; the path of its JSON (the .md and .png exist)."""
  out = tmp_path_factory.mktemp("bench") / "q"
  proc = _run([BENCH, "--quick", *options, "--out", out], timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for ext in ("md", "json", "png"):
    assert out.with_suffix(f".{ext}").is_file(), ext
  return out.with_suffix(".json")


@pytest.fixture(scope="module")
def quick_json(tmp_path_factory):
  return _bench(tmp_path_factory)


def test_quick_json(quick_json):
  result = json.loads(quick_json.read_text())
  meta = result["meta"]
  for key in ("jax", "device", "date", "backend", "loadavg_start", "loadavg_end",
              "total_s", "options", "default_solver"):
    assert key in meta, key
  assert meta["options"]["quick"] is True
  assert result["cells"], "no cells"
  for cell in result["cells"]:
    for key in ("name", "batch", "n", "k", "l", "loadavg", "records"):
      assert key in cell, key
    by = {r["contender"]: r for r in cell["records"]}
    assert "hard fwd" in by and "soft auto p=4/3" in by and "soft auto p=2" in by
    hard = by["hard fwd"]
    assert hard["median_s"] > 0 and hard["min_s"] > 0
    assert hard["repeats"] == len(hard["samples_s"]) == meta["options"]["repeats"]
    for rec in cell["records"]:
      assert "error" in rec or "skipped" in rec or (
          rec["median_s"] > 0 and rec["min_s"] > 0 and rec["min_s"] <= rec["median_s"]
          and rec["ratio"] > 0 and all(s > 0 for s in rec["samples_s"])), rec
    # The default solver must actually have run (an error here is a library failure).
    assert "median_s" in by["soft auto p=4/3"], by["soft auto p=4/3"].get("error")
  md = quick_json.with_suffix(".md").read_text()
  assert "| cell |" in md and "hard fwd (ms)" in md


def _write_table(result_json, readme, text):
  """``readme`` holding ``text``, rewritten by readme_table.py from ``result_json``."""
  readme.write_text(text)
  proc = _run([TABLE, result_json, "--write", readme], timeout=60)
  assert proc.returncode == 0, proc.stderr
  return readme.read_text()


def test_readme_table_replaces_block(quick_json, tmp_path):
  readme = tmp_path / "README.md"
  text = _write_table(quick_json, readme, "intro\n<!-- bench-matrix:start -->\nstale table\n"
                      "<!-- bench-matrix:end -->\noutro\n")
  assert "stale table" not in text
  assert text.startswith("intro\n<!-- bench-matrix:start -->\n")
  assert text.endswith("<!-- bench-matrix:end -->\noutro\n")
  assert "| cell | strength | hard fwd (ms) | auto p=4/3 | auto p=2 |" in text
  # Printing works too, and a file without markers is an error (exit 1, untouched).
  printed = _run([TABLE, quick_json], timeout=60)
  assert printed.returncode == 0 and "| cell |" in printed.stdout
  plain = tmp_path / "plain.md"
  plain.write_text("no markers here\n")
  missing = _run([TABLE, quick_json, "--write", plain], timeout=60)
  assert missing.returncode == 1 and "not found" in missing.stderr
  assert plain.read_text() == "no markers here\n"


@pytest.fixture(scope="module")
def ingraph_json(tmp_path_factory):
  return _bench(tmp_path_factory, "--mode", "ingraph", "--chain", "4", "--solvers",
                "auto,pallas")


def test_ingraph_json(ingraph_json):
  result = json.loads(ingraph_json.read_text())
  meta = result["meta"]
  assert meta["mode"] == "ingraph" and meta["options"]["chain"] == 4
  for cell in result["cells"]:
    assert cell["chain"] == 4  # the quick cell (1 x 1e3) is below the chain's size limit
    by = {r["contender"]: r for r in cell["records"]}
    hard, soft = by["hard fwd"], by["soft auto p=4/3"]
    assert hard["chain"] == soft["chain"] == 4
    assert "median_s" in soft and soft["ratio"] > 0, soft.get("error")
    # per op: the samples are one chained call divided by the chain length
    assert soft["min_s"] <= soft["median_s"] < soft["warm_s"] * 4
    pallas = by["soft pallas p=4/3"]
    if meta["backend"] == "cpu":
      assert "interpret mode" in pallas["skipped"], pallas
  md = ingraph_json.with_suffix(".md").read_text()
  assert "(in graph)" in md and "| cell | strength | N | hard fwd (ms) |" in md


def test_readme_table_writes_the_ingraph_block(ingraph_json, tmp_path):
  text = _write_table(ingraph_json, tmp_path / "README.md",
                      "<!-- bench-matrix:start -->\nper call\n<!-- bench-matrix:end -->\n"
                      "<!-- bench-matrix-ingraph:start -->\nstale\n"
                      "<!-- bench-matrix-ingraph:end -->\n")
  assert "per call" in text and "stale" not in text and "in graph" in text
  assert "| cell | strength | hard fwd (ms) | auto p=4/3 |" in text
  only_percall = tmp_path / "percall.md"
  only_percall.write_text("<!-- bench-matrix:start -->\n<!-- bench-matrix:end -->\n")
  missing = _run([TABLE, ingraph_json, "--write", only_percall], timeout=60)
  assert missing.returncode == 1 and "bench-matrix-ingraph:start" in missing.stderr


def test_profile_native_prints_every_stage():
  # benchmarks/profile_native.py runs the kernel's own stages: it breaks (and this test
  # with it) if the kernel's functions change their signatures.
  proc = _run([ROOT / "benchmarks" / "profile_native.py", "--cells", "64x100:2", "--repeats", "1"],
              timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [line for line in proc.stdout.splitlines() if line.startswith("| 64x100")]
  assert len(rows) == 2  # p = 4/3 and p = 2
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    stages = [float(v) for v in cells[2:6]]
    assert all(v > 0 for v in stages + [float(v) for v in cells[6:]]), row


def _timing_module():
  """``benchmarks/_timing.py``, imported as the scripts import it (their folder on the path)."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  try:
    import _timing  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.remove(str(ROOT / "benchmarks"))
  return _timing


def test_interleaved_timing_rotates_the_order():
  # benchmarks/_timing.py: round r starts at the r-th contender, so over a multiple of
  # the contenders' count each follows every other equally often (a call right after
  # another contender's can run slower; a fixed order charged that to one of them)
  _timing = _timing_module()
  calls = []
  fns = {name: (lambda x, name=name: calls.append(name) or x) for name in "abc"}
  times = _timing.interleaved(fns, 0.0, repeats=6)
  assert set(times) == set("abc") and all(len(t) == 3 for t in times.values())
  timed = calls[6:]  # after the two warm-up calls of each
  follows = {}
  for before, after in zip(timed, timed[1:]):
    if before != after:
      follows[(before, after)] = follows.get((before, after), 0) + 1
  assert len(follows) == 6, follows  # every ordered pair occurs
  assert timed[:3] == list("abc") and timed[3:6] == list("bca") and timed[6:9] == list("cab")


@pytest.mark.parametrize("mode", ["percall", "ingraph"])
def test_support_budget_benchmark_runs(tmp_path, mode):
  out = tmp_path / "budget.json"
  proc = _run([ROOT / "benchmarks" / "bench_support_budget.py", "--cells", "3", "--repeats", "2",
               "--no-jax-path", "--mode", mode, "--chain", "3", "--json", out], timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(out.read_text())
  record = results["cells"][0]
  assert results["mode"] == mode
  assert record["chain"] == (3 if mode == "ingraph" else None)
  assert (record["n"], record["max_support"]) == (1000, 16)
  assert set(record["seconds"]) == {"hard fwd", "soft", "soft + max_support"}
  assert "| 64x1000 k=10 m=16 l=0.1 |" in proc.stdout and proc.stdout.count(" - |") == 1


def test_chained_op_feeds_each_output_to_the_next_call():
  _timing = _timing_module()
  out = jax.jit(_timing.chained(lambda z: 2.0 * z, 4))(jnp.float32(1.0))
  assert float(out) == pytest.approx((1.0 + 2.0 * _timing.CHAIN_STEP) ** 4, rel=1e-6)
  assert _timing.chain_length(1000, 50) == 50 and _timing.chain_length(4_000_000, 50) == 12
  assert _timing.chain_length(10**8, 50) == _timing.MIN_CHAIN
