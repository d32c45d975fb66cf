"""The authorization decision: role + what a request needs + the stored grants → allow/deny.

Pulsar's model, as a pure function (no I/O; the broker's shell loads the grants):

* a **superuser** (config ``superuser_roles``; also the cluster role brokers and the
  controller use) may do everything;
* a **tenant admin** (the tenant's ``adminRoles``) may do everything inside its tenant:
  administer namespaces and topics, grant permissions, produce and consume;
* a role granted **actions** on a namespace (``produce``, ``consume``; Pulsar's other
  action names are stored and ignored) has them on every topic of the namespace; a grant
  on a topic adds actions for that topic only (a partition or segment counts as its
  topic).

What a request needs (:class:`Need`)::

    Need            allowed for (role not None)                        Pulsar's check
    NONE            everyone (handshake, keepalive)                    -
    OWNED           everyone: acts on a producer/consumer of this      (checked at creation)
                    connection, whose creation was checked
    AUTHENTICATED   any role                                           -
    LOOKUP          produce or consume on the topic                    canLookup
    PRODUCE         produce on the topic                               canProduce
    CONSUME         consume on the topic                               canConsume
    NAMESPACE       produce or consume on the namespace (list topics)  GET_TOPICS
    TENANT_ADMIN    tenant admin of the resource's tenant              validateTenantAdmin
    SUPERUSER       superuser only                                     validateSuperUser
    CLUSTER         superuser only (broker/controller calls)           validateSuperUser

Superusers pass every row; tenant admins pass every row but SUPERUSER and CLUSTER for
resources of their tenant. ``role is None`` means authentication is off (the standalone
default): everything is allowed, as before authorization existed. With authentication on
but authorization off (``authorization_enabled = false``, Pulsar's default), every role
passes every row but CLUSTER: broker-to-broker and controller calls stay the superusers'.

Example:
    >>> grants = Grants(namespace={"app": frozenset({Action.CONSUME})})
    >>> allowed("app", Need.CONSUME, grants), allowed("app", Need.PRODUCE, grants)
    (True, False)
    >>> allowed("app", Need.LOOKUP, grants), allowed(None, Need.SUPERUSER, grants)
    (True, True)
    >>> allowed("root", Need.CLUSTER, Grants(superusers=frozenset({"root"})))
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum

from anabranch.errors import InvalidArgument


class Action(StrEnum):
    """An action a role may be granted on a namespace or topic (Pulsar's ``AuthAction``)."""

    PRODUCE = "produce"
    CONSUME = "consume"
    FUNCTIONS = "functions"
    SOURCES = "sources"
    SINKS = "sinks"
    PACKAGES = "packages"


class Need(Enum):
    """What a wire command or HTTP route requires (see the module docstring's table)."""

    NONE = "none"
    OWNED = "owned"
    AUTHENTICATED = "authenticated"
    LOOKUP = "lookup"
    PRODUCE = "produce"
    CONSUME = "consume"
    NAMESPACE = "namespace"
    TENANT_ADMIN = "tenant-admin"
    SUPERUSER = "superuser"
    CLUSTER = "cluster"

    @property
    def scoped(self) -> bool:
        """Whether deciding needs a resource (a tenant, namespace or topic) and its grants.

        Example:
            >>> Need.PRODUCE.scoped, Need.SUPERUSER.scoped
            (True, False)
        """
        return self in _SCOPED


_SCOPED = frozenset({Need.LOOKUP, Need.PRODUCE, Need.CONSUME, Need.NAMESPACE, Need.TENANT_ADMIN})
_OPEN = frozenset({Need.NONE, Need.OWNED, Need.AUTHENTICATED})

Actions = frozenset[Action]


@dataclass(frozen=True)
class Grants:
    """The stored facts one decision reads, for one resource.

    ``namespace`` and ``topic`` map a role to its actions on the resource's namespace and
    on the topic itself (empty for a namespace-level resource).
    """

    superusers: frozenset[str] = frozenset()
    tenant_admins: frozenset[str] = frozenset()
    namespace: Mapping[str, Actions] = field(default_factory=dict)
    topic: Mapping[str, Actions] = field(default_factory=dict)

    def actions(self, role: str) -> Actions:
        """The role's actions on the resource (namespace grants plus topic grants)."""
        return self.namespace.get(role, frozenset()) | self.topic.get(role, frozenset())


def allowed(role: str | None, need: Need, grants: Grants, *, enforced: bool = True) -> bool:
    """Whether ``role`` may do what ``need`` says, given ``grants`` (module docstring).

    ``enforced=False`` is Pulsar's ``authorizationEnabled=false``: any authenticated role
    may do everything but the CLUSTER calls, which stay the superusers'.

    Example:
        >>> allowed("app", Need.TENANT_ADMIN, Grants(), enforced=False)
        True
        >>> allowed("app", Need.CLUSTER, Grants(), enforced=False)
        False
    """
    if role is None or need in _OPEN:
        return True
    if role in grants.superusers:
        return True
    if not enforced:
        return need is not Need.CLUSTER
    if need in (Need.SUPERUSER, Need.CLUSTER):
        return False
    if role in grants.tenant_admins:
        return True
    if need is Need.TENANT_ADMIN:
        return False
    actions = grants.actions(role)
    if need is Need.PRODUCE:
        return Action.PRODUCE in actions
    if need is Need.CONSUME:
        return Action.CONSUME in actions
    # LOOKUP and NAMESPACE: either data action (a NAMESPACE resource has no topic grants).
    return Action.PRODUCE in actions or Action.CONSUME in actions


def parse_actions(names: Iterable[object]) -> list[str]:
    """Validate a grant's action names (Pulsar's spelling); sorted, without repeats.

    Example:
        >>> parse_actions(["consume", "produce", "consume"])
        ['consume', 'produce']
        >>> parse_actions(["write"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        anabranch.errors.InvalidArgument: unknown action 'write' (known: consume, ...)
    """
    known = {a.value for a in Action}
    out: set[str] = set()
    for name in names:
        if not isinstance(name, str) or name not in known:
            raise InvalidArgument(f"unknown action {name!r} (known: {', '.join(sorted(known))})")
        out.add(name)
    return sorted(out)


def to_actions(names: Iterable[str]) -> Actions:
    """Stored action names as :class:`Action` values (unknown names are skipped).

    Example:
        >>> sorted(to_actions(["produce", "bogus"]))
        [<Action.PRODUCE: 'produce'>]
    """
    known = {a.value for a in Action}
    return frozenset(Action(n) for n in names if n in known)


ROLE_CHARS_MAX = 255
"""Longest role name a grant accepts (a role is a metadata map key, not a path)."""


def validate_role(role: str) -> str:
    """A role name to grant to: 1..255 printable characters, no ``/``.

    Example:
        >>> validate_role("alice@example.com")
        'alice@example.com'
        >>> validate_role("")
        Traceback (most recent call last):
        ...
        anabranch.errors.InvalidArgument: role '' must be 1..255 printable characters without '/'
    """
    if not 0 < len(role) <= ROLE_CHARS_MAX or not role.isprintable() or "/" in role:
        raise InvalidArgument(
            f"role {role[:ROLE_CHARS_MAX]!r} must be 1..{ROLE_CHARS_MAX} printable characters"
            " without '/'"
        )
    return role
