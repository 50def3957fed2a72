"""BFCL's own verdict on one single-turn Python answer: its decoders, AST checker and runner rules.

This is the evaluation mode for BFCL numbers. The CAST reward (:mod:`lemon_rl.rewards.tool_calls`) differs
on purpose: it asks for ``[]`` on irrelevance items, while BFCL counts *any* answer it cannot decode into a
call as a correct abstention. Here every rule is BFCL's, re-implemented (``bfcl-eval`` is never imported;
Apache-2.0, see ``third_party/README.md``) from ``bfcl-eval`` 2026.3.23:

- ``model_handler/utils.py``: ``default_decode_ast_prompting`` / ``ast_parse`` / ``resolve_ast_call`` /
  ``resolve_ast_by_type`` (:func:`decode_python`); ``local_inference/qwen_fc.py`` ``decode_ast``
  (:func:`decode_hermes`); the ``</think>`` split of the Qwen handlers' ``_parse_query_response_prompting``
  (:func:`strip_reasoning`).
- ``eval_checker/ast_eval/ast_checker.py``: ``ast_checker`` and its helpers (:func:`ast_check`).
- ``eval_checker/eval_runner.py``: ``_evaluate_single_ast_entry`` and ``_evaluate_single_relevance_entry``;
  ``utils.py``: ``is_function_calling_format_output``, ``is_empty_output`` (:func:`check_output`).

Pipeline of :func:`check_output` for a BFCL test category ``c`` (its file stem: ``simple_python``,
``multiple``, ``parallel``, ``parallel_multiple``, ``live_simple``, ``live_multiple``, ``live_parallel``,
``live_parallel_multiple``, ``irrelevance``, ``live_irrelevance``):

1. Optional reasoning strip: text after the last ``</think>``, leading newlines removed (Qwen handlers).
2. Decode into ``[{name: {param: value}}, ...]``; any exception is a decoding failure.
3. ``c`` contains ``irrelevance``: correct iff decoding failed or gave no call (``[]``, ``[{}]``, or not
   in call format). Otherwise: a decoding failure or a non-call-format result is wrong, else the AST
   checker decides: ``c`` containing ``parallel`` -> order-free parallel checker (each gold call, in
   order, takes the first unused output call that passes: greedy); else containing ``multiple`` -> one
   call, checked against the doc of the gold's function; else (simple) -> one call, checked against the
   *first* function doc.
4. Per call (``simple_function_checker``): the doc's name must be a key of the call; required params
   present; every given param in the doc and in the gold; type check with BFCL's Python mapping
   (``integer -> int``, ``float -> float`` with ints promoted, ``array``/``tuple -> list``, tuples
   converted for ``tuple``, ``any -> str``; ``bool`` is not ``int``; arrays check one nesting level
   against each gold list; a value of the gold's own type is a "variable" and skips the value checks
   below); value check: strings by :func:`standardize_string`, lists element-wise (strings standardised),
   dicts key-by-key against each dict answer (missing keys allowed only when ``""`` is acceptable),
   lists of dicts position-wise, anything else by ``in``; every gold param not given must accept ``""``.

Checker exceptions: BFCL's runner does not catch exceptions raised inside ``ast_checker`` (its whole
evaluation aborts). On BFCL's single-turn data two are reachable from model output: a list holding a
non-dict for a list-of-dicts parameter whose gold also accepts ``""`` (``dict_checker`` calls
``.items()`` on it), and an error message that formats an integer beyond Python's 4300-digit
``str`` limit (e.g. a long hex literal). :func:`check_output` reports such an answer as wrong with error
type ``checker_exception:<ExceptionName>``.

*Decisions* where BFCL runs arbitrary code: BFCL ``eval``s a binary operation inside an argument
(``a=2*3``). :func:`decode_python` evaluates only literal arithmetic (constants, signs, ``+ - * / // % **
<< >> & | ^ @``, list/tuple/set/dict displays) with Python's semantics; a name, call or any other node
inside it, or a result larger than 2**24 bits / 10**7 items, is a decoding failure (BFCL would resolve
names in its own module, run calls, or spend the memory). Recursion limits are Python's, so verdicts on
expressions nested a few hundred levels deep may differ where the two call stacks differ by a few frames.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from typing import Any, Callable, Mapping, NamedTuple, Sequence

# ------------------------------------------------------------------------------------------------------
# Decoding.

THINK_CLOSE = "</think>"
DECODERS = ("python", "hermes", "lemon")
_HERMES_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
_LEMON_BLOCK_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_MAX_BITS = 1 << 24
_MAX_ITEMS = 10_000_000


class DecodeError(ValueError):
  """The text does not decode into calls (BFCL: any exception raised by the handler's ``decode_ast``)."""


def strip_reasoning(text: str) -> str:
  """BFCL's Qwen handlers: the text after the last ``</think>``, leading newlines removed (if present)."""
  if THINK_CLOSE in text:
    return text.split(THINK_CLOSE)[-1].lstrip("\n")
  return text


def decode_python(text: str) -> list[dict[Any, dict[Any, Any]]]:
  """BFCL's ``default_decode_ast_prompting`` (Python return format, no tool-call tag).

  ``text.strip("`\\n ")``, ``[`` / ``]`` added where missing, outer whitespace and ``'`` stripped, then
  parsed as one Python expression: a call, or a list/tuple of calls. A call becomes ``{name: kwargs}``
  (dotted names joined; positional arguments ignored; ``**x`` gives the key ``None``); values: constants
  (``...`` -> ``"..."``), lists, dicts, tuples, a unary operator on a constant (always negated: ``+5`` and
  ``~5`` give ``-5``, ``not True`` gives ``-1``), names as their identifier string, calls without keywords
  as their source text, calls with keywords as nested ``{name: kwargs}``, subscripts as source text,
  binary operations evaluated (module docstring).

  Raises:
    DecodeError: where BFCL's decoder raises.
  """
  try:
    text = text.strip("`\n ")
    if not text.startswith("["):
      text = "[" + text
    if not text.endswith("]"):
      text = text + "]"
    body = ast.parse(text.strip().strip("'"), mode="eval").body
    if isinstance(body, ast.Call):
      return [_resolve_call(body)]
    elements = getattr(body, "elts", None)
    if elements is None:
      raise DecodeError(f"not a call or a list of calls: {type(body).__name__}")
    out = []
    for element in elements:
      if not isinstance(element, ast.Call):
        raise DecodeError(f"list element is not a call: {type(element).__name__}")
      out.append(_resolve_call(element))
    return out
  except DecodeError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # BFCL's runner catches every exception.
    raise DecodeError(f"{type(e).__name__}: {e}") from e


def _resolve_call(node: ast.Call) -> dict[Any, dict[Any, Any]]:
  parts = []
  func = node.func
  while isinstance(func, ast.Attribute):
    parts.append(func.attr)
    func = func.value
  if isinstance(func, ast.Name):
    parts.append(func.id)
  args = {}
  for keyword in node.keywords:
    args[keyword.arg] = _resolve_value(keyword.value)
  return {".".join(reversed(parts)): args}


def _resolve_value(node: ast.AST) -> Any:
  """BFCL's ``resolve_ast_by_type``, branch for branch."""
  if isinstance(node, ast.Constant):
    return "..." if node.value is Ellipsis else node.value
  if isinstance(node, ast.UnaryOp):
    operand = node.operand
    if not isinstance(operand, ast.Constant):  # BFCL reads ``operand.value``: a node or no attribute.
      raise DecodeError(f"unary operator on {type(operand).__name__}")
    return -operand.value  # Whatever the operator; TypeError on str/None/bytes/Ellipsis.
  if isinstance(node, ast.List):
    return [_resolve_value(e) for e in node.elts]
  if isinstance(node, ast.Dict):
    if any(k is None for k in node.keys):
      raise DecodeError("** inside a dict display")
    return {_resolve_value(k): _resolve_value(v) for k, v in zip(node.keys, node.values)}
  if isinstance(node, ast.BinOp):
    # BFCL runs eval(ast.unparse(node)): unparse and compile (neither runs code) fail where its would,
    # e.g. on recursion depth; the compiled expression is then evaluated without eval.
    source = ast.unparse(node)
    compile(source, "<unknown>", "eval")
    return _evaluate(ast.parse(source, mode="eval").body)
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Call):
    return ast.unparse(node) if not node.keywords else _resolve_call(node)
  if isinstance(node, ast.Tuple):
    return tuple(_resolve_value(e) for e in node.elts)
  if isinstance(node, ast.Lambda):
    raise DecodeError("lambda")  # BFCL indexes ``body[0]`` of an expression node: always a TypeError.
  if isinstance(node, ast.Subscript):
    return ast.unparse(node.value) + "[" + ast.unparse(node.slice) + "]"
  raise DecodeError(f"unsupported AST type {type(node).__name__}")


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
    ast.BitXor: operator.xor, ast.BitAnd: operator.and_, ast.MatMult: operator.matmul,
}
_UNARY: dict[type, Callable[[Any], Any]] = {
    ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert,
}


