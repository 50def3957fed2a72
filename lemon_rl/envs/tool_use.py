"""Single-turn tool-use examples for CAST: a seeded generator over the tool world of :mod:`tool_world`.

An example is a dict with the fields

- ``id``: a stable query id (``"tool-s{seed}-{i}"``), the key of the case library's complexity profile;
- ``category``: ``simple`` (one tool offered, one call), ``multiple`` (2–3 tools offered, often look-alikes,
  one call), ``parallel`` (one tool, 2–3 calls), ``parallel_multiple`` (2–3 tools, 2–3 calls to at least
  two of them) or ``irrelevance`` (no offered tool serves the request; gold ``[]``);
- ``query``: the user request (short: the policy is a tiny byte-level model);
- ``functions``: the offered BFCL function docs (what the verifier checks against);
- ``gold``: BFCL possible answers ``[{name: {param: [acceptable values]}}, ...]`` (``[]`` = no call);
- ``prompt``: the model input, one compact signature line per offered tool then the query
  (see :func:`render_prompt`);
- ``demonstration``: the SFT target ``<think>...</think><tool_call>[...]</tool_call>``, whose thinking grows
  with the difficulty (one planning sentence, plus one explicit step per conversion such as ``5%=0.05``);
- ``num_conversions``: how many conversions the request needs (a static difficulty tag);
- ``intent``: the world tools that would serve the request (for ``irrelevance``: the tool the request was
  drawn from, none of which, nor its substitutes, is offered; ``[]`` for off-world requests);
- ``request``: the calls the query asks for, in ``gold``'s format: ``gold`` itself, except for
  ``irrelevance``, where it is the call of the tool the request was drawn from (``[]`` off-world). It is what
  the content key of the splits reads (``lemon_rl.envs.tool_use_task.canonical_key``);
- ``plan`` and ``calls``: the demonstration's parts, the planning sentence and ``[{tool, args, notes}]``, from
  which :func:`noisy_demonstration` builds an imperfect demonstration.

Everything is deterministic given ``seed`` (Python's :class:`random.Random`, whose sequence for ``random()``,
``randint``, ``choice`` and ``sample`` is stable across Python versions).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Any, Iterable, Sequence

from lemon_rl.envs import tool_world as world

CATEGORIES: tuple[str, ...] = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance")
# Default mix, roughly BFCL's non-live AST split (simple is the largest, irrelevance about a sixth).
DEFAULT_WEIGHTS: dict[str, float] = {"simple": 0.3, "multiple": 0.2, "parallel": 0.15,
                                     "parallel_multiple": 0.15, "irrelevance": 0.2}
CALL_STYLES = ("json", "python")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


# ---------------------------------------------------------------------------------------------------------
# Rendering.


def render_prompt(query: str, functions: Sequence[dict[str, Any]]) -> str:
  """The model's input: one signature per offered tool, then the query.

  Example::

    get_weather(city:str,unit?:celsius|fahrenheit)
    Q: Get the weather in Oslo in °F.

  The completion follows directly (it starts with ``<think>``).
  """
  lines = [world.signature(f) for f in functions]
  return "\n".join(lines + [f"Q: {query}", ""])


def _json_value(value: Any) -> str:
  return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def render_calls(calls: Sequence[tuple[str, dict[str, Any]]], style: str = "json") -> str:
  """The call block ``<tool_call>[...]</tool_call>`` for ``[(name, arguments), ...]``.

  Args:
    calls: the calls in order; ``[]`` renders ``<tool_call>[]</tool_call>`` (no call is right).
    style: ``"json"`` (default): ``[{"name":"f","arguments":{"a":1}}]``; ``"python"``: BFCL's call syntax
      ``[f(a=1)]`` (about 25 bytes shorter per call). Both are read by
      :func:`lemon_rl.rewards.tool_parsing.parse_tool_calls`.
  """
  if style == "json":
    body = _json_value([{"name": n, "arguments": a} for n, a in calls])
  elif style == "python":
    body = "[" + ",".join(
        f"{n}(" + ",".join(f"{k}={_python_value(v)}" for k, v in a.items()) + ")" for n, a in calls) + "]"
  else:
    raise ValueError(f"unknown call style {style!r}; expected one of {CALL_STYLES}")
  return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def _python_value(value: Any) -> str:
  if isinstance(value, bool):
    return "True" if value else "False"
  if isinstance(value, dict):
    return "{" + ",".join(f"{_python_value(k)}:{_python_value(v)}" for k, v in value.items()) + "}"
  if isinstance(value, (list, tuple)):
    return "[" + ",".join(_python_value(v) for v in value) + "]"
  return _json_value(value)  # str (double-quoted, a valid Python literal), int, float.


def render_completion(thinking: str, calls: Sequence[tuple[str, dict[str, Any]]], style: str = "json") -> str:
  """``<think>{thinking}</think><tool_call>[...]</tool_call>``."""
  return f"{THINK_OPEN}{thinking}{THINK_CLOSE}{render_calls(calls, style)}"


def _sentence(clauses: Sequence[str]) -> str:
  """Joins request clauses into one query: ``"A."``, ``"A, and B."``, ``"A; B; and C."``."""
  first = [c[0].upper() + c[1:] for c in clauses[:1]] + list(clauses[1:])
  if len(first) == 1:
    return first[0] + "."
  if len(first) == 2:
    return f"{first[0]}, and {first[1]}."
  return "; ".join(first[:-1]) + f"; and {first[-1]}."


def _thinking(plan: str, notes: Sequence[str], filler: Sequence[str] = ()) -> str:
  """Filler sentences, one planning sentence, every conversion note.

  E.g. ``"Use loan_payment. 5%=0.05. 2 years=24 months."`` (no filler).
  """
  return " ".join([*filler, plan] + [f"{n}." for n in notes])


# ---------------------------------------------------------------------------------------------------------
# Generation.


def _fresh_call(rng: random.Random, tool: str, taken: Sequence[world.Call], tries: int = 50) -> world.Call:
  """A request for ``tool`` whose clause and arguments differ from every call in ``taken``."""
  for _ in range(tries):
    c = world.SAMPLERS[tool](rng)
    if all(c.clause != d.clause and (c.tool != d.tool or c.args != d.args) for d in taken):
      return c
  raise RuntimeError(f"could not sample a fresh request for {tool}")


def _distractors(rng: random.Random, tools: Sequence[str], k: int, near_p: float = 0.6) -> list[str]:
  """``k`` other tools, preferring look-alikes from the same clusters with probability ``near_p``."""
  chosen: list[str] = []
  for _ in range(k):
    near = [t for tool in tools for t in world.CLUSTERS[world.CLUSTER_OF[tool]]
            if t not in tools and t not in chosen]
    far = [t for t in world.TOOL_NAMES if t not in tools and t not in chosen]
    pool = near if near and rng.random() < near_p else far
    chosen.append(rng.choice(sorted(set(pool))))
  return chosen


def _offered(rng: random.Random, tools: Sequence[str]) -> list[dict[str, Any]]:
  names = list(dict.fromkeys(tools))
  rng.shuffle(names)
  return [world.DOCS_BY_NAME[n] for n in names]


def _example(category: str, query: str, offered: list[dict[str, Any]], calls: Sequence[world.Call],
             plan: str, style: str, intent: Sequence[str] | None = None,
             request: Sequence[world.Call] | None = None) -> dict[str, Any]:
  return {
      "category": category,
      "query": query,
      "functions": offered,
      "gold": [c.gold_call for c in calls],
      "prompt": render_prompt(query, offered),
      "demonstration": render_completion(_thinking(plan, [n for c in calls for n in c.notes]),
                                         [(c.tool, c.args) for c in calls], style),
      "num_conversions": sum(len(c.notes) for c in calls),
      "intent": list(dict.fromkeys(c.tool for c in calls)) if intent is None else list(intent),
      "request": [c.gold_call for c in (calls if request is None else request)],
      "plan": plan,
      "calls": [{"tool": c.tool, "args": dict(c.args), "notes": list(c.notes)} for c in calls],
  }


def generate_example(rng: random.Random, category: str, style: str = "json") -> dict[str, Any]:
  """One example of ``category`` (without ``id``), drawing all randomness from ``rng``."""
  if category == "simple":
    tool = rng.choice(world.TOOL_NAMES)
    call = world.SAMPLERS[tool](rng)
    return _example(category, _sentence([call.clause]), _offered(rng, [tool]), [call], f"Use {tool}.", style)

  if category == "multiple":
    tool = rng.choice(world.TOOL_NAMES)
    call = world.SAMPLERS[tool](rng)
    others = _distractors(rng, [tool], rng.randint(1, 2))
    near = [o for o in others if world.CLUSTER_OF[o] == world.CLUSTER_OF[tool]]
    plan = f"Use {tool}." + (f" Not {near[0]}." if near else "")
    return _example(category, _sentence([call.clause]), _offered(rng, [tool, *others]), [call], plan, style)

  if category == "parallel":
    tool = rng.choice(world.TOOL_NAMES)
    calls = []
    for _ in range(2 if rng.random() < 0.75 else 3):
      calls.append(_fresh_call(rng, tool, calls))
    return _example(category, _sentence([c.clause for c in calls]), _offered(rng, [tool]), calls,
                    f"{len(calls)} calls to {tool}.", style)

  if category == "parallel_multiple":
    k = 2 if rng.random() < 0.75 else 3
    tools = rng.sample(world.TOOL_NAMES, 2)
    order = tools + [rng.choice(tools)] * (k - 2)
    calls: list[world.Call] = []
    for tool in order:
      calls.append(_fresh_call(rng, tool, calls))
    extra = _distractors(rng, tools, 1) if rng.random() < 0.3 else []
    plan = "Calls: " + ", ".join(c.tool for c in calls) + "."
    return _example(category, _sentence([c.clause for c in calls]), _offered(rng, [*tools, *extra]), calls,
                    plan, style)

  if category == "irrelevance":
    if rng.random() < 0.2:
      clause, need = rng.choice(world.OFF_WORLD_REQUESTS)
      offered = rng.sample(world.TOOL_NAMES, rng.randint(1, 2))
      intent: list[str] = []
      request: list[world.Call] = []
    else:
      tool = rng.choice(world.TOOL_NAMES)
      request = [world.SAMPLERS[tool](rng)]
      clause, need = request[0].clause, world.PURPOSE[tool]
      banned = {tool, *world.SUBSTITUTES.get(tool, ())}
      near = [t for t in world.CLUSTERS[world.CLUSTER_OF[tool]] if t not in banned]
      far = [t for t in world.TOOL_NAMES if t not in banned and t not in near]
      first = rng.choice(near) if near and rng.random() < 0.6 else rng.choice(far)
      offered = [first] + ([rng.choice([t for t in far if t != first])] if rng.random() < 0.4 else [])
      intent = [tool]
    plan = f"Needs {need}; no offered tool does that."
    return _example(category, _sentence([clause]), _offered(rng, offered), [], plan, style, intent, request)

  raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")


def generate_examples(num_examples: int,
                      seed: int = 0,
                      categories: Iterable[str] | dict[str, float] | None = None,
                      style: str = "json",
                      max_prompt_bytes: int | None = None,
                      max_completion_bytes: int | None = None) -> list[dict[str, Any]]:
  """``num_examples`` examples, deterministic given ``seed``.

  Args:
    num_examples: how many.
    seed: the generator seed; example ``i`` gets id ``f"tool-s{seed}-{i}"``.
    categories: a list of categories (sampled uniformly), a ``{category: weight}`` mix, or ``None`` for
      :data:`DEFAULT_WEIGHTS`.
    style: call-block style of the demonstrations (see :func:`render_calls`).
    max_prompt_bytes, max_completion_bytes: if set, resample an example whose UTF-8 prompt / demonstration
      is longer (at most 100 tries, then a ``RuntimeError``).

  Returns:
    A list of example dicts (module docstring).
  """
  if num_examples < 0:
    raise ValueError(f"num_examples must be >= 0, got {num_examples}")
  if categories is None:
    mix = dict(DEFAULT_WEIGHTS)
  elif isinstance(categories, dict):
    mix = dict(categories)
  else:
    mix = {c: 1.0 for c in categories}
  bad = [c for c in mix if c not in CATEGORIES]
  if bad or not mix:
    raise ValueError(f"unknown or empty categories {bad or list(mix)}; expected some of {CATEGORIES}")
  if any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
    raise ValueError(f"category weights must be >= 0 with a positive sum, got {mix}")
  names, weights = list(mix), [mix[c] for c in mix]
  rng = random.Random(seed)
  out = []
  for i in range(num_examples):
    category = rng.choices(names, weights)[0]
    for _ in range(100):
      ex = generate_example(rng, category, style)
      if ((max_prompt_bytes is None or len(ex["prompt"].encode()) <= max_prompt_bytes) and
          (max_completion_bytes is None or len(ex["demonstration"].encode()) <= max_completion_bytes)):
        break
    else:
      raise RuntimeError(f"no {category} example within the byte limits after 100 tries")
    out.append({"id": f"tool-s{seed}-{i}", **ex})
  return out


# ---------------------------------------------------------------------------------------------------------
# Imperfect demonstrations (the CAST rerun's headroom design, issue 10).

FILLER = ("Read the query.", "Check the tools.", "Check each type.", "Match the keys.", "Recheck values.",
          "Keep it short.")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclasses.dataclass(frozen=True)
class DemoNoise:
  """Imperfections of SFT demonstrations that leave an RL method something to act on.

  With the clean demonstrations, thinking length is fixed by the template and the calls are always well
  formed, so a length budget has no within-group variance to cut and a schema-faithful reward has no partial
  credit to give. Each field is a probability (independent draws, :func:`noisy_demonstration`):

  Attributes:
    skip_conversion: per call with conversion notes, drop one note from the thinking AND pass the value the
      query wrote instead of the converted one (``5%`` -> ``5``, ``Apple`` -> ``"Apple"``): thinking is
      causally useful on the queries that need a conversion.
    filler: per demonstration, 1 to ``max_filler`` sentences of :data:`FILLER` at the start of the thinking,
      independent of the calls: thinking to cut without changing correctness.
    look_alike_key: per demonstration, one argument under a look-alike key (``start_date`` -> ``startDate``,
      ``city`` -> ``City``): the key dimension fails, name and values hold.
    number_as_string: per demonstration, one numeric argument as a string (``0.05`` -> ``"0.05"``): the type
      dimension fails.
    max_filler: the most filler sentences in one demonstration.
  """

  skip_conversion: float = 0.0
  filler: float = 0.0
  look_alike_key: float = 0.0
  number_as_string: float = 0.0
  max_filler: int = 2

  def __post_init__(self):
    for name in ("skip_conversion", "filler", "look_alike_key", "number_as_string"):
      p = getattr(self, name)
      if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
        raise ValueError(f"DemoNoise.{name} must be a probability in [0, 1], got {p!r}")
    if not isinstance(self.max_filler, int) or self.max_filler < 1:
      raise ValueError(f"DemoNoise.max_filler must be an int >= 1, got {self.max_filler!r}")

  @property
  def max_extra_bytes(self) -> int:
    """How much longer than the clean demonstration a noisy one can be (filler, and the quotes of a number
    turned string; a skipped conversion and a look-alike key never lengthen it)."""
    filler = self.max_filler * (1 + max(len(f) for f in FILLER)) if self.filler else 0
    return filler + (2 if self.number_as_string else 0)


def _surface(value: Any) -> str:
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, (int, float)):
    return world.fmt_num(value)
  return str(value)


def _naive_value(written: str, value: Any) -> Any:
  """What a policy that skips a conversion passes: the query's words, or their first number if the argument is
  numeric (``"5%"`` -> ``5``, ``"2 years"`` -> ``2``, ``"a dozen"`` -> ``"a dozen"``)."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    match = _NUMBER.search(written)
    if match:
      x = float(match.group())
      return int(x) if x.is_integer() else x
  return written


