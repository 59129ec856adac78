"""The speed figures of README.md and docs/ are those of the committed results files.

``benchmarks/doc_figures.py`` writes every marked figure (blocks between
``<!-- NAME:start -->`` and ``<!-- NAME:end -->``, inline figures between
``<!-- fig:SPEC -->`` and ``<!-- /fig -->``) from ``benchmarks/results/*.json`` and
``examples/results/*.json``. Here every page is regenerated in memory and compared with
the file, and the pages are scanned for speed figures (``1.75x``, ``3.2 ms``, ``82 s``)
outside the markers. Fast: nothing is timed or compiled.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("doc_figures", ROOT / "benchmarks" / "doc_figures.py")
doc_figures = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(doc_figures)

RESULTS = doc_figures.load_results()
PAGES = [pathlib.Path(p) for p in doc_figures.doc_files()]

# A ratio (1.75x, 2.0-4.2x; not a shape such as 16384x64 or "64 x 1e5") or a time with
# its unit (0.96 ms, 10 us, 40-80 ns, 1.5 s, 31 to 340 ms, 2 seconds).
_NUMBER = r"\d+(?:\.\d+)?"
_RANGE = rf"{_NUMBER}(?:\s?(?:-|–|to)\s?{_NUMBER})?"
SPEED = re.compile(rf"(?<![\w.]){_RANGE}(?:x(?![\w])|\s(?:ms|us|µs|ns|s|seconds|milliseconds|minutes)(?![\w]))")

# Figures outside the markers that are not measurements: (page, the figure, a phrase of
# its context that must stay next to it, why). Nothing else is let through.
NOT_MEASURED = [
    ("docs/scaling.md", "40 seconds", "exceeded", "an error message of XLA, quoted"),
    ("docs/layout.md", "2 seconds", "says so once", "the start-up log's threshold"),
    ("docs/guides/pruning.md", "82 s", "python examples/magnitude_pruning.py",
     "how long an example takes to run, stated with its command"),
    ("docs/guides/pruning.md", "4 minutes", "python examples/pruning_schedule.py",
     "how long an example takes to run, stated with its command"),
]


# A table column of speed figures: its header names a time unit, a time or a ratio.
SPEED_COLUMN = re.compile(r"\b(?:ms|us|µs|ns|s|seconds|time|ratio|speed-?up)\b|/ hard", re.I)
_CELL_NUMBER = re.compile(rf"(?<![\w.]){_NUMBER}(?![\w.])")


class _Figure:
  """A figure found by the scan: where it starts and its text (as a regex match)."""

  def __init__(self, start: int, text: str):
    self._start, self._text = start, text

  def start(self):
    return self._start

  def end(self):
    return self._start + len(self._text)

  def group(self, _=0):
    return self._text


def _table_figures(text: str):
  """The numbers in the speed columns of the Markdown tables of ``text``."""
  lines = text.splitlines(keepends=True)
  offsets = [0]
  for line in lines:
    offsets.append(offsets[-1] + len(line))
  i = 0
  while i < len(lines):
    if not (lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"\|\s*:?-", lines[i + 1])):
      i += 1
      continue
    header = lines[i].strip().strip("|").split("|")
    columns = {c for c, cell in enumerate(header) if SPEED_COLUMN.search(cell)}
    j = i + 2
    while j < len(lines) and lines[j].startswith("|"):
      pos = offsets[j] + 1
      for c, cell in enumerate(lines[j].rstrip("\n").strip("|").split("|")):
        if c in columns:
          for m in _CELL_NUMBER.finditer(cell):
            yield _Figure(pos + m.start(), m.group(0))
        pos += len(cell) + 1
      j += 1
    i = j


def _outside_markers(text: str):
  spans = doc_figures.marked_spans(text)
  found = sorted([*SPEED.finditer(text), *_table_figures(text)], key=lambda m: m.start())
  for m in found:
    if not any(a <= m.start() < b for a, b in spans):
      yield m


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_marked_figures_match_the_results(page):
  text = page.read_text(encoding="utf-8")
  rendered = doc_figures.render(text, RESULTS)
  if rendered != text:
    old, new = text.splitlines(), rendered.splitlines()
    first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    pytest.fail(f"{page.relative_to(ROOT)} line {first + 1} differs from the committed results: "
                f"{old[first] if first < len(old) else ''!r} should read "
                f"{new[first] if first < len(new) else ''!r} "
                "(python benchmarks/doc_figures.py rewrites it)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_speed_figure_outside_the_markers(page):
  rel = str(page.relative_to(ROOT))
  text = page.read_text(encoding="utf-8")
  allowed = [(fig, ctx) for p, fig, ctx, _ in NOT_MEASURED if p == rel]
  loose = []
  for m in _outside_markers(text):
    context = text[max(0, m.start() - 120):m.end() + 120]
    if any(m.group(0) == fig and ctx in context for fig, ctx in allowed):
      continue
    line = text.count("\n", 0, m.start()) + 1
    loose.append(f"line {line}: {m.group(0)!r}")
  assert not loose, (f"{rel}: speed figures not written from the results files (mark them "
                     f"for benchmarks/doc_figures.py): {loose}")


def test_every_exception_is_still_needed():
  """Each entry of NOT_MEASURED still matches a figure (the list does not outlive them)."""
  for page, fig, ctx, _ in NOT_MEASURED:
    text = (ROOT / page).read_text(encoding="utf-8")
    hits = [m for m in _outside_markers(text) if m.group(0) == fig
            and ctx in text[max(0, m.start() - 120):m.end() + 120]]
    assert hits, f"{page}: {fig!r} near {ctx!r} is gone; drop it from NOT_MEASURED"


def test_the_pages_have_marked_figures():
  """The README's tables and summary and the guide's figures are marked (else the
  comparison above checks nothing)."""
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  for name in ("bench-matrix", "bench-matrix-ingraph", "bench-summary"):
    assert f"<!-- {name}:start -->" in readme, name
  choosing = (ROOT / "docs" / "guides" / "choosing.md").read_text(encoding="utf-8")
  assert len(doc_figures.INLINE.findall(choosing)) >= 4
  used = set()
  for page in PAGES:
    used |= {m["name"] for m in doc_figures.BLOCK.finditer(page.read_text(encoding="utf-8"))}
  assert set(doc_figures.BLOCKS) <= used, f"blocks no page uses: {set(doc_figures.BLOCKS) - used}"


def test_a_stale_figure_fails():
  """A figure edited by hand, or a results file that moved on, makes the page differ."""
  page = ROOT / "docs" / "guides" / "choosing.md"
  text = page.read_text(encoding="utf-8")
  m = next(m for m in doc_figures.INLINE.finditer(text) if m["spec"].startswith("ratio|"))
  stale = text[:m.start("text")] + "3.24x" + text[m.end("text"):]
  assert doc_figures.render(stale, RESULTS) == text != stale
  # The same page against results in which that cell's ratio changed.
  kind, stem, cell, contender = m["spec"].split("|")
  moved = json.loads(json.dumps(RESULTS))
  doc_figures.matrix_record(moved, stem, cell, contender)["ratio"] *= 1.5
  assert doc_figures.render(text, moved) != text
  # A table row: the README's per-call table against a changed hard-mask time.
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  moved = json.loads(json.dumps(RESULTS))
  moved["cpu_matrix"]["cells"][0]["records"][0]["median_s"] = 1.0
  assert doc_figures.render(readme, moved) != readme


def test_the_scan_sees_loose_figures():
  """The scanner finds ratios and times outside the markers, not shapes or the marked ones."""
  text = ("Ours is 1.75x, 2.0-4.2x and 0.96 ms against 99 ms (31 to 340 ms, 40-80 ns); "
          "shapes 16384x64 and 64 x 1e5 are not figures; "
          "<!-- fig:ratio|cpu_matrix|router 16384x64 k=2|soft auto p=4/3 -->1.75x<!-- /fig -->")
  found = [m.group(0) for m in _outside_markers(text)]
  assert found == ["1.75x", "2.0-4.2x", "0.96 ms", "99 ms", "31 to 340 ms", "40-80 ns"]
  table = ("| shape | method | ms / call | passes |\n|---|---|---:|---:|\n"
           "| (4, 8192) | mask | 10.0 | 3 |\n| (4, 65536) | mask | 28.1 | 4 |\n")
  assert [m.group(0) for m in _outside_markers(table)] == ["10.0", "28.1"]


def test_unknown_markers_are_errors():
  with pytest.raises(KeyError, match="unknown figure block"):
    doc_figures.render("<!-- no-such-block:start -->\n<!-- no-such-block:end -->", RESULTS)
  with pytest.raises(KeyError, match="no cell"):
    doc_figures.render("<!-- fig:ratio|cpu_matrix|no such cell|soft auto p=4/3 -->1x<!-- /fig -->",
                       RESULTS)
  with pytest.raises(ValueError, match="inline figure"):
    doc_figures.render("<!-- fig:nonsense -->1x<!-- /fig -->", RESULTS)


# ---------------------------------------------------------------- API at a glance

DEPRECATED_KEYWORDS = {"l", "topk"}  # still accepted with a DeprecationWarning until 0.3.0


def test_api_at_a_glance_lists_every_argument():
  """Every public function has a row in docs/operators.md's "API at a glance" that names
  each of its arguments (deprecated aliases aside)."""
  import inspect

  import implicit_topk

  text = (ROOT / "docs" / "operators.md").read_text(encoding="utf-8")
  section = text[text.index("## API at a glance"):]
  section = section[:section.index("\n## ", 1)]
  rows = [line for line in section.splitlines() if line.startswith("| `")]
  missing = {}
  for name in implicit_topk.__all__:
    fn = getattr(implicit_topk, name)
    if not inspect.isfunction(fn):
      continue
    row = next((r for r in rows if re.search(rf"`{name}`", r.split("|")[1])), None)
    if row is None:
      missing[name] = "no row"
      continue
    params = [p.name for p in inspect.signature(fn).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in DEPRECATED_KEYWORDS]
    absent = [p for p in params if not re.search(rf"\b{p}\b", row)]
    if absent:
      missing[name] = absent
  assert not missing, f"docs/operators.md, API at a glance, lacks: {missing}"