def _evaluate(node: ast.AST) -> Any:
  """Python's value of a literal arithmetic expression (what BFCL's ``eval`` gives), bounded in size."""
  if isinstance(node, ast.Constant):
    return node.value
  if isinstance(node, ast.UnaryOp):
    return _UNARY[type(node.op)](_evaluate(node.operand))
  if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
    if any(isinstance(e, ast.Starred) for e in node.elts):
      raise DecodeError("starred element in an evaluated expression")
    items = [_evaluate(e) for e in node.elts]
    return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
  if isinstance(node, ast.Dict):
    if any(k is None for k in node.keys):
      raise DecodeError("** inside an evaluated expression")
    return {_evaluate(k): _evaluate(v) for k, v in zip(node.keys, node.values)}
  if isinstance(node, ast.BinOp):
    left, right = _evaluate(node.left), _evaluate(node.right)
    _check_size(type(node.op), left, right)
    return _BINARY[type(node.op)](left, right)
  raise DecodeError(f"{type(node).__name__} inside an expression BFCL would eval")


def _bits(x: Any) -> float:
  return abs(x).bit_length() if type(x) in (int, bool) else 64.0


def _check_size(op: type, left: Any, right: Any) -> None:
  """Refuses results above the size limits (before computing them)."""
  if op is ast.Pow and type(left) in (int, bool) and type(right) in (int, bool) and right > 0:
    if abs(left) > 1 and right * math.log2(abs(left)) > _MAX_BITS:
      raise DecodeError("integer power too large to evaluate")
  if op is ast.LShift and type(right) in (int, bool) and right > _MAX_BITS:
    raise DecodeError("shift too large to evaluate")
  if op is ast.Mult:
    for seq, count in ((left, right), (right, left)):
      if isinstance(seq, (str, bytes, list, tuple)) and type(count) in (int, bool):
        if len(seq) * max(count, 0) > _MAX_ITEMS:
          raise DecodeError("repetition too large to evaluate")
    if type(left) in (int, bool) and type(right) in (int, bool) and _bits(left) + _bits(right) > _MAX_BITS:
      raise DecodeError("product too large to evaluate")


