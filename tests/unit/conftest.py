"""Unit tests need neither the engine nor the model: the embedded model's conversion is refused here."""

from __future__ import annotations

import pytest

from tests import support
from tests.unit.appliance.api import scripted_engine


@pytest.fixture(autouse=True)
def _no_model_conversion(monkeypatch):
    def refuse():
        raise AssertionError("a unit test asked for the converted default model; use support.model_stand_in")

    monkeypatch.setattr(support, "default_model_path", refuse)


@pytest.fixture(autouse=True)
def _stop_scripted_engines():
    yield
    scripted_engine.stop_all()
