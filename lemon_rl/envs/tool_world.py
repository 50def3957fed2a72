"""The CAST tool world: 26 typed tools and a seeded sampler of requests for each.

Every tool is a BFCL function doc (``{"name", "description", "parameters": {"type": "dict", "properties",
"required"}}``) with typed parameters (string, integer, float, boolean, array, dict), enums, numeric ranges
(``minimum``/``maximum``) and optional keys (with a ``default``). The full docs are what the verifier
(:mod:`lemon_rl.rewards.tool_calls`) checks against; the model sees only the one-line signature of
:func:`signature`, because the policy is a tiny byte-level model with a short context.

Each tool has a *request sampler* ``sample(rng) -> Call``: a short imperative clause ("convert 20 euros to
yen"), the arguments a correct call passes, the BFCL possible answer for that call (``{param: [acceptable
values]}``, ``""`` = the optional parameter may be omitted) and the conversion notes that a careful model
writes in its thinking ("5%=0.05", "2.5 h=150 min"). About half of the requests need such a conversion —
the ones a model gets wrong by copying the surface form (the CAST paper's "5%" passed as ``5``).

Tools are grouped into *clusters* of look-alikes (``convert_length`` / ``convert_mass``, ``set_timer`` /
``set_alarm``...) that :mod:`lemon_rl.envs.tool_use` offers as distractors, and a few tools can *substitute*
for each other (a forecast can answer "the weather in Paris"), which irrelevance examples must not offer.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, Callable

# ---------------------------------------------------------------------------------------------------------
# Function docs.


def _p(type_: str, description: str, **extra: Any) -> dict[str, Any]:
  """One BFCL parameter doc."""
  return {"type": type_, "description": description, **extra}


def _doc(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
  return {"name": name, "description": description,
          "parameters": {"type": "dict", "properties": properties, "required": required}}


CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CNY", "INR", "CAD", "CHF"]
LENGTH_UNITS = ["mm", "cm", "m", "km", "in", "ft", "yd", "mi"]
MASS_UNITS = ["g", "kg", "oz", "lb", "t"]
TEMP_UNITS = ["celsius", "fahrenheit", "kelvin"]
WEEKDAYS = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
LANGUAGES = ["fr", "de", "es", "it", "ja", "zh", "pt"]
STORES = ["amazon", "ebay", "walmart", "target"]

FUNCTION_DOCS: tuple[dict[str, Any], ...] = (
    _doc("get_weather", "Current weather in a city.", {
        "city": _p("string", "City name, e.g. Paris."),
        "unit": _p("string", "Temperature unit.", enum=["celsius", "fahrenheit"], default="celsius"),
    }, ["city"]),
    _doc("get_forecast", "Daily weather forecast for the next days.", {
        "city": _p("string", "City name."),
        "days": _p("integer", "Number of days to forecast.", minimum=1, maximum=14),
    }, ["city", "days"]),
    _doc("convert_currency", "Convert an amount of money between currencies.", {
        "amount": _p("float", "Amount in the source currency.", minimum=0),
        "src": _p("string", "ISO code of the source currency.", enum=CURRENCIES),
        "dst": _p("string", "ISO code of the target currency.", enum=CURRENCIES),
    }, ["amount", "src", "dst"]),
    _doc("compound_interest", "Future value of a deposit with compound interest.", {
        "principal": _p("float", "Initial deposit.", minimum=0),
        "rate": _p("float", "Annual interest rate as a fraction (5% is 0.05).", minimum=0, maximum=1),
        "years": _p("integer", "Number of years.", minimum=1, maximum=100),
        "n": _p("integer", "Compounding periods per year.", minimum=1, maximum=365, default=1),
    }, ["principal", "rate", "years"]),
    _doc("loan_payment", "Monthly payment of an amortised loan.", {
        "principal": _p("float", "Amount borrowed.", minimum=0),
        "rate": _p("float", "Annual interest rate as a fraction (5% is 0.05).", minimum=0, maximum=1),
        "months": _p("integer", "Loan term in months.", minimum=1, maximum=480),
    }, ["principal", "rate", "months"]),
    _doc("split_bill", "Split a bill evenly, optionally adding a tip.", {
        "total": _p("float", "Bill total.", minimum=0),
        "people": _p("integer", "Number of people paying.", minimum=1, maximum=50),
        "tip": _p("float", "Tip as a fraction of the total (15% is 0.15).", minimum=0, maximum=1, default=0.0),
    }, ["total", "people"]),
    _doc("get_stock_price", "Latest price of a stock.", {
        "symbol": _p("string", "Ticker symbol, e.g. AAPL."),
    }, ["symbol"]),
    _doc("convert_length", "Convert a length between units.", {
        "value": _p("float", "The length."),
        "src": _p("string", "Source unit.", enum=LENGTH_UNITS),
        "dst": _p("string", "Target unit.", enum=LENGTH_UNITS),
    }, ["value", "src", "dst"]),
    _doc("convert_mass", "Convert a mass between units.", {
        "value": _p("float", "The mass."),
        "src": _p("string", "Source unit.", enum=MASS_UNITS),
        "dst": _p("string", "Target unit.", enum=MASS_UNITS),
    }, ["value", "src", "dst"]),
    _doc("convert_temp", "Convert a temperature between scales.", {
        "value": _p("float", "The temperature."),
        "src": _p("string", "Source scale.", enum=TEMP_UNITS),
        "dst": _p("string", "Target scale.", enum=TEMP_UNITS),
    }, ["value", "src", "dst"]),
    _doc("set_timer", "Start a countdown timer.", {
        "minutes": _p("integer", "Duration in minutes.", minimum=1, maximum=1440),
        "label": _p("string", "Name of the timer."),
    }, ["minutes"]),
    _doc("set_alarm", "Set an alarm clock.", {
        "time": _p("string", "Time of day, 24-hour HH:MM."),
        "repeat": _p("array", "Days on which the alarm repeats.", items={"type": "string", "enum": WEEKDAYS}),
    }, ["time"]),
    _doc("create_event", "Add an event to the calendar.", {
        "title": _p("string", "Event title."),
        "date": _p("string", "Date, YYYY-MM-DD."),
        "time": _p("string", "Start time, 24-hour HH:MM."),
        "duration": _p("integer", "Length in minutes.", minimum=5, maximum=720, default=60),
    }, ["title", "date"]),
    _doc("search_flights", "Search flights between two cities.", {
        "origin": _p("string", "Departure city."),
        "destination": _p("string", "Arrival city."),
        "date": _p("string", "Departure date, YYYY-MM-DD."),
        "passengers": _p("integer", "Number of passengers.", minimum=1, maximum=9, default=1),
        "cabin": _p("string", "Cabin class.", enum=["economy", "business", "first"], default="economy"),
    }, ["origin", "destination", "date"]),
    _doc("book_hotel", "Book a hotel room.", {
        "city": _p("string", "City of the hotel."),
        "nights": _p("integer", "Number of nights.", minimum=1, maximum=30),
        "guests": _p("integer", "Number of guests.", minimum=1, maximum=8, default=1),
        "breakfast": _p("boolean", "Whether breakfast is included.", default=False),
    }, ["city", "nights"]),
    _doc("get_route", "Directions between two places.", {
        "origin": _p("string", "Start."),
        "destination": _p("string", "End."),
        "mode": _p("string", "Travel mode.", enum=["driving", "walking", "cycling", "transit"], default="driving"),
    }, ["origin", "destination"]),
    _doc("calc_density", "Density of an object in kg/m^3.", {
        "mass": _p("float", "Mass in kilograms.", minimum=0),
        "volume": _p("float", "Volume in cubic metres.", minimum=0),
    }, ["mass", "volume"]),
    _doc("calc_bmi", "Body mass index.", {
        "weight": _p("float", "Weight in kilograms.", minimum=1, maximum=400),
        "height": _p("float", "Height in metres.", minimum=0.3, maximum=2.6),
    }, ["weight", "height"]),
    _doc("average", "Arithmetic mean of a list of numbers.", {
        "numbers": _p("array", "The numbers.", items={"type": "float"}),
    }, ["numbers"]),
    _doc("send_email", "Send an email.", {
        "to": _p("string", "Recipient address."),
        "subject": _p("string", "Subject line."),
        "body": _p("string", "Message text."),
    }, ["to", "subject"]),
    _doc("translate", "Translate text into another language.", {
        "text": _p("string", "Text to translate."),
        "target": _p("string", "ISO 639-1 code of the target language.", enum=LANGUAGES),
    }, ["text", "target"]),
    _doc("add_contact", "Save a contact.", {
        "name": _p("string", "Contact name."),
        "details": _p("dict", "Contact details.", properties={
            "phone": _p("string", "Phone number."),
            "email": _p("string", "Email address."),
        }, required=["phone"]),
    }, ["name", "details"]),
    _doc("get_rating", "Average customer rating of a product in a store.", {
        "product": _p("string", "Product name."),
        "store": _p("string", "Store.", enum=STORES),
    }, ["product", "store"]),
    _doc("order_pizza", "Order pizzas for delivery.", {
        "size": _p("string", "Pizza size.", enum=["small", "medium", "large"]),
        "quantity": _p("integer", "Number of pizzas.", minimum=1, maximum=20, default=1),
        "toppings": _p("array", "Toppings.", items={"type": "string"}),
    }, ["size"]),
    _doc("play_music", "Play music.", {
        "query": _p("string", "Song, artist or genre."),
        "shuffle": _p("boolean", "Shuffle playback.", default=False),
        "volume": _p("integer", "Volume in percent.", minimum=0, maximum=100),
    }, ["query"]),
    _doc("set_thermostat", "Set the home thermostat.", {
        "temperature": _p("float", "Target temperature in celsius.", minimum=10, maximum=30),
        "mode": _p("string", "Operating mode.", enum=["heat", "cool", "auto"], default="auto"),
    }, ["temperature"]),
)

DOCS_BY_NAME: dict[str, dict[str, Any]] = {d["name"]: d for d in FUNCTION_DOCS}

# Look-alike groups (distractors for "multiple", near misses for "irrelevance").
CLUSTERS: dict[str, tuple[str, ...]] = {
    "weather": ("get_weather", "get_forecast"),
    "money": ("convert_currency", "compound_interest", "loan_payment", "split_bill", "get_stock_price"),
    "units": ("convert_length", "convert_mass", "convert_temp"),
    "time": ("set_timer", "set_alarm", "create_event"),
    "travel": ("search_flights", "book_hotel", "get_route"),
    "science": ("calc_density", "calc_bmi", "average"),
    "comms": ("send_email", "translate", "add_contact"),
    "home": ("get_rating", "order_pizza", "play_music", "set_thermostat"),
}
CLUSTER_OF: dict[str, str] = {t: c for c, tools in CLUSTERS.items() for t in tools}

# Tools that can serve another tool's requests; an irrelevance example never offers them.
SUBSTITUTES: dict[str, tuple[str, ...]] = {"get_weather": ("get_forecast",), "get_forecast": ("get_weather",)}

# What each tool does, in a few words (used in the thinking of irrelevance demonstrations).
PURPOSE: dict[str, str] = {
    "get_weather": "the weather", "get_forecast": "a forecast", "convert_currency": "a currency conversion",
    "compound_interest": "compound interest", "loan_payment": "a loan payment", "split_bill": "splitting a bill",
    "get_stock_price": "a stock price", "convert_length": "a length conversion",
    "convert_mass": "a mass conversion", "convert_temp": "a temperature conversion", "set_timer": "a timer",
    "set_alarm": "an alarm", "create_event": "a calendar event", "search_flights": "a flight search",
    "book_hotel": "a hotel booking", "get_route": "directions", "calc_density": "a density",
    "calc_bmi": "a BMI", "average": "an average", "send_email": "an email", "translate": "a translation",
    "add_contact": "saving a contact", "get_rating": "a product rating", "order_pizza": "a pizza order",
    "play_music": "music", "set_thermostat": "the thermostat",
}

# ---------------------------------------------------------------------------------------------------------
# Calls.


@dataclasses.dataclass(frozen=True)
class Call:
  """One requested tool call.

  Attributes:
    tool: the function name.
    clause: the request in words, an imperative clause without final punctuation.
    args: the arguments of the demonstrated call, in order (a correct call passes exactly these).
    gold: BFCL possible answer ``{param: [acceptable values]}``; optional parameters the request leaves
      open are listed as ``["", default]`` (may be omitted or given their default).
    notes: conversion steps for the thinking, e.g. ``("5%=0.05",)``; empty when the clause is literal.
  """

  tool: str
  clause: str
  args: dict[str, Any]
  gold: dict[str, list[Any]]
  notes: tuple[str, ...] = ()

  @property
  def gold_call(self) -> dict[str, dict[str, list[Any]]]:
    """The call in BFCL's possible-answer format ``{tool: {param: [values]}}``."""
    return {self.tool: self.gold}


