"""Integrations with model libraries (each an optional extra of the ``cakeops`` distribution)."""
