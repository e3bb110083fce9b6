"""The app in this process over httpx's ASGI transport: a request's (status, JSON body), and the official openai
client (async) pointed at it."""
from __future__ import annotations

import asyncio

import httpx
import openai


def post(demo_app, path: str, body: dict | None, **kwargs) -> tuple[int, dict]:
    """POST ``body`` (JSON; or ``content=`` raw bytes) to the app; (status, the JSON answer)."""
    _, app = demo_app

    async def send() -> tuple[int, dict]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            response = await client.post(path, **({"json": body} if body is not None else {}), **kwargs)
            return response.status_code, response.json()
    return asyncio.run(send())


def with_client(demo_app, action):
    """``await action(client)`` with an AsyncOpenAI client on the app; its result."""
    _, app = demo_app

    async def run():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="-", http_client=http,
                                      max_retries=0) as client:
            return await action(client)
    return asyncio.run(run())