def decode_hermes(text: str) -> list[dict[Any, dict[Any, Any]]]:
  """BFCL's ``QwenFCHandler.decode_ast``: JSON objects in ``<tool_call>\\n...\\n</tool_call>`` blocks.

  Blocks that are not valid JSON are skipped; no block gives ``[]``. Each object becomes
  ``{obj["name"]: dict(obj["arguments"])}``.

  Raises:
    DecodeError: a block decodes to a non-object, or an object lacks ``name`` / dict-like ``arguments``.
  """
  calls = []
  for block in _HERMES_RE.findall(text):
    try:
      calls.append(json.loads(block))
    except Exception:  # pylint: disable=broad-except
      pass
  return _calls_from_objects(calls)


def _calls_from_objects(calls: Any) -> list[dict[Any, dict[Any, Any]]]:
  if type(calls) != list or any(type(item) != dict for item in calls):  # pylint: disable=unidiomatic-typecheck
    raise DecodeError("not a list of call objects")
  try:
    return [{call["name"]: {k: v for k, v in call["arguments"].items()}} for call in calls]
  except Exception as e:  # pylint: disable=broad-except
    raise DecodeError(f"{type(e).__name__}: {e}") from e


def decode_lemon(text: str) -> list[dict[Any, dict[Any, Any]]]:
  """lemon_rl's CAST call blocks ``<tool_call>[...]</tool_call>`` (:func:`lemon_rl.envs.tool_use.render_calls`).

  Not a BFCL handler: BFCL's tool-call-tag rule (``<TOOLCALL>...</TOOLCALL>``) with lemon_rl's tag and
  one or more blocks, searched after the last ``</think>`` (as
  :func:`lemon_rl.rewards.tool_parsing.parse_tool_calls` does). Each block's content (stripped) is read
  as JSON call objects
  ``[{"name": ..., "arguments": {...}}]`` (or one object) with :func:`decode_hermes`'s rules when it is
  valid JSON, else with :func:`decode_python`; the blocks' calls are concatenated.

  Raises:
    DecodeError: no block, or a block that neither decoder reads.
  """
  end = text.rfind(THINK_CLOSE)
  if end >= 0:
    text = text[end + len(THINK_CLOSE):]
  blocks = _LEMON_BLOCK_RE.findall(text)
  if not blocks:
    raise DecodeError("no <tool_call>...</tool_call> block")
  out = []
  for block in blocks:
    block = block.strip()
    try:
      value = json.loads(block)
    except Exception:  # pylint: disable=broad-except
      out.extend(decode_python(block))
      continue
    out.extend(_calls_from_objects([value] if isinstance(value, dict) else value))
  return out


