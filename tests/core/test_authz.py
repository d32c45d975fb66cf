"""The authorization decision against a plain model (hypothesis), plus its helpers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch.core.authz import (
    Action,
    Grants,
    Need,
    allowed,
    parse_actions,
    to_actions,
    validate_role,
)
from anabranch.errors import InvalidArgument

ROLES = ["root", "admin", "alice", "bob", "eve"]
role_names = st.sampled_from(ROLES)
actions = st.frozensets(st.sampled_from(list(Action)))
role_actions = st.dictionaries(role_names, actions, max_size=4)
grants = st.builds(
    Grants,
    superusers=st.frozensets(role_names, max_size=2),
    tenant_admins=st.frozensets(role_names, max_size=2),
    namespace=role_actions,
    topic=role_actions,
)


def model(role: str | None, need: Need, g: Grants, enforced: bool = True) -> bool:
    """The rules written out as a table lookup, one line per kind of role."""
    if role is None:
        return True  # authentication off: as before authorization existed
    if need in (Need.NONE, Need.OWNED, Need.AUTHENTICATED):
        return True
    if role in g.superusers:
        return True
    if not enforced:  # authorization off: only the cluster calls stay the superusers'
        return need is not Need.CLUSTER
    if need in (Need.SUPERUSER, Need.CLUSTER):
        return False
    if role in g.tenant_admins:
        return True
    held = g.namespace.get(role, frozenset()) | g.topic.get(role, frozenset())
    data = {Action.PRODUCE, Action.CONSUME}
    return {
        Need.TENANT_ADMIN: False,
        Need.PRODUCE: Action.PRODUCE in held,
        Need.CONSUME: Action.CONSUME in held,
        Need.LOOKUP: bool(held & data),
        Need.NAMESPACE: bool(held & data),
    }[need]


@given(st.none() | role_names, st.sampled_from(list(Need)), grants, st.booleans())
def test_decision_matches_the_model(
    role: str | None, need: Need, g: Grants, enforced: bool
) -> None:
    assert allowed(role, need, g, enforced=enforced) == model(role, need, g, enforced)


@given(role_names, grants)
def test_more_grants_never_take_a_permission_away(role: str, g: Grants) -> None:
    everything = frozenset(Action)
    wider = Grants(
        superusers=g.superusers,
        tenant_admins=g.tenant_admins,
        namespace={**g.namespace, role: everything},
        topic=g.topic,
    )
    for need in Need:
        if allowed(role, need, g):
            assert allowed(role, need, wider), need


def test_other_actions_grant_no_data_access() -> None:
    g = Grants(namespace={"fn": frozenset({Action.FUNCTIONS, Action.SINKS})})
    assert not any(allowed("fn", n, g) for n in (Need.LOOKUP, Need.PRODUCE, Need.CONSUME))


def test_a_topic_grant_adds_to_the_namespace_grant() -> None:
    g = Grants(
        namespace={"app": frozenset({Action.CONSUME})},
        topic={"app": frozenset({Action.PRODUCE})},
    )
    assert allowed("app", Need.PRODUCE, g) and allowed("app", Need.CONSUME, g)
    assert not allowed("app", Need.TENANT_ADMIN, g)


def test_tenant_admin_is_not_superuser() -> None:
    g = Grants(tenant_admins=frozenset({"ops"}))
    assert allowed("ops", Need.TENANT_ADMIN, g) and allowed("ops", Need.PRODUCE, g)
    assert not allowed("ops", Need.SUPERUSER, g)
    assert not allowed("ops", Need.CLUSTER, g)


def test_scoped_needs() -> None:
    assert {n for n in Need if n.scoped} == {
        Need.LOOKUP,
        Need.PRODUCE,
        Need.CONSUME,
        Need.NAMESPACE,
        Need.TENANT_ADMIN,
    }


def test_parse_actions() -> None:
    assert parse_actions(["produce", "consume", "produce"]) == ["consume", "produce"]
    assert parse_actions(["functions"]) == ["functions"]
    for bad in (["write"], [1], ["Produce"]):
        with pytest.raises(InvalidArgument):
            parse_actions(bad)
    assert to_actions(["produce", "gone"]) == frozenset({Action.PRODUCE})


@pytest.mark.parametrize("role", ["", "a/b", "x" * 256, "tab\there"])
def test_bad_roles_are_refused(role: str) -> None:
    with pytest.raises(InvalidArgument):
        validate_role(role)


def test_good_roles() -> None:
    for role in ("alice", "CN=client,O=acme", "svc@example.com", "x" * 255):
        assert validate_role(role) == role
