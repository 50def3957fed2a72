"""Chat templates and whole-directory loading against ``transformers`` (test-only comparison).

Each model directory is built by ``experiments.make_tiny_checkpoint.write_model_dir``, nothing downloaded: a
byte-level BPE ``tokenizer.json`` trained by the ``tokenizers`` library in the public format of Qwen2 / Llama 3
(their pre-tokenizer regex, added control tokens after the BPE vocabulary), the config files those models ship, a
verbatim public chat template from ``tests/fixtures/chat_templates/``, and a tiny random checkpoint saved by
``transformers``.
"""

import json
import os

import jax
import jinja2
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from experiments.make_tiny_checkpoint import write_json as _write_json  # noqa: E402
from experiments.make_tiny_checkpoint import write_model_dir  # noqa: E402
from lemon_rl.models.hf import load_hf_policy  # noqa: E402
from lemon_rl.sampling import generate  # noqa: E402
from lemon_rl.text import ChatTemplate, HFTokenizer  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Weather in a city: <b>°C</b> & °F — “quoted”, 天气",
    "parameters": {"type": "object",
                   "properties": {"location": {"type": "string", "description": "City, e.g. Paris"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["location"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]


def _call(name, arguments):
  return {"type": "function", "function": {"name": name, "arguments": arguments}}


PLAIN = [{"role": "user", "content": "What is 12+30?"}]
MULTI_TURN = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! 😀 How can I help?"},
    {"role": "user", "content": "2+2? Answer with <b>bold</b> & no more."},
]
TOOL_TURNS = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": None,  # An API's None: must read as a missing key.
     "tool_calls": [_call("get_weather", {"location": "Paris", "unit": "celsius"})]},
    {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 21 °C and clear in Paris."},
    {"role": "user", "content": "And 3+4?"},
]
PARALLEL_TOOLS = [
    {"role": "user", "content": "Weather in Oslo, and 3+4?"},
    {"role": "assistant", "content": "Let me check.",
     "tool_calls": [_call("get_weather", {"location": "Oslo"}), _call("add", {"a": 3, "b": 4})]},
    {"role": "tool", "content": '{"temperature": -3}'},
    {"role": "tool", "content": "7"},
]
THINKING = [
    {"role": "user", "content": "What is 6*7?"},
    {"role": "assistant", "content": "<think>\n6*7 is 42.\n</think>\n\nIt is 42."},
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "reasoning_content": "I should call the tool.", "content": "",
     "tool_calls": [_call("get_weather", '{"location": "Rome"}')]},
    {"role": "tool", "content": '{"temperature": 25}'},
    {"role": "assistant", "content": "<think>\nThe tool says 25.\n</think>\n\nIt is 25 °C in Rome."},
]
LLAMA_TOOL_TURNS = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "tool_calls": [_call("get_weather", {"location": "Paris", "unit": "celsius"})]},
    {"role": "tool", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 °C in Paris."},
    {"role": "user", "content": "Thanks!"},
]

# (conversation, tools) pairs per template; every one is rendered with and without add_generation_prompt.
CASES = {
    "qwen2_5_instruct": [(PLAIN, None), (MULTI_TURN, None), (PLAIN, TOOLS), (TOOL_TURNS, TOOLS),
                         (PARALLEL_TOOLS, TOOLS), (TOOL_TURNS, None)],
    "qwen3": [(PLAIN, None), (MULTI_TURN, None), (PLAIN, TOOLS), (TOOL_TURNS, TOOLS), (PARALLEL_TOOLS, TOOLS),
              (THINKING, TOOLS), (THINKING, None)],
    "llama3_2_instruct": [(PLAIN, None), (MULTI_TURN, None), (PLAIN, TOOLS), (LLAMA_TOOL_TURNS, TOOLS),
                          (MULTI_TURN[1:], None)],
}
# Extra template variables each case is rendered under.
TEMPLATE_KWARGS = {
    "qwen2_5_instruct": [{}],
    "qwen3": [{}, {"enable_thinking": True}, {"enable_thinking": False}],
    "llama3_2_instruct": [{}, {"date_string": "01 Dec 2026"}, {"tools_in_user_message": False}],
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf_dirs")
  return {name: write_model_dir(str(root / name), name) for name in CASES}


@pytest.fixture(scope="module")
def hf_tokenizers(model_dirs):
  return {name: transformers.AutoTokenizer.from_pretrained(path) for name, path in model_dirs.items()}


def _hf_ids(hf_tok, messages, tools, add_generation_prompt, **kwargs) -> list[int]:
  out = hf_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   tokenize=True, return_dict=False, **kwargs)
  return [int(i) for i in out]


