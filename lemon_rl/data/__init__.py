"""Data: task-independent grain pipelines, curriculum samplers and CAST's case library.

The tasks' own datasets (e.g. the arithmetic tfds builder, ``lemon_rl.envs.arithmetic_builder``) live with the
tasks in ``lemon_rl.envs``, which import this package; nothing here imports ``lemon_rl.envs``.
"""

from lemon_rl.data.pipeline import BatchIterator
from lemon_rl.data.pipeline import collate
from lemon_rl.data.pipeline import decode_record

__all__ = ["BatchIterator", "collate", "decode_record"]
