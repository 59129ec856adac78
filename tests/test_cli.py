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
