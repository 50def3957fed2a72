"""Sampling from the decoder: the jitted generate loop, the sampling distribution it draws from (shared with
the learner), and lossless speculative decoding."""

from lemon_rl.sampling.distribution import filter_logits, sample, sampling_log_probs, sampling_logits
from lemon_rl.sampling.sampler import SampleOutput, generate, left_pad, prompt_bucket, right_pad
from lemon_rl.sampling.speculative import (Drafter, GreedyAgreement, ModelDrafter, SpeculativeOutput,
                                          SpeculativeStats, compare_coupled, compare_greedy,
                                          speculative_generate)
