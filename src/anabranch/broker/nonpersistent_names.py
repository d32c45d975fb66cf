"""Which ``non-persistent://`` topics a namespace has: the ones loaded somewhere.

Nothing of a non-persistent topic is registered or stored, so a listing is what is
loaded: on this broker, and in cluster mode every topic another broker owns (its
ownership record names it). Topic listings (GET_TOPICS_OF_NAMESPACE in NON_PERSISTENT or
ALL mode, the admin routes) use this.

Example:
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(service: BrokerService) -> None:
    ...     ns = NamespaceName.parse("public/default")
    ...     assert await non_persistent_topic_names(service, ns) == []
    ...     await service.get_non_persistent_topic("non-persistent://public/default/t",
    ...                                            create=True)
    ...     print(await non_persistent_topic_names(service, ns))
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             await demo(broker.service)
    >>> asyncio.run(main())
    ['non-persistent://public/default/t']
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anabranch.broker.cluster.ownership import ClusterOwnership
from anabranch.core.names import NamespaceName, TopicDomain, TopicName

if TYPE_CHECKING:
    from anabranch.broker.service import BrokerService


async def non_persistent_topic_names(service: BrokerService, ns: NamespaceName) -> list[str]:
    """The namespace's loaded non-persistent topics, sorted (see the module docstring)."""
    names = {
        topic.name
        for topic in service.loaded_non_persistent_topics()
        if TopicName.parse(topic.name).namespace_name == ns
    }
    ownership = service.ownership
    if isinstance(ownership, ClusterOwnership):
        names.update(await ownership.ownerships(f"{TopicDomain.NON_PERSISTENT.value}://{ns}/"))
    return sorted(names)
