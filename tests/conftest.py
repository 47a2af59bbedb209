"""Test settings shared by the whole suite."""

import os

import torch
from hypothesis import HealthCheck, settings

# Property tests: enough examples to find edge cases, bounded so the suite stays fast on 2 CPU cores.
settings.register_profile("default", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=1000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# One intra-op thread for the whole suite: the models here are tiny, and on a 2-core machine a second
# thread only adds an OpenMP barrier per small matmul (10-50x slower when trainer and agent threads
# share the cores). Tests that need more set it themselves.
torch.set_num_threads(1)
