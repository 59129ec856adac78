"""The command line (implicit_topk/__main__.py): every subcommand, at tiny sizes."""

import io
import os
import subprocess
import sys
import warnings

import pytest

from implicit_topk import __main__ as cli
from implicit_topk import cli_tools


def test_help_lists_every_command(capsys):
  with pytest.raises(SystemExit) as exc:
    cli.main(["--help"])
  assert exc.value.code == 0
  out = capsys.readouterr().out
  for command in ("demo", "figure", "bench", "check"):
    assert command in out


@pytest.mark.parametrize("command", ["demo", "figure", "bench", "check"])
def test_subcommand_help(command, capsys):
  with pytest.raises(SystemExit) as exc:
    cli.main([command, "--help"])
  assert exc.value.code == 0
  assert f"implicit-topk {command}" in capsys.readouterr().out


@pytest.mark.slow
def test_demo(capsys):
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)  # the demo uses the 0.2.0 names
    assert cli.main(["demo", "--no-timing"]) == 0
  out = capsys.readouterr().out
  for name in ("soft_topk_mask", "hard_topk_mask", "soft_topk_mag", "soft_sort", "soft_rank",
               "topk_fenchel_young_loss", "Sander et al. 2023"):
    assert name in out
  # The fractional example: a soft entry strictly between 0 and 1, a non-zero gradient.
  assert "0.8396" in out and "0.6651" in out
  for shorthand in ("seed 0", "reference README", "the reference prints"):
    assert shorthand not in out
  assert "Timing" not in out


@pytest.mark.slow  # the demo without timing runs in the default group
def test_demo_timing_table(capsys):
  from implicit_topk import demo
  demo.timing_section(sizes=(64,), batch=2, repeats=3)
  out = capsys.readouterr().out
  assert "3 timed calls" in out and "median [interquartile range]" in out
  assert "soft fwd+bwd" in out and "hard fwd" in out
  if hasattr(os, "getloadavg"):
    assert "load average" in out
  row = next(line for line in out.splitlines() if line.strip().startswith("64 "))
  assert row.rstrip().endswith("x")


def test_output_defaults_are_in_the_current_directory():
  parser = cli._parser()
  assert parser.parse_args(["figure"]).out == os.path.join(".", "implicit_topk_figure.png")
  args, rest = parser.parse_known_args(["bench", "--quick"])
  assert args.out == os.path.join(".", "implicit_topk_bench") + os.sep and rest == ["--quick"]
  for command, default in (("figure", "implicit_topk_figure.png"),
                           ("bench", "implicit_topk_bench")):
    help_text = parser._subparsers._group_actions[0].choices[command].format_help()
    assert default in help_text


def test_bench_passes_out_to_the_benchmark(monkeypatch):
  seen = []
  monkeypatch.setattr(cli_tools, "run_bench", lambda argv, repo=None: seen.append(argv))
  assert cli.main(["bench", "--quick"]) == 0
  assert cli.main(["bench", "--quick", "--out", "/tmp/x"]) == 0
  assert cli.main(["bench", "--bench-help"]) == 0
  assert seen == [["--quick", "--out", os.path.join(".", "implicit_topk_bench") + os.sep],
                  ["--quick", "--out", "/tmp/x"], ["--help"]]


