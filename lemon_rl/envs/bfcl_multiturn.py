"""BFCL's multi-turn tasks as a stateful text tool environment (METHODS.md section 5).

An optional extra: ``bfcl-eval`` (``pip install --no-deps bfcl-eval``, plus ``mpmath`` for ``MathAPI``)
ships the simulated APIs of BFCL's multi-turn categories (``GorillaFileSystem``, ``MathAPI``,
``MessageAPI``, ``TwitterAPI``, ``TicketAPI``, ``TradingBot``, ``TravelAPI``, ``VehicleControlAPI``) as
Python classes, the tasks (``data/BFCL_v4_multi_turn_<category>.json``: per task several user turns, the
``initial_config`` of every involved class) and the ground-truth calls of every turn
(``data/possible_answer/...``). This module reads the data files directly (as :mod:`bfcl_data` does) and
imports only the API classes, lazily (:func:`bfcl_multiturn_available`; a clear ``ImportError`` otherwise).
Categories: ``base``, ``miss_param`` (turns whose ground truth is ``[]``: the model should ask) and
``long_context`` (the classes load their long-context extensions); ``miss_func`` (functions revealed
mid-episode) is not supported.

Episode. ``reset(seed)`` plays task ``tasks[seed % len(tasks)]`` on fresh instances (every stateful class
loads a deep copy of its ``initial_config``, as BFCL does) and returns the prompt: the instructions, the
offered functions (BFCL's docs of the involved classes, one JSON line each, or compact signatures) and the
first user message, ending in ``"Assistant: "``. One :meth:`BfclMultiTurnEnv.step` is one model action:

- an action with calls (:func:`lemon_rl.rewards.tool_parsing.parse_tool_calls` status ``ok``: BFCL's
  Python-call syntax ``[cd(folder='x'), ls(a=True)]`` or JSON call objects, optionally in ``<tool_call>``
  blocks after a ``<think>`` block) runs the calls in order on the live instances; the observation is one
  ``<tool_response>...</tool_response>`` line per call and the user turn goes on;
- an action with no call (status ``empty``, e.g. ``[]``, or plain text that does not look like a call
  block: the model's answer to the user) ends the user turn: the turn is checked (below) and the next user
  message is the observation (``"User: ...\\nAssistant: "``);
- a malformed call block (the text after ``</think>`` contains ``<tool_call>`` or starts with ``[``, ``{``,
  a code fence or ``identifier(``, yet does not parse) is an invalid action: ``on_invalid="raise"``
  (default) raises :class:`~lemon_rl.envs.protocol.InvalidAction` (the episode engine ends the episode
  with status ``invalid_action`` and its ``invalid_action_reward``); ``"end"`` ends the episode here with
  ``invalid_action_reward`` (default -1) and ``info["status"] == "invalid_action"``; ``"end_turn"``
  treats it as the end of the user turn, which is what BFCL's own inference loop does with an undecodable
  response (for evaluation with BFCL's rules).

Dispatch (never ``eval``): a call's name must be a public method (``inspect.ismethod``, no leading
underscore) of an involved instance; where two classes share a name the later one in
``involved_classes`` wins (BFCL's mapping). The method is called with the parsed keyword arguments. The
result text is BFCL's: a ``str`` as is, a ``dict`` as ``json.dumps`` (``str`` if that fails), anything
else ``str(value)``; a call that raises (inside the API, or on binding its arguments) gives
``"Error during execution: <message>"`` as BFCL's executor does, and an unknown (or dotted) name gives
``"Error during execution: unknown function '<name>'"`` (BFCL's executor would report a ``NameError``).
Positional arguments are malformed (the landed parser rejects them). BFCL's own decoder is more lenient
on three points, which this environment deliberately does not copy: it appends a missing ``]``, reads a
bare name as a string (``cd(folder=docs)``) and silently drops positional arguments. The API methods' own
error returns (``{"error": ...}``) are ordinary results.

Turn check (BFCL's ``multi_turn_checker``, in its order, at the end of every user turn ``k``). The
ground-truth calls of turn ``k`` are run on a second set of instances (which has run the ground truth of
every earlier turn); if that list is empty (``miss_param`` turns; two ``base`` tasks) nothing is checked.
Otherwise the turn fails with BFCL's ``error_type``

1. ``multi_turn:empty_turn_model_response`` if the model made no call during turn ``k``;
2. ``multi_turn:instance_state_mismatch`` if any public attribute (``vars()``, no leading underscore) of a
   ground-truth instance differs (``!=``) from the model instance's (:func:`state_differences`);
3. ``multi_turn:execution_response_mismatch`` if the ground-truth result texts of turn ``k`` are not all
   contained, as a multiset, in the model's result texts of all turns so far.

A task succeeds iff every turn passes. BFCL stops at the first failing turn; so does the episode by
default (``end_on_turn_failure``): the verdict cannot change afterwards. BFCL force-quits a task whose
user turn runs more than ``MAXIMUM_STEP_LIMIT = 20`` call actions; here the ``max_steps_per_turn + 1``-th
call action of a user turn is run and then ends the episode as a failure
(``multi_turn:force_terminated``).

Episode end and rewards (*Decisions*):

- the action that ends the last user turn: ``done``; ``success_reward`` (1) if every turn passed, else
  ``failure_reward`` (0); ``info["status"]`` ``"success"`` / ``"failure"``;
- a failed turn check (with ``end_on_turn_failure``) or the step limit: ``done``, ``failure_reward``;
- a malformed action: as ``on_invalid`` says (above);
- every other step: 0, plus ``call_error_reward`` (default 0) per call that raised or named an unknown
  function. The default keeps the return equal to BFCL's task accuracy (errors already cost turns of the
  episode engine's budget and BFCL lets a model recover from them); a negative value shapes against
  hallucinated functions.

The environment has no turn budget of its own: the episode engine's ``max_turns`` cuts an episode that
never ends its last user turn (``budget_exhausted``). :func:`reference_actions` gives, per user turn, the
action texts that replay the ground truth (``task["num_reference_actions"]``: one call per action plus one
turn-ending action per turn), a natural ``T_max`` base and an SFT demonstration.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import os
import re
from typing import Any, Callable, Mapping, Sequence

from lemon_rl.envs import bfcl_data
from lemon_rl.envs import tool_world
from lemon_rl.envs.protocol import InvalidAction, StepResult
from lemon_rl.rewards.tool_parsing import PARSE_MALFORMED, PARSE_OK, ToolCall, parse_tool_calls

CATEGORIES: tuple[str, ...] = ("base", "miss_param", "long_context")
FILE_PREFIX = bfcl_data.VERSION_PREFIX + "multi_turn_"
MAXIMUM_STEP_LIMIT = 20  # bfcl_eval.constants.default_prompts.MAXIMUM_STEP_LIMIT
ERROR_PREFIX = "Error during execution: "
END_TURN_ACTION = "[]"
INSTALL_HINT = ("pip install --no-deps bfcl-eval (its pinned dependencies clash with jax, see DESIGN.md) "
                "and mpmath (imported by its MathAPI)")

# BFCL's error types (multi_turn_checker / eval_runner).
EMPTY_TURN = "multi_turn:empty_turn_model_response"
STATE_MISMATCH = "multi_turn:instance_state_mismatch"
RESPONSE_MISMATCH = "multi_turn:execution_response_mismatch"
FORCE_TERMINATED = "multi_turn:force_terminated"

RUNNING, SUCCESS, FAILURE, INVALID_ACTION = "running", "success", "failure", "invalid_action"
ON_INVALID = ("raise", "end", "end_turn")
PROMPT_STYLES = ("json", "signatures")

SYSTEM_TEXT = (
    "You complete the user's requests by calling functions. To call functions, answer with only a list of "
    "calls in Python syntax with keyword arguments, e.g. [func_a(x=1), func_b(name='y')]. Their results come "
    "back in <tool_response> tags and you may call again. When the request is done (or cannot be done), "
    "answer in plain text without calls to end your turn.")
USER_PREFIX = "User: "
ASSISTANT_PREFIX = "Assistant: "

_CALL_START_RE = re.compile(r"^(\[|\{|```|[A-Za-z_][\w.]*\s*\()")
_THINK_END = "</think>"
_TOOL_CALL_OPEN = "<tool_call>"
_MISSING = object()


# ----------------------------------------------------------------------------------------------------------
# bfcl-eval (lazy).


def _backend_config():
  """``bfcl_eval.constants.executable_backend_config`` (class -> module; stateless classes)."""
  try:
    return importlib.import_module("bfcl_eval.constants.executable_backend_config")
  except ImportError as e:
    raise ImportError(f"the BFCL multi-turn environment needs bfcl-eval ({e}); {INSTALL_HINT}") from e


def api_class(class_name: str) -> type:
  """BFCL's simulated API class ``class_name`` (e.g. ``"GorillaFileSystem"``), imported lazily."""
  config = _backend_config()
  if class_name not in config.CLASS_FILE_PATH_MAPPING:
    raise ValueError(f"unknown BFCL API class {class_name!r}")
  try:
    module = importlib.import_module(config.CLASS_FILE_PATH_MAPPING[class_name])
  except ImportError as e:
    raise ImportError(f"BFCL's {class_name} does not import ({e}); {INSTALL_HINT}") from e
  return getattr(module, class_name)


