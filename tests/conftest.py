"""Session fixtures: one real appliance (real vLLM CPU engine) shared by the API tests."""

from __future__ import annotations

import pytest

from tests.support import RunningAppliance, start_appliance


@pytest.fixture(scope="session")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> RunningAppliance:
    running = start_appliance(tmp_path_factory.mktemp("appliance"))
    try:
        running.wait_ready()
    except BaseException:
        running.stop()
        raise
    yield running
    running.stop()


@pytest.fixture()
def oai(appliance: RunningAppliance):
    import openai

    return openai.OpenAI(base_url=f"{appliance.url}/v1", api_key="unused-on-loopback", max_retries=0, timeout=120)
