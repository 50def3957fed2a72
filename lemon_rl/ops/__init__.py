"""Array operations shared by losses, advantages and training.

- masked reductions: :func:`masked_sum`, :func:`masked_mean`, :func:`safe_divide`;
- additive metrics: :class:`WeightedMetric` ``(sum, denominator)``, :class:`MinMetric`,
  :class:`MaxMetric`, :func:`sum_of_means`; :func:`merge_metrics` (two dicts) and
  :func:`reduce_metrics` (across a named device axis: psum / pmin / pmax);
- segment (group) statistics over integer ids: :func:`segment_count`, :func:`segment_mean`,
  :func:`segment_std` (unbiased), :func:`broadcast_to_members`; each takes an optional ``axis_name``
  to reduce across devices that hold parts of the groups;
- :func:`token_log_probs` and :func:`entropy_from_logits`.
"""

from lemon_rl.ops.logits import entropy_from_logits
from lemon_rl.ops.logits import token_log_probs
from lemon_rl.ops.reductions import masked_max
from lemon_rl.ops.reductions import masked_mean
from lemon_rl.ops.reductions import masked_min
from lemon_rl.ops.reductions import masked_sum
from lemon_rl.ops.reductions import MaxMetric
from lemon_rl.ops.reductions import merge_metrics
from lemon_rl.ops.reductions import Metric
from lemon_rl.ops.reductions import metric_values
from lemon_rl.ops.reductions import MinMetric
from lemon_rl.ops.reductions import reduce_metric
from lemon_rl.ops.reductions import reduce_metrics
from lemon_rl.ops.reductions import safe_divide
from lemon_rl.ops.reductions import sum_of_means
from lemon_rl.ops.reductions import weighted_metric
from lemon_rl.ops.reductions import WeightedMetric
from lemon_rl.ops.segments import broadcast_to_members
from lemon_rl.ops.segments import check_segment_ids
from lemon_rl.ops.segments import segment_count
from lemon_rl.ops.segments import segment_max
from lemon_rl.ops.segments import segment_mean
from lemon_rl.ops.segments import segment_mean_std
from lemon_rl.ops.segments import segment_std
from lemon_rl.ops.segments import segment_sum
