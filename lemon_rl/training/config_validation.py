"""Config checks that run before anything is compiled; every error names the offending field.

Unknown keys are already rejected by ``ml_collections`` (configs are locked). This checks the sections every
experiment has (task name, model and its Hugging Face checkpoint, mesh, phases, eval, checkpoint), then hands
each part to its owner: every listed phase with ``steps > 0`` checks its own section
(:data:`lemon_rl.training.phases.PHASES`, the ``rl`` phase also its algorithm's fields) and the task its own
(:data:`lemon_rl.envs.tasks.TASK_CONFIG_CHECKS`).
"""

from __future__ import annotations

import os

from lemon_rl.envs.tasks import TASK_CONFIG_CHECKS, TASKS
from lemon_rl.models.config import ModelConfig, preset_names
from lemon_rl.models.sharding import AXIS_RULE_SETS
from lemon_rl.training.phases import PHASES
from lemon_rl.utils.config_checks import ConfigError, require, require_name, require_positive

__all__ = ["ConfigError", "validate_config"]


def validate_config(config) -> None:
  """Raises :class:`ConfigError` naming the first invalid field."""
  require_name(TASKS, "task.name", config.task.name)
  require(config.model.preset in preset_names(), "model.preset", config.model.preset,
          f"must be one of {', '.join(preset_names())}")
  try:
    ModelConfig(**{**ModelConfig().__dict__, **dict(config.model.overrides)})
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.model.overrides={dict(config.model.overrides)!r}: {e}") from None
  _check_checkpoint(config)
  for axis in ("data", "fsdp", "tensor"):
    require(config.mesh[axis] == -1 or config.mesh[axis] >= 1, f"mesh.{axis}", config.mesh[axis],
            "must be -1 (all remaining devices) or >= 1")
  phases = tuple(config.phases)
  require(len(set(phases)) == len(phases), "phases", phases, "a phase may be listed once")
  for name in phases:
    require_name(PHASES, "phases", name)
    require(name in config, "phases", phases, f"phase {name!r} needs a config section of that name")
    require_positive(config[name], name, "steps", allow_zero=True)
    if config[name].steps:
      PHASES.get(name).check_config(config)
  if config.task.name in TASK_CONFIG_CHECKS:
    TASK_CONFIG_CHECKS.get(config.task.name)(config)
  require_positive(config.checkpoint, "checkpoint", "every", "max_to_keep")
  require_positive(config.eval, "eval", "num_examples", "batch_size")


# What a Hugging Face model directory needs for model.hf_checkpoint (the weights are checked when read).
CHECKPOINT_FILES = ("config.json", "tokenizer.json")


def _check_checkpoint(config) -> None:
  """``model.axis_rules``, ``model.hf_checkpoint`` and ``model.chat_template`` (base_config documents them)."""
  model = config.model
  rules = model.get("axis_rules", "")
  require(rules == "" or rules in AXIS_RULE_SETS, "model.axis_rules", rules,
          f"must be '' (the preset's) or one of {', '.join(AXIS_RULE_SETS)}")
  path = model.get("hf_checkpoint", "")
  require(not model.get("chat_template", False) or bool(path), "model.chat_template", model.get("chat_template"),
          "needs model.hf_checkpoint (a directory with a chat template)")
  if not path:
    return
  missing = [f for f in CHECKPOINT_FILES if not os.path.isfile(os.path.join(path, f))]
  require(not missing, "model.hf_checkpoint", path,
          f"must be a local Hugging Face model directory; missing {', '.join(missing)}")
  tokenizer = config.task.get("tokenizer", "byte")
  require(tokenizer in ("byte", path), "task.tokenizer", tokenizer,
          f"the task uses model.hf_checkpoint's tokenizer; leave task.tokenizer at 'byte' or set it to {path!r}")