def bfcl_multiturn_available() -> bool:
  """Whether bfcl-eval's data files and API classes (with their dependencies) are importable."""
  if bfcl_data.bfcl_data_dir() is None:
    return False
  try:
    for name in ("GorillaFileSystem", "MathAPI", "MessageAPI", "TwitterAPI", "TicketAPI", "TradingBot",
                 "TravelAPI", "VehicleControlAPI"):
      api_class(name)
  except (ImportError, ValueError):
    return False
  return True


def make_instances(task: Mapping[str, Any]) -> dict[str, Any]:
  """Fresh instances of the task's classes, each stateful one loaded with a deep copy of its config.

  What ``execute_multi_turn_func_call`` does on first use (``class_()``, then ``_load_scenario(deepcopy(
  initial_config.get(name, {})), long_context=...)`` unless the class is stateless).
  """
  stateless = set(_backend_config().STATELESS_CLASSES)
  instances = {}
  for name in task["involved_classes"]:
    instance = api_class(name)()
    if name not in stateless:
      config = copy.deepcopy(task["initial_config"].get(name, {}))
      load = instance._load_scenario  # pylint: disable=protected-access
      load(config, long_context=bool(task.get("long_context", False)))
    instances[name] = instance
  return instances


def method_table(instances: Mapping[str, Any]) -> dict[str, Callable[..., Any]]:
  """Public bound methods by name over the instances in order (a later class wins a shared name)."""
  table = {}
  for instance in instances.values():
    for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
      if not name.startswith("_"):
        table[name] = method
  return table