def make_call(tool: str, clause: str, args: dict[str, Any], notes: tuple[str, ...] | list[str] = (),
              extra_ok: dict[str, list[Any]] | None = None) -> Call:
  """Builds a :class:`Call`, deriving the possible answer from the tool's doc.

  Args:
    tool: function name (must be in :data:`DOCS_BY_NAME`).
    clause: the request in words.
    args: the demonstrated arguments; every required parameter must be present.
    notes: conversion notes for the thinking.
    extra_ok: further acceptable values per parameter (e.g. ``{"date": [...]}``).

  Returns:
    The call; gold lists ``[value, *extra_ok]`` for every given parameter and ``["", default]`` (or
    ``[""]``) for every optional parameter not given.
  """
  doc = DOCS_BY_NAME[tool]
  props = doc["parameters"]["properties"]
  unknown = set(args) - set(props)
  if unknown:
    raise ValueError(f"{tool}: unknown arguments {sorted(unknown)}")
  missing = set(doc["parameters"]["required"]) - set(args)
  if missing:
    raise ValueError(f"{tool}: missing required arguments {sorted(missing)}")
  gold: dict[str, list[Any]] = {}
  for name, spec in props.items():
    if name in args:
      gold[name] = [args[name], *(extra_ok or {}).get(name, [])]
    else:
      gold[name] = ["", spec["default"]] if "default" in spec else [""]
  return Call(tool, clause, dict(args), gold, tuple(notes))


