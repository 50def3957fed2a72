"""The BFCL multi-turn tool environment against bfcl-eval's own executor and multi-turn checker.

- Every ``multi_turn_base`` task (and every fourth ``miss_param`` / ``long_context`` task), fed its
  ground-truth calls through the text interface (one call per action, or a whole turn per action), ends in
  success with reward 1; the end states of the environment's instances equal those of BFCL's own execution
  path (``execute_multi_turn_func_call``, which ``eval``s the ground-truth strings), the per-turn result
  texts equal BFCL's, and BFCL's ``multi_turn_checker`` (fed what BFCL's decoder makes of the same action
  texts, as its eval runner does) says valid.
- Perturbed ground truth (a wrong argument value, a dropped / duplicated call, an empty turn): the
  environment's verdict and error type equal BFCL's checker's on every case, both when the episode stops at
  the first failed turn and when it plays on.
- Malformed action text, an unknown function, a call that raises inside the API class, the step limit,
  and a missing bfcl-eval each behave as documented in ``lemon_rl/envs/bfcl_multiturn.py``.

Skipped (not failed) when bfcl-eval is not installed; see tests/bfcl_support.py.
"""

from __future__ import annotations

import itertools
import random
import sys
from typing import Any

import pytest

pytest.importorskip("bfcl_eval")

import bfcl_support  # pylint: disable=g-import-not-at-top,wrong-import-position
from lemon_rl.envs import bfcl_multiturn as bm  # pylint: disable=g-import-not-at-top,wrong-import-position
from lemon_rl.envs import protocol  # pylint: disable=g-import-not-at-top,wrong-import-position
from lemon_rl.rewards.tool_parsing import ToolCall  # pylint: disable=g-import-not-at-top,wrong-import-order

BFCL, _SKIP_REASON = bfcl_support.import_bfcl()
if BFCL is None:
  pytest.skip(_SKIP_REASON, allow_module_level=True)
if not bm.bfcl_multiturn_available():
  pytest.skip("bfcl-eval's multi-turn API classes do not import (mpmath missing?)", allow_module_level=True)

# pylint: disable=g-import-not-at-top,wrong-import-position,wrong-import-order
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
from bfcl_eval.model_handler.utils import default_decode_execute_prompting

_NAMES = itertools.count()


@pytest.fixture(scope="module")
def base_tasks():
  return bm.load_multi_turn_tasks("base")


# ----------------------------------------------------------------------------------------------------------
# BFCL's side (test only).


def _fresh_model_name() -> str:
  return f"lemonrltest{next(_NAMES)}"


def _forget(model_name: str) -> None:
  """Drops the instances BFCL's executor cached in its module globals under ``model_name``."""
  for key in [k for k in vars(multi_turn_utils) if k.startswith(model_name)]:
    del vars(multi_turn_utils)[key]


def _entry(task: dict[str, Any]) -> dict[str, Any]:
  return {"id": task["id"], "initial_config": task["initial_config"],
          "involved_classes": task["involved_classes"]}


def bfcl_decode(action_texts: list[list[str]]) -> list[list[list[str]]]:
  """What BFCL's eval runner makes of the actions: per turn the decoded non-empty steps."""
  decoded = []
  for turn in action_texts:
    steps = []
    for text in turn:
      try:
        calls = default_decode_execute_prompting(text)
      except Exception:  # pylint: disable=broad-except  (the runner skips undecodable steps)
        continue
      if not multi_turn_utils.is_empty_execute_response(calls):
        steps.append(calls)
    decoded.append(steps)
  return decoded


def bfcl_check(task: dict[str, Any], action_texts: list[list[str]]) -> dict[str, Any]:
  name = _fresh_model_name()
  try:
    return multi_turn_checker(bfcl_decode(action_texts), task["ground_truth"], _entry(task),
                              "multi_turn_" + task["category"], name)
  finally:
    _forget(name)


def bfcl_execute(task: dict[str, Any], turns: list[list[str]]) -> tuple[list[list[str]], dict[str, Any]]:
  """BFCL's own execution path (``eval`` of the call strings): per turn the results, and the instances."""
  name = _fresh_model_name()
  try:
    results, instances = [], {}
    for calls in turns:
      out, instances = multi_turn_utils.execute_multi_turn_func_call(
          calls, task["initial_config"], task["involved_classes"], name, task["id"],
          long_context=task["long_context"], is_evaL_run=True)
      results.append(out)
    return results, instances
  finally:
    _forget(name)


# ----------------------------------------------------------------------------------------------------------
# Our side.


