"""Small utilities shared across lemon_rl packages.

- :class:`Registry` / :class:`UnknownNameError`: one name -> callable registry per family (aggregation mode,
  KL estimator, policy loss, advantage estimator, task), whose unknown-name errors list the valid names.
- :mod:`lemon_rl.utils.config_checks`: :class:`ConfigError` and the field-naming checks of every config
  section (each task, phase and algorithm checks its own section with them).
"""

from lemon_rl.utils.registry import Registry
from lemon_rl.utils.registry import UnknownNameError
