"""The SDK types an answer is parsed into are built before the call is sent (issue 49 §5): the
openai client builds its deferred pydantic models while it parses a process's first answer,
seconds of CPU between the provider's last byte and the step's record."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runs.engine.sdk_types import protocol_of

ROOT = Path(__file__).resolve().parent.parent

#: In a fresh process (this one may have built them already): the first streamed answer of the
#: responses API, through the Agents SDK's model, after `build_for`; prints the classes built
#: while the answer was read.
FIRST_ANSWER = """
import asyncio, importlib, pkgutil, sys, pydantic
from agents import ModelSettings, OpenAIResponsesModel, set_tracing_disabled
from agents.models.interface import ModelTracing
from openai import AsyncOpenAI
from runs.engine import sdk_types

set_tracing_disabled(True)
model = OpenAIResponsesModel("stepguard-demo", AsyncOpenAI(base_url=sys.argv[1], api_key="k"))
types = importlib.import_module("openai.types.responses")
classes = [
    v for info in pkgutil.iter_modules(types.__path__, "openai.types.responses.")
    for v in vars(importlib.import_module(info.name)).values()
    if isinstance(v, type) and issubclass(v, pydantic.BaseModel)
]

async def main():
    if sys.argv[2] == "build":
        await sdk_types.abuild_for(model)
    before = {c for c in classes if c.__pydantic_complete__}
    settings = ModelSettings(extra_headers={"Idempotency-Key": "first"})
    async for _ in model.stream_response(
        "SCRIPT: answer", "hello", settings, [], None, [], ModelTracing.DISABLED
    ):
        pass
    print(len({c for c in classes if c.__pydantic_complete__} - before))

asyncio.run(main())
"""


def built_while_answering(url: str, how: str) -> int:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", FIRST_ANSWER, url, how],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return int(done.stdout.split()[-1])


def test_nothing_is_built_between_the_first_answers_last_byte_and_its_record(demo_model):
    url = os.environ["STEPGUARD_MODEL_BASE_URL"]
    assert built_while_answering(url, "cold") > 20  # what the first answer used to build
    assert built_while_answering(url, "build") == 0
    assert demo_model.total == 2


@pytest.mark.parametrize(
    ("where", "protocol"),
    [
        ("openai.resources.responses.responses.AsyncResponses", "responses"),
        ("openai.resources.chat.completions.completions.Completions", "chat"),
        ("anthropic.resources.messages.messages.AsyncMessages", "anthropic"),
        ("agents.models.openai_chatcompletions.OpenAIChatCompletionsModel", "chat"),
        ("pydantic_ai.models.anthropic.AnthropicModel", "anthropic"),
        ("pydantic_ai.models.openai.OpenAIResponsesModel", "responses"),
        ("builtins.dict", None),
    ],
)
def test_the_protocol_is_read_from_the_client_or_the_frameworks_model(where, protocol):
    module, name = where.rsplit(".", 1)
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert protocol_of(cls) == protocol
