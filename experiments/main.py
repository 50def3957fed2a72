r"""Launches an experiment from a config file.

    python -m experiments.main --config=configs/grpo_arithmetic.py[:variant] --workdir=DIR \
        [--config.rl.steps=200 --config.seed=1 ...]

Every field of the config can be overridden with ``--config.a.b=value``; an unknown key or an invalid
value fails before anything is compiled, naming the field. Re-running on the same ``--workdir`` resumes.
The launcher re-executes itself with glibc malloc settings that keep XLA's per-step scratch memory in the
process (``lemon_rl.utils.allocator``); ``--default_malloc`` keeps the system's defaults.
Outputs in ``--workdir``: ``metrics.jsonl``, TensorBoard files under ``tb/``, ``checkpoints/``,
``curves.png``, ``summary.txt`` / ``summary.json``.

Several processes or hosts: start one launcher per process with ``--distributed`` (on SLURM, Open MPI and
Cloud TPU JAX finds the coordinator, process count and index itself), or with ``--coordinator_address=HOST:PORT
--num_processes=N --process_id=I`` (or the environment variables ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``; the first alone asks for a distributed run). Every process gets the
same config and ``--workdir`` (a filesystem they all see); the mesh spans every process's devices and batch
sizes in the config are global.
"""

import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Experiment config file, e.g. configs/grpo_arithmetic.py:cpu.",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots (resumed if it exists).")
flags.DEFINE_bool("distributed", False, "Start jax.distributed before anything else (multi-process / multi-host); "
                  "implied by the three flags below or by JAX_COORDINATOR_ADDRESS.")
flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0's coordinator (a distributed run).")
flags.DEFINE_integer("num_processes", None, "Number of processes of a distributed run.")
flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from lemon_rl.training import distributed  # pylint: disable=g-import-not-at-top
  if (FLAGS.distributed or FLAGS.coordinator_address or FLAGS.num_processes is not None
      or FLAGS.process_id is not None or distributed.requested_by_environment()):
    distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  from lemon_rl.training import experiment  # pylint: disable=g-import-not-at-top
  from lemon_rl.training.config_validation import ConfigError  # pylint: disable=g-import-not-at-top

  logging.set_verbosity(logging.WARNING)
  try:
    experiment.run(FLAGS.config, FLAGS.workdir)
  except ConfigError as e:
    sys.exit(f"error: {e}")
  except experiment.Preempted as e:
    print(e, file=sys.stderr)
    sys.exit(experiment.PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
  from lemon_rl.utils.allocator import reexec_with_malloc_tuning  # pylint: disable=g-import-not-at-top
  reexec_with_malloc_tuning()
  app.run(main)
