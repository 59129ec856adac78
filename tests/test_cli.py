"""The command line (implicit_topk/__main__.py): every subcommand, at tiny sizes."""

import io
import subprocess
import sys

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
  assert cli.main(["demo", "--no-timing"]) == 0
  assert "soft" in capsys.readouterr().out.lower()


@pytest.mark.slow
def test_figure(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  out = tmp_path / "fig.png"
  assert cli.main(["figure", "--out", str(out), "--num", "21"]) == 0
  assert out.stat().st_size > 1000
  assert str(out) in capsys.readouterr().out


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
