"""Test helper: BFCL's data and AST checker from the ``bfcl-eval`` package, without its model SDKs.

``bfcl-eval`` 2026.3.23 is installed with ``pip install --no-deps bfcl-eval==2026.3.23`` plus
``tree_sitter==0.21.3 tree-sitter-java==0.21.0 tree-sitter-javascript==0.21.4 filelock tenacity`` (its
pinned dependencies would downgrade numpy). Two things make its checker importable here:

- ``bfcl_eval.constants.model_config`` imports every model SDK; it is replaced in ``sys.modules`` by a
  small module whose ``MODEL_CONFIG_MAPPING`` maps :data:`STUB_MODEL_NAME` to a config with
  ``underscore_to_dot=False`` (the only field the AST checker reads);
- ``bfcl_eval.constants.eval_config`` creates result folders under ``BFCL_PROJECT_ROOT`` at import
  time (by default inside site-packages), so it is pointed at a temporary directory.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile
import types
from typing import Any, Callable

# No underscores: BFCL's convert_func_name looks the model up under model_name.replace("_", "/").
STUB_MODEL_NAME = "lemon-rl-stub"

# BFCL's non-live, single-turn, Python categories used by the tests (file stem -> checker category).
AST_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")
IRRELEVANCE_CATEGORY = "irrelevance"


@dataclasses.dataclass(frozen=True)
class _StubModelConfig:
  underscore_to_dot: bool = False


@dataclasses.dataclass(frozen=True)
class Bfcl:
  """What the tests use from bfcl-eval."""

  ast_checker: Callable[..., dict]
  python_language: Any
  decode_ast: Callable[[str], list]
  is_function_calling_format_output: Callable[[Any], bool]
  is_empty_output: Callable[[Any], bool]
  data_dir: pathlib.Path
  version: str

  def load_category(self, category: str) -> list[dict[str, Any]]:
    """Entries of ``BFCL_v4_<category>.json`` with their ``ground_truth`` (absent for irrelevance)."""
    entries = _read_jsonl(self.data_dir / f"BFCL_v4_{category}.json")
    answer_file = self.data_dir / "possible_answer" / f"BFCL_v4_{category}.json"
    if answer_file.exists():
      answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(answer_file)}
      for entry in entries:
        entry["ground_truth"] = answers[entry["id"]]
    return entries

  def check(self, category: str, functions: list, gold: list, output_text: str) -> bool:
    """BFCL's verdict on a Python-syntax output, as its eval runner computes it for ``category``."""
    if category == IRRELEVANCE_CATEGORY:
      # _evaluate_single_relevance_entry: correct iff decoding fails or yields no call.
      try:
        decoded = self.decode_ast(output_text)
      except Exception:  # pylint: disable=broad-except
        return True
      return self.is_empty_output(decoded)
    # _evaluate_single_ast_entry.
    try:
      decoded = self.decode_ast(output_text)
    except Exception:  # pylint: disable=broad-except
      return False
    if not self.is_function_calling_format_output(decoded):
      return False
    result = self.ast_checker(functions, decoded, gold, self.python_language, category,
                              STUB_MODEL_NAME)
    return bool(result["valid"])


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def import_bfcl() -> tuple[Bfcl | None, str]:
  """Imports bfcl-eval's checker; returns ``(Bfcl, "")`` or ``(None, reason)``."""
  try:
    import bfcl_eval  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return None, (f"bfcl-eval is not importable ({e}); install it with "
                  "`pip install --no-deps bfcl-eval==2026.3.23` and `pip install tree_sitter==0.21.3 "
                  "tree-sitter-java==0.21.0 tree-sitter-javascript==0.21.4 filelock tenacity`")
  if "BFCL_PROJECT_ROOT" not in os.environ:
    root = tempfile.mkdtemp(prefix="bfcl_project_root_")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    os.environ["BFCL_PROJECT_ROOT"] = root
  name = "bfcl_eval.constants.model_config"
  if name not in sys.modules:
    stub = types.ModuleType(name)
    stub.MODEL_CONFIG_MAPPING = {STUB_MODEL_NAME: _StubModelConfig()}
    sys.modules[name] = stub
  else:
    sys.modules[name].MODEL_CONFIG_MAPPING.setdefault(STUB_MODEL_NAME, _StubModelConfig())
  try:
    # pylint: disable=import-outside-toplevel
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.model_handler.utils import default_decode_ast_prompting
    from bfcl_eval.utils import is_empty_output
    from bfcl_eval.utils import is_function_calling_format_output
  except Exception as e:  # pylint: disable=broad-except
    return None, f"bfcl-eval is installed but its checker does not import: {type(e).__name__}: {e}"
  try:
    from importlib.metadata import version  # pylint: disable=import-outside-toplevel
    bfcl_version = version("bfcl-eval")
  except Exception:  # pylint: disable=broad-except
    bfcl_version = "unknown"
  data_dir = pathlib.Path(bfcl_eval.__file__).parent / "data"
  if not (data_dir / "possible_answer").is_dir():
    return None, f"bfcl-eval has no data directory at {data_dir}"
  return Bfcl(ast_checker, Language.PYTHON, default_decode_ast_prompting,
              is_function_calling_format_output, is_empty_output, data_dir, bfcl_version), ""


