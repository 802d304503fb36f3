"""Hypothesis profile for the ops tests: no example database (keeps the repo clean), no deadline."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "hybridcache-ops",
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("hybridcache-ops")
