"""A Jepsen-style fault-injection harness over real processes (issue 19).

A run starts a :class:`~anabranch.testing.faults.cluster.FaultCluster` (etcd, a TCP proxy
per broker in front of etcd, three brokers started through a test-only launcher that
reads a control file), drives workloads (keyed producers with unique values, transactions,
stream, queue and checkpoint consumers, a split/merge storm), injects faults from a seeded
schedule (:mod:`~anabranch.testing.faults.nemesis`), heals everything, reads the topic
in full and checks the recorded history (:mod:`~anabranch.testing.faults.checker`).

Modules, one concept each:

- :mod:`~anabranch.testing.faults.values` -- unique values ``producer/key/counter``;
- :mod:`~anabranch.testing.faults.history` -- the JSONL history (invoke/ok/fail/info);
- :mod:`~anabranch.testing.faults.lineage` -- a key's segments in the final DAG;
- :mod:`~anabranch.testing.faults.checker` -- the pure checker;
- :mod:`~anabranch.testing.faults.txn_checker` -- its transactions part;
- :mod:`~anabranch.testing.faults.control` -- the control file a broker polls;
- :mod:`~anabranch.testing.faults.disk` -- disk faults and lose-unfsynced on a broker;
- :mod:`~anabranch.testing.faults.clock` -- a broker clock that jumps on command;
- :mod:`~anabranch.testing.faults.launcher` -- the test-only broker entry point;
- :mod:`~anabranch.testing.faults.cluster` -- the cluster with its proxies and controls;
- :mod:`~anabranch.testing.faults.nemesis` -- the faults and their seeded schedule;
- :mod:`~anabranch.testing.faults.workload` -- producers, consumers and the storm;
- :mod:`~anabranch.testing.faults.run` -- one seeded run, end to end.

Nothing outside ``anabranch.testing`` imports this package.
"""