# ------------------------------------------------------------------------------------------------------
# Calls rendered from BFCL's ground truth, and the mutations the comparisons with its checker use.

Calls = list[tuple[str, dict[str, Any]]]


def python_text(calls: Calls) -> str:
  """``[f(a=1), g(b='x')]``: BFCL's Python call syntax."""
  return "[" + ", ".join(
      f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})" for name, args in calls) + "]"


def schemas(functions: list[dict]) -> dict[str, dict]:
  """Function name -> its parameters schema (the first declaration of a name)."""
  out = {}
  for f in functions:
    out.setdefault(f["name"], f["parameters"])
  return out


def first_acceptable(values: list) -> Any:
  """The first of BFCL's possible answers that is not the empty "not given" marker."""
  return [v for v in values if v != ""][0]


def render_value(value: Any, schema: dict) -> Any:
  """A dict answer is a possible-answer dict ``{key: [values]}``; also inside lists of dicts."""
  if schema.get("type") == "dict" and isinstance(value, dict):
    return {k: first_acceptable(v) for k, v in value.items() if "" not in v}
  items = schema.get("items", {})
  if schema.get("type") == "array" and items.get("type") == "dict" and isinstance(value, list):
    return [render_value(x, items) for x in value]
  return value


def render_gold(functions: list[dict], gold: list[dict]) -> Calls:
  """First acceptable value of each parameter; optional ones ("" accepted, not required) left out."""
  by_name = schemas(functions)
  calls = []
  for entry in gold:
    (name, params), = entry.items()
    schema = by_name.get(name, {"properties": {}, "required": []})
    required = set(schema.get("required", []))
    args = {}
    for param, values in params.items():
      concrete = [v for v in values if v != ""]
      if not concrete or ("" in values and param not in required):
        continue
      args[param] = render_value(concrete[0], schema["properties"].get(param, {}))
    calls.append((name, args))
  return calls


def default_value(param_schema: dict) -> Any:
  """A value of the parameter's declared type."""
  return {"string": "abc", "integer": 3, "float": 1.5, "boolean": True, "array": ["abc"],
          "tuple": ["abc"], "dict": {}, "any": "abc"}.get(param_schema.get("type"), "abc")


def wrong_type(value: Any) -> Any:
  """``value`` as another type (a number as a string, a string as a number...)."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (int, float)):
    return str(value)
  if isinstance(value, str):
    return 12345
  if isinstance(value, list):
    return ",".join(map(str, value))
  if isinstance(value, dict):
    return list(value.items())
  return 0


def wrong_value(value: Any) -> Any:
  """Another value of the same type."""
  if isinstance(value, bool):
    return not value
  if isinstance(value, int):
    return value + 1
  if isinstance(value, float):
    return value + 0.5
  if isinstance(value, str):
    return value + " xyz"
  if isinstance(value, list):
    return value + [value[0]] if value else ["xyz"]
  if isinstance(value, dict):
    changed = dict(value)
    if changed:
      key = sorted(changed)[0]
      changed[key] = wrong_value(changed[key])
    else:
      changed["xyz"] = 1
    return changed
  return "xyz"
