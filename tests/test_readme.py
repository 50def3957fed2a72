"""The README's two commands stay in sync with CI and the repository, and its Python example runs."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _first_code_block():
  text = open(os.path.join(ROOT, "README.md")).read()
  return re.search(r"```bash\n(.*?)```", text, re.S).group(1)


def test_ci_runs_exactly_the_readme_test_command():
  ci_command = [l for l in open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
                if l and not l.startswith(("#", "set ", "cd "))]
  assert len(ci_command) == 1
  commands = [l for l in _first_code_block().splitlines() if l and not l.startswith("#")]
  assert len(commands) == 2
  assert commands[1] == ci_command[0]


def test_main_job_command_points_at_a_real_config():
  main_job = [l for l in _first_code_block().splitlines() if "experiments.main" in l][0]
  config = re.search(r"--config=(\S+?)(:\S+)?\s", main_job + " ").group(1)
  assert os.path.exists(os.path.join(ROOT, config)), config


def _python_block(section: str) -> str:
  text = open(os.path.join(ROOT, "README.md")).read()
  match = re.search(r"^## " + re.escape(section) + r"\n.*?```python\n(.*?)```", text, re.S | re.M)
  assert match, f"no python block under '## {section}'"
  return match.group(1)


def test_using_the_pieces_runs_as_written(tmp_path):
  """The tour runs in a fresh interpreter, from an unrelated directory, with nothing defined beforehand."""
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  script = tmp_path / "readme_example.py"
  script.write_text(_python_block("Using the pieces") + "\nprint('loss', float(loss.value))\n")
  out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().splitlines()[-1].startswith("loss ")
