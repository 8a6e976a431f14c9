"""bench --endpoint counts tokens, not events, and agrees with the server's usage."""
from pathlib import Path

import pytest

from sarathi_rt.harness.http_replay import EndpointError, StreamTokens, agree_with_usage, tokens_in


def test_an_event_carries_the_tokens_it_reports() -> None:
    assert tokens_in({"text": "ab", "token_ids": [5, 6, 7]}) == 3
    assert tokens_in({"text": "ab", "logprobs": {"tokens": ["a", "b"]}}) == 2
    assert tokens_in({"text": "a"}) == 1 and tokens_in({"delta": {"content": "a"}}) == 1
    assert tokens_in({"text": "", "finish_reason": "length"}) == 0  # the final empty event
    assert tokens_in({"delta": {}, "finish_reason": "stop"}) == 0


def test_counts_agree_with_the_usage() -> None:
    assert agree_with_usage([1.0, 2.0], None) == [1.0, 2.0]
    assert agree_with_usage([1.0, 2.0, 3.0], 2) == [1.0, 2.0]
    # Two tokens merged into the last event (a UTF-8 character split across tokens).
    assert agree_with_usage([1.0, 2.0], 4) == [1.0, 2.0, 2.0, 2.0]
    with pytest.raises(EndpointError, match="streamed none"):
        agree_with_usage([], 3)


def test_a_recorded_llama_cpp_stream_counts_its_usage() -> None:
    """llama-server (llama.cpp 0c1e570, the llama-cpp-python 0.3.36 sdist) streaming 12
    tokens of Japanese: it holds back tokens that end inside a UTF-8 character and sends
    them merged (7 events with text), then an empty final event that carries the usage."""
    lines = (Path(__file__).parent / "data" / "llamacpp_completion_stream.sse").read_text().splitlines()
    stream = StreamTokens("jp")
    fed = 0
    for now, line in enumerate(lines):
        fed += 1
        if not stream.feed(line, float(now)):
            break
    assert fed == len(lines) - 1  # stopped at [DONE]; the blank line after it is not read
    assert len(stream.times) == 7 and stream.completion_tokens == 12
    times = stream.token_times()
    assert len(times) == 12 and times[:7] == stream.times and set(times[7:]) == {stream.times[-1]}


def test_an_error_event_names_the_request() -> None:
    with pytest.raises(EndpointError, match="request 7: .*slot unavailable"):
        StreamTokens(7).feed('data: {"error": {"message": "slot unavailable"}}', 0.0)
