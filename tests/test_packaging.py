"""Packaging metadata (pyproject.toml, LICENSE, py.typed): fast checks on the checkout.

The full check (sdist + wheel, twine, the wheel in a fresh venv) is .ci/check_package.sh.
"""

import ast
import importlib.metadata
import pathlib
import re
import sys

import pytest

import implicit_topk

if sys.version_info >= (3, 11):
  import tomllib
else:  # pragma: no cover
  tomllib = pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "implicit_topk"


@pytest.fixture(scope="module")
def pyproject():
  with open(ROOT / "pyproject.toml", "rb") as f:
    return tomllib.load(f)


def test_version_has_one_source(pyproject):
  project = pyproject["project"]
  assert "version" not in project, "the version is dynamic: implicit_topk.__version__"
  assert "version" in project["dynamic"]
  attr = pyproject["tool"]["setuptools"]["dynamic"]["version"]["attr"]
  assert attr == "implicit_topk.__version__"
  # setuptools reads the literal without importing the package (jax, numba): keep it one.
  tree = ast.parse((PACKAGE / "__init__.py").read_text())
  literals = [node.value.value for node in tree.body
              if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
              and isinstance(node.value, ast.Constant)]
  assert literals == [implicit_topk.__version__]
  assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", implicit_topk.__version__)


def test_installed_metadata_matches_version():
  try:
    installed = importlib.metadata.version("implicit-topk")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("implicit-topk is not installed (imported from the source tree)")
  assert installed == implicit_topk.__version__, (
      "installed metadata is stale: reinstall (pip install -e .)")


def test_changelog_names_the_version():
  text = (ROOT / "CHANGELOG.md").read_text()
  assert f"## [{implicit_topk.__version__}]" in text


def test_license(pyproject):
  project = pyproject["project"]
  assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639)
  assert project["license-files"] == ["LICENSE"]
  text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text
  # PEP 639: no license classifier next to an SPDX license expression.
  assert not [c for c in project["classifiers"] if c.startswith("License ::")]
  requires = pyproject["build-system"]["requires"]
  assert any(re.fullmatch(r"setuptools>=(\d+).*", r) and int(
      re.fullmatch(r"setuptools>=(\d+).*", r).group(1)) >= 77 for r in requires)


def test_py_typed_is_package_data(pyproject):
  assert (PACKAGE / "py.typed").is_file()
  assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["implicit_topk"]
  assert "Typing :: Typed" in pyproject["project"]["classifiers"]


def test_extras(pyproject):
  extras = pyproject["project"]["optional-dependencies"]
  assert {"test", "docs", "typecheck", "bench", "peers", "dev"} <= set(extras)
  assert extras["dev"] == ["implicit-topk[test,docs,typecheck,bench]"]
  assert any(r.startswith("softjax") and "python_version >= '3.12'" in r
             for r in extras["peers"])
  urls = pyproject["project"]["urls"]
  assert {"Homepage", "Source", "Issues", "Changelog"} <= set(urls)


_GROUPED_TESTS = '''
import os
import pytest

@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("case", range(8))
def test_case(case):
  with open(os.path.join(os.path.dirname(__file__), f"worker_{case}.txt"), "w") as f:
    f.write(os.environ["PYTEST_XDIST_WORKER"])
'''


@pytest.mark.slow  # two pytest-xdist workers in a subprocess: a few seconds
def test_xdist_groups_run_on_one_worker(tmp_path):
  """The suite's `xdist_group` marks (pyproject.toml: `--dist loadgroup`) keep a group on
  one worker: tests that share a module fixture or compiled functions run them once.
  Caught pytest 9.2 with pytest-xdist 3.8, which ran such groups on every worker."""
  import subprocess
  (tmp_path / "test_grouped.py").write_text(_GROUPED_TESTS)
  (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's options
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"),
       "--rootdir", str(tmp_path), "-n", "2", "--dist", "loadgroup", str(tmp_path / "test_grouped.py")],
      cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  workers = {(tmp_path / f"worker_{case}.txt").read_text() for case in range(8)}
  assert len(workers) == 1, f"one xdist_group ran on the workers {sorted(workers)}"
