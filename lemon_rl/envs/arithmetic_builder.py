"""The arithmetic task as a ``tensorflow_datasets`` builder written to ``array_record`` (no TensorFlow needed).

Splits (records ``{prompt, answer, completion, sloppy}`` from :func:`lemon_rl.envs.arithmetic.generate_examples`):

- ``train``: RL prompts with their exact answers (train bucket);
- ``sft``: demonstrations by the sloppy teacher (``completion`` is carry-less with probability ``p_sloppy``;
  sft bucket);
- ``validation``: distinct problems with exact answers for tuning (validation bucket);
- ``test``: distinct held-out problems (test bucket) with exact answers.

The four buckets partition the canonical problems (``arithmetic.canonical_key``: ``a+b`` = ``b+a``), so no
problem is in two splits in either operand order (:mod:`lemon_rl.envs.arithmetic`).

Usage::

  builder = build_arithmetic(data_dir)                      # default config, ~10 s the first time
  sources = builder.as_data_source()                        # {"train", "sft", "validation", "test"}
  builder = build_arithmetic(data_dir, seed=1, num_sft=1000)  # a custom config, named after its parameters

Every config is a pure function of its parameters; its name encodes them (``make_config``), so two different
configurations never share a directory (``data_dir/lemon_arithmetic/<config name>/<version>/``).

It lives with the task (``lemon_rl.envs``), like the other tasks' generators: ``lemon_rl.data`` holds the
task-independent machinery (grain pipelines, curriculum samplers, the case library) and imports no task, so
the tasks may use it without an import cycle.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

from etils import epath
import numpy as np
import tensorflow_datasets as tfds

from lemon_rl.data import splits as content_splits
from lemon_rl.envs import arithmetic

DATASET_NAME = "lemon_arithmetic"


@dataclasses.dataclass(eq=False)
class ArithmeticConfig(tfds.core.BuilderConfig):
  """Parameters of one arithmetic dataset (see :mod:`lemon_rl.envs.arithmetic`)."""

  seed: int = 0  # Generation seed; each split draws from its own stream.
  num_train: int = 50_000  # RL prompts.
  num_sft: int = 200_000  # Sloppy-teacher demonstrations.
  num_test: int = 500  # Distinct held-out problems.
  num_validation: int = 500  # Distinct problems for tuning.
  p_sloppy: float = arithmetic.DEFAULT_P_SLOPPY  # Probability of the carry-less demonstration.
  mul_fraction: float = arithmetic.DEFAULT_MUL_FRACTION  # Probability of a multiplication problem.
  test_fraction: float = arithmetic.DEFAULT_TEST_FRACTION  # Share of the problem space held out.
  validation_fraction: float = arithmetic.DEFAULT_VALIDATION_FRACTION  # Share in the validation bucket.
  train_fraction: float = arithmetic.DEFAULT_TRAIN_FRACTION  # Share in the RL (train) bucket; SFT: the rest.

  def num_examples(self, split: str) -> int:
    return {"train": self.num_train, "sft": self.num_sft, "test": self.num_test,
            "validation": self.num_validation}[split]


_DEFAULTS = ArithmeticConfig(name="_")


def config_name(**params: Any) -> str:
  """A directory-safe name listing the parameters that differ from the defaults (``"default"`` if none)."""
  short = {"seed": "seed", "num_train": "train", "num_sft": "sft", "num_test": "test", "num_validation": "val",
           "p_sloppy": "psloppy", "mul_fraction": "mul", "test_fraction": "heldout",
           "validation_fraction": "valfrac", "train_fraction": "rlfrac"}
  unknown = set(params) - set(short)
  if unknown:
    raise ValueError(f"unknown arithmetic dataset parameter(s) {sorted(unknown)}; valid: {sorted(short)}")
  parts = [f"{short[k]}{params[k]:g}" if isinstance(params[k], float) else f"{short[k]}{params[k]}"
           for k in short if k in params and params[k] != getattr(_DEFAULTS, k)]
  return "_".join(parts) if parts else "default"


def make_config(**params: Any) -> ArithmeticConfig:
  """An :class:`ArithmeticConfig` named after its non-default parameters (validated)."""
  config = ArithmeticConfig(name=config_name(**params), description="lemon_rl arithmetic task", **params)
  for field in ("num_train", "num_sft", "num_test", "num_validation"):
    if int(getattr(config, field)) < 1:  # tfds cannot write an empty split.
      raise ValueError(f"{field} must be >= 1, got {getattr(config, field)}")
  if not 0.0 <= config.p_sloppy <= 1.0:
    raise ValueError(f"p_sloppy must be in [0, 1], got {config.p_sloppy}")
  if not 0.0 <= config.mul_fraction <= 1.0:
    raise ValueError(f"mul_fraction must be in [0, 1], got {config.mul_fraction}")
  fractions = (("test", config.test_fraction), ("validation", config.validation_fraction),
               ("train", config.train_fraction))
  content_splits.check_fractions(fractions, "sft")  # Raises ValueError naming the fractions.
  return config


class LemonArithmetic(tfds.core.GeneratorBasedBuilder):
  """``"aaa+bbb="`` / ``"aa*bb="`` problems with 4-digit answers; splits train / sft / validation / test."""

  VERSION = tfds.core.Version("2.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release.",
                   "2.0.0": "Splits keyed on the canonical problem (a+b = b+a), one bucket each for SFT, RL "
                            "(train), validation and test; a validation split."}
  BUILDER_CONFIGS = [make_config(), make_config(num_train=2_000, num_sft=5_000, num_test=200, num_validation=200)]
  DEFAULT_CONFIG_NAME = "default"

  # tfds 4.9.10 evaluates `importlib_resources.abc.Traversable` in `code_path` for any builder defined inside a
  # package, but only declares `importlib_resources` for Python < 3.9 (tensorflow/datasets#11212). Returning the
  # source file directly is what tfds's own fallback does, without the missing module.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(inspect.getfile(cls))

  def _info(self) -> tfds.core.DatasetInfo:
    text = tfds.features.Text()
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            "prompt": text, "answer": text, "completion": text, "sloppy": np.bool_,
        }),
        supervised_keys=None,
    )

  def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
    del dl_manager  # Nothing to download.
    return {split: self._generate_examples(split) for split in arithmetic.SPLITS}

  def _generate_examples(self, split: str):
    config: ArithmeticConfig = self.builder_config
    examples = arithmetic.generate_examples(
        config.seed, config.num_examples(split), split, p_sloppy=config.p_sloppy,
        mul_fraction=config.mul_fraction, test_fraction=config.test_fraction,
        validation_fraction=config.validation_fraction, train_fraction=config.train_fraction)
    for index, example in enumerate(examples):
      # Operands, operator and carry-less answer follow from the prompt (`arithmetic.parse_prompt`); leaving them
      # out halves the (pure-Python) tfds serialisation time.
      yield index, {k: example[k] for k in ("prompt", "answer", "completion", "sloppy")}


def build_arithmetic(data_dir: str | os.PathLike[str], config: ArithmeticConfig | str | None = None,
                     **params: Any) -> LemonArithmetic:
  """Generates (once; later calls reuse the files) and returns the builder.

  Args:
    data_dir: root directory of the tfds data.
    config: an :class:`ArithmeticConfig`, the name of a predefined one (``"default"``, or the small one
      ``"train2000_sft5000_test200_val200"``), or ``None`` to build one from ``params`` (``make_config(**params)``).
    **params: fields of :class:`ArithmeticConfig` (only with ``config=None``).

  In a multi-process run, call this on one process (or per host into a host-local ``data_dir``) before the
  others open the data: concurrent builds into one directory are not coordinated.
  """
  if config is not None and params:
    raise ValueError("pass either config or keyword parameters, not both")
  if config is None:
    config = make_config(**params)
  if isinstance(config, ArithmeticConfig) and config.name in LemonArithmetic.builder_configs:
    config = config.name  # tfds refuses a custom config named like a predefined one; names encode parameters.
  builder = LemonArithmetic(data_dir=os.fspath(data_dir), config=config, file_format="array_record")
  builder.download_and_prepare()
  return builder