# ----------------------------------------------------------------------------------------------------------
# Data.


def _read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def function_docs(involved_classes: Sequence[str]) -> list[dict[str, Any]]:
  """BFCL's function docs of the classes (``data/multi_turn_func_doc``), in class order."""
  data = bfcl_data.bfcl_data_dir()
  if data is None:
    raise FileNotFoundError(f"bfcl-eval is not installed; {INSTALL_HINT}")
  mapping = _backend_config().MULTI_TURN_FUNC_DOC_FILE_MAPPING
  docs = []
  for name in involved_classes:
    docs.extend(_read_jsonl(os.path.join(data, "multi_turn_func_doc", mapping[name])))
  return docs


def load_multi_turn_tasks(category: str = "base", limit: int | None = None) -> list[dict[str, Any]]:
  """BFCL's multi-turn tasks of one category, in file order.

  Args:
    category: one of :data:`CATEGORIES`.
    limit: keep the first ``limit`` tasks if set.

  Returns:
    Dicts with ``id``, ``category``, ``turns`` (per user turn its user text; several user messages of one
    turn joined by newlines), ``initial_config``, ``involved_classes``, ``ground_truth`` (per turn BFCL's
    call strings), ``functions`` (the docs offered), ``long_context`` and ``num_reference_actions``
    (ground-truth calls plus one turn-ending action per turn).

  Raises:
    ValueError: unknown category. FileNotFoundError / ImportError: bfcl-eval missing.
  """
  if category not in CATEGORIES:
    raise ValueError(f"unknown multi-turn category {category!r}; expected one of {CATEGORIES}")
  data = bfcl_data.bfcl_data_dir()
  if data is None:
    raise FileNotFoundError(f"bfcl-eval is not installed; {INSTALL_HINT}")
  stem = FILE_PREFIX + category + ".json"
  entries = _read_jsonl(os.path.join(data, stem))
  answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(os.path.join(data, "possible_answer", stem))}
  if limit is not None:
    entries = entries[:limit]
  tasks = []
  for entry in entries:
    gold = answers[entry["id"]]
    if len(gold) != len(entry["question"]):
      raise ValueError(f"{entry['id']}: {len(entry['question'])} turns but {len(gold)} ground-truth turns")
    tasks.append({
        "id": entry["id"],
        "category": category,
        "turns": ["\n".join(m["content"] for m in turn if m.get("role") == "user")
                  for turn in entry["question"]],
        "initial_config": entry["initial_config"],
        "involved_classes": list(entry["involved_classes"]),
        "ground_truth": gold,
        "functions": function_docs(entry["involved_classes"]),
        "long_context": category == "long_context",
        "num_reference_actions": sum(len(turn) for turn in gold) + len(gold),
    })
  return tasks


