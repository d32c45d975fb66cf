"""``anabranch admin namespaces|topics grant-permission|revoke-permission|permissions``.

As pulsar-admin: ``--role`` names the role and ``--actions`` the comma-separated actions
(``produce``, ``consume``). A ``topic://`` name addresses a scalable topic, anything else
a persistent one.

Example:
    $ anabranch admin namespaces grant-permission acme/orders --role app --actions produce,consume
    $ anabranch admin topics permissions persistent://acme/orders/in --output json
    $ anabranch admin topics revoke-permission acme/orders/in --role app
"""

from __future__ import annotations

from typing import Annotated

import typer

from anabranch.cli.admin import OutputOpt, _run, namespaces_app, topics_app

RoleOpt = Annotated[str, typer.Option("--role", help="The role to grant to or revoke from.")]
ActionsOpt = Annotated[
    str, typer.Option("--actions", help="Comma-separated actions: produce, consume.")
]


def _actions(text: str) -> list[str]:
    """``produce, consume`` → ``['produce', 'consume']``.

    Example:
        >>> _actions("produce, consume")
        ['produce', 'consume']
    """
    return [part.strip() for part in text.split(",") if part.strip()]


@namespaces_app.command("permissions")
def namespaces_permissions(namespace: str, output: OutputOpt = None) -> None:
    """Roles and their actions on a namespace."""
    _run(lambda c: c.namespace_permissions(namespace), output, f"permissions on {namespace}")


@namespaces_app.command("grant-permission")
def namespaces_grant(
    namespace: str, role: RoleOpt, actions: ActionsOpt, output: OutputOpt = None
) -> None:
    """Grant a role actions on a namespace (replacing its grant there)."""
    _run(lambda c: c.grant_namespace_permission(namespace, role, _actions(actions)), output,
         f"granted {actions} on {namespace} to {role}")  # fmt: skip


@namespaces_app.command("revoke-permission")
def namespaces_revoke(namespace: str, role: RoleOpt, output: OutputOpt = None) -> None:
    """Revoke a role's grant on a namespace."""
    _run(lambda c: c.revoke_namespace_permission(namespace, role), output,
         f"revoked {role} on {namespace}")  # fmt: skip


@topics_app.command("permissions")
def topics_permissions(topic: str, output: OutputOpt = None) -> None:
    """Roles and their actions on a topic (namespace grants included)."""
    _run(lambda c: c.permissions(topic), output, f"permissions on {topic}")


@topics_app.command("grant-permission")
def topics_grant(topic: str, role: RoleOpt, actions: ActionsOpt, output: OutputOpt = None) -> None:
    """Grant a role actions on one topic."""
    _run(lambda c: c.grant_permission(topic, role, _actions(actions)), output,
         f"granted {actions} on {topic} to {role}")  # fmt: skip


@topics_app.command("revoke-permission")
def topics_revoke(topic: str, role: RoleOpt, output: OutputOpt = None) -> None:
    """Revoke a role's grant on one topic."""
    _run(lambda c: c.revoke_permission(topic, role), output, f"revoked {role} on {topic}")
