"""LEMON's task: word problems, the world's rules, programmatic workers, the teacher and content splits.

Pure Python (no model): the statistical checks use a few thousand draws, with tolerances of about four
binomial standard errors (e.g. sqrt(0.25 * 0.75 / 2000) ~ 0.01 -> 0.04).
"""

import collections

import numpy as np
import pytest

from configs import lemon_orchestration
from lemon_rl.data.splits import key_overlaps
from lemon_rl.envs import word_problems as wp
from lemon_rl.envs.orchestration import (Executor, enumerate_edits, format_agent_prompt,
                                         parse_agent_prompt, parse_spec)
from lemon_rl.text import ByteTokenizer
from lemon_rl.training import lemon
from lemon_rl.utils.config_checks import ConfigError

PROBLEM = wp.Problem(12, (("+", 5), ("*", 3), ("-", 7)), name=0, item=0, wording=(0, 1, 1), distractor=(0, 9, 1))
TEXT = ("Ann has 12 pens. She gets 5 more. Ann is 9 years old. She trades each for 3. She loses 7. "
        "How many pens now?")


def test_problem_text_expression_answer_and_parse_round_trip():
  assert PROBLEM.text == TEXT
  assert PROBLEM.expression == "12+5*3-7"
  assert PROBLEM.answer == 44 == ((12 + 5) * 3) - 7  # Left to right, no precedence.
  assert PROBLEM.kind == "multiply"
  assert wp.parse_problem(TEXT) == PROBLEM
  rng = np.random.default_rng(0)
  for i in range(300):
    p = wp.sample_problem(rng, wp.KINDS[i % 2], 2 + i % 2)
    assert wp.parse_problem(p.text) == p
    assert p.kind == wp.KINDS[i % 2]
    assert 0 < p.answer <= wp.MAX_VALUE
    assert len(p.text) <= wp.max_task_chars()
  for bad in ("", "Ann has 3 pens.", TEXT.replace("She loses", "She eats"), TEXT + " Extra.",
              TEXT.replace("How many pens", "How many cards")):
    with pytest.raises(ValueError):
      wp.parse_problem(bad)


def test_evaluate_chain_and_worked_chain_by_hand():
  assert wp.evaluate_chain("2+3*4") == 20
  assert wp.evaluate_chain("30-11-17*3") == 6
  assert wp.evaluate_chain("5-9") == -4
  assert wp.worked_chain("30-11-17*3") == "19 2 6"
  assert wp.worked_chain("5-9*2") == "-4 -8"
  for bad in ("7", "2+", "+2", "2x3", "2 + 3"):
    with pytest.raises(ValueError):
      wp.evaluate_chain(bad)
    with pytest.raises(ValueError):
      wp.worked_chain(bad)


@pytest.mark.parametrize("output,value", [
    ("44", "44"), ("17 51 44", "44"), (" 17 51 44\n", "44"), ("-4 -8", "-8"),
    ("", None), ("?", None), ("3 steps", None), ("17  51", None), ("12+5", None), ("44.", None)])
def test_number_value_and_answer_check(output, value):
  assert wp.number_value(output) == value
  assert wp.answer_matches(output, "44") == (value == "44")


def test_corrupt_moves_a_number_value_or_one_operand():
  for u in np.linspace(0, 0.99, 12):
    wrong = wp.corrupt("17 51 44", u)
    assert wrong.startswith("17 51 ") and 1 <= abs(int(wp.number_value(wrong)) - 44) <= 3
    assert 1 <= abs(int(wp.corrupt("44", u)) - 44) <= 3
    assert wp.corrupt("12+5*3", u) in ("13+5*3", "12+6*3", "12+5*4")
  assert wp.corrupt("looks fine", 0.3) == "looks fine"


def test_canonical_key_ignores_surface_and_commuting_order():
  a = wp.Problem(12, (("+", 5), ("-", 3), ("*", 2)), name=1, item=2, wording=(1, 0, 0))
  b = wp.Problem(12, (("-", 3), ("+", 5), ("*", 2)), name=4, item=5, wording=(0, 1, 1), distractor=(2, 40, 0))
  c = wp.Problem(12, (("*", 2), ("+", 5), ("-", 3)))  # Different order across runs: another problem.
  assert wp.canonical_key(a) == wp.canonical_key(b) == wp.canonical_key(b.text) == "12(+5-3)(*2)"
  assert a.answer == b.answer
  assert wp.canonical_key(c) != wp.canonical_key(a)


