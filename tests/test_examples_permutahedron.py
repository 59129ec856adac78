"""Smoke runs of the permutahedron examples (quick modes)."""

import pathlib
import runpy

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _main(name):
  return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name=name)["main"]


def test_soft_median_filter_quick(tmp_path):
  pytest.importorskip("matplotlib")
  scores = _main("soft_median_filter")(["--quick", "--out", str(tmp_path)])
  assert (tmp_path / "soft_median_filter_quick.png").is_file()
  assert scores["hard median"] > scores["noisy"] + 2  # the filter removes the noise
  assert abs(scores["soft median l=0.3"] - scores["hard median"]) < 0.05  # small l: the median
  learned = [v for k, v in scores.items() if k.startswith("learned")][0]
  assert learned >= scores["hard median"] - 1e-6  # learning l can only help


def test_soft_rank_training_quick(tmp_path):
  pytest.importorskip("sklearn")
  pytest.importorskip("matplotlib")
  results = _main("soft_rank_training")(["--quick", "--out", str(tmp_path)])
  for r in results.values():
    assert r["test_accuracy"][-1] > 0.8
