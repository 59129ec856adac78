"""Smoke test of the benchmark matrix (benchmarks/bench_topk.py --quick) and of
benchmarks/readme_table.py (the README block it rewrites)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_topk.py"
TABLE = ROOT / "benchmarks" / "readme_table.py"


def _run(args, **kw):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env,
                        capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def quick_json(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench") / "q"
  proc = _run([BENCH, "--quick", "--out", out], timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for ext in ("md", "json", "png"):
    assert out.with_suffix(f".{ext}").is_file(), ext
  return out.with_suffix(".json")


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


def test_readme_table_replaces_block(quick_json, tmp_path):
  readme = tmp_path / "README.md"
  readme.write_text("intro\n<!-- bench-matrix:start -->\nstale table\n"
                    "<!-- bench-matrix:end -->\noutro\n")
  proc = _run([TABLE, quick_json, "--write", readme], timeout=60)
  assert proc.returncode == 0, proc.stderr
  text = readme.read_text()
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
