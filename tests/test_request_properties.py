"""Property tests (hypothesis) of the request bodies: whatever JSON a client sends, the server's
parsing and mapping either yield a request for the engine or refuse it with a 4xx naming the
problem, never another exception; and the refusal never echoes what the client sent."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from draftwise.sampling.params import SamplingParams
from draftwise.server.handler import describe
from draftwise.server.protocol import ChatCompletionRequest, CompletionRequest
from draftwise.server.requests import (RequestError, Served, ServerLimits, chat_request, completion_request,
                                       completion_requests)

MARKER = "Zq7-marker"  # a value no error message may repeat
SERVED = Served(frozenset({"ngram"}), "ngram")
LIMITS = ServerLimits()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12) | st.just(MARKER),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8)
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
          "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "echo", "suffix", "best_of", "user",
          "ignore_eos", "speculative", "segment", "messages", "tools", "response_format", "max_completion_tokens"]
bodies = st.fixed_dictionaries({"model": st.just("tiny")}, optional={
    name: json_values for name in FIELDS}) | st.dictionaries(st.sampled_from(FIELDS + ["junk", "min_p"]), json_values)


def process(model, mapper, body: dict):
    try:
        parsed = model.model_validate_json(json.dumps(body))
    except ValidationError as error:
        raise describe(error) from None
    return mapper(parsed, LIMITS, SERVED)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_any_completion_body_is_served_or_refused_cleanly(body):
    for model, mapper in ((CompletionRequest, completion_requests), (ChatCompletionRequest, chat_request)):
        try:
            requests = process(model, mapper, body)
        except RequestError as error:
            assert 400 <= error.status < 500
            assert MARKER not in error.message
            assert error.message
        else:
            for request in requests if isinstance(requests, list) else [requests]:  # (a batch: one per prompt)
                assert isinstance(request.params, SamplingParams)


@settings(max_examples=200, deadline=None)
@given(temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.integers(-1, 1000),
       seed=st.none() | st.integers(-2**63, 2**64 - 1), max_tokens=st.integers(1, 4096),
       stop=st.lists(st.text(min_size=1, max_size=20), max_size=4))
def test_valid_sampling_fields_reach_sampling_params_unchanged(temperature, top_p, top_k, seed, max_tokens, stop):
    body = {"model": "tiny", "prompt": "hi", "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "seed": seed, "max_tokens": max_tokens, "stop": stop}
    try:
        params = process(CompletionRequest, completion_request, body).params
    except RequestError as error:  # a stop string that is not valid Unicode text (a lone surrogate)
        assert "stop" in error.message
        return
    assert (params.temperature, params.top_p, params.seed, params.max_tokens, params.stop) == (
        temperature, top_p, seed, max_tokens, stop)
    assert params.top_k == (0 if top_k == -1 else top_k)


def test_a_lone_surrogate_is_refused_as_what_it_is():
    # (the parser says "unexpected end of hex escape" of valid JSON syntax: the refusal says why)
    for raw in ('{"model": "tiny", "prompt": "\\ud800"}', '{"model": "tiny", "prompt": "a\\udc00b"}'):
        try:
            CompletionRequest.model_validate_json(raw)
        except ValidationError as error:
            message = describe(error).message
        assert "not valid JSON" in message and "surrogate pair" in message, message