def canonical_value(value: Any) -> Any:
  """A JSON-able normal form of an argument value, equal for every surface form of the same value.

  Numbers: integral values as ``int`` (``250.0 -> 250``), others as ``float`` (``0.05`` stays ``0.05``);
  booleans stay booleans (never numbers); strings are case-folded with runs of whitespace collapsed
  (``" New  York" -> "new york"``); dicts recurse; lists are treated as multisets (every list parameter of
  the world is: repeat days, toppings, numbers to average), so their elements are sorted by their JSON form.
  """
  if isinstance(value, bool) or value is None:
    return value
  if isinstance(value, (int, float)):
    x = float(value)
    return int(x) if x.is_integer() else x
  if isinstance(value, str):
    return " ".join(value.split()).casefold()
  if isinstance(value, dict):
    return {str(k): canonical_value(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    items = [canonical_value(v) for v in value]
    return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
  raise TypeError(f"cannot normalise a {type(value).__name__}: {value!r}")


def canonical_call(tool: str, gold: dict[str, list[Any]]) -> str:
  """The content key of one requested call, from its BFCL possible answer ``{param: [values]}``.

  The demonstrated value of a parameter is the first acceptable one (:func:`make_call`); a parameter whose
  first value is ``""`` (may be omitted) or that equals the tool's documented default is dropped, so "the
  weather in Paris" and "the weather in Paris in Celsius" are one request. Values go through
  :func:`canonical_value`; the key is ``tool`` + the JSON of the arguments with sorted keys, e.g.
  ``'get_weather{"city":"paris"}'``.
  """
  props = DOCS_BY_NAME[tool]["parameters"]["properties"] if tool in DOCS_BY_NAME else {}
  args = {}
  for name, values in gold.items():
    if not values or (isinstance(values[0], str) and values[0] == ""):
      continue
    value = canonical_value(values[0])
    spec = props.get(name, {})
    if "default" in spec and value == canonical_value(spec["default"]) and (
        isinstance(value, bool) == isinstance(spec["default"], bool)):
      continue
    args[name] = value
  return tool + json.dumps(args, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------------------
# Words for numbers, times and dates.

NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine",
                10: "ten", 12: "twelve", 20: "twenty"}
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
CITIES = ["Paris", "Tokyo", "Berlin", "Madrid", "Rome", "Lima", "Cairo", "Oslo", "Delhi", "Seoul", "Boston",
          "Denver", "Sydney", "Toronto", "Beijing", "London", "Dubai", "Miami", "Lagos", "Vienna"]
NAMES = ["Ana", "Bob", "Chen", "Dara", "Eli", "Fay", "Gus", "Ines", "Jon", "Kim", "Lea", "Max"]


def fmt_num(x: float) -> str:
  """``250.0 -> "250"``, ``19.5 -> "19.5"``: the surface form of a number in a query."""
  return str(int(x)) if float(x).is_integer() else repr(float(x))


def _clean(x: float) -> float:
  """Rounds away binary noise (``0.1 * 3``) so that JSON and the gold agree exactly."""
  return float(round(x, 9))


def _money(r: random.Random, dollars: bool = False) -> tuple[float, str, list[str]]:
  """An amount, its surface form (``$250``, ``$5k``, ``five thousand dollars`` if ``dollars``) and notes."""
  kind = r.random()
  sign = "$" if dollars else ""
  if kind < 0.55:
    x = float(r.choice([20, 50, 75, 120, 250, 300, 480, 999, 1500, 2000, 5000, 12000]))
    return x, f"{sign}{fmt_num(x)}", []
  if kind < 0.8:
    k = r.choice([2, 5, 10, 15, 20, 50])
    return float(k * 1000), f"{sign}{k}k", [f"{k}k={k * 1000}"]
  k = r.choice([2, 3, 5, 10])
  words = f"{NUMBER_WORDS[k]} thousand"
  return float(k * 1000), words + (" dollars" if dollars else ""), [f"{words}={k * 1000}"]


def _percent(r: random.Random) -> tuple[float, str, list[str]]:
  """A rate given in percent; the call needs the fraction (the CAST paper's ``5% -> 0.05``)."""
  p = r.choice([1, 2, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 10, 12, 15])
  frac = _clean(p / 100)
  return frac, f"{fmt_num(p)}%", [f"{fmt_num(p)}%={frac!r}"]


def _date(r: random.Random) -> tuple[str, str, list[str]]:
  """A date, its surface form and notes; the call needs ``YYYY-MM-DD``."""
  year, month, day = r.choice([2026, 2027]), r.randint(1, 12), r.randint(1, 28)
  iso = f"{year}-{month:02d}-{day:02d}"
  kind = r.random()
  if kind < 0.4:
    return iso, iso, []
  if kind < 0.75:
    text = f"{MONTHS[month - 1][:3]} {day}, {year}"
  elif kind < 0.9:
    text = f"{day} {MONTHS[month - 1]} {year}"
  else:
    iso = f"{year}-12-25"
    text = f"Christmas {year}"
  return iso, text, [f"{text}={iso}"]


def _clock(r: random.Random) -> tuple[str, str, list[str]]:
  """A time of day and its surface form; the call needs 24-hour ``HH:MM``."""
  kind = r.random()
  if kind < 0.35:
    h, m = r.randint(5, 22), r.choice([0, 15, 30, 45])
    return f"{h:02d}:{m:02d}", f"{h:02d}:{m:02d}", []
  if kind < 0.7:
    h, m = r.randint(1, 11), r.choice([0, 15, 30, 45])
    ampm = r.choice(["am", "pm"])
    hh = h + 12 if ampm == "pm" else h
    text = f"{h}:{m:02d} {ampm}" if m else f"{h} {ampm}"
    return f"{hh:02d}:{m:02d}", text, [f"{text}={hh:02d}:{m:02d}"]
  if kind < 0.8:
    text, hhmm = r.choice([("noon", "12:00"), ("midnight", "00:00")])
    return hhmm, text, [f"{text}={hhmm}"]
  h = r.randint(1, 10)
  text = f"half past {NUMBER_WORDS.get(h, str(h))} pm"
  hhmm = f"{h + 12:02d}:30"
  return hhmm, text, [f"{text}={hhmm}"]


def _count(r: random.Random, lo: int, hi: int, noun: str) -> tuple[int, str, list[str]]:
  """A count in ``[lo, hi]`` in digits, words or idioms ("a dozen", "a couple of") followed by ``noun``."""
  idioms = [(n, t) for n, t in [(12, "a dozen"), (6, "half a dozen"), (2, "a couple of"), (24, "two dozen")]
            if lo <= n <= hi]
  worded = [k for k in range(lo, hi + 1) if k in NUMBER_WORDS]
  kind = r.random()
  if kind < 0.5 or not idioms:
    n = r.randint(lo, min(hi, 9))
    return n, f"{n} {noun}", []
  if kind < 0.7 and worded:
    n = r.choice(worded)
    return n, f"{NUMBER_WORDS[n]} {noun}", []
  n, idiom = r.choice(idioms)
  return n, f"{idiom} {noun}", [f"{idiom}={n}"]


# ---------------------------------------------------------------------------------------------------------
# Request samplers, one per tool.


def _weather(r: random.Random) -> Call:
  city = r.choice(CITIES)
  kind = r.random()
  if kind < 0.5:
    return make_call("get_weather", r.choice([f"get the weather in {city}", f"check the weather in {city}"]),
                     {"city": city})
  unit = r.choice(["celsius", "fahrenheit"])
  if kind < 0.75:
    return make_call("get_weather", f"get the weather in {city} in {unit.capitalize()}",
                     {"city": city, "unit": unit})
  sym = "°F" if unit == "fahrenheit" else "°C"
  return make_call("get_weather", f"weather in {city} in {sym}", {"city": city, "unit": unit},
                   [f"{sym}={unit}"])


def _forecast(r: random.Random) -> Call:
  city = r.choice(CITIES)
  kind = r.random()
  if kind < 0.5:
    d = r.randint(1, 10)
    return make_call("get_forecast", f"get the {d}-day forecast for {city}", {"city": city, "days": d})
  text, d = r.choice([("the next week", 7), ("a fortnight", 14), ("the next couple of days", 2),
                      ("the weekend", 2), ("the next ten days", 10)])
  return make_call("get_forecast", f"forecast {city} for {text}", {"city": city, "days": d},
                   [f"{text}={d} days"])


_CURRENCY_WORDS = {"USD": "dollars", "EUR": "euros", "GBP": "pounds", "JPY": "yen", "CNY": "yuan",
                   "INR": "rupees", "CAD": "Canadian dollars", "CHF": "Swiss francs"}


def _currency(r: random.Random) -> Call:
  amount, amount_text, notes = _money(r)
  src, dst = r.sample(CURRENCIES, 2)
  if r.random() < 0.4:
    clause = f"convert {amount_text} {src} to {dst}"
  else:
    clause = f"convert {amount_text} {_CURRENCY_WORDS[src]} to {_CURRENCY_WORDS[dst]}"
    notes = notes + [f"{_CURRENCY_WORDS[src]}={src}", f"{_CURRENCY_WORDS[dst]}={dst}"]
  return make_call("convert_currency", clause, {"amount": amount, "src": src, "dst": dst}, notes)


def _years(r: random.Random) -> tuple[int, str, list[str]]:
  kind = r.random()
  if kind < 0.6:
    y = r.choice([2, 3, 5, 7, 10, 15, 20, 30])
    return y, f"{y} years", []
  text, y = r.choice([("a decade", 10), ("two decades", 20), ("half a decade", 5)])
  return y, text, [f"{text}={y} years"]


def _compound(r: random.Random) -> Call:
  principal, p_text, notes = _money(r, dollars=True)
  rate, r_text, r_notes = _percent(r)
  years, y_text, y_notes = _years(r)
  args = {"principal": principal, "rate": rate, "years": years}
  clause = f"future value of {p_text} at {r_text} for {y_text}"
  notes = notes + r_notes + y_notes
  if r.random() < 0.4:
    word, n = r.choice([("monthly", 12), ("quarterly", 4), ("daily", 365)])
    clause += f", compounded {word}"
    args["n"] = n
    notes.append(f"{word}: n={n}")
  return make_call("compound_interest", clause, args, notes)


def _loan(r: random.Random) -> Call:
  principal, p_text, notes = _money(r, dollars=True)
  rate, r_text, r_notes = _percent(r)
  notes = notes + r_notes
  if r.random() < 0.35:
    months = r.choice([6, 12, 18, 24, 36, 48])
    term = f"{months} months"
  else:
    years = r.choice([1, 2, 3, 5, 10, 15, 20, 30])
    months = 12 * years
    term = f"{years} year" + ("s" if years > 1 else "")
    notes.append(f"{term}={months} months")
  return make_call("loan_payment", f"monthly payment on a {p_text} loan at {r_text} over {term}",
                   {"principal": principal, "rate": rate, "months": months}, notes)


def _split(r: random.Random) -> Call:
  total = float(r.choice([36, 48, 60, 84, 90, 120, 150, 240]))
  people, p_text, notes = _count(r, 2, 12, "friends")
  args: dict[str, Any] = {"total": total, "people": people}
  clause = f"split a ${fmt_num(total)} bill among {p_text}"
  if r.random() < 0.5:
    tip, t_text, t_notes = _percent(r)
    clause += f" with a {t_text} tip"
    args["tip"] = tip
    notes = notes + t_notes
  return make_call("split_bill", clause, args, notes)


_COMPANIES = {"Apple": "AAPL", "Microsoft": "MSFT", "Tesla": "TSLA", "Amazon": "AMZN", "Nvidia": "NVDA",
              "Netflix": "NFLX", "Intel": "INTC", "Nike": "NKE"}


def _stock(r: random.Random) -> Call:
  company, symbol = r.choice(sorted(_COMPANIES.items()))
  if r.random() < 0.4:
    return make_call("get_stock_price", f"get the stock price of {symbol}", {"symbol": symbol})
  return make_call("get_stock_price", f"get the stock price of {company}", {"symbol": symbol},
                   [f"{company}={symbol}"])


_LENGTH_WORDS = {"mm": "millimetres", "cm": "centimetres", "m": "metres", "km": "kilometres", "in": "inches",
                 "ft": "feet", "yd": "yards", "mi": "miles"}
_MASS_WORDS = {"g": "grams", "kg": "kilograms", "oz": "ounces", "lb": "pounds", "t": "tonnes"}
_TEMP_WORDS = {"celsius": "°C", "fahrenheit": "°F", "kelvin": "K"}


def _unit_conversion(r: random.Random, tool: str, units: list[str], words: dict[str, str]) -> Call:
  value = float(r.choice([1, 2, 3, 5, 8, 10, 12, 26.2, 42, 100, 250, 1000]))
  src, dst = r.sample(units, 2)
  if r.random() < 0.4:
    clause, notes = f"convert {fmt_num(value)} {src} to {dst}", []
  else:
    clause = f"convert {fmt_num(value)} {words[src]} to {words[dst]}"
    notes = [f"{words[src]}={src}", f"{words[dst]}={dst}"]
  return make_call(tool, clause, {"value": value, "src": src, "dst": dst}, notes)


def _length(r: random.Random) -> Call:
  return _unit_conversion(r, "convert_length", LENGTH_UNITS, _LENGTH_WORDS)


def _mass(r: random.Random) -> Call:
  return _unit_conversion(r, "convert_mass", MASS_UNITS, _MASS_WORDS)


def _temp(r: random.Random) -> Call:
  value = float(r.choice([-40, -5, 0, 12, 20, 37, 68, 98.6, 100, 300]))
  src, dst = r.sample(TEMP_UNITS, 2)
  if r.random() < 0.5:
    return make_call("convert_temp", f"convert {fmt_num(value)} {src} to {dst}",
                     {"value": value, "src": src, "dst": dst})
  clause = f"convert {fmt_num(value)}{_TEMP_WORDS[src]} to {_TEMP_WORDS[dst]}"
  notes = [f"{_TEMP_WORDS[src]}={src}", f"{_TEMP_WORDS[dst]}={dst}"]
  return make_call("convert_temp", clause, {"value": value, "src": src, "dst": dst}, notes)


def _timer(r: random.Random) -> Call:
  kind = r.random()
  if kind < 0.4:
    minutes = r.choice([1, 3, 5, 10, 12, 20, 25, 45, 90])
    text, notes = f"{minutes} minutes", []
  else:
    text, minutes = r.choice([
        ("half an hour", 30), ("a quarter of an hour", 15), ("an hour and a half", 90),
        ("two and a half hours", 150), ("3 hours", 180), ("2 hours", 120), ("an hour", 60),
        ("1 hour 15 minutes", 75), ("a day", 1440)])
    notes = [f"{text}={minutes} min"]
  args: dict[str, Any] = {"minutes": minutes}
  clause = f"set a timer for {text}"
  if r.random() < 0.3:
    label = r.choice(["pasta", "tea", "eggs", "laundry", "bread"])
    clause = f"set a {label} timer for {text}"
    args["label"] = label
  return make_call("set_timer", clause, args, notes)


def _alarm(r: random.Random) -> Call:
  hhmm, text, notes = _clock(r)
  args: dict[str, Any] = {"time": hhmm}
  clause = f"set an alarm for {text}"
  kind = r.random()
  if kind < 0.2:
    clause += " on weekdays"
    args["repeat"] = WEEKDAYS[:5]
    notes = notes + ["weekdays=mon-fri"]
  elif kind < 0.3:
    clause += " on weekends"
    args["repeat"] = WEEKDAYS[5:]
    notes = notes + ["weekends=sat,sun"]
  elif kind < 0.45:
    i = r.randrange(7)
    day = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"][i]
    clause += f" every {day}"
    args["repeat"] = [WEEKDAYS[i]]
  return make_call("set_alarm", clause, args, notes)


def _event(r: random.Random) -> Call:
  title = r.choice(["Dentist", "Yoga", "Team sync", "Lunch", "Gym", "Review", "Piano"])
  iso, d_text, notes = _date(r)
  args: dict[str, Any] = {"title": title, "date": iso}
  clause = f"add '{title}' on {d_text}"
  if r.random() < 0.6:
    hhmm, t_text, t_notes = _clock(r)
    clause += f" at {t_text}"
    args["time"] = hhmm
    notes = notes + t_notes
  if r.random() < 0.35:
    text, minutes = r.choice([("for an hour", 60), ("for 90 minutes", 90), ("for half an hour", 30),
                              ("for two hours", 120)])
    clause += f" {text}"
    args["duration"] = minutes
    if "minutes" not in text:
      notes = notes + [f"{text[4:]}={minutes} min"]
  return make_call("create_event", clause, args, notes)


def _flights(r: random.Random) -> Call:
  a, b = r.sample(CITIES, 2)
  iso, d_text, notes = _date(r)
  args: dict[str, Any] = {"origin": a, "destination": b, "date": iso}
  clause = f"find flights from {a} to {b} on {d_text}"
  kind = r.random()
  if kind < 0.3:
    n, text = r.choice([(2, "for me and my wife"), (4, "for a family of four"), (3, "for 3 people"),
                        (2, "for two")])
    clause += f" {text}"
    args["passengers"] = n
    if not text[4].isdigit():
      notes = notes + [f"{text[4:]}={n} passengers"]
  if r.random() < 0.3:
    cabin = r.choice(["business", "first"])
    clause += f" in {cabin} class"
    args["cabin"] = cabin
  return make_call("search_flights", clause, args, notes)


def _hotel(r: random.Random) -> Call:
  city = r.choice(CITIES)
  kind = r.random()
  if kind < 0.5:
    nights = r.randint(1, 9)
    text, notes = f"{nights} night" + ("s" if nights > 1 else ""), []
  else:
    text, nights = r.choice([("a week", 7), ("a fortnight", 14), ("a weekend", 2), ("two weeks", 14)])
    notes = [f"{text}={nights} nights"]
  args: dict[str, Any] = {"city": city, "nights": nights}
  clause = f"book a hotel in {city} for {text}"
  if r.random() < 0.35:
    g, g_text = r.choice([(2, "for a couple"), (2, "for two"), (3, "for 3 guests"), (4, "for four")])
    clause += f" {g_text}"
    args["guests"] = g
    if not g_text[4].isdigit():
      notes = notes + [f"{g_text[4:]}={g} guests"]
  if r.random() < 0.3:
    b = r.random() < 0.6
    clause += " with breakfast" if b else " without breakfast"
    args["breakfast"] = b
    notes = notes + [f"breakfast={'true' if b else 'false'}"]
  return make_call("book_hotel", clause, args, notes)


def _route(r: random.Random) -> Call:
  a, b = r.sample(["the station", "the airport", "home", "work", "the museum", "the park", "the zoo"], 2)
  clause = f"directions from {a} to {b}"
  if r.random() < 0.4:
    return make_call("get_route", clause, {"origin": a, "destination": b})
  text, mode = r.choice([("by bike", "cycling"), ("on foot", "walking"), ("by bus", "transit"),
                         ("by train", "transit"), ("by car", "driving"), ("walking", "walking")])
  notes = [] if text == mode else [f"{text}={mode}"]
  return make_call("get_route", f"{clause} {text}", {"origin": a, "destination": b, "mode": mode}, notes)


def _density(r: random.Random) -> Call:
  kind = r.random()
  if kind < 0.5:
    mass, volume = float(r.choice([2, 5, 12, 50, 80, 120])), float(r.choice([0.5, 2, 4, 10]))
    return make_call("calc_density", f"density of {fmt_num(mass)} kg in {fmt_num(volume)} m3",
                     {"mass": mass, "volume": volume})
  grams, litres = r.choice([200, 500, 750, 1500]), r.choice([1, 2, 5])
  mass, volume = _clean(grams / 1000), _clean(litres / 1000)
  return make_call("calc_density", f"density of {grams} g in {litres} L", {"mass": mass, "volume": volume},
                   [f"{grams} g={mass!r} kg", f"{litres} L={volume!r} m3"])


def _bmi(r: random.Random) -> Call:
  weight = float(r.choice([52, 60, 68, 70, 75, 82, 95]))
  cm = r.choice([155, 160, 165, 170, 175, 180, 185, 190])
  if r.random() < 0.4:
    height = _clean(cm / 100)
    return make_call("calc_bmi", f"BMI for {fmt_num(weight)} kg and {fmt_num(height)} m",
                     {"weight": weight, "height": height})
  height = _clean(cm / 100)
  return make_call("calc_bmi", f"BMI for {fmt_num(weight)} kg, {cm} cm tall",
                   {"weight": weight, "height": height}, [f"{cm} cm={height!r} m"])


def _average(r: random.Random) -> Call:
  nums = [float(r.choice([1, 2, 3, 4, 5, 7, 8, 10, 12, 15, 20, 42])) for _ in range(r.randint(2, 4))]
  text = ", ".join(fmt_num(x) for x in nums[:-1]) + f" and {fmt_num(nums[-1])}"
  return make_call("average", f"average of {text}", {"numbers": nums})


def _email(r: random.Random) -> Call:
  name = r.choice(NAMES)
  addr = f"{name.lower()}@mail.com"
  subject = r.choice(["lunch", "report", "trip", "invoice", "party"])
  args: dict[str, Any] = {"to": addr, "subject": subject}
  clause = f"email {addr} about '{subject}'"
  if r.random() < 0.3:
    body = r.choice(["see you soon", "thanks", "running late"])
    clause += f" saying '{body}'"
    args["body"] = body
  return make_call("send_email", clause, args)


_LANGUAGE_NAMES = {"fr": "French", "de": "German", "es": "Spanish", "it": "Italian", "ja": "Japanese",
                   "zh": "Chinese", "pt": "Portuguese"}


def _translate(r: random.Random) -> Call:
  text = r.choice(["good morning", "thank you", "where is the bank", "I am hungry", "see you"])
  code = r.choice(LANGUAGES)
  return make_call("translate", f"translate '{text}' into {_LANGUAGE_NAMES[code]}",
                   {"text": text, "target": code}, [f"{_LANGUAGE_NAMES[code]}={code}"])


def _contact(r: random.Random) -> Call:
  name = r.choice(NAMES)
  phone = f"555-{r.randint(0, 9999):04d}"
  if r.random() < 0.6:
    return make_call("add_contact", f"save {name}'s number {phone}",
                     {"name": name, "details": {"phone": phone}})
  email = f"{name.lower()}@mail.com"
  return make_call("add_contact", f"save {name}: {phone}, {email}",
                   {"name": name, "details": {"phone": phone, "email": email}})


def _rating(r: random.Random) -> Call:
  product = r.choice(["Kindle", "AirPods", "Echo Dot", "iPad", "Switch", "Roomba"])
  store = r.choice(STORES)
  return make_call("get_rating", f"get the {store.capitalize()} rating of the {product}",
                   {"product": product, "store": store})


def _pizza(r: random.Random) -> Call:
  size = r.choice(["small", "medium", "large"])
  n, text, notes = _count(r, 1, 20, f"{size} pizzas")
  if n == 1:
    text = f"a {size} pizza"
  args: dict[str, Any] = {"size": size}
  if n != 1:
    args["quantity"] = n
  clause = f"order {text}"
  if r.random() < 0.4:
    tops = r.sample(["ham", "olives", "mushrooms", "onions", "basil"], r.randint(1, 2))
    clause += " with " + " and ".join(tops)
    args["toppings"] = tops
  return make_call("order_pizza", clause, args, notes)


def _music(r: random.Random) -> Call:
  query = r.choice(["jazz", "Abbey Road", "Adele", "lo-fi", "Beethoven", "Queen"])
  args: dict[str, Any] = {"query": query}
  clause, notes = f"play {query}", []
  if r.random() < 0.35:
    clause += " on shuffle"
    args["shuffle"] = True
    notes.append("shuffle=true")
  if r.random() < 0.4:
    text, vol = r.choice([("at half volume", 50), ("at full volume", 100), ("at volume 30", 30),
                          ("at volume 70", 70)])
    clause += f" {text}"
    args["volume"] = vol
    if not text[-1].isdigit():
      notes.append(f"{text[3:]}={vol}")
  return make_call("play_music", clause, args, notes)


def _thermostat(r: random.Random) -> Call:
  temp = float(r.choice([16, 18, 19, 20, 21, 22, 23, 24, 25.5]))
  kind = r.random()
  if kind < 0.5:
    return make_call("set_thermostat", f"set the thermostat to {fmt_num(temp)} degrees", {"temperature": temp})
  verb, mode = r.choice([("heat the house to", "heat"), ("cool the house to", "cool"),
                         ("warm it up to", "heat"), ("cool it down to", "cool")])
  return make_call("set_thermostat", f"{verb} {fmt_num(temp)} degrees", {"temperature": temp, "mode": mode},
                   [f"{verb.split()[0]}: mode={mode}"])


SAMPLERS: dict[str, Callable[[random.Random], Call]] = {
    "get_weather": _weather, "get_forecast": _forecast, "convert_currency": _currency,
    "compound_interest": _compound, "loan_payment": _loan, "split_bill": _split, "get_stock_price": _stock,
    "convert_length": _length, "convert_mass": _mass, "convert_temp": _temp, "set_timer": _timer,
    "set_alarm": _alarm, "create_event": _event, "search_flights": _flights, "book_hotel": _hotel,
    "get_route": _route, "calc_density": _density, "calc_bmi": _bmi, "average": _average,
    "send_email": _email, "translate": _translate, "add_contact": _contact, "get_rating": _rating,
    "order_pizza": _pizza, "play_music": _music, "set_thermostat": _thermostat,
}
TOOL_NAMES: tuple[str, ...] = tuple(d["name"] for d in FUNCTION_DOCS)

# Requests no tool of the world can serve (irrelevance examples with no look-alike offered).
OFF_WORLD_REQUESTS: tuple[tuple[str, str], ...] = (
    ("tell me a joke", "a joke"), ("who wrote Hamlet", "trivia"), ("summarise this article", "a summary"),
    ("recommend a good novel", "a recommendation"), ("what is the capital of Peru", "trivia"),
    ("write a haiku about rain", "a poem"), ("explain photosynthesis", "an explanation"),
)

# ---------------------------------------------------------------------------------------------------------
# One-line signatures for the prompt.

_TYPE_ABBREV = {"string": "str", "integer": "int", "float": "float", "boolean": "bool", "number": "float",
                "array": "list", "dict": "dict", "tuple": "list", "any": "any"}


def _type_sig(spec: dict[str, Any]) -> str:
  """Compact type: ``str``, ``int[1..14]``, ``celsius|fahrenheit``, ``[mon|tue..]``, ``{phone:str,email?:str}``."""
  if not isinstance(spec, dict):
    return "any"
  if "enum" in spec:
    return "|".join(str(v) for v in spec["enum"])
  t = spec.get("type", "any")
  if t == "array" or t == "tuple":
    items = spec.get("items")
    return f"[{_type_sig(items)}]" if isinstance(items, dict) else "list"
  if t == "dict" and isinstance(spec.get("properties"), dict):
    req = set(spec.get("required", []))
    inner = ",".join(f"{k}{'' if k in req else '?'}:{_type_sig(v)}" for k, v in spec["properties"].items())
    return "{" + inner + "}"
  out = _TYPE_ABBREV.get(t, str(t))
  lo, hi = spec.get("minimum"), spec.get("maximum")
  if lo is not None and hi is not None:
    out += f"[{fmt_num(lo)}..{fmt_num(hi)}]"
  elif lo is not None:
    out += f">={fmt_num(lo)}"
  elif hi is not None:
    out += f"<={fmt_num(hi)}"
  return out


def signature(doc: dict[str, Any]) -> str:
  """A BFCL function doc as one line, e.g. ``get_forecast(city:str,days:int[1..14])``.

  Optional parameters carry a ``?`` (``unit?:celsius|fahrenheit``); enums are ``a|b|c``; numeric ranges
  ``[lo..hi]``; arrays ``[item]``; dicts ``{key:type,...}``. Descriptions are dropped (the prompt must stay
  short for a byte-level model).
  """
  cached = _WORLD_SIGNATURES.get(id(doc))
  if cached is not None and cached[0] is doc:  # A doc of FUNCTION_DOCS (constants): rendered once.
    return cached[1]
  params = doc.get("parameters", {}) or {}
  props = params.get("properties", {}) or {}
  req = set(params.get("required", []) or [])
  args = ",".join(f"{k}{'' if k in req else '?'}:{_type_sig(v)}" for k, v in props.items())
  return f"{doc.get('name', '?')}({args})"


_WORLD_SIGNATURES: dict[int, tuple[dict[str, Any], str]] = {}
_WORLD_SIGNATURES.update({id(d): (d, signature(d)) for d in FUNCTION_DOCS})
