"""The server's speculation: what a request may ask of a server without a default drafter, and the
drafter options of `draftwise serve` reaching the per-request drafters that take them."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from draftwise.cli import build_parser  # noqa: E402
from draftwise.cli.serve import build_server  # noqa: E402
from draftwise.errors import InvalidParameterError  # noqa: E402
from draftwise.server.protocol import CompletionRequest  # noqa: E402
from draftwise.server.requests import RequestError, Served, ServerLimits, completion_request  # noqa: E402


@pytest.mark.parametrize("speculative", [{"num_speculative_tokens": 3}, {"enabled": True}])
def test_speculation_asked_of_a_plain_server_without_a_method_names_the_field(speculative):
    body = CompletionRequest(model="m", prompt="hi", speculative=speculative)
    with pytest.raises(RequestError) as error:
        completion_request(body, ServerLimits(), Served(frozenset({"ngram", "suffix"}), None))
    assert error.value.status == 400 and error.value.param == "speculative.method"
    assert "ngram" in error.value.message
    with pytest.raises(RequestError, match="'nope' is not served"):  # (a bad value is refused even when off)
        completion_request(CompletionRequest(model="m", prompt="hi", speculative={"enabled": False, "method": "nope"}),
                           ServerLimits(), Served(frozenset({"ngram"}), "ngram"))
    asked = completion_request(CompletionRequest(model="m", prompt="hi", speculative={"method": "ngram"}),
                               ServerLimits(), Served(frozenset({"ngram"}), None))
    assert asked.options["speculative"]["method"] == "ngram"


def _serve_args(tiny_qwen, *flags):
    return build_parser().parse_args(["serve", "--model", str(tiny_qwen), "--max-model-len", "128", *flags])


def test_drafter_options_of_serve_reach_the_per_request_drafters_that_take_them(tiny_qwen, drafting_pays):
    args = _serve_args(tiny_qwen, "--per-request-methods", "suffix,ngram", "--suffix-cache-mb", "0",
                       "--suffix-max-branches", "1", "--prompt-lookup-max", "2")
    _, engine = build_server(args, announce=False)
    drafters = engine.llm.engine.drafters
    assert drafters["suffix"].proposer.cache is None and drafters["suffix"].proposer.options.suffix_max_branches == 1
    assert drafters["ngram"].proposer.max_n == 2


def test_serve_refuses_an_unknown_per_request_method_and_an_option_no_drafter_takes(tiny_qwen):
    with pytest.raises(InvalidParameterError, match="unknown method.*'sufix'"):
        build_server(_serve_args(tiny_qwen, "--per-request-methods", "sufix"), announce=False)
    with pytest.raises(InvalidParameterError, match="--draft-branches need --method"):
        build_server(_serve_args(tiny_qwen, "--per-request-methods", "suffix", "--draft-branches", "2"),
                     announce=False)
