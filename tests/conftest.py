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

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