def play(env: bm.BfclMultiTurnEnv, index: int, action_texts: list[list[str]]):
  """Feeds the actions until the episode ends; returns the last StepResult."""
  env.reset(index)
  result = None
  for turn in action_texts:
    for text in turn:
      result = env.step(text)
      if result.done:
        return result
  return result


def _public_states(instances: dict[str, Any]) -> dict[str, dict[str, Any]]:
  return {name: bm.public_state(instance) for name, instance in instances.items()}


def _replay_and_compare(tasks: list[dict[str, Any]], indices: list[int]) -> int:
  """Ground-truth replay of ``tasks[i]``; returns how many end states differ from the initial ones."""
  env = bm.BfclMultiTurnEnv(tasks)
  changed = 0
  for i in indices:
    task = tasks[i]
    actions = bm.reference_actions(task, calls_per_action=1 if i % 2 else None)
    result = play(env, i, actions)
    assert result.done and result.info["success"] and result.reward == 1.0, (task["id"], result.info)
    assert protocol.finish_status(result) == protocol.FinishStatus.SUCCESS
    assert len(env.turn_checks) == len(task["turns"]) and all(c["valid"] for c in env.turn_checks)

    bfcl_results, bfcl_instances = bfcl_execute(task, task["ground_truth"])
    expected = _public_states(bfcl_instances)
    assert _public_states(env.instances) == expected, task["id"]
    assert _public_states(env.reference_instances) == expected, task["id"]
    assert env.reference_results == bfcl_results, task["id"]
    assert env.results == [r for turn in bfcl_results for r in turn], task["id"]
    changed += expected != _public_states(bm.make_instances(task))

    verdict = bfcl_check(task, actions)
    assert verdict["valid"], (task["id"], verdict.get("error_message"))
  return changed


# ----------------------------------------------------------------------------------------------------------
# Ground-truth replay.


def test_ground_truth_replay_matches_bfcl_on_every_base_task(base_tasks):
  assert len(base_tasks) == 200
  changed = _replay_and_compare(base_tasks, list(range(len(base_tasks))))
  # The comparison has teeth: most tasks change the state (a no-op environment would fail them).
  assert changed >= 150, changed


@pytest.mark.parametrize("category", ["miss_param", "long_context"])
def test_ground_truth_replay_matches_bfcl_on_other_categories(category):
  tasks = bm.load_multi_turn_tasks(category)
  if category == "miss_param":
    assert all(any(not turn for turn in t["ground_truth"]) for t in tasks)  # turns with nothing to call
  _replay_and_compare(tasks, list(range(0, len(tasks), 4)))


def test_reference_calls_bind_positional_arguments(base_tasks):
  task = base_tasks[0]
  assert task["ground_truth"][2] == ["sort('final_report.pdf')"]
  assert bm.reference_calls(task)[2] == [ToolCall("sort", {"file_name": "final_report.pdf"})]
  expected = ["[sort(file_name='final_report.pdf')]", "[]"]
  assert bm.reference_actions(task, calls_per_action=None)[2] == expected
  assert task["num_reference_actions"] == sum(len(t) for t in task["ground_truth"]) + len(task["turns"])


# ----------------------------------------------------------------------------------------------------------
# Perturbations: our verdict equals BFCL's checker's.


def _mutate_value(value: Any) -> Any:
  if isinstance(value, bool):
    return not value
  if isinstance(value, (int, float)):
    return value + 1
  if isinstance(value, str):
    return value + "_x"
  if isinstance(value, list):
    return value[:-1] if value else ["x"]
  if isinstance(value, dict):
    return {} if value else {"x": 1}
  return "x"


def _perturb(rng: random.Random, turns: list[list[ToolCall]]) -> tuple[str, list[list[ToolCall]]] | None:
  turns = [list(t) for t in turns]
  candidates = [k for k, t in enumerate(turns) if t]
  k = rng.choice(candidates)
  kind = rng.choice(["value", "value", "drop", "duplicate", "empty_turn"])
  j = rng.randrange(len(turns[k]))
  call = turns[k][j]
  if kind == "value":
    if not call.arguments:
      return None
    key = rng.choice(sorted(call.arguments))
    turns[k][j] = ToolCall(call.name, {**call.arguments, key: _mutate_value(call.arguments[key])})
  elif kind == "drop":
    del turns[k][j]
  elif kind == "duplicate":
    turns[k].insert(j, call)
  else:
    turns[k] = []
  return kind, turns