# ----------------------------------------------------------------------------------------------------------
# Calls and results.


def execution_result_text(value: Any) -> str:
  """BFCL's text of a call's return value (``execute_multi_turn_func_call``)."""
  if type(value) == str:  # pylint: disable=unidiomatic-typecheck  (BFCL's exact rule)
    return value
  if type(value) == dict:  # pylint: disable=unidiomatic-typecheck
    try:
      return json.dumps(value)
    except Exception:  # pylint: disable=broad-except
      return str(value)
  return str(value)


def run_call(table: Mapping[str, Callable[..., Any]], name: str, args: Sequence[Any] = (),
             kwargs: Mapping[str, Any] | None = None) -> tuple[str, bool]:
  """Runs one call through the method table; returns ``(result_text, raised)``."""
  method = table.get(name)
  if method is None:
    return f"{ERROR_PREFIX}unknown function {name!r}", True
  try:
    return execution_result_text(method(*args, **dict(kwargs or {}))), False
  except Exception as e:  # pylint: disable=broad-except  (BFCL reports any exception as a result)
    return ERROR_PREFIX + str(e), True


def parse_reference_call(text: str) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
  """``(name, args, kwargs)`` of one of BFCL's ground-truth call strings (trusted data; literals only).

  Ground truth may pass positional arguments (``sort('final_report.pdf')``), which the model interface
  does not accept; :func:`reference_calls` binds them to the method's parameter names.
  """
  node = ast.parse(text.strip(), mode="eval").body
  if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
    raise ValueError(f"not a plain call: {text!r}")
  if any(k.arg is None for k in node.keywords):
    raise ValueError(f"**kwargs in {text!r}")
  args = tuple(ast.literal_eval(a) for a in node.args)
  kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
  return node.func.id, args, kwargs


