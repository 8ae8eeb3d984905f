"""The CLI's SSE parser: events, ids, multi-line data, comments."""

from jobs.client import parse_sse


def test_parse_sse_messages() -> None:
    lines = [
        ": heartbeat",
        "",
        "event: status",
        "id: 0-1",
        'data: {"status": "running"}',
        "",
        "event: metrics",
        "id: 5-1",
        'data: {"step": 1,',
        'data:  "metrics": {"loss/sft": 2.5}}',
        "",
        "event: end",
        "data: {}",
        "",
    ]
    messages = list(parse_sse(iter(lines)))
    assert [(m.event, m.id) for m in messages] == [("status", "0-1"), ("metrics", "5-1"), ("end", "5-1")]
    assert messages[0].data == {"status": "running"}
    assert messages[1].data == {"step": 1, "metrics": {"loss/sft": 2.5}}