_DECODE_FNS: dict[str, Callable[[str], list]] = {
    "python": decode_python, "hermes": decode_hermes, "lemon": decode_lemon,
}


def decode(text: str, decoder: str = "python") -> list[dict[Any, dict[Any, Any]]]:
  """Decodes ``text`` with one of :data:`DECODERS`; raises :class:`DecodeError` like BFCL's handler."""
  if decoder not in _DECODE_FNS:
    raise ValueError(f"unknown decoder {decoder!r}; expected one of {DECODERS}")
  if not isinstance(text, str):
    raise DecodeError(f"model output is a {type(text).__name__}, not a string")
  return _DECODE_FNS[decoder](text)


def is_function_calling_format(decoded: Any) -> bool:
  """BFCL's ``is_function_calling_format_output``: ``[{name: {param: value}}, ...]`` (``[]`` included)."""
  if type(decoded) != list:  # pylint: disable=unidiomatic-typecheck
    return False
  for item in decoded:
    if type(item) != dict or len(item) != 1:  # pylint: disable=unidiomatic-typecheck
      return False
    if type(list(item.values())[0]) != dict:  # pylint: disable=unidiomatic-typecheck
      return False
  return True


def is_empty_output(decoded: Any) -> bool:
  """BFCL's ``is_empty_output``: not call format, ``[]`` or ``[{}]``."""
  if not is_function_calling_format(decoded):
    return True
  return len(decoded) == 0 or (len(decoded) == 1 and len(decoded[0]) == 0)


# ------------------------------------------------------------------------------------------------------
# The AST checker (Python).

PYTHON_TYPE_MAPPING: dict[str, type] = {
    "string": str, "integer": int, "float": float, "boolean": bool,
    "array": list, "tuple": list, "dict": dict, "any": str,
}
_NESTED_TYPES = ("array", "tuple")
_STANDARDIZE_RE = re.compile(r"[ \,\.\/\-\_\*\^]")


class CheckResult(NamedTuple):
  """A verdict: ``valid``, and for a wrong answer BFCL's ``error_type`` and an error message."""

  valid: bool
  error_type: str = ""
  error: str = ""


