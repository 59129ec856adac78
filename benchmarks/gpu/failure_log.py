"""A pytest plugin for a timed GPU run: each failing test's id and the tail of its report
go to ``$OUT/failures.txt`` as soon as the test fails, so that a run stopped by its time
limit still says why. Usage: ``PYTHONPATH=benchmarks/gpu python -m pytest -p failure_log``."""

import os


def pytest_runtest_logreport(report):
  if not report.failed:
    return
  lines = report.longreprtext.splitlines()
  with open(os.path.join(os.environ.get("OUT", "."), "failures.txt"), "a") as log:
    log.write(f"=== {report.nodeid} ({report.when})\n" + "\n".join(lines[-30:]) + "\n")
