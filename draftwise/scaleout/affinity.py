"""The affinity key of a request: what should keep hitting the same replica.

- a session the client names: the `X-Session-Id` header, or the body's `user` field;
- a chat: its system messages and first user message (every turn of one conversation starts with
  them, so its turns meet the prefix cache and the suffix index that know the conversation);
- a completion: the first PROMPT_KEY_CHARS characters of the prompt (a shared prompt's head).
Nothing else (no body, another path, unreadable JSON): no key, so least outstanding requests.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

PROMPT_KEY_CHARS = 1024


def affinity_key(path: str, headers: Mapping[str, str], body: bytes) -> str | None:
    try:
        return _key(path, headers, body)
    except RecursionError:  # (JSON nested past Python's limit: the replica refuses it by name)
        return None


def _key(path: str, headers: Mapping[str, str], body: bytes) -> str | None:
    session = headers.get("x-session-id")
    if session:
        return "session:" + session
    if not body or path not in ("/v1/chat/completions", "/v1/completions"):
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if isinstance(request.get("user"), str) and request["user"]:
        return "user:" + request["user"]
    if path == "/v1/chat/completions":
        return _digest("chat", _conversation_start(request.get("messages")))
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return _digest("prompt", prompt[:PROMPT_KEY_CHARS]) if isinstance(prompt, str) and prompt else None


def _conversation_start(messages) -> list | None:
    """The system messages up to and with the first user message."""
    if not isinstance(messages, list):
        return None
    start = []
    for message in messages:
        start.append(message)
        if isinstance(message, dict) and message.get("role") == "user":
            break
    return start or None


def _digest(kind: str, value) -> str | None:
    if value is None:
        return None
    return kind + ":" + hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=12).hexdigest()
