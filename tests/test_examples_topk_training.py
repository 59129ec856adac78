"""Smoke run of examples/topk_training.py (quick mode)."""

import pathlib
import runpy

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def test_topk_training_quick(tmp_path):
  pytest.importorskip("sklearn")
  pytest.importorskip("matplotlib")
  main = runpy.run_path(str(EXAMPLES / "topk_training.py"), run_name="topk_training")["main"]
  results = main(["--quick", "--out", str(tmp_path)])
  assert (tmp_path / "topk_training_quick.md").is_file() and (tmp_path / "topk_training_quick.png").is_file()
  assert len(results) == 6
  for r in results.values():
    assert r["top5"] >= r["top1"] and r["top5"] > 0.6