_VALID = CheckResult(True)


def _invalid(error_type: str, error: str) -> CheckResult:
  return CheckResult(False, error_type, error)


def standardize_string(text: str) -> str:
  """BFCL's normalisation: drop spaces and ``,./-_*^``, lower-case, ``'`` -> ``\"``."""
  return _STANDARDIZE_RE.sub("", text).lower().replace("'", '"')


def convert_func_name(name: str, underscore_to_dot: bool) -> str:
  """BFCL's ``convert_func_name``: dots become underscores for models whose API forbids them."""
  if "." in name and underscore_to_dot:
    return re.sub(r"\.", "_", name)
  return name


def _possible_answer_type(possible_answer: Sequence[Any]) -> type | None:
  for answer in possible_answer:
    if answer != "":  # "" marks an optional parameter.
      return type(answer)
  return None


def _type_check(param: str, value: Any, possible_answer: Sequence[Any], description: str, expected: type,
                nested: type | None) -> tuple[CheckResult, bool]:
  """BFCL's ``type_checker``: ``(result, is_variable)``; nested lists checked one level deep."""
  answer_type = _possible_answer_type(possible_answer)
  is_variable = answer_type is not None and answer_type != expected
  failed = None
  if type(value) == expected:  # pylint: disable=unidiomatic-typecheck
    if nested is None:
      return _VALID, is_variable
    for item in possible_answer:
      ok = True
      if type(item) == list:  # pylint: disable=unidiomatic-typecheck
        for element in value:
          if not _type_check(param, element, item, str(nested), nested, None)[0].valid:
            ok = False
            break
      if ok:
        return _VALID, is_variable
    failed = _invalid("type_error:nested",
                      f"Nested type checking failed for parameter {param!r}. Expected outer type "
                      f"{description} with inner type {nested}. Parameter value: {value!r}.")
  if answer_type is not None and type(value) == answer_type:  # pylint: disable=unidiomatic-typecheck
    return (_VALID if failed is None else failed), True
  return _invalid("type_error:simple",
                  f"Incorrect type for parameter {param!r}. Expected type {description}, got "
                  f"{type(value).__name__}. Parameter value: {value!r}."), False


def _string_check(param: str, value: str, possible_answer: Sequence[Any]) -> CheckResult:
  allowed = [standardize_string(a) for a in possible_answer if type(a) == str]  # pylint: disable=unidiomatic-typecheck
  if standardize_string(value) not in allowed:
    return _invalid("value_error:string", f"Invalid value for parameter {param!r}: {value!r}. Expected one "
                    f"of {possible_answer}. Case insensitive.")
  return _VALID


def _std(x: Any) -> Any:
  return standardize_string(x) if type(x) == str else x  # pylint: disable=unidiomatic-typecheck


def _list_check(param: str, value: list, possible_answer: Sequence[Any]) -> CheckResult:
  """Element-wise after standardising top-level strings; each answer is indexed as BFCL does."""
  standardized = [_std(x) for x in value]
  answers = []
  for answer in possible_answer:
    answers.append([_std(answer[j]) for j in range(len(answer))])
  if standardized not in answers:
    return _invalid("value_error:list/tuple",
                    f"Invalid value for parameter {param!r}: {value!r}. Expected one of {possible_answer}.")
  return _VALID


def _dict_check(value: Any, possible_answers: Sequence[Any]) -> CheckResult:
  """BFCL's ``dict_checker``: some non-``""`` answer accepts every key and has no missing required key."""
  result = _invalid("dict_checker:unclear", "")
  for answer in possible_answers:
    if answer == "":
      continue
    result = _invalid("dict_checker:unclear", "")
    ok = True
    for key, item in value.items():  # AttributeError on a non-dict, as in BFCL.
      if key not in answer:
        result = _invalid("value_error:dict_key", f"Unexpected dict key parameter: '{key}'.")
        ok = False
        break
      allowed = [_std(answer[key][i]) for i in range(len(answer[key]))]
      if _std(item) not in allowed:
        result = _invalid("value_error:dict_value", f"Invalid value for parameter {key!r}: {item!r}. "
                          f"Expected one of {allowed}.")
        ok = False
        break
    for key, acceptable in answer.items():
      if key not in value and "" not in acceptable:
        result = _invalid("value_error:dict_key", f"Missing dict key parameter: '{key}'.")
        ok = False
        break
    if ok:
      return _VALID
  return result


