r"""BFCL evaluation: accuracy per single-turn Python category and BFCL's summary scores, by BFCL's own rules.

Score a file of model outputs (JSON lines ``{"id": BFCL id, "model_output_text": str}``; BFCL's own result
files, ``{"id", "result"}``, are read too; several files may be given)::

    python -m experiments.eval_bfcl --outputs=outputs.jsonl [--categories=simple,live_simple,irrelevance] \
        [--decoder=python|hermes|lemon] [--strip_think] [--partial] [--errors] \
        [--json_out=scores.json] [--details_out=verdicts.jsonl]

Generate greedy answers with a Hugging Face-format checkpoint (lemon_rl's tool-use prompt,
:func:`lemon_rl.envs.tool_use.render_prompt`) and score them (``--decoder`` defaults to ``lemon`` here)::

    python -m experiments.eval_bfcl --checkpoint=DIR [--tokenizer=DIR|byte] --categories=simple,irrelevance \
        [--limit=50] [--max_new_tokens=512] [--batch_size=32] --generations_out=outputs.jsonl

Decoders (:mod:`lemon_rl.rewards.bfcl_checker`): ``python`` is BFCL's prompting decoder (``[f(a=1), ...]``),
``hermes`` its Qwen function-calling one (``<tool_call>\n{"name", "arguments"}\n</tool_call>``), ``lemon`` reads
lemon_rl's CAST call blocks. ``--strip_think`` drops everything up to the last ``</think>`` first, as BFCL's Qwen
handlers do. Without ``--partial`` (BFCL's ``--partial-eval``) every entry of an evaluated category needs an output;
``--limit`` implies it. The BFCL data is the installed ``bfcl-eval``'s (``--data_dir`` for another copy);
``bfcl-eval`` itself is not imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from lemon_rl.eval import bfcl
from lemon_rl.rewards import bfcl_checker

OUTPUT_KEYS = ("model_output_text", "result")


def read_outputs(paths: Sequence[str]) -> dict[str, Any]:
  """``{id: model output}`` from JSON-lines files (module docstring); duplicate ids are an error."""
  outputs: dict[str, Any] = {}
  for path in paths:
    with open(path, encoding="utf-8") as f:
      for line_number, line in enumerate(f, 1):
        if not line.strip():
          continue
        row = json.loads(line)
        key = next((k for k in OUTPUT_KEYS if k in row), None)
        if "id" not in row or key is None:
          raise ValueError(f"{path}:{line_number}: expected an 'id' and one of {OUTPUT_KEYS}")
        if row["id"] in outputs:
          raise ValueError(f"{path}:{line_number}: duplicate id {row['id']!r}")
        outputs[row["id"]] = row[key]
  return outputs


def write_jsonl(path: str, rows: Sequence[dict[str, Any]]) -> None:
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")


def generate_outputs(model, tokenizer, categories: Sequence[str], *, limit: int | None = None,
                     max_new_tokens: int = 512, batch_size: int = 32, seed: int = 0) -> dict[str, str]:
  """Greedy completions of the BFCL prompts (``{id: text}``; special tokens kept, EOS dropped)."""
  # pylint: disable=import-outside-toplevel
  import jax

  from lemon_rl.envs import bfcl_data
  from lemon_rl.sampling import generate
  from lemon_rl.text.decoding import decode_completion, encode_prompt

  examples = [ex for c in categories for ex in bfcl_data.load_bfcl(c, limit=limit)]
  key = jax.random.key(seed)
  outputs = {}
  for start in range(0, len(examples), batch_size):
    chunk = examples[start:start + batch_size]
    ids = [encode_prompt(tokenizer, ex["prompt"]) for ex in chunk]
    out = generate(model, ids, max_new_tokens, jax.random.fold_in(key, start), temperature=0.0,
                   eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)
    for i, ex in enumerate(chunk):
      outputs[ex["id"]] = decode_completion(tokenizer, out.tokens[i, :out.lengths[i]].tolist())
  return outputs


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--outputs", nargs="+", help="JSON-lines files of model outputs")
  source.add_argument("--checkpoint", help="Hugging Face-format model directory to generate with")
  parser.add_argument("--categories", default="", help=f"comma-separated subset of {','.join(bfcl.CATEGORIES)} "
                      "(default: those with outputs; with --checkpoint: all)")
  parser.add_argument("--decoder", choices=bfcl_checker.DECODERS, default=None,
                      help="default: python (lemon with --checkpoint)")
  parser.add_argument("--strip_think", action="store_true", help="drop text up to the last </think> first")
  parser.add_argument("--underscore_to_dot", action="store_true", help="BFCL's flag for FC models whose API "
                      "replaces '.' in function names by '_'")
  parser.add_argument("--partial", action="store_true", help="score only the entries that have an output")
  parser.add_argument("--data_dir", default=None, help="a BFCL data/ directory (default: bfcl-eval's)")
  parser.add_argument("--errors", action="store_true", help="print BFCL's error types per category")
  parser.add_argument("--json_out", default=None, help="write per-category and summary scores here")
  parser.add_argument("--details_out", default=None, help="write one verdict per entry here (JSON lines)")
  parser.add_argument("--tokenizer", default=None, help="tokenizer spec (default: the checkpoint directory)")
  parser.add_argument("--limit", type=int, default=None, help="first N entries per category (implies --partial)")
  parser.add_argument("--max_new_tokens", type=int, default=512)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--generations_out", default=None, help="with --checkpoint: write the outputs here")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> bfcl.BfclReport:
  """Runs the command; returns the report (also printed)."""
  args = _parse_args(argv)
  categories = [c.strip() for c in args.categories.split(",") if c.strip()] or None
  partial = args.partial or args.limit is not None
  if args.checkpoint:
    # pylint: disable=import-outside-toplevel
    from lemon_rl.models.hf import from_hf
    from lemon_rl.text.tokenizers import load_tokenizer

    categories = categories or list(bfcl.CATEGORIES)
    model = from_hf(args.checkpoint)
    tokenizer = load_tokenizer(args.tokenizer or args.checkpoint)
    outputs = generate_outputs(model, tokenizer, categories, limit=args.limit, max_new_tokens=args.max_new_tokens,
                               batch_size=args.batch_size, seed=args.seed)
    if args.generations_out:
      write_jsonl(args.generations_out, [{"id": k, "model_output_text": v} for k, v in outputs.items()])
    decoder = args.decoder or "lemon"
  else:
    outputs = read_outputs(args.outputs)
    if categories is not None:
      outputs = {k: v for k, v in outputs.items() if bfcl.category_of_id(k) in categories}
    decoder = args.decoder or "python"
  report = bfcl.score_outputs(outputs, categories, decoder=decoder, strip_think=args.strip_think,
                              underscore_to_dot=args.underscore_to_dot, partial=partial, data_dir=args.data_dir)
  print(f"BFCL evaluation (decoder={decoder}, strip_think={args.strip_think}, partial={partial})")
  print(bfcl.format_report(report, show_errors=args.errors))
  if args.json_out:
    directory = os.path.dirname(args.json_out)
    if directory:
      os.makedirs(directory, exist_ok=True)
    with open(args.json_out, "w", encoding="utf-8") as f:
      json.dump({"decoder": decoder, "strip_think": args.strip_think, "partial": partial, **report.as_dict()}, f,
                indent=2)
  if args.details_out:
    write_jsonl(args.details_out, [{"id": v.id, "category": v.category, "valid": v.valid,
                                    "error_type": v.error_type, "error": v.error} for v in report.verdicts])
  return report


if __name__ == "__main__":
  try:
    main()
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
