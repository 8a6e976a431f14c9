"""bench --endpoint counts tokens, not events, and agrees with the server's usage."""
import pytest

from sarathi_rt.measure.http_replay import EndpointError, agree_with_usage, tokens_in


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
