"""The benchmark scripts run on today's library (no timing).

``benchmarks/train_step.py`` builds its own GRPO step; this runs that step once on a small model, so that a
config field the trainer starts to require, or a change of the trainer's interface, fails here and not in a
benchmark run on another machine. ``benchmarks/decode_profile.py``'s HLO classification and its decode step
(which must compute what ``generate`` computes) are checked on small inputs.
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import decode_profile  # pylint: disable=g-import-not-at-top,wrong-import-position
import train_step  # pylint: disable=g-import-not-at-top,wrong-import-position

from lemon_rl.models import Transformer, get_preset  # pylint: disable=g-import-not-at-top,wrong-import-position
from lemon_rl.sampling import generate  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_train_step_benchmark_grpo_step_runs_full_length_completions():
  cfg = dataclasses.replace(get_preset("bench"), num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2,
                            mlp_dim=64)
  run, holder = train_step.lemon_grpo_step(Transformer(cfg, rngs=nnx.Rngs(0)))
  run()  # Asserts the rollout shapes (every completion NEW_TOKENS long) itself.
  metrics = holder["metrics"]
  assert np.isfinite(float(metrics["train/loss"])) and float(metrics["rl/skipped_zero_signal"]) == 0
  assert float(metrics["frac_all_equal_groups"]) < 1  # The trivial reward gives the update a signal.


# -- benchmarks/decode_profile.py --------------------------------------------------------------------------

_HLO = """HloModule m

%inner (p: f32[2,3], q: f32[3,4]) -> f32[2,4] {
  %p = f32[2,3]{1,0} parameter(0)
  %q = f32[3,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[2,4]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%outer (a: f32[2,3], b: f32[3,4]) -> f32[2,4] {
  %a = f32[2,3]{1,0} parameter(0)
  %b = f32[3,4]{1,0} parameter(1)
  ROOT %nested = f32[2,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%inner
}

%elementwise (x: f32[2,4]) -> f32[2,4] {
  %x = f32[2,4]{1,0} parameter(0)
  ROOT %tanh.1 = f32[2,4]{1,0} tanh(%x)
}

ENTRY %main (a: f32[2,3], b: f32[3,4]) -> f32[2,4] {
  %a = f32[2,3]{1,0} parameter(0)
  %b = f32[3,4]{1,0} parameter(1)
  %outer_fusion = f32[2,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%outer
  %dot.2 = f32[2,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %add.1 = f32[2,4]{1,0} add(%outer_fusion, %dot.2)
  ROOT %tanh_fusion = f32[2,4]{1,0} fusion(%add.1), kind=kLoop, calls=%elementwise
}
"""


def test_matmul_instructions_are_dots_and_fusions_that_contain_one_at_any_depth():
  found = decode_profile.matmul_instructions(_HLO)
  assert {"outer_fusion", "dot.2", "nested", "dot.1"} <= found
  assert not {"add.1", "tanh_fusion", "tanh.1", "a", "b"} & found


def test_matmul_instructions_of_a_compiled_module():
  fn = jax.jit(lambda x, w: jnp.tanh(x @ w) + 1.0)
  hlo = fn.lower(jnp.ones((4, 8)), jnp.ones((8, 16))).compile().as_text()
  found = decode_profile.matmul_instructions(hlo)  # empty if XLA's text format drifted from the parser's
  assert found
  for name in found:
    line = next(line for line in hlo.splitlines() if f"%{name} = " in line)
    assert " dot(" in line or " fusion(" in line, line


def test_the_profiled_decode_step_decodes_what_generate_decodes():
  cfg = dataclasses.replace(get_preset("bench"), num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                            mlp_dim=64)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  step, state, cache, first = decode_profile.decode_step(model, batch=2, context=12, slots=16)
  prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)).tolist()  # the step's prompts
  out = generate(model, prompts, 2, jax.random.key(0), temperature=0.0)
  cache, second = step(state, cache, first)
  np.testing.assert_array_equal(np.asarray(first), out.tokens[:, 0])
  np.testing.assert_array_equal(np.asarray(second), out.tokens[:, 1])
  assert cache.lengths.tolist() == [12, 12]  # rolled back: every step reads the same cache
