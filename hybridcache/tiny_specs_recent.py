"""Tiny checkpoint specs of the families added for issue 25, in the same form as ``tiny_specs.FAMILY_SPECS``
(family -> (HF config class name, HF model class name, config values)); kept apart so each file stays short.
``RECENT_EAGER`` lists those built with HF's eager attention path."""

RECENT_SPECS: dict[str, tuple[str, str, dict]] = {}

RECENT_EAGER: set[str] = set()
