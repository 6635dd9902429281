"""Fixtures of the chaos modules."""

from tests.chaos.scenario import patient_starts  # noqa: F401 - a fixture both chaos modules use
