"""Rules shared by the embedded backends: commit conditions and argument checks."""

from __future__ import annotations

from anabranch.errors import BadVersion, InvalidArgument
from anabranch.metadata.api import (
    Check,
    Op,
    Put,
    Session,
    sequential_name,
    validate_path,
    validate_prefix,
)


def check_condition(op: Op, version: int, create_revision: int) -> None:
    """Raise BadVersion unless ``op``'s conditions hold for a key in this state.

    ``version == 0`` (and ``create_revision == 0``) describe an absent key.

    >>> check_condition(Put("/a", b"", expected_version=0), version=0, create_revision=0)
    """
    if op.expected_version is not None and op.expected_version != version:
        raise BadVersion(op.path, op.expected_version, version)
    if (
        isinstance(op, Check)
        and op.expected_create_revision is not None
        and op.expected_create_revision != create_revision
    ):
        raise BadVersion(op.path, op.expected_create_revision, create_revision)


def session_ids(ops: list[Op]) -> set[int]:
    """Sessions the Puts of a commit attach keys to."""
    return {op.session_id for op in ops if isinstance(op, Put) and op.session_id is not None}


def session_id_of(session: Session | None) -> int | None:
    if session is None:
        return None
    if not isinstance(session, Session):
        raise InvalidArgument(f"not a metadata session: {session!r}")
    return session.id


def validate_sequential_prefix(prefix: str) -> str:
    """A sequential prefix must make a valid path once the counter is appended."""
    validate_prefix(prefix)
    validate_path(sequential_name(prefix, 0))
    return prefix


def validate_range(start: str, end: str) -> None:
    if not isinstance(start, str) or not isinstance(end, str):
        raise InvalidArgument(f"range bounds must be strings: {start!r}, {end!r}")


def validate_revision(revision: int | None, what: str) -> None:
    if revision is not None and (not isinstance(revision, int) or revision < 0):
        raise InvalidArgument(f"{what} must be None or a revision >= 0: {revision!r}")


def children_prefix(path: str) -> str:
    """The prefix of the keys below ``path``."""
    validate_path(path)
    return "/" if path == "/" else path + "/"