def test_perturbed_trajectories_agree_with_bfcl_checker(base_tasks):
  rng = random.Random(0)
  stop_env = bm.BfclMultiTurnEnv(base_tasks)
  play_on_env = bm.BfclMultiTurnEnv(base_tasks, end_on_turn_failure=False)
  outcomes = []
  for _ in range(90):
    i = rng.randrange(len(base_tasks))
    task = base_tasks[i]
    perturbed = _perturb(rng, bm.reference_calls(task))
    if perturbed is None:
      continue
    kind, turns = perturbed
    actions = [[bm.render_calls([c]) for c in calls] + [bm.END_TURN_ACTION] for calls in turns]
    verdict = bfcl_check(task, actions)
    for env in (stop_env, play_on_env):
      result = play(env, i, actions)
      assert result.done, task["id"]
      assert result.info["success"] == verdict["valid"], (task["id"], kind, result.info, verdict)
      assert result.reward == (1.0 if verdict["valid"] else 0.0)
      failed = [c for c in env.turn_checks if not c["valid"]]
      if not verdict["valid"]:
        assert failed[0]["error_type"] == verdict["error_type"], (task["id"], kind, failed[0], verdict)
    assert len(play_on_env.turn_checks) == len(task["turns"])
    outcomes.append(verdict.get("error_type", "valid"))
  # The sample exercises every rule of the checker, and perturbations that still pass (e.g. a repeated
  # read-only call).
  for error_type in ("valid", bm.EMPTY_TURN, bm.STATE_MISMATCH, bm.RESPONSE_MISMATCH):
    assert error_type in outcomes, (error_type, sorted(set(outcomes)))


def test_wrong_argument_changes_state_and_fails_under_both(base_tasks):
  task = base_tasks[0]
  turns = bm.reference_calls(task)
  assert turns[0][1] == ToolCall("mkdir", {"dir_name": "temp"})
  turns[0][1] = ToolCall("mkdir", {"dir_name": "tmp"})
  actions = [[bm.render_calls(calls), bm.END_TURN_ACTION] for calls in turns]
  env = bm.BfclMultiTurnEnv(base_tasks)
  result = play(env, 0, actions)
  assert result.done and not result.info["success"] and result.reward == 0.0
  assert protocol.finish_status(result) == protocol.FinishStatus.FAILURE
  check = result.info["check"]
  assert check["turn"] == 0 and check["error_type"] == bm.STATE_MISMATCH
  assert check["class"] == "GorillaFileSystem" and "root" in check["differences"]
  verdict = bfcl_check(task, actions)
  assert not verdict["valid"] and verdict["error_type"] == bm.STATE_MISMATCH


# ----------------------------------------------------------------------------------------------------------
# Malformed actions, unknown functions, raising calls, limits.


# (text, whether BFCL's lenient decoder still reads calls from it: it appends a missing "]", reads a bare
# name as a string and drops positional arguments; the landed parser rejects all three).
@pytest.mark.parametrize("text, bfcl_decodes", [
    ("[cd(folder='document')", True), ("[cd('document')]", True), ("cd(folder=document)", True),
    ("[cd(folder=)]", False), ("<tool_call>[cd(folder=)]</tool_call>", False), ("{\"name\": \"cd\"", False),
    ("```\n[cd(folder='a'),]]\n```", False)])
def test_malformed_action(base_tasks, text, bfcl_decodes):
  env = bm.BfclMultiTurnEnv(base_tasks)
  env.reset(0)
  before = _public_states(env.instances)
  with pytest.raises(protocol.InvalidAction):
    env.step(text)
  assert _public_states(env.instances) == before

  env = bm.BfclMultiTurnEnv(base_tasks, on_invalid="end", invalid_action_reward=-1.0)
  env.reset(0)
  result = env.step(text)
  assert result.done and result.reward == -1.0 and result.info["status"] == bm.INVALID_ACTION
  assert protocol.finish_status(result) == protocol.FinishStatus.INVALID_ACTION

  # BFCL's rule: an undecodable response ends the turn; turn 0 then has no call, under both.
  env = bm.BfclMultiTurnEnv(base_tasks, on_invalid="end_turn")
  env.reset(0)
  result = env.step(text)
  assert result.done and result.reward == 0.0 and result.info["malformed"]
  assert result.info["check"]["error_type"] == bm.EMPTY_TURN
  actions = [[text]] + [[bm.END_TURN_ACTION]] * (len(base_tasks[0]["turns"]) - 1)
  assert (bfcl_decode(actions)[0] != []) == bfcl_decodes
  if not bfcl_decodes:
    assert bfcl_check(base_tasks[0], actions)["error_type"] == bm.EMPTY_TURN


