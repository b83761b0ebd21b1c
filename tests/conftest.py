"""Shared test settings: hypothesis profiles, chosen with LORAHOOK_HYPOTHESIS_PROFILE."""
import os

from hypothesis import HealthCheck, settings

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=_QUIET)
settings.register_profile("dev", max_examples=50, deadline=None, suppress_health_check=_QUIET)
settings.register_profile("thorough", max_examples=2000, deadline=None, suppress_health_check=_QUIET)
settings.load_profile(os.environ.get("LORAHOOK_HYPOTHESIS_PROFILE", "ci"))
