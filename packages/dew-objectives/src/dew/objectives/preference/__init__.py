"""Preference optimisation against a frozen reference (``dpo``)."""
