"""The official `openai` SDK through the gateway: streaming, non-streaming, and its typed errors for ours."""

from __future__ import annotations

import openai
import pytest

from gateway.settings import GatewaySettings, TierSettings
from gateway.testing import FixedSource, one_variant_table, run_gateway, stubs

KEY = "sk-sdk-test-key-1"


def sdk(url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def test_openai_sdk_streaming_and_not() -> None:
    async with (
        stubs(2, tokens=6) as ws,
        run_gateway(FixedSource(one_variant_table("smollm2", ws)), {KEY: "standard"}) as gw,
    ):
        client = sdk(gw.url)
        stream = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=6
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == "tok0 tok1 tok2 tok3 tok4 tok5 "

        answer = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert answer.choices[0].message.content == "tok0 tok1 tok2 "
        assert answer.usage is not None and answer.usage.completion_tokens == 3

        completion = await client.completions.create(model="smollm2", prompt="once", max_tokens=2)
        assert completion.choices[0].text == "tok0 tok1 "
        models = await client.models.list()
        assert [m.id for m in models.data] == ["smollm2"]
        await client.close()


async def test_openai_sdk_raises_its_typed_errors() -> None:
    tiers = (TierSettings(name="standard", priority=1, requests_per_minute=1),)
    s = GatewaySettings(tiers=tiers)
    async with (
        stubs(1, tokens=10) as ws,
        run_gateway(FixedSource(one_variant_table("smollm2", ws)), {KEY: "standard"}, s) as gw,
    ):
        with pytest.raises(openai.AuthenticationError):
            await sdk(gw.url, "sk-wrong-key-123").chat.completions.create(model="smollm2", messages=[])
        client = sdk(gw.url)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=[])
        ws[0].mode = "midstream"
        stream = await client.chat.completions.create(model="smollm2", messages=[], stream=True)
        got: list[str] = []
        with pytest.raises(openai.APIError, match="mid-stream"):
            async for c in stream:
                got.append(c.choices[0].delta.content or "")
        assert got == ["tok0 ", "tok1 "]  # what arrived before the failure, then the error
        with pytest.raises(openai.RateLimitError) as e:
            await client.chat.completions.create(model="smollm2", messages=[])
        assert e.value.response.headers["retry-after"]
        await client.close()
