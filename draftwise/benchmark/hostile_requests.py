"""A catalogue of hostile and malformed requests, each with the answer a hardened server must give.

The abuse tests send them beside ordinary streams and check every answer; the server-load suite's
abuse variant sends them in a burst. Each is one HTTP request described as data: method, path,
body (JSON value, or raw bytes), headers, and the expected status with a fragment of the error
message (and the `param`, where one is named).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True, slots=True)
class Hostile:
    name: str
    status: int
    fragment: str  # must appear in error.message
    path: str = "/v1/completions"
    method: str = "POST"
    json: object = None  # a JSON body, or None
    content: bytes | None = None  # a raw body instead
    headers: dict = field(default_factory=dict)
    param: str | None = None  # the error's param, where the answer names one

    def send(self, client: httpx.Client) -> httpx.Response:
        headers = {"content-type": "application/json", **self.headers} if self.content is not None else self.headers
        return client.request(self.method, self.path, json=self.json, content=self.content, headers=headers)

    async def send_async(self, client: httpx.AsyncClient) -> httpx.Response:
        headers = {"content-type": "application/json", **self.headers} if self.content is not None else self.headers
        return await client.request(self.method, self.path, json=self.json, content=self.content, headers=headers)

    def problems(self, response: httpx.Response) -> list[str]:
        """What is wrong with the server's answer (empty: it answered as it must)."""
        if response.status_code != self.status:
            return [f"{self.name}: status {response.status_code}, expected {self.status}: {response.text[:200]}"]
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return [f"{self.name}: the body is not an OpenAI error: {response.text[:200]}"]
        problems = []
        if set(error) != {"message", "type", "param", "code"}:
            problems.append(f"{self.name}: error keys {sorted(error)}")
        if self.fragment not in str(error.get("message")):
            problems.append(f"{self.name}: message {error.get('message')!r} lacks {self.fragment!r}")
        if self.param is not None and error.get("param") != self.param:
            problems.append(f"{self.name}: param {error.get('param')!r}, expected {self.param!r}")
        return problems


def catalogue(model: str, max_request_bytes: int) -> list[Hostile]:
    """Every hostile request, for a server serving `model` with this body limit."""
    def completion(**fields) -> dict:
        return {"model": model, "prompt": "hi", "max_tokens": 4, **fields}

    def chat(**fields) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}

    refused = [(name, value) for name, value in (
        ("spaces_between_special_tokens", True),)]
    chat_refused = [(name, value) for name, value in (
        ("functions", [{"name": "f"}]), ("modalities", ["text", "audio"]),
        ("store", True), ("reasoning_effort", "high"), ("prediction", {"type": "content", "content": "x"}))]
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
    return [
        Hostile("top_k past the vocabulary", 400, "top_k", json=completion(top_k=2**63)),
        Hostile("seed past 64 bits", 400, "seed", json=completion(seed=2**64)),
        Hostile("a lone surrogate", 400, "not valid JSON", content=(
            '{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 4}' % model).encode()),
        Hostile("NaN temperature", 400, "finite", content=(
            '{"model": "%s", "prompt": "hi", "temperature": NaN}' % model).encode()),
        Hostile("a body over the limit", 413, "larger than", content=b'{"model": "x", "prompt": "'
                + b"a" * (max_request_bytes + 10) + b'"}'),
        Hostile("a prompt longer than any context", 400, "context", json=completion(
            prompt="word " * (max_request_bytes // 6)), param="prompt"),
        Hostile("ten thousand stop strings", 400, "stop", json=completion(stop=[f"s{i}" for i in range(10_000)]),
                param="stop"),
        Hostile("an unknown model on chat", 404, "does not exist", path="/v1/chat/completions",
                json=chat(model="gpt-9"), param="model"),
        Hostile("a string for an integer", 400, "max_tokens", json=completion(max_tokens="10")),
        Hostile("true for a number", 400, "temperature", json=completion(temperature=True)),
        Hostile("a string for a boolean", 400, "stream", json=completion(stream="yes")),
        Hostile("an unknown field", 400, "mirostat_tau", json=completion(mirostat_tau=5.0), param="mirostat_tau"),
        Hostile("stream_options without stream", 400, "stream_options", json=completion(
            stream_options={"include_usage": True})),
        Hostile("malformed JSON", 400, "not valid JSON", content=b"{not json"),
        Hostile("an unknown path", 404, "no route", path="/v1/nothing", method="GET"),
        Hostile("the wrong method", 405, "not allowed", path="/v1/completions", method="GET"),
        Hostile("a DNS-rebinding Host", 400, "not allowed", json=completion(), headers={"host": "evil.example"}),
        Hostile("an image part", 400, "image_url", path="/v1/chat/completions", json=chat(messages=[image])),
        Hostile("best_of below n", 400, "best_of", json=completion(n=3, best_of=2)),
        Hostile("best_of streamed", 400, "best_of", json=completion(n=1, best_of=2, stream=True), param="best_of"),
        Hostile("prompt_logprobs past 20", 400, "prompt_logprobs", json=completion(prompt_logprobs=50)),
        Hostile("a penalty out of range", 400, "presence_penalty", json=completion(presence_penalty=5.0)),
        Hostile("a logit bias past the vocabulary", 400, "logit_bias", json=completion(logit_bias={"99999999": 5})),
        Hostile("top_logprobs without logprobs", 400, "top_logprobs", path="/v1/chat/completions",
                json=chat(top_logprobs=3), param="top_logprobs"),
        Hostile("a tool message without its call id", 400, "tool_call_id", path="/v1/chat/completions",
                json=chat(messages=[{"role": "tool", "content": "42"}])),
        Hostile("a response_format of an unknown type", 400, "response_format.type", path="/v1/chat/completions",
                json=chat(response_format={"type": "grammar"})),
        Hostile("a JSON Schema with a typo", 400, "Invalid type: strin", path="/v1/chat/completions",
                json=chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "strin"}}})),
        Hostile("a JSON Schema keyword not enforced", 400, "uniqueItems", json=completion(
            guided_json={"type": "array", "uniqueItems": True}), param="guided_json"),
        Hostile("a regex that does not compile", 400, "unclosed group", json=completion(guided_regex="[0-9]+(")),
        Hostile("two output constraints", 400, "one output constraint", json=completion(
            guided_regex="a+", guided_choice=["a"])),
        Hostile("a tool of an unknown type", 400, "tools[0]", path="/v1/chat/completions",
                json=chat(tools=[{"type": "web_search"}])),
        Hostile("tool_choice naming no tool", 400, "tool_choice", path="/v1/chat/completions", json=chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}})),
        Hostile("no messages", 400, "messages", path="/v1/chat/completions", json=chat(messages=[])),
        Hostile("max_tokens past the context", 400, "context", json=completion(max_tokens=10**6)),
        *[Hostile(f"{name} (not implemented)", 400, name, json=completion(**{name: value}), param=name)
          for name, value in refused],
        *[Hostile(f"chat {name} (not implemented)", 400, name, path="/v1/chat/completions",
                  json=chat(**{name: value}), param=name) for name, value in chat_refused],
    ]
