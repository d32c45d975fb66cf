"""The authorization shell: load the grants a decision needs, ask ``core.authz``, refuse.

One :class:`Authorizer` per broker serves both the wire dispatch (``command_table``) and
the admin HTTP middleware. A request names a :class:`Resource` (a tenant, a namespace or
a topic; a partition or segment is checked as its topic, as Pulsar checks a partition as
its partitioned topic). :meth:`Authorizer.check` reads only what the decision needs:
nothing for an unauthenticated broker (role ``None``), a superuser, or an unscoped need;
otherwise the tenant's ``adminRoles`` and the namespace's ``auth_policies``.

A refusal is :class:`~anabranch.errors.AuthorizationError` naming the role, the action and
the resource the request itself named; a tenant or namespace that does not exist is
refused the same way (what exists is not revealed to a role that may not see it), except
where the caller asks for Pulsar's answer to a missing tenant (``missing_tenant=True``:
PARTITIONED_METADATA, whose handler upstream turns the tenant check's 404 into
TopicNotFound, and clients rely on it).

Example:
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> async def demo(authorizer: Authorizer) -> None:
    ...     topic = Resource.of_topic("persistent://acme/orders/in-partition-3")
    ...     await authorizer.check("app", Need.PRODUCE, topic, "produce")
    ...     try:
    ...         await authorizer.check("app", Need.CONSUME, topic, "consume")
    ...     except AuthorizationError as err:
    ...         print(err)
    >>> async def main() -> None:
    ...     policies = Policies(MemoryMetadataStore())
    ...     await policies.create_cluster("c1")
    ...     await policies.create_tenant("acme")
    ...     await policies.create_namespace("acme/orders")
    ...     await policies.grant_namespace_permission("acme/orders", "app", ["produce"])
    ...     await demo(Authorizer(policies))
    ...     await policies.store.close()
    >>> asyncio.run(main())
    role app is not authorized to consume on persistent://acme/orders/in
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from anabranch.broker.policies import AuthPolicies, Policies
from anabranch.core.authz import Grants, Need, allowed, to_actions
from anabranch.core.names import NamespaceName, SegmentName, parse_name
from anabranch.errors import AuthorizationError, NotFound


@dataclass(frozen=True)
class Resource:
    """What a request acts on: ``tenant``, plus ``namespace`` (``t/ns``) and ``topic`` (a
    base topic name) when it names them."""

    tenant: str | None = None
    namespace: str | None = None
    topic: str | None = None

    @classmethod
    def of_topic(cls, text: str) -> Resource:
        """The resource of a topic, partition or segment name (InvalidArgument if bad).

        Example:
            >>> Resource.of_topic("segment://a/b/c/0000-ffff-0")
            Resource(tenant='a', namespace='a/b', topic='topic://a/b/c')
        """
        name = parse_name(text)
        base = name.topic if isinstance(name, SegmentName) else name.base
        return cls(base.tenant, f"{base.tenant}/{base.namespace}", str(base))

    @classmethod
    def of_namespace(cls, text: str) -> Resource:
        """The resource of ``tenant/namespace``.

        Example:
            >>> Resource.of_namespace("a/b")
            Resource(tenant='a', namespace='a/b', topic=None)
        """
        ns = NamespaceName.parse(text)
        return cls(ns.tenant, str(ns))

    def __str__(self) -> str:
        return self.topic or self.namespace or self.tenant or "the cluster"


NONE_RESOURCE = Resource()


class Authorizer:
    """Decides for one broker (see the module docstring)."""

    def __init__(
        self, policies: Policies, superusers: Iterable[str] = (), *, enforced: bool = True
    ) -> None:
        self.policies = policies
        self.superusers = frozenset(superusers)
        self.enforced = enforced
        """False: Pulsar's ``authorizationEnabled=false`` (only CLUSTER is checked)."""

    def txn_role(self, role: str | None) -> str | None:
        """The role a transaction must be owned by for ``role`` to add to it or end it:
        None (any transaction) with authentication off or for a superuser."""
        return None if role is None or role in self.superusers else role

    async def is_allowed(self, role: str | None, need: Need, resource: Resource) -> bool:
        """Whether ``role`` may do ``need`` on ``resource``."""
        unscoped = role is None or role in self.superusers or not need.scoped
        if unscoped or not self.enforced:
            grants = Grants(superusers=self.superusers)
            return allowed(role, need, grants, enforced=self.enforced)
        return allowed(role, need, await self.grants(resource, need))

    async def check(
        self,
        role: str | None,
        need: Need,
        resource: Resource,
        what: str,
        *,
        named: str | None = None,
        missing_tenant: bool = False,
    ) -> None:
        """Return if allowed; AuthorizationError naming ``what`` and ``named`` (default:
        the resource) if not, or, with ``missing_tenant``, NotFound when the resource's
        tenant does not exist (Pulsar checks the tenant before the grants and answers
        PARTITIONED_METADATA for a missing one with TopicNotFound)."""
        if not await self.is_allowed(role, need, resource):
            if missing_tenant and resource.tenant is not None:
                # Only reached on a refusal: a role allowed in never learns more than before.
                try:
                    await self.policies.get_tenant(resource.tenant)
                except NotFound:
                    # Named as the request named it, not by its metadata path.
                    raise NotFound(f"tenant {resource.tenant}") from None
            shown = str(resource) if named is None else named
            raise AuthorizationError(role or "anonymous", what, shown)

    async def grants(self, resource: Resource, need: Need = Need.LOOKUP) -> Grants:
        """The grants stored for ``resource`` (empty where its tenant/namespace is absent);
        the tenant and the namespace are read concurrently, the namespace only when ``need``
        is a data action."""
        admins, auth = await asyncio.gather(
            self._tenant_admins(resource.tenant),
            self._auth_policies(resource.namespace if need is not Need.TENANT_ADMIN else None),
        )
        topic_auth = auth.destination_auth.get(resource.topic, {}) if resource.topic else {}
        return Grants(
            superusers=self.superusers,
            tenant_admins=admins,
            namespace={role: to_actions(a) for role, a in auth.namespace_auth.items()},
            topic={role: to_actions(a) for role, a in topic_auth.items()},
        )

    async def _tenant_admins(self, tenant: str | None) -> frozenset[str]:
        if tenant is None:
            return frozenset()
        try:
            return frozenset((await self.policies.get_tenant(tenant)).admin_roles)
        except NotFound:
            return frozenset()

    async def _auth_policies(self, namespace: str | None) -> AuthPolicies:
        if namespace is None:
            return AuthPolicies()
        try:
            return (await self.policies.namespace_policies(namespace)).auth_policies
        except NotFound:
            return AuthPolicies()