def reference_calls(task: Mapping[str, Any]) -> list[list[ToolCall]]:
  """Per user turn the ground-truth calls with keyword arguments only (positional ones bound by name)."""
  table = method_table({name: api_class(name)() for name in task["involved_classes"]})
  turns = []
  for turn in task["ground_truth"]:
    calls = []
    for text in turn:
      name, args, kwargs = parse_reference_call(text)
      if args:
        kwargs = dict(inspect.signature(table[name]).bind(*args, **kwargs).arguments)
      calls.append(ToolCall(name, kwargs))
    turns.append(calls)
  return turns


def render_calls(calls: Sequence[ToolCall]) -> str:
  """BFCL's Python-call syntax ``[f(a=1), g(b='x')]`` (values as ``repr``, as BFCL's decoder writes them)."""
  return "[" + ", ".join(
      f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})" for c in calls) + "]"


def reference_actions(task: Mapping[str, Any], calls_per_action: int | None = 1,
                      end_turn_text: str = END_TURN_ACTION) -> list[list[str]]:
  """Per user turn the action texts that replay the ground truth, the last one ending the turn.

  Args:
    task: a task of :func:`load_multi_turn_tasks`.
    calls_per_action: calls per action (``None``: the whole turn in one action).
    end_turn_text: the turn-ending action.
  """
  out = []
  for calls in reference_calls(task):
    size = len(calls) if calls_per_action is None else calls_per_action
    chunks = [calls[i:i + size] for i in range(0, len(calls), max(size, 1))]
    out.append([render_calls(chunk) for chunk in chunks] + [end_turn_text])
  return out


# ----------------------------------------------------------------------------------------------------------
# State check.


def public_state(instance: Any) -> dict[str, Any]:
  """The attributes BFCL's state checker compares: ``vars(instance)`` without leading underscores."""
  return {k: v for k, v in vars(instance).items() if not k.startswith("_")}


def state_differences(model_instance: Any, reference_instance: Any) -> dict[str, dict[str, Any]]:
  """BFCL's ``_compare_instances``: per differing public attribute of the reference ``{"model",
  "ground_truth"}`` (an attribute the model instance lacks differs; BFCL would raise there)."""
  diffs = {}
  for name, value in public_state(reference_instance).items():
    model_value = getattr(model_instance, name, _MISSING)
    if model_value is _MISSING or model_value != value:
      diffs[name] = {"model": None if model_value is _MISSING else model_value, "ground_truth": value}
  return diffs


def missing_results(reference: Sequence[str], model: Sequence[str]) -> list[str]:
  """Reference results not in ``model`` when matched as multisets (BFCL's ``_is_subsequence_unordered``)."""
  pool = list(model)
  missing = []
  for item in reference:
    try:
      pool.remove(item)
    except ValueError:
      missing.append(item)
  return missing


def render_user_text(text: str) -> str:
  """A user message as an observation: ``"User: <text>\\nAssistant: "``."""
  return f"{USER_PREFIX}{text}\n{ASSISTANT_PREFIX}"


def _looks_like_calls(text: str) -> bool:
  end = text.rfind(_THINK_END)
  rest = text[end + len(_THINK_END):] if end >= 0 else text
  return _TOOL_CALL_OPEN in rest or bool(_CALL_START_RE.match(rest.strip()))


# ----------------------------------------------------------------------------------------------------------
# Environment.


