"""The model endpoint the demo agents use, from the environment.

STEPGUARD_MODEL_BASE_URL, STEPGUARD_MODEL_API_KEY and STEPGUARD_MODEL name a real
OpenAI-compatible endpoint. Unset, the agents talk to the scripted demo model that `make run`
serves on 127.0.0.1 (examples/model_server.py): not a language model, labelled as such.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when a client is made: a worker starts about 0.8 s sooner
    from openai import AsyncOpenAI, OpenAI

DEMO_MODEL = "stepguard-demo"


def model_name() -> str:
    return os.environ.get("STEPGUARD_MODEL", DEMO_MODEL)


def _settings() -> dict:
    base_url = os.environ.get("STEPGUARD_MODEL_BASE_URL")
    if not base_url:
        raise RuntimeError(
            "no model endpoint: set STEPGUARD_MODEL_BASE_URL (make run serves the demo model)"
        )
    return {
        "base_url": base_url,
        "api_key": os.environ.get("STEPGUARD_MODEL_API_KEY", "demo-key-not-a-secret"),
        # Stepguard retries steps itself, with the same idempotency key.
        "max_retries": 0,
        "timeout": 60,
    }


def client() -> OpenAI:
    from openai import OpenAI

    return OpenAI(**_settings())


def async_client() -> AsyncOpenAI:
    from openai import AsyncOpenAI

    return AsyncOpenAI(**_settings())