@pytest.mark.slow
def test_figure(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  out = tmp_path / "fig.png"
  assert cli.main(["figure", "--out", str(out), "--num", "21",
                   "--regularization-strength", "0.5"]) == 0
  assert out.stat().st_size > 1000
  assert str(out) in capsys.readouterr().out


def test_figure_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
  # An installed wheel has no matplotlib unless asked for: a usage error naming the
  # package, no traceback, no file.
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
  out = tmp_path / "fig.png"
  assert cli.main(["figure", "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert "needs matplotlib" in err and "pip install matplotlib" in err
  assert not out.exists()


@pytest.mark.slow
def test_figure_default_in_cwd(tmp_path, monkeypatch, capsys):
  pytest.importorskip("matplotlib")
  import implicit_topk
  checkout = os.path.dirname(os.path.dirname(implicit_topk.__file__))
  committed = os.path.join(checkout, "docs", "operator_figure.png")
  before = os.stat(committed).st_mtime_ns if os.path.exists(committed) else None
  monkeypatch.chdir(tmp_path)
  assert cli.main(["figure", "--num", "21"]) == 0
  assert (tmp_path / "implicit_topk_figure.png").stat().st_size > 1000
  assert sorted(p.name for p in tmp_path.iterdir()) == ["implicit_topk_figure.png"]
  after = os.stat(committed).st_mtime_ns if os.path.exists(committed) else None
  assert after == before


@pytest.mark.slow
def test_figure_deprecated_l_alias(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  out = tmp_path / "fig.png"
  with pytest.warns(DeprecationWarning, match="--regularization-strength"):
    assert cli.main(["figure", "--out", str(out), "--num", "11", "--l", "0.5"]) == 0
  assert out.is_file()
  help_text = cli._parser()._subparsers._group_actions[0].choices["figure"].format_help()
  assert "--l " not in help_text and "--regularization-strength" in help_text


@pytest.mark.slow
def test_bench_tiny(tmp_path, capsys):
  code = cli.main(["bench", "--sizes", "100", "--batches", "1", "--solvers", "threshold",
                   "--methods", "threshold p=2", "--repeats", "2", "--min-repeats", "1",
                   "--cell-budget", "0.01", "--out", str(tmp_path), "--tag", "t"])
  assert code == 0
  out = capsys.readouterr().out
  assert "[########################]   2/2 100%" in out  # the progress bar
  for ext in ("md", "json"):
    assert (tmp_path / f"cpu_t.{ext}").is_file() or any(tmp_path.glob(f"*_t.{ext}"))
  md = next(tmp_path.glob("*_t.md")).read_text()
  assert "soft threshold p=2" in md


@pytest.mark.slow
def test_bench_default_out_in_cwd(tmp_path, monkeypatch, capsys):
  import implicit_topk
  results = os.path.join(os.path.dirname(os.path.dirname(implicit_topk.__file__)),
                         "benchmarks", "results")
  before = sorted(os.listdir(results)) if os.path.isdir(results) else None
  monkeypatch.chdir(tmp_path)
  code = cli.main(["bench", "--sizes", "100", "--batches", "1", "--solvers", "threshold",
                   "--methods", "threshold p=2", "--repeats", "2", "--min-repeats", "1",
                   "--cell-budget", "0.01", "--tag", "cwd"])
  assert code == 0
  written = sorted(p.name for p in (tmp_path / "implicit_topk_bench").iterdir())
  assert [n.rsplit(".", 1)[1] for n in written if n.endswith("_cwd.md")] == ["md"]
  assert any(n.endswith("_cwd.json") for n in written)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["implicit_topk_bench"]
  after = sorted(os.listdir(results)) if os.path.isdir(results) else None
  assert after == before


def test_bench_passthrough_error_exit_code(capsys):
  assert cli.main(["bench", "--solvers", "nonsense"]) == 2


def test_bench_help_passthrough(capsys):
  assert cli.main(["bench", "--bench-help"]) == 0
  assert "--quick" in capsys.readouterr().out


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(cli_tools.__file__)))


def _cli_elsewhere(cwd, *args, timeout):
  """``python -m implicit_topk *args`` in a fresh interpreter, run from ``cwd`` (not the
  checkout), with only the package importable: benchmarks/ is on no path (the in-process
  tests above run where a worker may have imported benchmarks/_timing already)."""
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "IMPLICIT_TOPK_REPO")}
  env["PYTHONPATH"] = ROOT
  return subprocess.run([sys.executable, "-m", "implicit_topk", *args], cwd=str(cwd),
                        env=env, capture_output=True, text=True, timeout=timeout)


