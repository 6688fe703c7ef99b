"""Stream buffers apply pushes in stream order whatever order they arrive in, and end only once
every announced item arrived (pushes and the end come from different processes)."""

from mstar.graph import FixedChunkPolicy, SlidingWindowChunkPolicy
from mstar.runtime.streams import StreamBuffer


def drain(buf, node="n", name="x"):
    out = []
    while (c := buf.pull(node, name)) is not None and c.items:
        out.append(list(c.items))
    return out


def test_out_of_order_pushes_and_early_end():
    buf = StreamBuffer()
    f = lambda: SlidingWindowChunkPolicy(window=3, stride=1)  # noqa: E731
    buf.end("p", {("n", "x"): 5})  # the end overtook every push
    assert not buf.all_ended({"p"}) and not buf.has_pending()  # 5 items announced, none here yet
    buf.push("n", "x", "p", f, [3, 4], offset=3)
    assert drain(buf) == [] and not buf.all_ended({"p"})
    buf.push("n", "x", "p", f, [0, 1, 2], offset=0)
    assert drain(buf) == [[0, 1, 2], [1, 2, 3], [2, 3, 4]]
    assert buf.all_ended({"p"})


def test_end_of_empty_stream_and_continue_after_done():
    buf = StreamBuffer()
    f = lambda: FixedChunkPolicy(chunk_size=2, continue_after_done=True)  # noqa: E731
    buf.push("n", "x", "p", f, [7], offset=0)
    assert buf.pull("n", "x") is None
    buf.end("p", {("n", "x"): 1})
    last = buf.pull("n", "x")
    assert last.items == (7,) and last.is_final
    again = buf.pull("n", "x")  # a consumer that keeps running sees an empty final chunk
    assert again.items == () and again.is_final


def test_an_empty_push_after_the_end_changes_nothing():
    """A producer step that streams nothing (an LM token that carries no audio) may reach the
    consumer after the stream's end: it must not reopen or break the finished stream."""
    buf = StreamBuffer()
    f = lambda: FixedChunkPolicy(chunk_size=2)  # noqa: E731
    buf.push("n", "x", "p", f, [1, 2], offset=0)
    buf.end("p", {("n", "x"): 2})
    buf.push("n", "x", "p", f, [], offset=2)
    buf.push("n", "x", "p", f, [], offset=0)
    assert drain(buf) == [[1, 2]] and buf.all_ended({"p"})


def test_a_stream_that_announced_nothing_ends_at_once():
    buf = StreamBuffer()
    buf.end("p", {("n", "x"): 0})
    assert buf.all_ended({"p"}) and buf.pull("n", "x") is None
