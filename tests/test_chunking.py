"""Property tests for mstar.graph.chunking (chunk policies for streaming edges)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mstar.graph.chunking as chunking_mod
from mstar.graph.chunking import (
    Chunk,
    ChunkPolicy,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
)

SETTINGS = settings(max_examples=100, deadline=None)


# --------------------------------------------------------------------------- helpers
class Rec:
    """One chunk as observed by a driver: which call returned it and the counts around it."""

    def __init__(self, chunk: Chunk, before: int, after: int, from_finish: bool) -> None:
        self.chunk = chunk
        self.before = before  # stream count before the call that returned it
        self.after = after  # stream count after that call
        self.from_finish = from_finish


def drive(policy: ChunkPolicy, stream: list, sizes: list[int]) -> tuple[list[Rec], list[int]]:
    """Push ``stream`` in batches of ``sizes`` (rest in one last push), then finish.

    Returns the observed chunks and ``buffered`` after each call; checks the bound on
    memory and the bookkeeping counters after every call.
    """
    recs: list[Rec] = []
    buffered: list[int] = []
    pos = 0
    batches = []
    for s in sizes:
        s = min(s, len(stream) - pos)
        batches.append(stream[pos : pos + s])
        pos += s
    batches.append(stream[pos:])
    for batch in batches:
        before = policy.total
        out = policy.push(batch)
        assert policy.total == before + len(batch)
        recs.extend(Rec(c, before, policy.total, False) for c in out)
        buffered.append(policy.buffered)
        assert policy.buffered <= policy.max_buffered
        assert policy.pending == policy.total - policy.delivered
        assert not policy.done
    fin = policy.finish()
    assert policy.done
    assert policy.buffered == 0
    recs.extend(Rec(c, policy.total, policy.total, True) for c in fin)
    return recs, buffered


def chunks_of(recs: list[Rec]) -> list[Chunk]:
    return [r.chunk for r in recs]


def check_common(recs: list[Rec], stream: list) -> None:
    """Invariants shared by every policy."""
    chunks = chunks_of(recs)
    # Every item delivered as new exactly once, in order (by identity, not copy).
    new = [x for c in chunks for x in c.new_items]
    assert len(new) == len(stream)
    assert all(a is b for a, b in zip(new, stream))
    prev_end = 0
    for r in recs:
        c = r.chunk
        # Each chunk is the contiguous stream slice starting at c.start.
        assert list(c.items) == stream[c.start : c.end]
        assert all(a is b for a, b in zip(c.items, stream[c.start : c.end]))
        assert c.num_context == c.new_start - c.start >= 0
        assert c.new_start == prev_end  # new parts tile the stream
        prev_end = c.end
        if not r.from_finish:
            assert not c.is_final
            # Fired as early as possible: during the push that delivered its last item.
            assert r.before < c.end <= r.after
            assert c.num_new > 0
    fin = [r for r in recs if r.from_finish]
    assert len(fin) <= 1
    if fin:
        assert recs[-1].from_finish and recs[-1].chunk.is_final
    assert sum(c.is_final for c in chunks) == len(fin)


def signature(recs: list[Rec]) -> list[tuple]:
    """What a chunk sequence looks like independent of push splitting."""
    return [(r.chunk.items, r.chunk.start, r.chunk.new_start, r.chunk.is_final, r.from_finish) for r in recs]


def one_by_one(policy: ChunkPolicy, stream: list) -> list[Rec]:
    return drive(policy, stream, [1] * len(stream))[0]


streams = st.integers(0, 150).map(lambda n: [object() for _ in range(n)])
split_sizes = st.lists(st.integers(0, 40), max_size=30)


# ------------------------------------------------------------------ fixed chunks
@SETTINGS
@given(streams, split_sizes, st.integers(1, 20), st.booleans())
def test_fixed_properties(stream, sizes, chunk_size, cont):
    recs, _ = drive(FixedChunkPolicy(chunk_size, continue_after_done=cont), stream, sizes)
    check_common(recs, stream)
    chunks = chunks_of(recs)
    pushed = [r.chunk for r in recs if not r.from_finish]
    assert all(c.num_context == 0 for c in chunks)  # no overlap
    assert all(len(c.items) == chunk_size for c in pushed)
    assert [c.end for c in pushed] == list(range(chunk_size, len(stream) + 1, chunk_size))
    remainder = len(stream) % chunk_size
    fin = [r.chunk for r in recs if r.from_finish]
    if remainder:
        assert len(fin) == 1 and len(fin[0].items) == remainder
    elif cont:
        assert fin == [Chunk(items=(), start=len(stream), new_start=len(stream), is_final=True)]
    else:
        assert fin == []
    assert signature(recs) == signature(one_by_one(FixedChunkPolicy(chunk_size, cont), stream))


# ---------------------------------------------------------------- sliding window
@st.composite
def window_stride(draw):
    window = draw(st.integers(1, 30))
    stride = draw(st.integers(1, window))
    return window, stride


@SETTINGS
@given(streams, split_sizes, window_stride())
def test_sliding_window_properties(stream, sizes, ws):
    window, stride = ws
    recs, buffered = drive(SlidingWindowChunkPolicy(window, stride), stream, sizes)
    check_common(recs, stream)
    n = len(stream)
    pushed = [r.chunk for r in recs if not r.from_finish]
    fin = [r.chunk for r in recs if r.from_finish]
    assert all(len(c.items) == window for c in pushed)
    assert [c.end for c in pushed] == list(range(window, n + 1, stride))
    starts = [c.start for c in pushed]
    assert all(b - a == stride for a, b in zip(starts, starts[1:]))
    for i, c in enumerate(pushed):
        assert c.new_start == (0 if i == 0 else c.start + window - stride)
    # Final flush.
    last_end = pushed[-1].end if pushed else 0
    if n > last_end:
        assert len(fin) == 1
        f = fin[0]
        assert f.end == n and f.start == max(0, n - window) and f.new_start == last_end
        if pushed:
            assert 1 <= f.start - pushed[-1].start < stride
    else:
        assert fin == []
    assert signature(recs) == signature(one_by_one(SlidingWindowChunkPolicy(window, stride), stream))


# ------------------------------------------------------------------ left context
@SETTINGS
@given(streams, split_sizes, st.integers(1, 20), st.integers(0, 30))
def test_left_context_properties(stream, sizes, chunk, left):
    recs, _ = drive(LeftContextChunkPolicy(chunk, left), stream, sizes)
    check_common(recs, stream)
    n = len(stream)
    pushed = [r.chunk for r in recs if not r.from_finish]
    fin = [r.chunk for r in recs if r.from_finish]
    for c in chunks_of(recs):
        assert list(c.context_items) == stream[max(0, c.new_start - left) : c.new_start]
    assert all(c.num_new == chunk for c in pushed)
    assert [c.end for c in pushed] == list(range(chunk, n + 1, chunk))
    if n % chunk:
        assert len(fin) == 1 and fin[0].num_new == n % chunk
    else:
        assert fin == []
    assert signature(recs) == signature(one_by_one(LeftContextChunkPolicy(chunk, left), stream))


def ramp_ends(n: int, chunk: int, first: int) -> list[int]:
    """Where the chunks of a ramped LeftContextChunkPolicy end, for a stream of n items."""
    ends, size, end = [], first, first
    while end <= n:
        ends.append(end)
        size = min(chunk, 2 * size)
        end += size
    return ends


@SETTINGS
@given(streams, split_sizes, st.integers(1, 20), st.integers(0, 30), st.integers(1, 20))
def test_left_context_with_a_ramped_first_chunk(stream, sizes, chunk, left, first):
    first = min(first, chunk)
    make = lambda: LeftContextChunkPolicy(chunk, left, first_chunk=first)  # noqa: E731
    recs, _ = drive(make(), stream, sizes)
    check_common(recs, stream)
    for c in chunks_of(recs):
        assert list(c.context_items) == stream[max(0, c.new_start - left) : c.new_start]
    ends = ramp_ends(len(stream), chunk, first)
    assert [r.chunk.end for r in recs if not r.from_finish] == ends
    fin = [r.chunk for r in recs if r.from_finish]
    assert len(fin) == (len(stream) > (ends[-1] if ends else 0))
    assert signature(recs) == signature(one_by_one(make(), stream))


def test_ramped_first_chunk_schedule_and_errors():
    assert ramp_ends(100, 25, 5) == [5, 15, 35, 60, 85]
    with pytest.raises(ValueError, match="first_chunk"):
        LeftContextChunkPolicy(chunk=4, left_context=0, first_chunk=5)


# ------------------------------------------------------------- bounded memory
@pytest.mark.parametrize(
    "factory, bound",
    [
        (lambda: FixedChunkPolicy(16), 16),
        (lambda: FixedChunkPolicy(5, continue_after_done=True), 5),
        (lambda: SlidingWindowChunkPolicy(window=28, stride=7), 28),
        (lambda: SlidingWindowChunkPolicy(window=10, stride=10), 10),
        (lambda: LeftContextChunkPolicy(chunk=25, left_context=25), 50),
        (lambda: LeftContextChunkPolicy(chunk=3, left_context=0), 3),
        (lambda: LeftContextChunkPolicy(chunk=25, left_context=25, first_chunk=5), 50),
    ],
)
def test_bounded_memory_long_stream(factory, bound):
    policy = factory()
    assert policy.max_buffered == bound
    batch_sizes = [0, 1, 2, 3, 7, 50, 13, 1]
    n = 0
    for i in range(3000):
        s = batch_sizes[i % len(batch_sizes)]
        policy.push(range(n, n + s))
        n += s
        assert policy.buffered <= bound
    assert policy.total == n
    policy.finish()
    assert policy.buffered == 0


@SETTINGS
@given(streams, split_sizes, window_stride(), st.integers(1, 20), st.integers(0, 30))
def test_buffer_holds_exactly_what_can_still_be_delivered(stream, sizes, ws, chunk, left):
    """buffered equals the number of items a future chunk could still contain."""
    window, stride = ws
    cases = [
        (FixedChunkPolicy(chunk), lambda p: p.total - p.delivered),
        (SlidingWindowChunkPolicy(window, stride), lambda p: min(p.total, window)),
        (LeftContextChunkPolicy(chunk, left), lambda p: p.total - max(0, p.delivered - left)),
    ]
    for policy, expected in cases:
        pos = 0
        for s in [*sizes, len(stream)]:
            policy.push(stream[pos : pos + s])
            pos = min(pos + s, len(stream))
            assert policy.buffered == expected(policy)


# --------------------------------------------------------------- explicit examples
def test_orpheus_one_by_one_70():
    policy = SlidingWindowChunkPolicy(window=28, stride=7)
    fired_at = []
    chunks = []
    for i in range(70):
        out = policy.push([i])
        if out:
            assert len(out) == 1
            fired_at.append(i + 1)
            chunks.extend(out)
    assert fired_at == [28, 35, 42, 49, 56, 63, 70]
    assert [c.start for c in chunks] == [0, 7, 14, 21, 28, 35, 42]
    assert [c.new_start for c in chunks] == [0, 28, 35, 42, 49, 56, 63]
    assert chunks[0].items == tuple(range(28))
    assert chunks[-1].items == tuple(range(42, 70))
    assert policy.finish() == []
    assert policy.done


def test_orpheus_tail_flush():
    policy = SlidingWindowChunkPolicy(window=28, stride=7)
    out = policy.push(list(range(73)))
    assert [c.start for c in out] == [0, 7, 14, 21, 28, 35, 42]
    (fin,) = policy.finish()
    assert fin == Chunk(items=tuple(range(45, 73)), start=45, new_start=70, is_final=True)
    assert fin.num_context == 25 and fin.new_items == (70, 71, 72)


def test_sliding_short_stream():
    policy = SlidingWindowChunkPolicy(window=28, stride=7)
    assert policy.push("abcde") == []
    assert policy.finish() == [Chunk(items=tuple("abcde"), start=0, new_start=0, is_final=True)]
    assert SlidingWindowChunkPolicy(4, 2).finish() == []


def test_qwen3_omni_left_context():
    policy = LeftContextChunkPolicy(chunk=25, left_context=25)
    out = policy.push(range(80))
    assert [(c.start, c.new_start, c.end) for c in out] == [(0, 0, 25), (0, 25, 50), (25, 50, 75)]
    (fin,) = policy.finish()
    assert (fin.start, fin.new_start, fin.end, fin.is_final) == (50, 75, 80, True)
    assert fin.items == tuple(range(50, 80))


def test_fixed_examples():
    p = FixedChunkPolicy(4)
    assert [c.items for c in p.push(range(10))] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert p.finish() == [Chunk(items=(8, 9), start=8, new_start=8, is_final=True)]

    p = FixedChunkPolicy(4)
    assert len(p.push(range(8))) == 2
    assert p.finish() == []

    p = FixedChunkPolicy(4, continue_after_done=True)
    assert len(p.push(range(8))) == 2
    assert p.finish() == [Chunk(items=(), start=8, new_start=8, is_final=True)]

    assert FixedChunkPolicy(3, continue_after_done=True).finish() == [Chunk((), 0, 0, True)]
    assert FixedChunkPolicy(3).finish() == []


def test_one_push_can_fire_several_chunks():
    p = SlidingWindowChunkPolicy(window=4, stride=1)
    out = p.push(range(7))
    assert [c.start for c in out] == [0, 1, 2, 3]
    assert [c.new_start for c in out] == [0, 4, 5, 6]


def test_push_accepts_iterables_and_empty():
    p = FixedChunkPolicy(2)
    assert p.push([]) == []
    assert p.push(()) == []
    assert [c.items for c in p.push(x for x in "abc")] == [("a", "b")]
    assert p.total == 3 and p.delivered == 2 and p.pending == 1 and p.buffered == 1


@pytest.mark.parametrize(
    "factory",
    [
        lambda: FixedChunkPolicy(3),
        lambda: FixedChunkPolicy(3, continue_after_done=True),
        lambda: SlidingWindowChunkPolicy(5, 2),
        lambda: LeftContextChunkPolicy(3, 2),
    ],
)
def test_push_or_finish_after_finish_raises(factory):
    p = factory()
    p.push([1, 2, 3, 4])
    p.finish()
    with pytest.raises(RuntimeError):
        p.push([5])
    with pytest.raises(RuntimeError):
        p.push([])
    with pytest.raises(RuntimeError):
        p.finish()


@pytest.mark.parametrize(
    "make",
    [
        lambda: FixedChunkPolicy(0),
        lambda: FixedChunkPolicy(-3),
        lambda: FixedChunkPolicy(2.5),
        lambda: FixedChunkPolicy(True),
        lambda: SlidingWindowChunkPolicy(0, 1),
        lambda: SlidingWindowChunkPolicy(5, 0),
        lambda: SlidingWindowChunkPolicy(5, 6),
        lambda: SlidingWindowChunkPolicy("28", 7),
        lambda: LeftContextChunkPolicy(0, 0),
        lambda: LeftContextChunkPolicy(5, -1),
        lambda: LeftContextChunkPolicy(5, None),
    ],
)
def test_bad_constructor_args(make):
    with pytest.raises(ValueError):
        make()


def test_constructor_edge_values_ok():
    SlidingWindowChunkPolicy(5, 5)
    SlidingWindowChunkPolicy(1, 1)
    LeftContextChunkPolicy(1, 0)
    FixedChunkPolicy(1)


def test_chunk_helpers_and_validation():
    c = Chunk(items=[10, 11, 12, 13], start=3, new_start=5)
    assert c.items == (10, 11, 12, 13)  # coerced to a tuple
    assert c.num_context == 2 and c.num_new == 2 and c.end == 7
    assert c.context_items == (10, 11) and c.new_items == (12, 13)
    assert not c.is_final
    with pytest.raises(ValueError):
        Chunk(items=(1,), start=0, new_start=2)
    with pytest.raises(ValueError):
        Chunk(items=(1,), start=2, new_start=1)
    with pytest.raises(ValueError):
        Chunk(items=(), start=-1, new_start=-1)


def test_factory_instances_are_independent():
    factory = lambda: SlidingWindowChunkPolicy(window=3, stride=1)  # noqa: E731
    a, b = factory(), factory()
    assert len(a.push(range(5))) == 3
    assert b.total == 0 and b.push([0, 1]) == []
    a.finish()
    assert not b.done


def test_module_is_pure_python():
    tree = ast.parse(Path(chunking_mod.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            roots.add(node.module.split(".")[0])
    assert roots <= set(sys.stdlib_module_names), roots - set(sys.stdlib_module_names)
