"""Cluster mode: N brokers sharing an etcd metadata store (DESIGN.md §1).

* :mod:`.records` - the registry and ownership records and their metadata paths;
* :mod:`.placement` - the pure choice of a broker for an unowned topic;
* :mod:`.ownership` - the broker's session, registry record, topic ownership, lookup
  answers, unload and the stop-serving-on-session-loss guard;
* :mod:`.node` - a cluster broker process (``anabranch broker --config FILE``).
"""
