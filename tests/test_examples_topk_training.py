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


def test_topk_loss_strength_quick(tmp_path):
  main = runpy.run_path(str(EXAMPLES / "topk_loss_strength.py"), run_name="topk_loss_strength")["main"]
  result = main(["--quick", "--out", str(tmp_path)])
  assert (tmp_path / "topk_loss_strength_quick.md").is_file()
  methods = [r["method"] for r in result["summary"]]
  assert len(methods) == len(set(methods)) >= 4 and methods[0] == "softmax cross-entropy"
  for r in result["summary"]:
    assert 0 < r["top1"] <= r["top5"] <= 1
    assert 0 <= r["no_grad_start"] <= 1 and 0 <= r["no_grad_end"] <= 1
