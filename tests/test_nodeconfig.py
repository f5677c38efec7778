"""One typed node configuration and one assembly (issue 43): ``rallypoint serve``'s
flags fill one :class:`~rallypoint.nodeconfig.NodeConfig` -- a cluster node's
``MemberConfig`` holds the same typed storage and snapshot options, no option dicts --
and :func:`~rallypoint.nodeconfig.start_serving` is what sets a serving coordinator up,
for a single node and for each leadership of a cluster node."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from rallypoint import cli
from rallypoint.cluster.member import MemberConfig, ShardMember
from rallypoint.node import open_node
from rallypoint.nodeconfig import (
    NodeConfig, RetentionOptions, ServingOptions, SnapshotOptions, StorageOptions, start_serving,
)
from rallypoint.transport.server import Server


def _serve_args(*flags):
    """``serve`` flags parsed, with what ``cmd_serve`` derives before it serves."""
    args = cli.build_parser().parse_args(["serve", *flags])
    args.retention = {"retain_finished_ms": 3_600_000, "retain_events": None, "retain_events_ms": 86_400_000}
    args.limits = {"runs": 7}
    return args


def test_the_flags_fill_one_typed_config_that_a_cluster_node_shares():
    common = ["--data-dir", "/tmp/rp-cfg", "--interval-ms", "25", "--watch-stall", "7",
              "--http-idempotency-hours", "2", "--snapshot-every-records", "500", "--slow-request-ms", "250"]
    single = cli.node_config(_serve_args(*common))
    assert single.member is None and single.data_dir == "/tmp/rp-cfg"
    assert single.storage.interval_ms == 25
    assert single.storage.retention == RetentionOptions(retain_finished_ms=3_600_000, retain_events_ms=86_400_000)
    assert single.snapshots.every_records == 500
    assert single.serving == ServingOptions(limits={"runs": 7}, watch_stall_s=7.0, idempotency_ttl_ms=7_200_000,
                                            slow_request_s=0.25)
    node = cli.node_config(_serve_args(*common, "--cluster", "etcd://127.0.0.1:2379", "--node", "n1"))
    m = node.member
    assert isinstance(m, MemberConfig) and m.node == "n1" and m.data_dir == "/tmp/rp-cfg"
    assert m.storage is node.storage and m.snapshots is node.snapshots  # one set of options, not a copy
    assert node.storage == single.storage and node.serving == single.serving


def test_a_cluster_node_without_a_data_dir_or_a_name_is_refused_from_its_flags():
    from rallypoint.errors import ValidationError

    with pytest.raises(ValidationError, match="needs a data dir"):
        cli.node_config(_serve_args("--durability", "memory", "--cluster", "etcd://127.0.0.1:2379", "--node", "n1"))
    with pytest.raises(ValidationError, match="needs --node"):
        cli.node_config(_serve_args("--cluster", "etcd://127.0.0.1:2379"))


def test_no_field_of_the_node_configuration_is_an_untyped_dict():
    # (issue 43: MemberConfig passed node_options / serve_options dicts read with .get)
    for cls in (NodeConfig, StorageOptions, SnapshotOptions, RetentionOptions, MemberConfig):
        hints = typing.get_type_hints(cls, globalns=vars(__import__(cls.__module__, fromlist=["x"])) | {
            "Clock": object, "Storage": object, "MemberConfig": MemberConfig, "EtcdAccess": object})
        for f in dataclasses.fields(cls):
            assert hints[f.name] not in (dict, typing.Any) or f.name in ("peer_tls", "disk"), (cls.__name__, f.name)


async def test_start_serving_sets_a_coordinator_up_from_the_serving_options():
    opts = ServingOptions(limits={"runs": 3}, watch_stall_s=7.5, idempotency_ttl_ms=1234, slow_request_s=0.5)
    async with open_node(None) as node:
        server = Server(node.service)
        metrics = start_serving(node, server, opts)
        coord = node.coordinator
        assert coord.limits.values["runs"] == 3
        assert coord.watchers.stall_s == 7.5 and coord.idempotency.ttl_ms == 1234
        assert server.metrics is metrics and metrics.slow_s == 0.5
        assert coord.connections is server and coord.connection_count() == 0


async def test_a_cluster_node_opens_its_data_dir_with_its_storage_options(tmp_path):
    # the options reach recovered() typed (once read with .get("clock") from a dict)
    cfg = MemberConfig(etcd=["http://127.0.0.1:1"], node="n1", data_dir=str(tmp_path / "n1"),
                       storage=StorageOptions(sync_helper="thread", interval_ms=40,
                                              retention=RetentionOptions(retain_events=40)))
    member = ShardMember(cfg, make_server=lambda d: None)
    async with member._recovered() as rec:
        assert rec.coordinator.events.retain_count == 40
        assert rec.coordinator.journal.interval_s == 0.04
