"""Helpers of the command line (``implicit-topk bench`` and ``implicit-topk check``).

``benchmarks/`` and ``proofs/`` are not part of the installed package: they are found
next to the package in a source checkout (or an editable install), or where
``--repo`` / ``IMPLICIT_TOPK_REPO`` says.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pathlib
import re
import subprocess
import sys
import time

_PROGRESS = re.compile(r"^\[\s*(\d+)/(\d+)\]")


_NOT_INSTALLED = (
    "they are not part of the installed package: run from a clone of the repository "
    "(https://github.com/implicit-topk/implicit-topk) or pass --repo PATH (or set "
    "IMPLICIT_TOPK_REPO) naming one")


def repo_root(explicit: str | None = None, need: str | None = None) -> pathlib.Path:
  """The source checkout holding ``benchmarks/`` and ``proofs/`` (``need``: the first
  candidate holding that folder, e.g. ``"benchmarks"``; by default either)."""
  candidates = []
  if explicit:
    candidates.append(pathlib.Path(explicit))
  if os.environ.get("IMPLICIT_TOPK_REPO"):
    candidates.append(pathlib.Path(os.environ["IMPLICIT_TOPK_REPO"]))
  candidates += [pathlib.Path(__file__).resolve().parents[1], pathlib.Path.cwd()]
  folders = (need,) if need else ("proofs", "benchmarks")
  for c in candidates:
    if any((c / folder).is_dir() for folder in folders):
      return c.resolve()
  wanted = ", ".join(f"{folder}/" for folder in folders)
  raise FileNotFoundError(f"cannot find the source checkout's {wanted}: {_NOT_INSTALLED}")


# ----------------------------------------------------------------------------------
# bench: benchmarks/bench_topk.py with a progress bar
# ----------------------------------------------------------------------------------


def progress_bar(done: int, total: int, width: int = 24) -> str:
  """``[#########...............]  9/24  38%``."""
  total = max(total, 1)
  filled = int(round(width * min(done, total) / total))
  return f"[{'#' * filled}{'.' * (width - filled)}] {done:>3}/{total} {100 * done // total:3d}%"


class _ProgressStream(io.TextIOBase):
  """Line filter over a text stream: prefixes the benchmark's ``[ i/total]`` lines
  with a progress bar (on a terminal the bar is redrawn in place on stderr)."""

  def __init__(self, stream, bar_stream=None):
    self._stream = stream
    self._bar = bar_stream
    self._buf = ""

  def writable(self):
    return True

  def write(self, text):
    self._buf += text
    while "\n" in self._buf:
      line, self._buf = self._buf.split("\n", 1)
      self._emit(line)
    return len(text)

  def _emit(self, line):
    m = _PROGRESS.match(line)
    if m:
      done, total = int(m.group(1)), int(m.group(2))
      rest = line[m.end():].lstrip()
      if self._bar is not None:
        self._bar.write("\r\033[K")
        self._stream.write(rest + "\n")
        self._stream.flush()
        self._bar.write(progress_bar(done, total))
        if done == total:
          self._bar.write("\n")
        self._bar.flush()
        return
      line = f"{progress_bar(done, total)}  {rest}"
    elif self._bar is not None:
      self._bar.write("\r\033[K")
    self._stream.write(line + "\n")
    self._stream.flush()

  def flush(self):
    if self._buf:
      self._emit(self._buf)
      self._buf = ""
    self._stream.flush()


def load_bench_module(root: pathlib.Path):
  """``root/benchmarks/bench_topk.py`` as a module, imported as ``python
  benchmarks/bench_topk.py`` runs it: with its folder first on ``sys.path``, so that its
  sibling modules (``import _timing``) are found, from any working directory.

  The siblings are imported afresh from that folder (a module of the same name already
  imported, e.g. from another checkout, is set aside meanwhile), and ``sys.path`` and
  ``sys.modules`` are as before afterwards (the module keeps its own references)."""
  folder = root / "benchmarks"
  path = folder / "bench_topk.py"
  if not path.is_file():
    raise FileNotFoundError(f"missing {path}: benchmarks/ holds the benchmark scripts, "
                            f"{_NOT_INSTALLED}")
  spec = importlib.util.spec_from_file_location("implicit_topk_bench_topk", path)
  if spec is None or spec.loader is None:
    raise ImportError(f"cannot load {path}")
  module = importlib.util.module_from_spec(spec)
  siblings = {p.stem for p in folder.glob("*.py")}
  saved = {name: sys.modules.pop(name) for name in siblings if name in sys.modules}
  entry = str(folder)
  sys.path.insert(0, entry)
  try:
    spec.loader.exec_module(module)
  finally:
    try:
      sys.path.remove(entry)
    except ValueError:
      pass
    for name in siblings:
      sys.modules.pop(name, None)
    sys.modules.update(saved)
  return module


def run_bench(bench_argv, *, repo=None, stream=None):
  """Runs ``benchmarks/bench_topk.py``'s ``main(bench_argv)`` in this process, with a
  progress bar over its ``[i/total]`` lines; returns its list of records."""
  root = repo_root(repo, need="benchmarks")
  module = load_bench_module(root)
  stream = sys.stdout if stream is None else stream
  interactive = hasattr(stream, "isatty") and stream.isatty() and sys.stderr.isatty()
  filtered = _ProgressStream(stream, sys.stderr if interactive else None)
  old = sys.stdout
  sys.stdout = filtered
  try:
    records = module.main(list(bench_argv))
  finally:
    filtered.flush()
    sys.stdout = old
  return records


# ----------------------------------------------------------------------------------
# check: the proofs' companion scripts
# ----------------------------------------------------------------------------------


def discover_proofs(root: pathlib.Path):
  """Names of ``proofs/*.py`` checking scripts (files starting with ``_`` are helpers)."""
  return sorted(p.stem for p in (root / "proofs").glob("*.py") if not p.name.startswith("_"))


def run_check(name: str, root: pathlib.Path, timeout: float):
  """Runs ``proofs/<name>.py`` in a subprocess; returns (ok, seconds, detail)."""
  script = root / "proofs" / f"{name}.py"
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  t0 = time.perf_counter()
  try:
    proc = subprocess.run([sys.executable, str(script)], cwd=str(root), env=env,
                          capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return False, time.perf_counter() - t0, f"timed out after {timeout:g}s"
  seconds = time.perf_counter() - t0
  lines = proc.stdout.strip().splitlines()
  last = lines[-1].strip() if lines else ""
  if proc.returncode == 0 and last == f"{name}: OK":
    return True, seconds, last
  err = [l for l in proc.stderr.strip().splitlines() if l.strip()]
  detail = err[-1] if err else (last or f"exit code {proc.returncode}")
  return False, seconds, detail


def check_table(rows):
  """Markdown table of (name, ok, seconds, detail) rows."""
  lines = ["| proof script | result | time (s) | detail |", "|---|---|---:|---|"]
  for name, ok, seconds, detail in rows:
    detail = detail.replace("|", "/")
    if len(detail) > 70:
      detail = detail[:67] + "..."
    lines.append(f"| {name} | {'PASS' if ok else 'FAIL'} | {seconds:.1f} | {detail} |")
  return "\n".join(lines)