def test_bench_help_from_another_directory(tmp_path):
  # benchmarks/bench_topk.py imports its sibling benchmarks/_timing.py: the loader puts
  # benchmarks/ on sys.path while importing it (ModuleNotFoundError: _timing before).
  proc = _cli_elsewhere(tmp_path, "bench", "--bench-help", timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "--quick" in proc.stdout and "--solvers" in proc.stdout
  assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_bench_quick_from_another_directory(tmp_path):
  # The documented smoke run (docs/cli.md), in a fresh interpreter away from the checkout.
  out = tmp_path / "out"
  proc = _cli_elsewhere(tmp_path, "bench", "--quick", "--out", f"{out}{os.sep}", timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "100%" in proc.stdout
  assert {p.suffix for p in out.glob("*_matrix.*")} >= {".md", ".json"}


def test_load_bench_module_restores_path_and_modules(monkeypatch):
  # Another `_timing` already imported (e.g. another checkout's) is neither used nor
  # replaced; benchmarks/ leaves sys.path and its modules leave sys.modules afterwards.
  stale = type(sys)("_timing")
  monkeypatch.setitem(sys.modules, "_timing", stale)
  path_before = list(sys.path)
  module = cli_tools.load_bench_module(cli_tools.repo_root(need="benchmarks"))
  assert module._timing is not stale
  assert os.path.dirname(module._timing.__file__) == os.path.join(ROOT, "benchmarks")
  assert module.CHAIN_ELEMENTS == module._timing.CHAIN_ELEMENTS
  assert sys.path == path_before and sys.modules["_timing"] is stale


def test_bench_without_checkout_is_a_clear_error(tmp_path, monkeypatch, capsys):
  # An installed wheel has no benchmarks/: a usage error saying what to do, no traceback.
  site = tmp_path / "site-packages" / "implicit_topk"
  site.mkdir(parents=True)
  monkeypatch.setattr(cli_tools, "__file__", str(site / "cli_tools.py"))
  monkeypatch.delenv("IMPLICIT_TOPK_REPO", raising=False)
  monkeypatch.chdir(tmp_path)
  (tmp_path / "proofs").mkdir()  # a checkout's proofs/ alone does not do for bench
  assert cli.main(["bench", "--bench-help"]) == 2
  err = capsys.readouterr().err
  assert "benchmarks/" in err and "not part of the installed package" in err
  assert "--repo PATH" in err and "IMPLICIT_TOPK_REPO" in err
  with pytest.raises(FileNotFoundError, match="--repo PATH"):
    cli_tools.load_bench_module(tmp_path)


def test_progress_stream():
  buf = io.StringIO()
  stream = cli_tools._ProgressStream(buf)
  stream.write("header\n[  1/4] first\n[  4/4] last")
  stream.flush()
  lines = buf.getvalue().splitlines()
  assert lines[0] == "header"
  assert lines[1].startswith("[######..................]   1/4  25%") and "first" in lines[1]
  assert lines[2].startswith("[########################]   4/4 100%")


@pytest.mark.slow
def test_check_subset(capsys):
  assert cli.main(["check", "--only", "limits"]) == 0
  out = capsys.readouterr().out
  assert "| limits | PASS |" in out and "1/1 passed" in out


def test_check_list_and_unknown(capsys):
  assert cli.main(["check", "--list"]) == 0
  names = capsys.readouterr().out.split()
  assert "limits" in names and "_proofs_common" not in names
  assert cli.main(["check", "--only", "no_such_proof"]) == 2


def test_check_reports_failure(tmp_path, capsys):
  proofs = tmp_path / "proofs"
  proofs.mkdir()
  (proofs / "good.py").write_text("print('good: OK')\n")
  (proofs / "bad.py").write_text("assert 1 == 2, 'broken'\nprint('bad: OK')\n")
  (proofs / "_helper.py").write_text("raise SystemExit(3)\n")
  assert cli.main(["check", "--repo", str(tmp_path)]) == 1
  out = capsys.readouterr().out
  assert "| good | PASS |" in out and "| bad | FAIL |" in out and "_helper" not in out
  assert "AssertionError: broken" in out


@pytest.mark.slow
def test_python_dash_m_entry_point():
  proc = subprocess.run([sys.executable, "-m", "implicit_topk", "--help"],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and "check" in proc.stdout
