"""Shared pytest setup: float32 everywhere, no GPU/TPU probing."""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture
def pmap_variant_on_one_device():
  """chex skips ``with_pmap`` variants on one device; run them (pmap over the one device pytest sees)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  import chex  # pylint: disable=g-import-not-at-top,unused-import  (defines the flag)
  flag = flags.FLAGS["chex_skip_pmap_variant_if_single_device"]
  saved, flag.value = flag.value, False
  yield
  flag.value = saved
