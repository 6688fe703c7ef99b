"""Failure kinds are decided from the exception, never from its text."""

from mstar.runtime.failures import FailureKind, KVCacheExhausted


def test_kinds_of_exceptions():
    assert FailureKind.of(ValueError("x")) is FailureKind.INPUT
    assert FailureKind.of(KVCacheExhausted("x")) is FailureKind.OUT_OF_MEMORY
    assert FailureKind.of(MemoryError()) is FailureKind.OUT_OF_MEMORY
    assert FailureKind.of(RuntimeError("ValueError died")) is FailureKind.INTERNAL  # the text is not read


def test_kind_follows_the_cause_chain():
    try:
        try:
            raise ValueError("bad shape")
        except ValueError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as outer:
        assert FailureKind.of(outer) is FailureKind.INPUT
