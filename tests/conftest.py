import os

from hypothesis import HealthCheck, settings

# Tests never need the network or a W&B account.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Deterministic in CI (the same examples every run); more examples locally with HYPOTHESIS_PROFILE=dev.
settings.register_profile(
    "ci", max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
