"""The one error vocabulary: re-raising a kind with a new message keeps the kind."""

from __future__ import annotations

from gpusnap.errors import (
    KINDS,
    Corrupt,
    GpusnapError,
    Unavailable,
    exit_code_for,
    with_message,
)


class _TwoArgs(Unavailable):
    def __init__(self, detail: str, message: str) -> None:
        super().__init__(message)
        self.detail = detail


def test_with_message_keeps_the_class_when_its_constructor_takes_a_message() -> None:
    err = with_message(Corrupt("chunk x is damaged"), "chunk x is damaged; in checkpoint y")
    assert type(err) is Corrupt
    assert str(err) == "chunk x is damaged; in checkpoint y"


def test_with_message_falls_back_to_the_public_kind_for_other_constructors() -> None:
    original = _TwoArgs("detail", "store down")
    err = with_message(original, "store down; retried 3 times")
    assert type(err) is Unavailable
    assert err.retryable
    assert exit_code_for(err) == exit_code_for(original)
    assert str(err) == "store down; retried 3 times"


def test_every_kind_rebuilds_with_a_message_alone() -> None:
    for kind, cls in KINDS.items():
        err = with_message(cls("a"), "b")
        assert isinstance(err, GpusnapError)
        assert err.kind == kind
