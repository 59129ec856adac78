"""numba's disk cache follows each kernel module's dependencies
(:mod:`implicit_topk.kernels.cpu.cache_stamp`): numba keys a cached function on its own
file only, so an edit of a module compiled into it must delete its cache files."""

import pathlib

from implicit_topk.kernels.cpu import cache_stamp


def test_the_package_graph_reaches_the_inlined_row_solvers():
  hashes = cache_stamp.dependency_hashes()
  here = pathlib.Path(cache_stamp.__file__).parent
  imports = {p.stem: cache_stamp.package_imports(p.read_text()) for p in here.glob("*.py")}
  assert "native_threshold" in imports["native_mask"]
  assert "isotonic_pav" in imports["pav_capped_simplex"]
  assert "pav_capped_simplex" in imports["pav_ffi"]
  assert "abi" in imports["pav_ffi"]
  # (`from implicit_topk.kernels.cpu import native_threshold as _nt`: an aliased import)
  assert "native_threshold" in imports["native_magnitude"]
  assert set(hashes) == set(imports)


# Each import form that can bring a module's kernels in, with the names it must yield.
_FORMS = {
    "import implicit_topk.kernels.cpu.leaf": {"leaf"},
    "import implicit_topk.kernels.cpu.leaf as renamed": {"leaf"},
    "import numpy, implicit_topk.kernels.cpu.leaf.inner as renamed": {"leaf"},
    "from implicit_topk.kernels.cpu import leaf": {"leaf"},
    "from implicit_topk.kernels.cpu import leaf as renamed": {"leaf"},
    "from implicit_topk.kernels.cpu import (abi,\n    leaf as renamed)": {"abi", "leaf"},
    "from implicit_topk.kernels.cpu.leaf import VALUE": {"leaf"},
    "from implicit_topk.kernels.cpu.leaf import VALUE as renamed": {"leaf"},
    "from implicit_topk.kernels.cpu.leaf.inner import (f as g,\n    h)": {"leaf"},
    "from . import leaf as renamed": {"leaf"},
    "from .leaf import VALUE as renamed": {"leaf"},
    "def f():\n  from implicit_topk.kernels.cpu import leaf as renamed\n": {"leaf"},
    # the package itself bound to a name: any module is reachable through it
    "import implicit_topk.kernels.cpu as kernels": {cache_stamp.EVERY},
    "from implicit_topk.kernels import cpu as kernels": {cache_stamp.EVERY},
    "from implicit_topk.kernels.cpu import *": {cache_stamp.EVERY},
    "import implicit_topk": {cache_stamp.EVERY},
    # not this package
    "import numpy as leaf": set(),
    "from implicit_topk.kernels.gpu import leaf as renamed": set(),
    "from implicit_topk import kernels_cpu_leaf": set(),
}


def test_every_import_form_is_followed():
  for source, expected in _FORMS.items():
    assert cache_stamp.package_imports(source) == expected, source


def _write(directory, name, *deps):
  body = "".join(f"from implicit_topk.kernels.cpu import {d}\n" for d in deps)
  (directory / f"{name}.py").write_text(body + f"VALUE = {name!r}\n")


def test_an_edit_deletes_the_cache_of_every_module_that_compiles_it_in(tmp_path):
  source, cache = tmp_path / "src", tmp_path / "cache"
  source.mkdir()
  cache.mkdir()
  _write(source, "leaf")
  _write(source, "middle", "leaf")
  (source / "entry.py").write_text("from implicit_topk.kernels.cpu.middle import VALUE\n")
  _write(source, "other")
  def populate():
    for module in ("leaf", "middle", "entry", "other"):
      for suffix in (".f-3.py311.nbi", ".f-3.py311.1.nbc"):
        (cache / f"{module}{suffix}").write_text("")
  def cached():
    return {p.name.split(".")[0] for p in cache.iterdir() if p.suffix in (".nbi", ".nbc")}

  populate()
  # Nothing recorded yet: every module's cache is of unknown provenance.
  assert cache_stamp.refresh(source, cache) == {"leaf", "middle", "entry", "other"}
  assert cached() == set()
  populate()
  assert cache_stamp.refresh(source, cache) == set()
  assert cached() == {"leaf", "middle", "entry", "other"}
  # An edit of the leaf: the modules that import it, directly or not, are stale; the
  # leaf itself is numba's own stamp, the unrelated module is kept.
  (source / "leaf.py").write_text("VALUE = 'edited'\n")
  assert cache_stamp.refresh(source, cache) == {"middle", "entry"}
  assert cached() == {"leaf", "other"}
  assert (cache / "kernel_dependencies.json").exists()


def test_an_edit_reaches_the_modules_that_import_it_under_another_name(tmp_path):
  source, cache = tmp_path / "src", tmp_path / "cache"
  source.mkdir()
  cache.mkdir()
  _write(source, "leaf")
  importers = {"module_alias": "import implicit_topk.kernels.cpu.leaf as renamed\n",
               "name_alias": "from implicit_topk.kernels.cpu import leaf as renamed\n",
               "grouped": "from implicit_topk.kernels.cpu import (\n    leaf as renamed,\n)\n",
               "function_alias": "from implicit_topk.kernels.cpu.leaf import VALUE as V\n",
               "relative": "from . import leaf as renamed\n",
               "whole": "import implicit_topk.kernels.cpu as kernels\n"}
  for name, text in importers.items():
    (source / f"{name}.py").write_text(text)
  _write(source, "other")
  assert cache_stamp.refresh(source, cache) == {"leaf", "other", *importers}
  assert cache_stamp.refresh(source, cache) == set()
  (source / "leaf.py").write_text("VALUE = 'edited'\n")
  assert cache_stamp.refresh(source, cache) == set(importers)