def _list_dict_check(value: list, possible_answers: Sequence[Any]) -> CheckResult:
  """BFCL's ``list_dict_checker``: same length as an answer and each dict accepted position-wise."""
  result = _invalid("list_dict_checker:unclear", "")
  for answer in possible_answers:
    if len(value) != len(answer):
      result = _invalid("value_error:list_dict_count", "Wrong number of dictionaries in the list.")
      continue
    ok = True
    for i in range(len(value)):
      result = _dict_check(value[i], [answer[i]])
      if not result.valid:
        ok = False
        break
    if ok:
      return _VALID
  return result


def simple_function_check(doc: Mapping[str, Any], call: Mapping[Any, Any], gold: Mapping[str, Any],
                          underscore_to_dot: bool = False) -> CheckResult:
  """BFCL's ``simple_function_checker`` (Python): one decoded call ``{name: args}`` against one gold call."""
  possible = list(gold.values())[0]
  name = convert_func_name(doc["name"], underscore_to_dot)
  properties = doc["parameters"]["properties"]
  required = doc["parameters"]["required"]
  if name not in call:
    return _invalid("simple_function_checker:wrong_func_name",
                    f"Function name {name!r} not found in model output.")
  args = call[name]
  for param in required:
    if param not in args:
      return _invalid("simple_function_checker:missing_required", f"Missing required parameter: {param!r}.")
  for param, value in args.items():
    if param not in properties or param not in possible:
      return _invalid("simple_function_checker:unexpected_param", f"Unexpected parameter: {param!r}.")
    description = properties[param]["type"]
    expected = PYTHON_TYPE_MAPPING[description]
    nested = None
    if description in _NESTED_TYPES:
      nested = PYTHON_TYPE_MAPPING[properties[param]["items"]["type"]]
    if description == "tuple" and type(value) == tuple:  # pylint: disable=unidiomatic-typecheck
      value = list(value)
    if description == "float" and type(value) == int:  # pylint: disable=unidiomatic-typecheck
      value = float(value)
    result, is_variable = _type_check(param, value, possible[param], description, expected, nested)
    if not result.valid:
      return result
    if not is_variable:
      if expected == dict:
        result = _dict_check(value, possible[param])
      elif expected == list and nested == dict:
        result = _list_dict_check(value, possible[param])
      elif expected == str:
        result = _string_check(param, value, possible[param])
      elif expected == list:
        result = _list_check(param, value, possible[param])
      else:
        result = None
      if result is not None:
        if not result.valid:
          return result
        continue
    if value not in possible[param]:
      return _invalid("value_error:others", f"Invalid value for parameter {param!r}: {value!r}. Expected "
                      f"one of {possible[param]}.")
  for param in possible:
    if param not in args and "" not in possible[param]:
      return _invalid("simple_function_checker:missing_optional",
                      f"Optional parameter {param!r} not provided and not marked as optional.")
  return _VALID


def _find_doc(functions: Any, name: str) -> Any:
  if type(functions) == list:  # pylint: disable=unidiomatic-typecheck
    for doc in functions:
      if doc["name"] == name:
        return doc
    return None
  return functions