def _skippable(notes: Sequence[str], args: dict[str, Any], gold: dict[str, list[Any]]) -> list[tuple[int, str, Any]]:
  """``(note index, argument, naive value)`` for every note whose converted value an argument holds and whose
  naive value the gold does not accept. A note reads ``written=converted`` (``"5%=0.05"``, ``"2 years=24
  months"``, ``"monthly: n=12"``)."""
  out = []
  for i, note in enumerate(notes):
    written, _, converted = note.partition("=")
    written, converted = written.split(":")[0].strip(), converted.strip()
    for key, value in args.items():
      if _surface(value) in (converted, converted.split(" ")[0]):
        naive = _naive_value(written, value)
        accepted = [world.canonical_value(v) for v in gold.get(key, [])]
        if world.canonical_value(naive) not in accepted:
          out.append((i, key, naive))
        break
  return out


def _look_alike(key: str) -> str:
  """``start_date`` -> ``startDate``; a one-word key is capitalised (``city`` -> ``City``)."""
  head, *rest = key.split("_")
  return head + "".join(p.capitalize() for p in rest) if rest else key.capitalize()


def noisy_demonstration(example: dict[str, Any], noise: DemoNoise, rng: random.Random, style: str = "json") -> str:
  """An imperfect demonstration of ``example`` (its ``plan``, ``calls`` and ``gold``) under ``noise``.

  Draws, in order: a skipped conversion per call with notes, a look-alike key, a number as a string, filler
  (see :class:`DemoNoise`). With every probability 0 it equals ``example["demonstration"]``.
  """
  calls = [(c["tool"], dict(c["args"]), list(c["notes"])) for c in example["calls"]]
  for (tool, args, notes), gold in zip(calls, example["gold"]):
    if notes and rng.random() < noise.skip_conversion:
      options = _skippable(notes, args, gold[tool])
      if options:
        i, key, naive = rng.choice(options)
        del notes[i]
        args[key] = naive
  if rng.random() < noise.look_alike_key:
    keyed = [(j, k) for j, (_, args, _) in enumerate(calls) for k in args if _look_alike(k) not in args]
    if keyed:
      j, key = rng.choice(keyed)
      tool, args, notes = calls[j]
      calls[j] = (tool, {(_look_alike(k) if k == key else k): v for k, v in args.items()}, notes)
  if rng.random() < noise.number_as_string:
    numeric = [(j, k) for j, (_, args, _) in enumerate(calls) for k, v in args.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if numeric:
      j, key = rng.choice(numeric)
      calls[j][1][key] = _surface(calls[j][1][key])
  filler = rng.sample(FILLER, rng.randint(1, noise.max_filler)) if rng.random() < noise.filler else []
  thinking = _thinking(example["plan"], [n for _, _, notes in calls for n in notes], filler)
  return render_completion(thinking, [(tool, args) for tool, args, _ in calls], style)


def sft_pairs(examples: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
  """``(prompt, demonstration)`` pairs for supervised fine-tuning."""
  return [(ex["prompt"], ex["demonstration"]) for ex in examples]
