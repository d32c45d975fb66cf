"""The broker's autoscale policies: ``scalable_autoscale_*`` defaults under namespace and
topic overrides, and the :class:`~anabranch.scalable.autoscaler.Autoscaler` it runs.

A namespace's overrides are the ``scalableAutoscale`` object of its policies; a topic's
live under the scalable topic's own metadata (``.../autoscale``). Both are partial
camelCase :class:`~anabranch.core.autoscale.AutoscalePolicy` records; the one in force is
``defaults.overridden(namespace).overridden(topic)``.

Example:
    >>> from anabranch.broker.config import BrokerConfig
    >>> policy = autoscale_defaults(BrokerConfig(scalable_autoscale_split_sustain_s=2.5))
    >>> policy.enabled, policy.split_sustain_ms
    (False, 2500)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anabranch.core.autoscale import AutoscalePolicy
from anabranch.core.names import TopicName
from anabranch.errors import NotFound
from anabranch.scalable.autoscaler import Autoscaler, read_topic_overrides

if TYPE_CHECKING:
    from anabranch.broker.config import BrokerConfig
    from anabranch.broker.service import BrokerService


def autoscale_defaults(config: BrokerConfig) -> AutoscalePolicy:
    """The broker-level policy from its ``scalable_autoscale_*`` settings."""
    c = config
    return AutoscalePolicy(
        enabled=c.scalable_autoscale_enabled,
        split_msg_rate_in=c.scalable_autoscale_split_msg_rate_in,
        split_throughput_in=c.scalable_autoscale_split_throughput_in,
        split_msg_rate_out=c.scalable_autoscale_split_msg_rate_out,
        split_throughput_out=c.scalable_autoscale_split_throughput_out,
        split_backlog=c.scalable_autoscale_split_backlog,
        min_segments=c.scalable_autoscale_min_segments,
        max_segments=c.scalable_autoscale_max_segments,
        target_segments=c.scalable_autoscale_target_segments,
        merge_low_water=c.scalable_autoscale_merge_low_water,
        split_sustain_ms=round(c.scalable_autoscale_split_sustain_s * 1000),
        merge_sustain_ms=round(c.scalable_autoscale_merge_sustain_s * 1000),
        split_cooldown_ms=round(c.scalable_autoscale_split_cooldown_s * 1000),
        merge_cooldown_ms=round(c.scalable_autoscale_merge_cooldown_s * 1000),
    )


class BrokerAutoscalePolicies:
    """Resolves the policy in force for a scalable topic on one broker."""

    def __init__(self, service: BrokerService) -> None:
        self.service = service

    def defaults(self) -> AutoscalePolicy:
        """The broker's defaults (validated: a bad combination fails at start)."""
        return autoscale_defaults(self.service.config).validate()

    async def namespace_policy(self, namespace: str) -> AutoscalePolicy:
        """The defaults under the namespace's overrides."""
        policy = self.defaults()
        try:
            ns = await self.service.policies.namespace_policies(namespace)
        except NotFound:
            return policy
        return policy.overridden(ns.scalable_autoscale or {})

    async def policy_of(self, topic: TopicName) -> AutoscalePolicy:
        """The policy in force for ``topic``."""
        policy = await self.namespace_policy(f"{topic.tenant}/{topic.namespace}")
        return policy.overridden(await read_topic_overrides(self.service.store, topic) or {})


def broker_autoscaler(service: BrokerService) -> Autoscaler:
    """The autoscaler of ``service``'s scalable-topic controllers (not started)."""
    policies = BrokerAutoscalePolicies(service)
    policies.defaults()
    return Autoscaler(
        service.scalable,
        policies.policy_of,
        interval_s=service.config.scalable_autoscale_interval_s,
        on_give_up=service.fatal.fail,
    )
