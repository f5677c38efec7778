"""Running a shard on several nodes: etcd as the configuration store (``etcd.py``, a
Trio client of its JSON gateway) and leadership, epochs and the in-sync set of one shard
(``leader.py``). See docs/architecture.md, "Cluster configuration in etcd"."""
