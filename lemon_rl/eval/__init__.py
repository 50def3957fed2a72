"""Evaluation: generation-based accuracy, Pass@k and Pass@(K,T), confidence intervals, Holm-corrected paired
differences, the step-0 headroom gate and validation-only hyper-parameter choice.

Multi-turn agents under turn budgets (Pass@(K,T) surfaces, step quality against ``Q*``, recovery from injected
errors) are in :mod:`lemon_rl.eval.budget_eval` (imported on its own: it runs the episode engine)."""

from lemon_rl.eval.generation import evaluate
from lemon_rl.eval.headroom import check_headroom
from lemon_rl.eval.headroom import group_std
from lemon_rl.eval.headroom import group_varies
from lemon_rl.eval.headroom import headroom_statistics
from lemon_rl.eval.headroom import HeadroomError
from lemon_rl.eval.headroom import HeadroomGate
from lemon_rl.eval.headroom import HeadroomReport
from lemon_rl.eval.headroom import HeadroomRollout
from lemon_rl.eval.pass_at_k import avg_at_k, pass_at_k, pass_at_k_t
from lemon_rl.eval.stats import format_mean_ci
from lemon_rl.eval.stats import format_paired
from lemon_rl.eval.stats import format_paired_row
from lemon_rl.eval.stats import format_paired_table
from lemon_rl.eval.stats import holm_adjust
from lemon_rl.eval.stats import holm_paired_intervals
from lemon_rl.eval.stats import mean_ci
from lemon_rl.eval.stats import NOT_DISTINGUISHABLE
from lemon_rl.eval.stats import OPPOSITE
from lemon_rl.eval.stats import PairedComparison
from lemon_rl.eval.stats import PairedResult
from lemon_rl.eval.stats import REPRODUCED
from lemon_rl.eval.tuning import choose_per_arm
from lemon_rl.eval.tuning import load_choice
from lemon_rl.eval.tuning import record_choice
from lemon_rl.eval.tuning import Trial
from lemon_rl.eval.tuning import TuningRecord