@pytest.mark.parametrize("name", list(CASES))
def test_prompt_ids_equal_apply_chat_template(name, model_dirs, hf_tokenizers):
  tok = HFTokenizer.from_file(model_dirs[name])
  template = ChatTemplate.from_dir(model_dirs[name], tokenizer=tok)
  hf_tok = hf_tokenizers[name]
  checked = 0
  for messages, tools in CASES[name]:
    for kwargs in TEMPLATE_KWARGS[name]:
      for add_generation_prompt in (False, True):
        where = f"{name} {kwargs} tools={tools is not None} agp={add_generation_prompt} messages={messages}"
        text = template.render(messages, tools, add_generation_prompt, **kwargs)
        expected_text = hf_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                   tokenize=False, **kwargs)
        assert text == expected_text, where
        ids = template.encode(messages, tools, add_generation_prompt, **kwargs)
        assert ids == _hf_ids(hf_tok, messages, tools, add_generation_prompt, **kwargs), where
        # Round trip: the ids decode back to the rendered text, as transformers decodes them.
        assert tok.decode(ids, skip_special_tokens=False) == text, where
        assert hf_tok.decode(ids, skip_special_tokens=False) == text, where
        checked += 1
  assert checked == len(CASES[name]) * len(TEMPLATE_KWARGS[name]) * 2