def test_prose_and_empty_list_end_the_turn_and_think_is_skipped(base_tasks):
  env = bm.BfclMultiTurnEnv(base_tasks)
  env.reset(1)  # turn 0: ls(a=True)
  result = env.step("<think>List all, hidden too: [ls(a=True)] fits.</think>[ls(a=True)]")
  assert not result.done and result.info["calls"] == ["ls"] and result.info["call_errors"] == 0
  assert result.observation.startswith("\n<tool_response>")
  assert result.observation.endswith(bm.ASSISTANT_PREFIX)
  result = env.step("Here are the contents of your directory.")
  assert not result.done and result.info["check"]["valid"] and result.info["turn"] == 1
  assert result.observation == bm.USER_PREFIX + base_tasks[1]["turns"][1] + "\n" + bm.ASSISTANT_PREFIX
  result = env.step("[]")
  assert result.done and result.info["check"]["error_type"] == bm.EMPTY_TURN


def test_unknown_function_is_an_error_result_with_its_reward(base_tasks):
  env = bm.BfclMultiTurnEnv(base_tasks, call_error_reward=-0.25)
  env.reset(0)
  before = _public_states(env.instances)
  result = env.step("[frobnicate(x=1), GorillaFileSystem.pwd()]")
  assert not result.done and result.reward == -0.25 * 2 and result.info["call_errors"] == 2
  assert result.info["results"] == [bm.ERROR_PREFIX + "unknown function 'frobnicate'",
                                    bm.ERROR_PREFIX + "unknown function 'GorillaFileSystem.pwd'"]
  assert _public_states(env.instances) == before
  result = env.step("[frobnicate(x=1), cd(folder='document')]")
  assert result.reward == -0.25 and result.info["results"][1] == '{"current_working_directory": "document"}'
  assert result.info["status"] == bm.RUNNING


def test_call_that_raises_gives_bfcls_error_text_and_the_episode_goes_on(base_tasks):
  task = base_tasks[0]
  env = bm.BfclMultiTurnEnv(base_tasks, call_error_reward=-0.25)
  env.reset(0)
  calls = ["cd(folder=5)", "cd()", "cd(folder='document', depth=2)"]
  result = env.step("[" + ", ".join(calls) + "]")
  expected, _ = bfcl_execute(task, [calls])
  assert result.info["results"] == expected[0]
  assert expected[0][0] == bm.ERROR_PREFIX + "'int' object has no attribute 'rstrip'"  # raised inside cd
  assert all(r.startswith(bm.ERROR_PREFIX) for r in expected[0])
  assert result.reward == -0.75 and not result.done
  # The episode goes on and the ground truth still succeeds (the failed calls left the state alone).
  for turn in bm.reference_actions(task):
    for text in turn:
      result = env.step(text)
  assert result.done and result.info["success"] and result.reward == 1.0


def test_step_limit_force_quits_like_bfcl(base_tasks):
  env = bm.BfclMultiTurnEnv(base_tasks)
  env.reset(0)
  for _ in range(bm.MAXIMUM_STEP_LIMIT):
    assert not env.step("[pwd()]").done
  result = env.step("[pwd()]")
  assert result.done and result.reward == 0.0 and result.info["check"]["error_type"] == bm.FORCE_TERMINATED
  with pytest.raises(RuntimeError):
    env.step("[]")

  env.reset(0)
  for _ in range(bm.MAXIMUM_STEP_LIMIT):
    env.step("[pwd()]")
  assert env.step("[]").info["check"]["error_type"] == bm.STATE_MISMATCH  # the limit itself is allowed


def test_protocol_prompt_and_seeding(base_tasks):
  env = bm.BfclMultiTurnEnv(base_tasks[:10])
  assert isinstance(env, protocol.Environment)
  with pytest.raises(RuntimeError):
    env.step("[]")
  prompt = env.reset(13)
  assert env.task is base_tasks[3] and prompt == env.reset(3)
  assert prompt.startswith(bm.SYSTEM_TEXT) and prompt.endswith(bm.render_user_text(base_tasks[3]["turns"][0]))
  names = {doc["name"] for doc in base_tasks[3]["functions"]}
  assert all(f'"name": "{name}"' in prompt for name in names)
  short = bm.BfclMultiTurnEnv(base_tasks[:1], prompt_style="signatures").reset(0)
  assert "\ncd(folder:str)\n" in short and len(short) < len(env.reset(0)) / 3
  with pytest.raises(ValueError):
    bm.load_multi_turn_tasks("miss_func")


def test_missing_bfcl_eval_gives_a_clear_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "bfcl_eval.constants.executable_backend_config", None)
  with pytest.raises(ImportError, match="pip install --no-deps bfcl-eval"):
    bm.api_class("MathAPI")
  assert not bm.bfcl_multiturn_available()
