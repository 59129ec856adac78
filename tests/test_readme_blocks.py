"""Every ```python block of README.md runs as written, and the README stays a landing page.

Each block runs in its own fresh interpreter with JAX's defaults (float32, as a newcomer
runs it; the suite's conftest turns float64 on in this process) and DeprecationWarning as
an error. The first block is also checked value by value by tests/test_readme_example.py,
which runs it; here it is left out. A block that needs several devices sets them up
itself: ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before its first
``import jax``. ```bash blocks are not run. The complete 8-device program of
docs/scaling.md runs the same way.

The cheap checks (word count, links, notation) run in the default group; the blocks run
in the slow group (a fresh interpreter imports JAX and compiles each block, about 10 s).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import test_readme_example

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_WORDS = 3000


BLOCKS = test_readme_example.python_blocks(README.read_text(encoding="utf-8"))


def _first_line(code: str, needle: str) -> int | None:
  for i, line in enumerate(code.splitlines()):
    if needle in line:
      return i
  return None


def test_readme_is_a_landing_page():
  words = len(README.read_text(encoding="utf-8").split())  # what `wc -w` counts
  assert words <= MAX_WORDS, f"README.md has {words} words; move reference material to docs/"


def test_readme_has_the_recipes():
  assert len(BLOCKS) >= 4, "README.md should have the example and three recipes"
  text = README.read_text(encoding="utf-8")
  for page in ("docs/guides/routing.md", "docs/guides/pruning.md", "docs/operators.md",
               "docs/scaling.md", "docs/examples.md", "docs/comparison.md", "docs/cli.md",
               "docs/guides/implicit_vs_unrolled.md", "docs/layout.md"):
    assert f"]({page}" in text, f"README.md does not link {page}"


def test_readme_links_resolve():
  text = README.read_text(encoding="utf-8")
  links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
  links += re.findall(r'<img src="([^"]+)"', text)
  local = [l for l in links if not re.match(r"[a-z]+:", l)]
  assert local
  missing = [l for l in local if not (ROOT / l).exists()]
  assert not missing, f"README.md links missing files: {missing}"


def test_docs_use_the_docstring_notation():
  """The strength is l (regularization_strength) and the threshold λ, as in the docstrings."""
  pages = [README, *DOCS.glob("*.md"), *DOCS.glob("guides/*.md")]
  for page in pages:
    text = page.read_text(encoding="utf-8")
    assert "\\tau" not in text, f"{page.name}: the threshold is \\lambda, not \\tau"
    assert "lambda_{\\mathrm{reg}}" not in text, f"{page.name}: the strength is l"
    # `tau` is only smooth_topk_svm_loss's own temperature.
    for line in text.splitlines():
      if re.search(r"\btau\b", line):
        assert "smooth_topk_svm_loss" in line or "svm" in line.lower(), (
            f"{page.name}: the threshold is λ, not tau: {line.strip()!r}")


def test_device_blocks_set_up_their_devices_first():
  for code in BLOCKS:
    flag = _first_line(code, "xla_force_host_platform_device_count")
    if flag is not None:
      first_jax = _first_line(code, "import jax")
      assert first_jax is None or flag < first_jax, (
          "a block that needs several host devices must set XLA_FLAGS before importing jax")


@pytest.mark.slow  # a fresh interpreter per block, about 10 s each (CI's slow group runs them)
@pytest.mark.parametrize("index", range(1, len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
  code = BLOCKS[index]
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_ENABLE_X64", "XLA_FLAGS")}
  env["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "cpu")
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
                        check=False)
  assert proc.returncode == 0, (
      f"README.md python block {index + 1} fails:\n{code}\n{proc.stderr[-3000:]}")


def _programs(path: pathlib.Path) -> list[str]:
  """The python blocks of a docs page that are whole programs (they set up their devices)."""
  return [b for b in test_readme_example.python_blocks(path.read_text(encoding="utf-8"))
          if b.startswith("import os\nos.environ[\"XLA_FLAGS\"]")]


@pytest.mark.slow  # 8 host devices in a fresh interpreter, about 25 s
def test_scaling_program_runs(tmp_path):
  programs = _programs(DOCS / "scaling.md")
  assert len(programs) == 1, "docs/scaling.md should have one complete 8-device program"
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_ENABLE_X64", "XLA_FLAGS")}
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", programs[0]],
                        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
                        check=False)
  assert proc.returncode == 0, f"docs/scaling.md's program fails:\n{proc.stderr[-3000:]}"