class BfclMultiTurnEnv:
  """BFCL multi-turn tasks as a text :class:`~lemon_rl.envs.protocol.Environment` (module docstring).

  Args:
    tasks: tasks of :func:`load_multi_turn_tasks` (default: all of ``category``).
    category: loaded when ``tasks`` is None.
    prompt_style: ``"json"`` (BFCL's docs, one JSON line each) or ``"signatures"`` (compact lines of
      :func:`lemon_rl.envs.tool_world.signature`, for small models).
    on_invalid: ``"raise"``, ``"end"`` or ``"end_turn"`` for a malformed call block.
    success_reward / failure_reward: the reward of the final step.
    invalid_action_reward: the reward of a malformed action with ``on_invalid="end"``.
    call_error_reward: added per call that raised or named an unknown function.
    max_steps_per_turn: BFCL's ``MAXIMUM_STEP_LIMIT`` (one more call action in a user turn ends it).
    end_on_turn_failure: end the episode at the first failed turn check.
  """

  def __init__(self, tasks: Sequence[Mapping[str, Any]] | None = None, category: str = "base", *,
               prompt_style: str = "json", on_invalid: str = "raise", success_reward: float = 1.0,
               failure_reward: float = 0.0, invalid_action_reward: float = -1.0,
               call_error_reward: float = 0.0, max_steps_per_turn: int = MAXIMUM_STEP_LIMIT,
               end_on_turn_failure: bool = True):
    if on_invalid not in ON_INVALID:
      raise ValueError(f"on_invalid must be one of {ON_INVALID}, got {on_invalid!r}")
    if prompt_style not in PROMPT_STYLES:
      raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
    if max_steps_per_turn < 1:
      raise ValueError(f"max_steps_per_turn must be >= 1, got {max_steps_per_turn}")
    self.tasks = list(tasks) if tasks is not None else load_multi_turn_tasks(category)
    if not self.tasks:
      raise ValueError("no tasks")
    self.prompt_style = prompt_style
    self.on_invalid = on_invalid
    self.success_reward = float(success_reward)
    self.failure_reward = float(failure_reward)
    self.invalid_action_reward = float(invalid_action_reward)
    self.call_error_reward = float(call_error_reward)
    self.max_steps_per_turn = int(max_steps_per_turn)
    self.end_on_turn_failure = bool(end_on_turn_failure)
    self.task: Mapping[str, Any] | None = None
    self.status = RUNNING

  # Rendering (override for another chat format).

  def render_prompt(self, task: Mapping[str, Any]) -> str:
    """Instructions, the offered functions, the first user message."""
    if self.prompt_style == "json":
      lines = [json.dumps(doc, ensure_ascii=False) for doc in task["functions"]]
    else:
      lines = [tool_world.signature(doc) for doc in task["functions"]]
    return SYSTEM_TEXT + "\nFunctions:\n" + "\n".join(lines) + "\n" + self.render_user(task["turns"][0])

  def render_user(self, text: str) -> str:
    return render_user_text(text)

  def render_results(self, results: Sequence[str]) -> str:
    return "\n" + "".join(f"<tool_response>{r}</tool_response>\n" for r in results) + ASSISTANT_PREFIX

  # Protocol.

  def reset(self, seed: int) -> str:
    """Starts task ``tasks[seed % len(tasks)]`` on fresh instances; returns the prompt."""
    self.task = self.tasks[int(seed) % len(self.tasks)]
    self.instances = make_instances(self.task)
    self.reference_instances = make_instances(self.task)
    self._table = method_table(self.instances)
    self._reference_table = method_table(self.reference_instances)
    self.turn = 0  # the current user turn
    self.steps_in_turn = 0  # call actions in the current user turn
    self.num_actions = 0
    self.results: list[str] = []  # result texts of every model call so far (all turns)
    self.reference_results: list[list[str]] = []  # per checked turn, the ground truth's result texts
    self.turn_checks: list[dict[str, Any]] = []
    self.status = RUNNING
    return self.render_prompt(self.task)

  def step(self, action_text: str) -> StepResult:
    """Applies one action: run its calls, or end the user turn (module docstring)."""
    if self.task is None:
      raise RuntimeError("call reset(seed) before step")
    if self.status != RUNNING:
      raise RuntimeError(f"the episode is over ({self.status}); call reset(seed)")
    parsed = parse_tool_calls(action_text)
    self.num_actions += 1
    text = action_text if isinstance(action_text, str) else ""
    if parsed.status == PARSE_MALFORMED and _looks_like_calls(text):
      if self.on_invalid == "raise":
        raise InvalidAction(f"malformed call block in {text[-120:]!r}; answer [f(a=1), g(b='x')]")
      if self.on_invalid == "end":
        self.status = INVALID_ACTION
        return StepResult("", self.invalid_action_reward, True, self._info(malformed=True))
      return self._end_turn(malformed=True)
    if parsed.status != PARSE_OK:
      return self._end_turn()
    return self._run_calls(parsed.calls)

  # Internals.

  def _run_calls(self, calls: Sequence[ToolCall]) -> StepResult:
    results, errors = [], 0
    for call in calls:
      text, raised = run_call(self._table, call.name, kwargs=call.arguments)
      results.append(text)
      errors += raised
    self.results.extend(results)
    self.steps_in_turn += 1
    reward = self.call_error_reward * errors
    extra = {"calls": [c.name for c in calls], "results": results, "call_errors": errors}
    if self.steps_in_turn > self.max_steps_per_turn:
      self.status = FAILURE
      check = {"valid": False, "turn": self.turn, "error_type": FORCE_TERMINATED,
               "error_message": f"more than {self.max_steps_per_turn} call actions in turn {self.turn}"}
      self.turn_checks.append(check)
      return StepResult("", reward + self.failure_reward, True, self._info(check=check, **extra))
    return StepResult(self.render_results(results), reward, False, self._info(**extra))

  def _end_turn(self, malformed: bool = False) -> StepResult:
    check = self._check_turn()
    self.turn_checks.append(check)
    last = self.turn == len(self.task["turns"]) - 1
    if not check["valid"] and self.end_on_turn_failure:
      self.status = FAILURE
    elif last:
      self.status = SUCCESS if all(c["valid"] for c in self.turn_checks) else FAILURE
    if self.status != RUNNING:
      reward = self.success_reward if self.status == SUCCESS else self.failure_reward
      return StepResult("", reward, True, self._info(check=check, malformed=malformed))
    self.turn += 1
    self.steps_in_turn = 0
    return StepResult(self.render_user(self.task["turns"][self.turn]), 0.0, False,
                      self._info(check=check, malformed=malformed))

  def _check_turn(self) -> dict[str, Any]:
    """Runs turn ``k``'s ground truth on the reference instances and checks the model's turn (BFCL's
    ``multi_turn_checker``)."""
    k = self.turn
    gold = self.task["ground_truth"][k]
    reference = []
    for text in gold:
      name, args, kwargs = parse_reference_call(text)
      reference.append(run_call(self._reference_table, name, args, kwargs)[0])
    self.reference_results.append(reference)
    if not gold:
      return {"valid": True, "turn": k}
    if self.steps_in_turn == 0:
      return {"valid": False, "turn": k, "error_type": EMPTY_TURN,
              "error_message": f"Model response list is empty for turn {k}"}
    for name, ref in self.reference_instances.items():
      diffs = state_differences(self.instances[name], ref)
      if diffs:
        return {"valid": False, "turn": k, "error_type": STATE_MISMATCH, "class": name, "differences": diffs,
                "error_message": f"Model instance for {name} does not match the state with ground truth"}
    missing = missing_results(reference, self.results)
    if missing:
      return {"valid": False, "turn": k, "error_type": RESPONSE_MISMATCH, "missing": missing,
              "error_message": f"Model results so far lack ground-truth results of turn {k}"}
    return {"valid": True, "turn": k}

  def _info(self, **extra: Any) -> dict[str, Any]:
    info = {"status": self.status, "success": self.status == SUCCESS, "task_id": self.task["id"],
            "turn": self.turn, "num_turns": len(self.task["turns"]), "steps_in_turn": self.steps_in_turn,
            "num_actions": self.num_actions}
    info.update(extra)
    return info