def test_splits_are_disjoint_by_content_key():
  kwargs = {"multiply_fraction": 0.5, "steps": (2, 3), "distractor_prob": 0.75}
  keys = {split: [wp.canonical_key(p) for p in wp.generate_problems(0, n, split, distinct=split != "sft",
                                                                    **kwargs)]
          for split, n in (("sft", 600), ("rl", 300), ("validation", 150), ("test", 150))}
  keys["workers"] = [wp.canonical_key(r["prompt"].split("\n")[0][len("task: "):])
                     for r in wp.worker_demonstrations(0, 300, **kwargs)]
  overlaps = key_overlaps(keys)
  assert all(v == 0 for (a, b), v in overlaps.items() if {a, b} != {"sft", "workers"}), overlaps
  for split in ("rl", "validation", "test"):
    assert len(set(keys[split])) == len(keys[split])  # Distinct problems.
  # The task's own splits (records as the runner sees them).
  config = lemon_orchestration.get_config("tiny")
  task = wp.build_task(config.task, "")
  by_split = {"sft": task.sft_source, "rl": task.rl_source, "validation": task.validation_examples,
              "test": task.test_examples}
  assert all(v == 0 for v in key_overlaps({k: [wp.canonical_key(r["task"]) for r in v]
                                           for k, v in by_split.items()}).values())
  assert len(task.validation_examples) == config.task.num_validation
  for r in task.rl_source:
    assert r["prompt"] == wp.orchestrator_prompt(r["task"]) and r["answer"] == str(wp.parse_problem(r["task"]).answer)
  # Generators are pure functions of (seed, split) and prefix-stable.
  assert wp.examples(0, 5, "test") == wp.examples(0, 5, "test")
  assert [r["task"] for r in wp.examples(0, 3, "test")] == [r["task"] for r in wp.examples(0, 5, "test")][:3]


def _prompt(duty, inputs=(), task=TEXT, role="solver"):
  return parse_agent_prompt(format_agent_prompt(task, role, duty, list(inputs)))


@pytest.mark.parametrize("duty,inputs,expected,skill", [
    ("extract", (), "12+5*3-7", "extract"),
    ("extract fast", (), "12+5*3-7", "extract"),  # Free text does not change the duty.
    ("compute", (("extractor", "12+5*3-7"),), "17 51 44", "multiply"),  # The worked chain.
    ("compute", (("extractor", "2+3"), ("critic", "looks fine")), "5", "add"),  # The last expression.
    ("compute", (("extractor", "2+3"), ("extractor", "4*2")), "8", "multiply"),
    ("compute", (), "?", None),  # No extractor: a calculator cannot work (the needed edge).
    ("compute", (("calculator", "17 51 44"),), "?", None),
    ("verify", (("extractor", "12+5*3-7"), ("calculator", "17 51 45")), "17 51 44", "multiply"),
    ("verify", (("calculator", "17 51 45"), ("critic", "looks fine")), "45", None),  # The last number's value.
    ("solve", (), "44", "solve_multiply"),  # One shot: no worked chain.
    ("aggregate", (("a", "3"), ("b", "2 5"), ("c", "5")), "5", None),  # By value.
    ("aggregate", (("a", "3"), ("b", "5")), "3", None),  # Tie: the earliest.
    ("aggregate", (("a", "looks fine"), ("b", "3 steps")), "?", None),  # Not numbers.
    ("plan", (), "3 steps", None),
    ("critique", (("a", "44"),), "looks fine", None),
    ("summarize", (), "Ann has 12 pens.", None),
    ("explain", (), "work left to right", None),
    ("format", (("a", "12+5"), ("b", "44")), "44", None),
    ("format", (), "?", None),
])
def test_reference_output_table(duty, inputs, expected, skill):
  prompt = _prompt(duty, inputs)
  assert wp.reference_output(prompt) == expected
  assert wp.skill_of(prompt) == skill


def test_roles_do_not_drive_behaviour_duties_do():
  for role in ("planner", "calculator", "critic"):
    assert wp.reference_output(_prompt("extract", role=role)) == "12+5*3-7"
  assert wp.reference_output(_prompt("plan", role="planner")) == "3 steps"  # The planner's default: useless.


def test_programmatic_workers_accuracy_coupling_and_tokens():
  tok = ByteTokenizer()
  pool = wp.programmatic_workers(tokenizer=tok)
  rng = np.random.default_rng(1)
  problems = [wp.sample_problem(rng, "multiply", 2) for _ in range(2000)]
  prompts = [format_agent_prompt(p.text, "calculator", "compute", [("extractor", p.expression)]) for p in problems]
  keys = list(range(2000))
  right = {}
  for cap, worker in pool.items():
    out = worker(prompts, keys)
    right[cap] = np.asarray([t == wp.worked_chain(p.expression) for t, p in zip(out.texts, problems)])
    assert abs(right[cap].mean() - wp.SKILL_ACCURACY["multiply"][cap]) < 0.04, (cap, right[cap].mean())
    assert list(out.prompt_tokens) == [len(tok.encode(x)) for x in prompts]
    assert list(out.completion_tokens) == [len(t) + 1 + wp.EXTRA_TOKENS[cap] for t in out.texts]
    assert all(wp.number_value(t) not in (None, str(p.answer))  # Corrupted numbers, not failures.
               for t, p, ok in zip(out.texts, problems, right[cap]) if not ok)
  assert not np.any(right["small"] & ~right["medium"]) and not np.any(right["medium"] & ~right["large"])
  again = pool["small"](prompts[:50], keys[:50]).texts
  assert again == pool["small"](prompts[:50], keys[:50]).texts  # A function of (prompt, key).
  assert again != pool["small"](prompts[:50], [k + 10_000 for k in keys[:50]]).texts
  # Exact duties never fail.
  useless = [format_agent_prompt(p.text, "critic", "critique", []) for p in problems[:100]]
  assert set(pool["small"](useless, keys[:100]).texts) == {"looks fine"}


