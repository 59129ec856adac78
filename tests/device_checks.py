"""The plumbing shared by the scripts that check operators on 8 host devices
(``tests/sharded_check.py``, ``tests/test_explicit_mesh.py``): the script side prints one
``OK``/``FAIL`` line per check and exits 1 if any failed; the test side runs the script
in a subprocess with the devices configured (they must be set before JAX starts) and
asserts that every line is ``OK``."""

import os
import subprocess
import sys

FAILED = []


def report(ok, name, detail=""):
  """Prints one check's line; remembers a failure."""
  print(f"{'OK  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
  if not ok:
    FAILED.append(name)


def run_named_groups(runs, groups):
  """Runs the named groups (all of ``runs`` when ``groups`` is empty), an exception
  counting as a failed check; returns the exit status (1 if any check failed)."""
  for group in groups or list(runs):
    try:
      runs[group]()
    except Exception as e:  # pylint: disable=broad-except
      report(False, f"group {group}", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
  print("FAILED", FAILED if FAILED else "none")
  return 1 if FAILED else 0


def env_with_devices(devices, **extra):
  """This process's environment for a subprocess with ``devices`` host devices: the
  device count added to this process's ``XLA_FLAGS`` (a run's own XLA flags carry over
  to the subprocess), plus ``extra``."""
  flags = os.environ.get("XLA_FLAGS", "")
  flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
  return dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
              **extra)


def run_script(script, *groups, timeout=900, devices=8):
  """Runs ``script groups...`` on ``devices`` host devices; asserts that it exits 0 and
  that every check line is OK; returns the check lines."""
  env = env_with_devices(devices)
  result = subprocess.run([sys.executable, str(script), *groups], env=env, capture_output=True,
                          text=True, timeout=timeout)
  lines = [l for l in result.stdout.splitlines() if l.startswith(("OK  ", "FAIL "))]
  lines_text = "\n".join(lines)
  assert result.returncode == 0, lines_text + "\n" + result.stderr[-3000:]
  assert lines and all(l.startswith("OK  ") for l in lines), lines_text
  return lines_text