def test_template_features_render_as_transformers(model_dirs, hf_tokenizers):
  """Details a template can reach: control tokens, thinking switch, tojson options, BOS, tools in system."""
  qwen3 = ChatTemplate.from_dir(model_dirs["qwen3"], tokenizer=HFTokenizer.from_file(model_dirs["qwen3"]))
  off = qwen3.render(PLAIN, add_generation_prompt=True, enable_thinking=False)
  assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  assert qwen3.render(PLAIN, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
  ids = qwen3.encode(PLAIN, add_generation_prompt=True, enable_thinking=False)
  tok = qwen3.tokenizer
  # Control tokens split the text, so the generation prompt's ids do not depend on what precedes them.
  tail = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  assert ids[-len(tail):] == tail and tail[0] == tok.token_to_id("<|im_start|>")
  assert tok.token_to_id("<think>") in tail and tok.token_to_id("</think>") in tail
  assert ids.count(tok.token_to_id("<|im_start|>")) == 2 and ids.count(tok.token_to_id("<|im_end|>")) == 1

  qwen25 = ChatTemplate.from_dir(model_dirs["qwen2_5_instruct"])
  text = qwen25.render(PLAIN, TOOLS)
  # tojson: non-ASCII kept and no HTML escaping (Jinja's own filter would write \u003cb\u003e).
  assert json.dumps(WEATHER, ensure_ascii=False) in text and "<b>°C</b> & °F" in text

  llama_dir = model_dirs["llama3_2_instruct"]
  llama = ChatTemplate.from_dir(llama_dir, tokenizer=HFTokenizer.from_file(llama_dir))
  text = llama.render(PLAIN, TOOLS, date_string="26 Jul 2024")
  assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
  assert json.dumps(ADD, indent=4) in text  # tojson(indent=4)
  assert llama.encode(PLAIN).count(llama.tokenizer.bos_id) == 1  # From the template, not the post-processor.
  assert _hf_ids(hf_tokenizers["llama3_2_instruct"], PLAIN, None, False).count(llama.tokenizer.bos_id) == 1
  # strftime_now: the template's default date is today's (transformers renders the same string).
  today = llama.render(PLAIN)
  assert today == hf_tokenizers["llama3_2_instruct"].apply_chat_template(PLAIN, tokenize=False)
  # raise_exception: two tool calls in one Llama turn.
  two_calls = [PARALLEL_TOOLS[0], {"role": "assistant", "tool_calls": PARALLEL_TOOLS[1]["tool_calls"]}]
  with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
    llama.render(two_calls, TOOLS)
  with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
    hf_tokenizers["llama3_2_instruct"].apply_chat_template(two_calls, tools=TOOLS, tokenize=False)


def test_environment_matches_transformers(model_dirs, hf_tokenizers):
  """The sandbox's filters, globals, extensions and variables on a template written to touch each of them."""
  source = (
      "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}\n"
      "{{ messages | tojson }}\n{{ tools | tojson(indent=2, sort_keys=true) }}\n"
      "{{ messages[0] | tojson(separators=(',', ':')) }}\n"
      "{%- set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
      "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }} {{ dict(a=1) | tojson }} {{ custom | default('none') }}\n"
      "{% for m in messages %}{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}"
      "{% endgeneration %}</a>{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
      "{{ add_generation_prompt }} {{ documents | tojson }}\n"
      "    {% if messages %}\nindented block tags: trim_blocks and lstrip_blocks\n    {% endif %}\nend")
  hf_tok = hf_tokenizers["qwen3"]
  template = ChatTemplate(source, special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                                  "bos_token": None, "other": "x"},
                          tokenizer=HFTokenizer.from_file(model_dirs["qwen3"]))
  messages = MULTI_TURN + [{"role": "assistant", "content": "4", "reasoning": "2+2", "name": None}]
  docs = [{"title": "T", "text": "Body & <tail>"}]
  for kwargs in ({}, {"custom": np.int64(3)}, {"documents": docs}):
    expected = hf_tok.apply_chat_template(messages, tools=TOOLS, chat_template=source, tokenize=False, **kwargs)
    assert template.render(messages, TOOLS, **kwargs) == expected, kwargs
  text, spans = template.render_with_spans(messages, TOOLS)
  assert [text[a:b] for a, b in spans] == [MULTI_TURN[2]["content"], "4"]
  # The assistant-token mask transformers derives from the same spans (token offsets overlapping a span).
  hf = hf_tok.apply_chat_template(messages, tools=TOOLS, chat_template=source, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
  enc = template.tokenizer.raw.encode(text, add_special_tokens=False)
  assert enc.ids == list(hf["input_ids"])
  mask = [int(any(s < b and e > a for a, b in spans)) for s, e in enc.offsets]
  assert mask == list(hf["assistant_masks"]) and sum(mask) > 0

  # Sandbox: a namespace refuses underscore attributes, the environment refuses attribute escapes.
  for bad in ("{% set ns = namespace(_x=1) %}", "{{ messages.__class__.__mro__ }}",
              "{{ ''.__class__.__subclasses__() }}"):
    with pytest.raises(jinja2.exceptions.SecurityError):
      ChatTemplate(bad).render(PLAIN)
  with pytest.raises(jinja2.TemplateError, match="nope"):
    ChatTemplate("{{ raise_exception('nope') }}").render(PLAIN)


def test_continue_final_message_and_template_selection(model_dirs, hf_tokenizers, tmp_path):
  name = "qwen2_5_instruct"
  hf_tok = hf_tokenizers[name]
  template = ChatTemplate.from_dir(model_dirs[name], tokenizer=HFTokenizer.from_file(model_dirs[name]))
  prefill = PLAIN + [{"role": "assistant", "content": "The answer is "}]
  expected = hf_tok.apply_chat_template(prefill, continue_final_message=True, tokenize=False)
  assert template.render(prefill, continue_final_message=True) == expected
  assert expected.endswith("<|im_start|>assistant\nThe answer is ")
  with pytest.raises(ValueError):
    template.render(prefill, add_generation_prompt=True, continue_final_message=True)

  # Several templates in tokenizer_config.json: "tool_use" when tools are given, else "default".
  path = str(tmp_path / "multi")
  os.makedirs(path)
  for f in ("tokenizer.json", "tokenizer_config.json"):
    with open(os.path.join(model_dirs[name], f), encoding="utf-8") as src:
      text = src.read()
    with open(os.path.join(path, f), "w", encoding="utf-8") as dst:
      dst.write(text)
  config = json.load(open(os.path.join(path, "tokenizer_config.json")))
  config["chat_template"] = [{"name": "default", "template": "D{{ messages | length }}"},
                             {"name": "tool_use", "template": "T{{ tools | length }}"}]
  _write_json(os.path.join(path, "tokenizer_config.json"), config)
  multi = ChatTemplate.from_dir(path)
  hf_multi = transformers.AutoTokenizer.from_pretrained(path)
  for tools in (None, TOOLS):
    assert multi.render(PLAIN, tools) == hf_multi.apply_chat_template(PLAIN, tools=tools, tokenize=False)
  assert multi.render(PLAIN, TOOLS, template_name="default") == "D1"
  # chat_template.jinja takes priority over the tokenizer_config.json entry.
  with open(os.path.join(path, "chat_template.jinja"), "w") as f:
    f.write("J{{ eos_token }}")
  assert ChatTemplate.from_dir(path).render(PLAIN) == "J<|im_end|>"
  assert transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(PLAIN, tokenize=False) == "J<|im_end|>"
  os.remove(os.path.join(path, "chat_template.jinja"))
  config.pop("chat_template")
  _write_json(os.path.join(path, "tokenizer_config.json"), config)
  assert ChatTemplate.from_dir(path) is None


def _swap_head_columns(model, a: int, b: int):
  """Exchanges the output logits of ids ``a`` and ``b`` (untied head: the inputs are unchanged)."""
  w = model.lm_head[...]
  model.lm_head.set_value(w.at[:, [a, b]].set(w[:, [b, a]]))


@pytest.mark.parametrize("name", ["qwen3", "llama3_2_instruct"])
def test_generation_stops_on_each_declared_eos(name, model_dirs):
  """``load_hf_policy`` gives every EOS of generation_config.json; greedy generation stops on each one.

  The tiny random model's greedy completion ``t_1 t_2 ...`` (no EOS in it) is rerouted by exchanging the
  head columns of a ``t_k`` that differs from ``t_1 .. t_{k-1}`` and an EOS id ``e``: the greedy path becomes
  ``t_1 .. t_{k-1} e`` and must end there (the swap leaves every earlier argmax in place).
  """
  path = model_dirs[name]
  model, tok, template = load_hf_policy(path)
  declared = json.load(open(os.path.join(path, "generation_config.json")))["eos_token_id"]
  assert len(declared) >= 2 and set(tok.eos_ids) == set(declared)
  assert tok.eos_id == tok.token_to_id("<|im_end|>" if name == "qwen3" else "<|eot_id|>")
  prompt = template.encode(PLAIN, add_generation_prompt=True)
  assert prompt[-1] != tok.eos_id and template.tokenizer is tok
  steps = 12
  rng = jax.random.key(0)
  base = generate(model, [prompt], steps, rng, temperature=0.0, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
  greedy = [int(t) for t in base.tokens[0]]
  assert base.finish_reasons == ["length"] and not set(greedy) & set(declared), greedy
  for eos in declared:
    # The latest step in the first half whose token differs from every earlier one (so that the swap leaves
    # t_1..t_{k-1} in place), leaving at least half the steps to show that generation stopped.
    k = max(i for i in range(steps // 2) if greedy[i] not in greedy[:i])
    _swap_head_columns(model, greedy[k], eos)
    out = generate(model, [prompt], steps, rng, temperature=0.0, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
    _swap_head_columns(model, greedy[k], eos)
    assert out.finish_reasons == ["eos"] and int(out.lengths[0]) == k + 1, (eos, greedy, out.tokens)
    assert [int(t) for t in out.tokens[0, :k + 1]] == greedy[:k] + [eos]
    assert (out.tokens[0, k + 1:] == tok.pad_id).all() and out.mask[0].sum() == k + 1