def test_teacher_specs_are_valid_short_and_give_every_edit_family_work():
  rng = np.random.default_rng(0)
  texts = [wp.teacher_text(rng) for _ in range(2000)]
  families = collections.Counter()
  for text in texts[:400]:
    spec = parse_spec(text, wp.TASK_SCHEMA)
    families.update({e.family for e in enumerate_edits(spec, wp.TASK_SCHEMA)})
  assert max(len(t) for t in texts) <= wp.max_teacher_chars() < wp.spec_token_budget()
  assert all(families[f] > 40 for f in ("drop_edge", "reset_duty", "lower_capacity")), families
  assert len(set(texts)) > 50  # Diverse: shapes x roles x capacities.
  caps = collections.Counter(line.split("cap: ")[1].split(",")[0].rstrip("}") for t in texts
                             for line in t.splitlines() if "calculator" in line)
  assert set(caps) == {"small", "medium", "large"}  # Capacities independent of the problem.


def _score(specs, examples):
  executor = Executor(wp.programmatic_workers(), schema=wp.TASK_SCHEMA, max_input_chars=wp.MAX_INPUT_CHARS)
  scorer = lemon.OrchestrationScorer(executor, lemon.RewardSettings(), check=wp.answer_matches)
  out = {}
  for name, text in specs.items():
    scored = scorer.score([text] * len(examples), [e["task"] for e in examples], [e["answer"] for e in examples],
                          [e["seed"] for e in examples])
    out[name] = {kind: np.mean([s.reward.success for s, e in zip(scored, examples) if e["kind"] == kind])
                 for kind in wp.KINDS}
  return out


def test_the_team_matters():
  spec = lambda first, cap, deps=", deps: [a]": (
      f"agents:\n- {{id: a, {first}, cap: small}}\n- {{id: b, role: calculator, duty: compute, cap: {cap}{deps}}}\n"
      "answer: b")
  specs = {"small": spec("role: extractor, duty: extract", "small"),
           "large": spec("role: extractor, duty: extract", "large"),
           "no_edge": spec("role: extractor, duty: extract", "large", ""),
           "planner_extracts": spec("role: planner, duty: extract", "large"),
           "planner_plans": spec("role: planner, duty: plan", "large"),
           "solo": "agents:\n- {id: a, role: solver, duty: solve, cap: large}\nanswer: a"}
  success = _score(specs, wp.examples(0, 300, "validation"))
  assert success["small"]["add"] > 0.9 and success["large"]["add"] > 0.9  # Every capacity adds.
  assert success["large"]["multiply"] > success["small"]["multiply"] + 0.5  # Only large multiplies well.
  assert success["no_edge"]["add"] == success["no_edge"]["multiply"] == 0.0  # The edge is needed.
  assert success["planner_plans"]["add"] == 0.0 < success["planner_extracts"]["add"]  # The duty matters.
  for kind in wp.KINDS:
    assert success["solo"][kind] < success["large"][kind]  # Extract-then-compute beats solving at once.


def test_worker_demonstrations_fit_and_cover_the_skills():
  demos = wp.worker_demonstrations(0, 1500)
  skills = collections.Counter(d["skill"] for d in demos)
  assert set(skills) == {"exact", *wp.SKILLS} and min(skills.values()) > 50
  tok = ByteTokenizer()
  assert max(len(tok.encode(d["prompt"])) + 1 for d in demos) <= wp.WORKER_PROMPT_LEN
  assert max(len(d["completion"]) + 1 for d in demos) <= wp.WORKER_MAX_NEW_TOKENS
  for d in demos[:200]:
    assert d["completion"] == wp.reference_output(parse_agent_prompt(d["prompt"]))
  assert wp.worker_demonstrations(0, 20) == demos[:20]  # Prefix-stable.


def test_task_config_checks():
  config = lemon_orchestration.get_config("tiny")
  wp.check_config(config)
  for field, value, match in (("workers", "robots", "task.workers"), ("multiply_fraction", 1.5, "multiply_fraction"),
                              ("max_steps", 4, "max_steps")):
    bad = lemon_orchestration.get_config("tiny")
    bad.task[field] = value
    with pytest.raises(ConfigError, match=match):
      wp.check_config(bad)
  models = lemon_orchestration.get_config("cpu")  # Worker models without a directory.
  with pytest.raises(ConfigError, match="workers_dir"):
    wp.check_config(models)
  bad = lemon_orchestration.get_config("tiny")
  bad.task.reward.token_measure = "words"
  with pytest.raises(ConfigError, match="token_measure"):
    wp.check_config(bad)