def ast_check(functions: Sequence[Mapping[str, Any]], decoded: Sequence[Mapping[Any, Any]],
              gold: Sequence[Mapping[str, Any]], test_category: str,
              underscore_to_dot: bool = False) -> CheckResult:
  """BFCL's ``ast_checker`` (Python) for a decoded, call-format answer; dispatches on ``test_category``."""
  if "parallel" in test_category:
    if len(decoded) != len(gold):
      return _invalid("parallel_function_checker_no_order:wrong_count", "Wrong number of functions.")
    used: list[int] = []
    for i, gold_call in enumerate(gold):
      doc = _find_doc(functions, list(gold_call.keys())[0])
      found = False
      for j, call in enumerate(decoded):
        if j in used:
          continue
        if simple_function_check(doc, call, gold_call, underscore_to_dot).valid:
          used.append(j)
          found = True
          break
      if not found:
        unused = [j for j in range(len(decoded)) if j not in used]
        return _invalid("parallel_function_checker_no_order:cannot_find_match",
                        f"Could not find a matching function among index {unused} of model output for index "
                        f"{i} of possible answers.")
    return _VALID
  if "multiple" in test_category:
    if len(decoded) != len(gold):
      return _invalid("multiple_function_checker:wrong_count", "Wrong number of functions.")
    doc = _find_doc(functions, list(gold[0].keys())[0])
    return simple_function_check(doc, decoded[0], gold[0], underscore_to_dot)
  if len(decoded) != 1:
    return _invalid("simple_function_checker:wrong_count", "Wrong number of functions.")
  return simple_function_check(functions[0], decoded[0], gold[0], underscore_to_dot)


# ------------------------------------------------------------------------------------------------------
# One answer, as BFCL's eval runner judges it.


def is_irrelevance_category(test_category: str) -> bool:
  """Categories judged by BFCL's relevance runner with the irrelevance rule (no call is right)."""
  return "irrelevance" in test_category


def check_output(text: str, test_category: str, functions: Sequence[Mapping[str, Any]],
                 gold: Sequence[Mapping[str, Any]] | None, *, decoder: str = "python",
                 strip_think: bool = False, underscore_to_dot: bool = False) -> CheckResult:
  """BFCL's verdict on one model output (module docstring).

  Args:
    text: the model output.
    test_category: BFCL's category name (file stem), e.g. ``"simple_python"``, ``"live_irrelevance"``.
    functions: the entry's function docs.
    gold: the possible answers ``[{name: {param: [values]}}]``; ignored (may be ``None``) for irrelevance.
    decoder: one of :data:`DECODERS`.
    strip_think: first drop everything up to the last ``</think>`` (:func:`strip_reasoning`, what
      BFCL's Qwen handlers do before decoding).
    underscore_to_dot: BFCL's per-model flag (``False`` for prompting models).

  Returns:
    :class:`CheckResult`; ``error_type`` is BFCL's (``ast_decoder:decoder_failed``,
    ``irrelevance_error:decoder_success``, ``value_error:string``, ...).
  """
  if decoder not in _DECODE_FNS:
    raise ValueError(f"unknown decoder {decoder!r}; expected one of {DECODERS}")
  if "relevance" in test_category and not is_irrelevance_category(test_category):
    raise ValueError(f"relevance categories ({test_category!r}) are not supported")
  if strip_think and isinstance(text, str):
    text = strip_reasoning(text)
  try:
    decoded = decode(text, decoder)
  except DecodeError as e:
    if is_irrelevance_category(test_category):
      return _VALID
    return _invalid("ast_decoder:decoder_failed", f"Invalid syntax. Failed to decode AST. {e}")
  if is_irrelevance_category(test_category):
    if is_empty_output(decoded):
      return _VALID
    return _invalid("irrelevance_error:decoder_success",
                    "Valid syntax. Successfully decode AST when it should not.")
  if not is_function_calling_format(decoded):
    return _invalid("ast_decoder:decoder_wrong_output_format", "Did not output in the specified format.")
  if gold is None:
    raise ValueError(f"category {test_category!r} needs the possible answers (gold)")
  try:
    return ast_check(functions, decoded, gold, test_category, underscore_to_dot)
  except Exception as e:  # pylint: disable=broad-except  # BFCL's runner would abort here.
    return _invalid(f"checker_exception:{type(e).__name__}", f"BFCL's checker raises {type(e).__name__}: {e}")
