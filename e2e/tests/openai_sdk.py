"""Drives kvgate-sim with the official `openai` Python SDK (streaming and not).

Usage: openai_sdk.py BASE_URL MODEL. Exits non-zero on the first failed check.
"""
import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)

models = client.models.list()
assert [m.id for m in models.data] == [model], models

c = client.completions.create(model=model, prompt="Say hello", max_tokens=5,
                              extra_body={"ignore_eos": True})
assert c.object == "text_completion", c
assert c.choices[0].finish_reason == "length", c
assert c.usage.completion_tokens == 5, c.usage
assert c.usage.prompt_tokens_details.cached_tokens == 0, c.usage

chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4,
    extra_body={"ignore_eos": True})
assert chat.choices[0].message.role == "assistant", chat
assert chat.choices[0].message.content, chat
assert chat.usage.completion_tokens == 4, chat.usage

stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=6,
    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
text, usage, reasons = "", None, []
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for ch in chunk.choices:
        text += ch.delta.content or ""
        if ch.finish_reason:
            reasons.append(ch.finish_reason)
assert text, "streamed no text"
assert reasons == ["length"], reasons
assert usage is not None and usage.completion_tokens == 6, usage
# The same conversation again hits the prefix cache.
assert usage.prompt_tokens_details is not None

cstream = client.completions.create(model=model, prompt="abc " * 40, max_tokens=3, stream=True,
                                    extra_body={"ignore_eos": True})
pieces = [ch.choices[0].text for ch in cstream if ch.choices]
assert len(pieces) == 3, pieces

again = client.completions.create(model=model, prompt="abc " * 40, max_tokens=1)
assert again.usage.prompt_tokens_details.cached_tokens > 0, again.usage

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    raise AssertionError("expected NotFoundError")
except openai.NotFoundError as e:
    assert "does not exist" in str(e), e

try:
    client.completions.create(model=model, prompt="x", max_tokens=10**6)
    raise AssertionError("expected BadRequestError")
except openai.BadRequestError as e:
    assert "maximum context length" in str(e), e

print("openai SDK checks passed")
