"""Losses and advantage estimators: pure functions of arrays (METHODS.md sections 0, 2, 5).

Registries (config validation reads their ``names()``):

- :data:`AGGREGATIONS`: ``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum``,
  ``seq_mean_token_sum_norm``;
- :data:`KL_ESTIMATORS`: ``k1``, ``k2``, ``k3``;
- :data:`POLICY_LOSSES`: ``ppo_clip``, ``gspo`` (each with its own defaults in :data:`POLICY_LOSS_DEFAULTS`);
- :data:`ADVANTAGE_ESTIMATORS`: ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp_baseline``, ``gigpo``.

:mod:`lemon_rl.losses.value` holds PPO's critic pieces: :func:`gae`, :func:`clipped_value_loss`,
:func:`explained_variance`, :func:`whiten_advantages` and the token/turn mapping of multi-turn batches.

:mod:`lemon_rl.losses.counterfactual` holds LEMON's span-local :func:`counterfactual_loss`, the total
:func:`combined_loss` (``L_GRPO + mu L_cf``) and the :class:`EditFamilySampler`.

:mod:`lemon_rl.losses.ppow` holds PPOW's window-level drafter objective (:func:`accepted_length`,
:func:`window_rewards`, :func:`window_advantages`, :func:`ppow_loss`) and ADAW window sampling.

:class:`SurrogateSettings` (``lemon_rl.losses.surrogate``) holds the clipped-surrogate fields of the trainers'
losses. The registry class itself lives in :mod:`lemon_rl.utils.registry`.
"""

from lemon_rl.losses.advantages import ADVANTAGE_ESTIMATORS
from lemon_rl.losses.advantages import dr_grpo
from lemon_rl.losses.advantages import gigpo
from lemon_rl.losses.advantages import GiGPOAdvantages
from lemon_rl.losses.advantages import grpo
from lemon_rl.losses.advantages import reinforce_pp_baseline
from lemon_rl.losses.advantages import rloo
from lemon_rl.losses.advantages import step_discounted_returns
from lemon_rl.losses.counterfactual import combined_loss
from lemon_rl.losses.counterfactual import counterfactual_loss
from lemon_rl.losses.counterfactual import EDIT_FAMILIES
from lemon_rl.losses.counterfactual import EditFamilySampler
from lemon_rl.losses.counterfactual import floored_proportional
from lemon_rl.losses.fest import adaptive_beta
from lemon_rl.losses.fest import decaying_weight
from lemon_rl.losses.fest import fest_dpo_loss
from lemon_rl.losses.fest import fest_grpo_loss
from lemon_rl.losses.fest import fest_grpo_sft_term
from lemon_rl.losses.fest import semi_online_dpo_loss
from lemon_rl.losses.fest import weighted_log_likelihood_loss
from lemon_rl.losses.policy_gradient import aggregate
from lemon_rl.losses.policy_gradient import AGGREGATIONS
from lemon_rl.losses.policy_gradient import clipped_surrogate_loss
from lemon_rl.losses.policy_gradient import entropy_bonus
from lemon_rl.losses.policy_gradient import grpo_loss
from lemon_rl.losses.policy_gradient import gspo_loss
from lemon_rl.losses.policy_gradient import importance_ratio
from lemon_rl.losses.policy_gradient import KL_ESTIMATORS
from lemon_rl.losses.policy_gradient import kl_k1
from lemon_rl.losses.policy_gradient import kl_k2
from lemon_rl.losses.policy_gradient import kl_k3
from lemon_rl.losses.policy_gradient import kl_penalty
from lemon_rl.losses.policy_gradient import LOG_RATIO_CLAMP
from lemon_rl.losses.policy_gradient import POLICY_LOSS_DEFAULTS
from lemon_rl.losses.policy_gradient import POLICY_LOSSES
from lemon_rl.losses.policy_gradient import PolicyLossDefaults
from lemon_rl.losses.policy_gradient import register_policy_loss
from lemon_rl.losses.policy_gradient import resolve_surrogate_options
from lemon_rl.losses.policy_gradient import seq_mean_token_mean
from lemon_rl.losses.policy_gradient import seq_mean_token_sum
from lemon_rl.losses.policy_gradient import seq_mean_token_sum_norm
from lemon_rl.losses.policy_gradient import token_mean
from lemon_rl.losses.ppow import Acceptance
from lemon_rl.losses.ppow import accepted_length
from lemon_rl.losses.ppow import adaw_probabilities
from lemon_rl.losses.ppow import adaw_sample
from lemon_rl.losses.ppow import criticality
from lemon_rl.losses.ppow import exact_kl
from lemon_rl.losses.ppow import measured_cost_ratio
from lemon_rl.losses.ppow import ppow_loss
from lemon_rl.losses.ppow import sliding_window_scores
from lemon_rl.losses.ppow import speedup_reward
from lemon_rl.losses.ppow import window_advantages
from lemon_rl.losses.ppow import window_metrics
from lemon_rl.losses.ppow import window_rewards
from lemon_rl.losses.ppow import window_scores
from lemon_rl.losses.ppow import WindowRewards
from lemon_rl.losses.surrogate import SurrogateSettings
from lemon_rl.losses.surrogate import surrogate_fields_from_config
from lemon_rl.losses.value import clipped_value_loss
from lemon_rl.losses.value import explained_variance
from lemon_rl.losses.value import explained_variance_from_metrics
from lemon_rl.losses.value import gae
from lemon_rl.losses.value import GAEAdvantages
from lemon_rl.losses.value import StepValues
from lemon_rl.losses.value import steps_to_tokens
from lemon_rl.losses.value import token_values_to_steps
from lemon_rl.losses.value import whiten_advantages
