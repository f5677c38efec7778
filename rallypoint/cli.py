"""The ``rallypoint`` command: ``serve | status | runs | watch | top | claims | pools | quotas | budgets | schedules |
keys | repair | bench``.

``rallypoint serve`` runs the daemon: it logs its address, version, data dir, durability
and what it recovered; SIGINT/SIGTERM drain it (stop accepting, finish in-flight
requests, snapshot) and it exits 0. Exit codes: 0 ok, 1 a command failed, 2 bad usage or
the daemon could not start (data dir locked, corrupt journal, newer format) or a
refused dangerous step (``keys create`` on an open-mode daemon without ``--force``), 141
the reader of stdout went away (``rallypoint ... | head``; nothing is printed).

Client commands print errors as one line, ``rallypoint: CODE: what happened; what to do``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import re
import select
import shlex
import signal
import sys
import time

from typing import TYPE_CHECKING

from ._version import __version__

if TYPE_CHECKING:
    from .cluster.member import MemberConfig
    from .nodeconfig import NodeConfig


class _LazyTrio:
    """``trio``, imported at its first use (then this module's ``trio`` is the module
    itself): ``rallypoint serve`` binds its ports before it (``_bind_listeners``), and
    a command that fails on its arguments never pays for it."""

    def __getattr__(self, name: str):
        import trio as module

        globals()["trio"] = module
        return getattr(module, name)


trio = _LazyTrio()

DEFAULT_LISTEN = "127.0.0.1:7411"
DEFAULT_URL = "tcp://127.0.0.1:7411"
DEFAULT_DATA_DIR = "./rallypoint-data"

log = logging.getLogger("rallypoint")


def _run_id(text: str) -> str:
    """An argparse type: a run id (``scp_...``)."""
    from .ids import is_id

    if not is_id(text, "scp"):
        raise argparse.ArgumentTypeError(f"expected a run id (scp_...), got {text!r}")
    return text


def _bounded(cast, minimum, inclusive: bool = True, maximum=None):
    """An argparse type: ``cast`` (int/float) no smaller than ``minimum`` (or greater
    than it when not ``inclusive``), and at most ``maximum`` if given - a negative limit
    would break every connection."""

    def parse(text: str):
        value = cast(text)
        if value < minimum or (not inclusive and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {minimum} (got {text})")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum} (got {text})")
        return value

    parse.__name__ = cast.__name__  # "invalid int value" in argparse's messages
    return parse


def _event_cursor(text: str):
    """``watch --cursor``: an event's seq (a single node) or the vector string a watch of
    a cluster of several shards printed (``0:120,1:45,2:9``; the SDK checks its shards)."""
    from .client.shardevents import _VECTOR

    t = text.strip()
    if t.isdigit():
        return _bounded(int, 0, maximum=2**63 - 1)(t)
    if _VECTOR.match(t):
        return t
    raise argparse.ArgumentTypeError(f"must be an event's seq, or SHARD:SEQ,... in a cluster of several shards "
                                     f"(got {text})")


_event_cursor.__name__ = "cursor"


#: the URL scheme a listen address may carry, per flag (the form its clients are given:
#: ``--connect tcp://HOST:PORT`` and RALLYPOINT_URL; an HTTP base URL); TLS is --tls-cert
_LISTEN_SCHEMES = {"--listen": "tcp://", "--replication": "tcp://", "--http": "http://", "--metrics": "http://",
                   "--console": "http://"}


def _parse_listen(s: str, flag: str | None = None) -> tuple[str, int]:
    """``HOST:PORT`` (or, as a client would write it, ``tcp://HOST:PORT`` for
    ``--listen``/``--replication`` and ``http://HOST:PORT`` for ``--http``,
    ``--metrics``, ``--console``; any of the two when ``flag`` is None) -> (host, port);
    an empty host is 127.0.0.1. Raises VALIDATION_FAILED, naming ``flag``, on anything
    else (another scheme, a path, a port outside 0-65535)."""
    from .errors import ValidationError

    name = f"{flag} " if flag else ""
    allowed = (_LISTEN_SCHEMES[flag],) if flag in _LISTEN_SCHEMES else tuple(sorted(set(_LISTEN_SCHEMES.values())))
    form = " or ".join(f"{a}HOST:PORT" for a in allowed)
    addr = s
    for scheme in allowed:
        if addr.lower().startswith(scheme):
            addr = addr[len(scheme):].rstrip("/")
            break
    host, sep, port = addr.rpartition(":")
    if "://" in addr:
        tls = " (TLS is --tls-cert/--tls-key)" if addr.lower().startswith(("tls://", "https://")) else ""
        raise ValidationError(f"{name}takes HOST:PORT or {form} (got {s!r}){tls}")
    if "/" in addr:
        raise ValidationError(f"{name}takes an address, HOST:PORT or {form}, not a path (got {s!r})")
    if not sep or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValidationError(f"{name}takes HOST:PORT with a port 0-65535 (got {s!r})")
    return host.strip("[]") or "127.0.0.1", int(port)


def _url_host(host: str) -> str:
    """``host`` as it goes in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _check_listen_free(host: str, port: int) -> None:
    """Before anything touches the data dir: bind (and release) each address ``host``
    resolves to, as the server will, so an address already in use is refused before a
    data dir is created or recovered. (The server's own bind still decides: this only
    moves the common mistake, a second daemon on the same port, ahead of the disk.)

    Raises OSError (EADDRINUSE, EADDRNOTAVAIL) like the server's bind would."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # the server's own bind reports it
    for family, type_, proto, _, addr in infos:
        with socket.socket(family, type_, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Trio's listeners do
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)


def _bind_listeners(host: str, port: int) -> list:
    """Listening sockets on every address ``host`` resolves to (bound and listening, as
    Trio's ``open_tcp_listeners`` makes them: SO_REUSEADDR, IPv6 only on IPv6), made
    first thing by ``serve``, before the heavy imports and the data dir's recovery: a
    client connecting while the daemon (re)starts then waits in the kernel's backlog
    until it is served, instead of being refused (the runstate SDK gives up on a
    refused connect after about 0.7 s, and a lease renewal it gave up on is lost).
    ``[]`` when ``host`` does not resolve (the server's own bind reports it).

    Raises OSError (EADDRINUSE, EADDRNOTAVAIL) when an address cannot be bound."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return []
    socks = []
    try:
        for family, type_, proto, _, addr in infos:
            s = socket.socket(family, type_, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(min(0xFFFF, socket.SOMAXCONN))
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def _inherited_listeners() -> list:
    """Listening TCP sockets handed down by a supervisor, which keeps them open across
    restarts so that no connect is ever refused: systemd's socket activation
    (``LISTEN_FDS`` sockets from fd 3; ``LISTEN_PID``, when set, must be this process) or
    ``RALLYPOINT_LISTEN_FDS`` (fd numbers, comma-separated). Anything that is not a
    listening TCP socket is left alone."""
    import socket

    fds: list[int] = []
    n = os.environ.get("LISTEN_FDS", "")
    if n.isdigit() and os.environ.get("LISTEN_PID", str(os.getpid())) == str(os.getpid()):
        fds += range(3, 3 + int(n))
    fds += [int(x) for x in os.environ.get("RALLYPOINT_LISTEN_FDS", "").split(",") if x.strip().isdigit()]
    out = []
    for fd in fds:
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        if s.type != socket.SOCK_STREAM or not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            s.detach()
            continue
        out.append(s)
    return out


def _take_inherited(inherited: list, host: str, port: int) -> list:
    """The sockets of ``inherited`` bound to ``host:port`` (removed from it)."""
    import socket

    try:
        wanted = {ai[4][:2] for ai in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)}
    except socket.gaierror:
        return []
    mine = [s for s in inherited if s.getsockname()[:2] in wanted]
    for s in mine:
        inherited.remove(s)
    return mine


def _http_max_requests(args) -> int:
    """HTTP requests in progress at once (then 429 CONCURRENCY_LIMITED): twice
    ``--max-connections``. HTTP/1.1 carries one request a connection, so the connection
    limit binds first; the margin is for HTTP/2 streams and for a connection closed to
    make room while its request is still unwinding (at equal limits, the well-behaved got
    429 under scripts/soak_http.py's slow-body attack)."""
    return 2 * args.max_connections


def _trio_listeners(socks: list):
    """``trio.SocketListener`` for each of :func:`_bind_listeners`'s sockets (None: none
    were made, the server binds by itself)."""
    if not socks:
        return None
    return [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in socks]


def _setup_logging(level: str, fmt: str = "text") -> None:
    from .logutil import JsonFormatter, TextFormatter

    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:  # (control characters in a message escaped: one event, one line)
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------------------ serve
def _ssl_context(args):
    """The server's TLS context from --tls-cert/--tls-key (None: plain TCP)."""
    from .errors import ValidationError

    if not (args.tls_cert or args.tls_key):
        return None
    import ssl

    if not (args.tls_cert and args.tls_key):
        raise ValidationError("give both --tls-cert and --tls-key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.tls_cert, args.tls_key)
    return ctx


def _server_factory(args, ssl_context):
    """dispatcher -> a TCP Server with the daemon's connection options."""
    from .transport.server import Server

    def make(dispatcher):
        return Server(
            dispatcher,
            ssl_context=ssl_context,
            max_connections=args.max_connections,
            max_connections_per_peer=args.max_connections_per_peer,
            max_inflight_per_conn=args.max_inflight,
            handshake_timeout=args.handshake_timeout,
            idle_ping_interval=args.idle_ping or None,
            max_outgoing_bytes=args.max_outgoing_bytes,
            watch_buffer_bytes=args.watch_buffer_bytes,
        )

    return make


# --------------------------------------------------------------- listeners' limits
def _listener_flags(s) -> None:
    """The serve flags that bound what one client may hold on the listeners (issue 41)."""
    s.add_argument("--max-connections-per-peer", type=_bounded(int, 0), default=128,
                   help="connections one peer address (IP) may hold open at once, per listener (TCP, HTTP, "
                        "console); one more from it is refused (UNAVAILABLE / 503) while other addresses still "
                        "connect; 0: no cap (e.g. every client behind one proxy) (default %(default)s)")
    s.add_argument("--header-timeout", type=_bounded(float, 0, inclusive=False), default=10.0,
                   help="HTTP: seconds a request's head (request line and headers, at most 16 KiB) may take from "
                        "its first byte; then the connection is closed (default %(default)s)")
    s.add_argument("--body-timeout", type=_bounded(float, 0, inclusive=False), default=30.0,
                   help="HTTP: seconds a request's body may take once its head arrived; then 408 and the "
                        "connection is closed (default %(default)s)")
    s.add_argument("--http-keep-alive", type=_bounded(float, 0, inclusive=False), default=30.0,
                   help="HTTP: seconds an idle keep-alive connection is kept between requests; when every "
                        "connection slot is taken, the one idle longest is closed for a new one "
                        "(default %(default)s)")


def _http_listener_options(args) -> dict:
    """``serve_http`` keywords from the flags of :func:`_listener_flags`."""
    return {"max_connections_per_peer": args.max_connections_per_peer, "header_s": args.header_timeout,
            "body_s": args.body_timeout, "keep_alive_s": args.http_keep_alive}


def _metrics_authorize(args, mhost: str, keys):
    """How scrapes of ``--metrics`` on ``mhost`` are authorized: None (everyone) on a
    loopback address or with ``--insecure``; else an operator key
    (``Authorization: Bearer``), from ``keys`` (the node's key table). Raises
    VALIDATION_FAILED when no key can be checked (open mode; a cluster node)."""
    from .errors import ValidationError
    from .metrics import key_authorizer

    if _is_loopback(mhost) or args.insecure:
        return None
    if keys is None or keys.open_mode:
        raise ValidationError(
            f"refusing to serve metrics on {mhost} without authentication: a non-loopback --metrics address "
            "needs an operator API key on every scrape (Authorization: Bearer), and "
            + ("a cluster node cannot check one" if keys is None else "no key exists yet (open mode)")
            + "; serve metrics on 127.0.0.1, or pass --insecure to serve them to anyone who connects")
    return key_authorizer(keys)


def _raise_descriptor_limit() -> None:
    """The soft RLIMIT_NOFILE up to the hard limit (one line at INFO when it changed)."""
    from .transport.guard import raise_nofile_limit

    before, after = raise_nofile_limit()
    if after != before:
        log.info("raised the open-file limit (RLIMIT_NOFILE) from %d to %d", before, after,
                 extra={"event": "nofile", "before": before, "after": after})


def node_config(args) -> "NodeConfig":
    """``rallypoint serve``'s flags as one typed :class:`~rallypoint.nodeconfig.NodeConfig`
    (``args``: the parsed flags, after :func:`cmd_serve` turned ``--retain-*`` and
    ``--limit`` into ``args.retention`` and ``args.limits``); with ``--cluster`` its
    ``member`` too (:func:`_member_config`, VALIDATION_FAILED as it says)."""
    from .nodeconfig import NodeConfig, RetentionOptions, ServingOptions, SnapshotOptions, StorageOptions

    storage = StorageOptions(
        interval_ms=args.interval_ms, retention=RetentionOptions(**args.retention),
        min_free_bytes=int(args.min_free_mb * (1 << 20)), ballast_bytes=int(args.ballast_mb * (1 << 20)),
        preallocate_bytes=int(args.preallocate_kb * 1024), sync_helper=args.sync_helper,
        slow_sync_s=args.slow_fsync_s)
    snapshots = SnapshotOptions(every_records=args.snapshot_every_records, every_s=args.snapshot_every_s,
                                retry_s=args.snapshot_retry_s)
    return NodeConfig(
        storage=storage, snapshots=snapshots,
        serving=ServingOptions(limits=args.limits, watch_stall_s=args.watch_stall,
                               idempotency_ttl_ms=int(args.http_idempotency_hours * 3600 * 1000),
                               slow_request_s=args.slow_request_ms / 1000),
        data_dir=None if args.durability == "memory" else args.data_dir, durability=args.durability,
        member=_member_config(args, storage, snapshots) if args.cluster else None)


def _member_config(args, storage, snapshots) -> "MemberConfig":
    """``serve --cluster``'s flags as the shard replica's
    :class:`~rallypoint.cluster.member.MemberConfig` (with the node's ``storage`` and
    ``snapshots`` options). VALIDATION_FAILED: the ``memory`` durability (a replica
    needs a data dir), no ``--node``, a bad address or etcd flag."""
    from .cluster.member import MemberConfig
    from .errors import ValidationError

    if args.durability == "memory":
        raise ValidationError("--cluster needs a data dir: --durability fsync (default) or interval")
    if not args.node:
        raise ValidationError("--cluster needs --node NAME (this node's name, unique in its shard)")
    host, port = _parse_listen(args.listen, "--listen")
    rhost, rport = _parse_listen(args.replication, "--replication")
    access = _etcd_access(args)
    return MemberConfig(
        etcd=list(access.endpoints), etcd_access=access, node=args.node, data_dir=args.data_dir,
        cluster=args.cluster_name, shard=args.shard, durability=args.durability, client=(host, port),
        replication=(rhost, rport), http=_parse_listen(args.http) if args.http else None,
        advertise_host=args.advertise, advertise_replication=_advertised(args.advertise_replication),
        ttl_s=args.lease_ttl, isr_timeout_s=args.isr_timeout, min_insync=args.min_insync,
        replicas=args.replicas, drain_timeout_s=args.drain_timeout, peer_tls=_peer_tls(args),
        insecure=args.insecure, storage=storage, snapshots=snapshots)


async def _serve(args) -> int:
    """``serve``: build the node's :class:`~rallypoint.nodeconfig.NodeConfig` from the
    flags and start it -- a single node here, one replica of a shard with
    ``--cluster`` (:func:`_serve_cluster`)."""
    from .errors import ValidationError
    from .node import open_node
    from .nodeconfig import start_serving

    cfg = node_config(args)
    if args.cluster:
        return await _serve_cluster(args, cfg)
    host, port = _parse_listen(args.listen)
    data_dir = cfg.data_dir
    pre_bound = getattr(args, "bound", {})  # (cmd_serve's sockets, bound before the imports)
    if args.http:
        # imported before the recovery: the clock resumes after it, so a restart's
        # lease extension covers the time this takes (docs/architecture.md, "Time")
        from .http import serve_http
    if args.console:
        from .console import serve_console
    from .transport import server as _transport_server  # noqa: F401  (the same: before the clock)

    async with open_node(data_dir, cfg.durability, **cfg.storage.recovered_kwargs(),
                         **cfg.snapshots.serving_kwargs()) as node:
        coord = node.coordinator
        if coord.keys.open_mode and not _is_loopback(host) and not args.insecure:
            raise ValidationError(
                f"refusing to listen on {host} without API keys: create one with "
                "`rallypoint keys create --space default --permission operator` (daemon stopped; see README, API keys), "
                "or pass --insecure to serve this address without authentication"
            )
        ssl_context = _ssl_context(args)
        server = _server_factory(args, ssl_context)(node.service)
        from .metrics import serve_metrics

        metrics = start_serving(node, server, cfg.serving)
        http_stop = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, _trio_listeners(pre_bound.get("--listen")), host, port)
            actual = server.port
            metrics_port = None
            if args.metrics:
                mhost, mport = _parse_listen(args.metrics)
                await nursery.start(metrics.lag_probe)
                authorize = _metrics_authorize(args, mhost, coord.keys)
                try:
                    metrics_port = await nursery.start(functools.partial(
                        serve_metrics, metrics, mhost, mport, authorize=authorize))
                except OSError as e:
                    raise ValidationError(_listen_error(args.metrics, "--metrics", e)) from None
                log.info("metrics at http://%s:%d/metrics", mhost, metrics_port,
                         extra={"event": "metrics", "url": f"http://{mhost}:{metrics_port}/metrics"})
            http_url = None
            if args.http:
                hhost, hport = _parse_listen(args.http)
                if coord.keys.open_mode and not _is_loopback(hhost) and not args.insecure:
                    raise ValidationError(
                        f"refusing to serve HTTP on {hhost} without API keys (see --listen); "
                        "pass --insecure to serve this address without authentication"
                    )
                try:
                    http_api, bound = await nursery.start(functools.partial(
                        serve_http, node.service, hhost, hport, certfile=args.tls_cert, keyfile=args.tls_key,
                        max_requests=_http_max_requests(args), max_connections=args.max_connections,
                        first_request_s=args.handshake_timeout, graceful_s=args.drain_timeout, metrics=metrics,
                        shutdown=http_stop, listeners=_trio_listeners(pre_bound.get("--http")),
                        hosts=args.http_host or (), **_http_listener_options(args)))
                except OSError as e:  # the bind: name the HTTP address, not --listen
                    raise ValidationError(_listen_error(args.http, "--http", e)) from None
                metrics.http = http_api.listener
                http_url = bound[0] if bound else f"http://{hhost}:{hport}"
                log.info("HTTP API (runstate SDK) on %s/v1/spaces/{spaceId}", http_url)
            console_url = None
            if args.console:
                chost, cport = _parse_listen(args.console)
                if coord.keys.open_mode and not _is_loopback(chost) and not args.insecure:
                    raise ValidationError(
                        f"refusing to serve the console on {chost} without API keys (see --listen); "
                        "pass --insecure to serve this address without authentication"
                    )
                try:
                    _console, bound = await nursery.start(functools.partial(
                        serve_console, node.service, chost, cport, certfile=args.tls_cert, keyfile=args.tls_key,
                        max_connections=args.max_connections, first_request_s=args.handshake_timeout,
                        graceful_s=args.drain_timeout, metrics=metrics, shutdown=http_stop,
                        hosts=args.http_host or (), listener_options=_http_listener_options(args)))
                except OSError as e:
                    raise ValidationError(_listen_error(args.console, "--console", e)) from None
                console_url = bound[0] if bound else f"http://{chost}:{cport}"
                log.info("web console on %s", console_url)
            info = node.recovery_info
            r = coord.retention.retain_ms
            log.info(
                "rallypoint %s listening on %s://%s:%d (data dir %s, durability %s, %d entities recovered, "
                "snapshot LSN %s, %s records replayed; finished runs kept %s, events kept %s)",
                __version__,
                "tls" if ssl_context is not None else "tcp",
                _url_host(host),
                actual,
                os.path.abspath(data_dir) if data_dir else "none",
                node.durability,
                node.coordinator.entity_count(),
                info.get("snapshot_lsn", 0),
                info.get("replayed", 0),
                f"{r / 1000:g} s" if r else "forever",
                args.retain_events,
                extra={"event": "startup", "version": __version__, "listen": f"{host}:{actual}",
                       "tls": ssl_context is not None, "data_dir": os.path.abspath(data_dir) if data_dir else None,
                       "durability": node.durability, "entities": node.coordinator.entity_count(),
                       "snapshot_lsn": info.get("snapshot_lsn", 0), "replayed": info.get("replayed", 0),
                       "retain_finished_ms": r, "retain_events": args.retain_events,
                       "metrics_port": metrics_port},
            )
            if coord.keys.open_mode:
                log.warning("open mode: no API keys are configured; serving WITHOUT authentication on %s", host)
            else:
                live = coord.keys.live_count()
                log.info("API keys required (%d live keys)", live)
            scheme = "tls" if ssl_context is not None else "tcp"
            tune_gc()
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                # A line for scripts and test fixtures (stdout, flushed), printed only once
                # SIGTERM/SIGINT drain the server rather than kill it.
                print(f"READY {scheme}://{_url_host(host)}:{actual}"
                      + (f" METRICS http://{_url_host(mhost)}:{metrics_port}/metrics" if metrics_port else ""),
                      flush=True)
                if http_url:
                    print(f"HTTP {http_url}", flush=True)
                if console_url:
                    print(f"CONSOLE {console_url}", flush=True)
                async for signum in signals:
                    log.info("received %s: draining (no new connections, finishing in-flight requests)",
                             signal.Signals(signum).name)
                    break
            # from now on no renewal can be heard: the next start extends leases from here
            node.stop_hearing()
            # drain() answers what is still in flight after the timeout UNAVAILABLE;
            # the outer bound is a safety net only.
            http_stop.set()
            with trio.move_on_after(args.drain_timeout + 5.0):
                await server.drain(timeout=args.drain_timeout)
            nursery.cancel_scope.cancel()
        log.info("stopped accepting; closing the coordinator")
    log.info("rallypoint stopped cleanly")
    return 0


async def _serve_cluster(args, cfg: "NodeConfig") -> int:
    """``serve --cluster``: this node is one replica of a shard (rallypoint.cluster.member):
    a standby until etcd makes it the leader, each leadership set up by
    :func:`~rallypoint.nodeconfig.start_serving` from ``cfg`` as a single node is.
    SIGTERM/SIGINT: a leader hands over to its in-sync standby, then exits; a second one
    exits at once."""
    from .cluster.member import ShardMember
    from .nodeconfig import start_serving

    config = cfg.member
    host, _port = config.client
    rhost, _rport = config.replication
    access = config.etcd_access
    endpoints = list(config.etcd)
    ssl_context = _ssl_context(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per etcd request otherwise
    if not _is_loopback(host) and not args.insecure:
        log.warning("cluster mode on %s: make sure API keys are configured (open mode serves without "
                    "authentication)", host)

    def on_role(role, member):
        print(f"ROLE {role} epoch={member.epoch or member.last_epoch_seen}", flush=True)

    from .metrics import ClusterMetrics, serve_metrics

    cluster_metrics = None

    def on_leader(node, member):
        metrics = start_serving(node, member.server, cfg.serving)
        if cluster_metrics is not None:
            cluster_metrics.leader_metrics = metrics
        return None

    def local_http(node):
        from .http.app import HttpApi

        api = HttpApi(node.service, max_requests=_http_max_requests(args))
        api.metrics = cluster_metrics.leader_metrics if cluster_metrics is not None else None
        return api

    await _etcd_preflight(access, args.cluster_name)
    member = ShardMember(config, make_server=_server_factory(args, ssl_context), on_leader=on_leader,
                         on_role=on_role)
    async with trio.open_nursery() as nursery:
        # a member of the shard's replica set, and the only live process of this name,
        # before any listener is bound or the data dir opened (else one line, exit 2)
        await nursery.start(member.admit)
        if args.metrics:
            cluster_metrics = ClusterMetrics(member)
            mhost, mport = _parse_listen(args.metrics)
            metrics_port = await nursery.start(functools.partial(
                serve_metrics, cluster_metrics, mhost, mport, authorize=_metrics_authorize(args, mhost, None)))
            log.info("metrics at http://%s:%d/metrics", mhost, metrics_port)
        http_app = None
        if args.http:
            # every node serves the runstate SDK's base URL, whatever its role
            # (rallypoint.cluster.forward): its own API while it leads, the leader's otherwise
            from .cluster.forward import ClusterHttpApp
            from .http import serve_http

            hhost, hport = _parse_listen(args.http)
            http_app = ClusterHttpApp(member, local_http)
            if cluster_metrics is not None:
                cluster_metrics.http_app = http_app
            _api, urls = await nursery.start(functools.partial(
                serve_http, None, hhost, hport, certfile=args.tls_cert, keyfile=args.tls_key,
                max_requests=_http_max_requests(args), max_connections=args.max_connections,
                first_request_s=args.handshake_timeout, graceful_s=args.drain_timeout, api=http_app,
                hosts=[*(args.http_host or ()), *([args.advertise] if args.advertise else [])],
                **_http_listener_options(args)))
            member.config.http = (hhost, int(urls[0].rsplit(":", 1)[1]))
        await nursery.start(member.run)
        console_url = None
        if args.console:  # every shard's pages, from any node (rallypoint.console.clusterview)
            from .console.clusterview import serve_cluster_console

            chost, cport = _parse_listen(args.console)
            _console, curls = await nursery.start(functools.partial(
                serve_cluster_console, member, chost, cport, insecure=args.insecure, loopback=_is_loopback(chost),
                certfile=args.tls_cert, keyfile=args.tls_key, max_connections=args.max_connections,
                first_request_s=args.handshake_timeout, graceful_s=args.drain_timeout,
                hosts=[*(args.http_host or ()), *([args.advertise] if args.advertise else [])],
                listener_options=_http_listener_options(args)))
            console_url = curls[0] if curls else f"http://{chost}:{cport}"
        scheme = "tls" if ssl_context is not None else "tcp"
        log.info("rallypoint %s node %s of shard %d (cluster %r, etcd %s) listening on %s://%s:%d, replication on "
                 "%s:%d", __version__, args.node, args.shard, args.cluster_name, ",".join(endpoints), scheme, host,
                 member.client_port, rhost, member.replication_port,
                 extra={"event": "startup", "node": args.node, "shard": args.shard, "cluster": args.cluster_name,
                        "listen": f"{host}:{member.client_port}",
                        "replication": f"{rhost}:{member.replication_port}"})
        tune_gc()
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            print(f"READY {scheme}://{_url_host(host)}:{member.client_port} REPLICATION "
                  f"{_url_host(rhost)}:{member.replication_port}"
                  + (f" HTTP http://{_url_host(_parse_listen(args.http)[0])}:{member.http_port}" if args.http else ""),
                  flush=True)
            if console_url:
                print(f"CONSOLE {console_url}", flush=True)
            n = 0
            async for signum in signals:
                n += 1
                if n == 1:
                    log.info("received %s: stopping (a leader hands over to its in-sync standby first)",
                             signal.Signals(signum).name)
                    member.stop()
                    nursery.start_soon(_cancel_when_stopped, member, nursery.cancel_scope)
                else:
                    log.warning("received %s again: exiting now", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break
    log.info("rallypoint stopped cleanly")
    return 0


def _peer_tls(args):
    """``--peer-cert/--peer-key/--peer-ca`` -> a PeerTls (all three or none)."""
    from .errors import ValidationError

    given = [args.peer_cert, args.peer_key, args.peer_ca]
    if not any(given):
        return None
    if not all(given):
        raise ValidationError("peer TLS needs all three of --peer-cert, --peer-key and --peer-ca")
    from .cluster.peerauth import PeerTls

    try:
        return PeerTls(args.peer_cert, args.peer_key, args.peer_ca)
    except ValueError as e:
        raise ValidationError(str(e)) from None


def cmd_cluster_etcd_auth(args) -> int:
    """``rallypoint cluster etcd-auth``: turn on etcd's authentication for a cluster --
    user ``root`` (role root), a role with read and write on ``/rallypoint/`` only, and
    the user the nodes and the CLI use (``--etcd-user``, default ``rallypoint``) -- then
    ``auth enable``. A step already done (a user that exists, auth already on) is
    passed over, so it can be run again. The passwords come from files (never the
    command line)."""
    from .cluster.etcd import EtcdAuth, EtcdError, prefix_end
    from .errors import RallypointError
    import base64
    import dataclasses

    def b64(x: str) -> str:
        return base64.b64encode(x.encode()).decode()

    try:
        access = _etcd_access(args)
        root_pw = _read_secret_file(args.root_password_file, "--root-password-file")
        user = access.auth.user if access.auth is not None else (args.etcd_user or "rallypoint")
        user_pw = access.auth.password if access.auth is not None else _read_secret_file(
            args.etcd_password_file or os.environ.get("RALLYPOINT_ETCD_PASSWORD_FILE"), "--etcd-password-file")
    except RallypointError as e:
        return _fail(e, args)
    if user == "root":
        print("rallypoint: the nodes' etcd user must not be root (give --etcd-user NAME)", file=sys.stderr)
        return 2
    role = "rallypoint"
    steps = [("/v3/auth/user/add", {"name": "root", "password": root_pw}),
             ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
             ("/v3/auth/role/add", {"name": role}),
             ("/v3/auth/role/grant", {"name": role, "perm": {"permType": "READWRITE", "key": b64("/rallypoint/"),
                                                             "range_end": b64(prefix_end("/rallypoint/").decode())}}),
             ("/v3/auth/user/add", {"name": user, "password": user_pw}),
             ("/v3/auth/user/grant", {"user": user, "role": role}),
             ("/v3/auth/enable", {})]

    async def main():
        done = []
        # before auth is on, calls need no token; once it is (a second run), root's
        plain = dataclasses.replace(access, auth=None)
        as_root = dataclasses.replace(access, auth=EtcdAuth("root", root_pw))
        for path, body in steps:
            for acc in (plain, as_root):
                try:
                    async with acc.client() as etcd:
                        await etcd.auth_step(path, body)
                    done.append(path.removeprefix("/v3/auth/"))
                    break
                except EtcdError as e:
                    msg = e.message.lower()
                    if "already exist" in msg or "already granted" in msg or "already enabled" in msg:
                        break
                    if acc is plain and ("user name is empty" in msg or "token" in msg
                                         or "permission denied" in msg or e.code in ("UNAUTHENTICATED", "FORBIDDEN")):
                        continue  # auth is on already: as root
                    raise
        return done

    try:
        done = trio.run(main)
    except RallypointError as e:
        return _fail(e, args)
    print(f"etcd authentication is on: user {user!r} may read and write /rallypoint/ only; root's password is in "
          f"{args.root_password_file} (keep it off the nodes){'' if done else ' (nothing was left to do)'}")
    return 0


def _read_secret_file(path: str | None, flag: str) -> str:
    from .errors import ValidationError

    if not path:
        raise ValidationError(f"give {flag} FILE (a file holding the password on its first line)")
    try:
        with open(path) as f:
            pw = f.readline().strip()
    except OSError as e:
        raise ValidationError(f"{flag}: {path}: {e.strerror}") from None
    if not pw:
        raise ValidationError(f"{flag}: {path} is empty")
    return pw


def cmd_cluster_certs(args) -> int:
    """``rallypoint cluster certs --out DIR --nodes a,b [--hosts ...] [--etcd]``."""
    from .cluster.pki import write_cluster_pki

    nodes = [n for n in args.nodes.split(",") if n.strip()]
    hosts = [h for h in args.hosts.split(",") if h.strip()]
    try:
        written = write_cluster_pki(args.out, nodes, hosts=hosts, etcd=args.etcd, days=args.days)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(f"serve each node with --peer-cert {os.path.join(args.out, 'NODE.pem')} --peer-key "
          f"{os.path.join(args.out, 'NODE.key')} --peer-ca {os.path.join(args.out, 'ca.pem')}; keep ca.key offline",
          file=sys.stderr)
    return 0


def _advertised(spec: str | None) -> str | None:
    """``--advertise-replication HOST:PORT`` checked and normalized (None: not given)."""
    if spec is None:
        return None
    from .errors import ValidationError

    try:
        h, p = _parse_listen(spec)
    except ValidationError:
        raise ValidationError(f"--advertise-replication: {spec!r} is not HOST:PORT") from None
    if not p:
        raise ValidationError(f"--advertise-replication: {spec!r} needs a port other than 0")
    return f"{h}:{p}"


async def _cancel_when_stopped(member, scope) -> None:
    await member.wait_role("stopped")
    scope.cancel()


#: the environment variables the etcd access flags default to (``--help`` says them)
ETCD_ENV = {"ca": "RALLYPOINT_ETCD_CA", "cert": "RALLYPOINT_ETCD_CERT", "key": "RALLYPOINT_ETCD_KEY",
            "user": "RALLYPOINT_ETCD_USER", "password_file": "RALLYPOINT_ETCD_PASSWORD_FILE",
            "password": "RALLYPOINT_ETCD_PASSWORD"}


def _etcd_access_arguments(parser, *, suppress: bool = False) -> None:
    """Add the flags of :func:`_etcd_access` (TLS files, user, password file) to
    ``parser`` (a parser or an argument group; ``suppress``: a subcommand's copy of a
    group's flags, so they work before or after the subcommand)."""
    d = argparse.SUPPRESS if suppress else None
    parser.add_argument("--etcd-ca", metavar="FILE", default=d,
                        help="CA certificate (PEM) that signed etcd's certificate, for https:// endpoints (default "
                             "$RALLYPOINT_ETCD_CA; none: the system's CAs)")
    parser.add_argument("--etcd-cert", metavar="FILE", default=d,
                        help="client certificate (PEM) for an etcd with --client-cert-auth (default "
                             "$RALLYPOINT_ETCD_CERT); with etcd's auth on it must have no Common Name")
    parser.add_argument("--etcd-key", metavar="FILE", default=d,
                        help="the client certificate's key (default $RALLYPOINT_ETCD_KEY; none: in --etcd-cert)")
    parser.add_argument("--etcd-user", metavar="NAME", default=d,
                        help="etcd user, when etcd's authentication is on (default $RALLYPOINT_ETCD_USER, or "
                             "USER in --cluster https://USER@HOST:PORT)")
    parser.add_argument("--etcd-password-file", metavar="FILE", default=d,
                        help="file whose first line is the etcd user's password (default "
                             "$RALLYPOINT_ETCD_PASSWORD_FILE; else $RALLYPOINT_ETCD_PASSWORD)")


def _etcd_access(args):
    """The :class:`~rallypoint.cluster.etcd.EtcdAccess` of ``--cluster`` and the etcd
    flags (``serve --cluster``, ``cluster ...``, ``keys ... --cluster``), each flag
    defaulting to its environment variable (:data:`ETCD_ENV`).

    ``--cluster``: ``etcd://``, ``http://`` (plaintext) or ``https://`` (TLS), then
    ``HOST:PORT[,HOST:PORT...]`` (a later endpoint may repeat the scheme, not change
    it); ``USER@`` names the etcd user; ``USER:PASSWORD@`` works but is warned about (the
    password shows in ``ps`` and shell history). The password: ``--etcd-password-file``,
    else ``$RALLYPOINT_ETCD_PASSWORD``, else the URL's. Warns when a password would cross a
    non-loopback network in plaintext. Raises ValidationError (one line) for a bad
    URL, mixed schemes, TLS files with a plaintext etcd, a user without a password (or
    the reverse), two different users, an unreadable file."""
    import re
    from urllib.parse import unquote

    from .cluster.etcd import EtcdAccess, EtcdAuth, EtcdTls
    from .errors import ValidationError

    def opt(name: str) -> tuple[str | None, str]:
        """The flag's value, else the environment's, with where it came from."""
        flag = "--etcd-" + name.replace("_", "-")
        value = getattr(args, "etcd_" + name, None)
        if value:
            return value, flag
        env = os.environ.get(ETCD_ENV[name]) or None
        return env, f"${ETCD_ENV[name]}"

    spec = (args.cluster or "").strip()
    scheme = None
    url_user = url_password = None
    endpoints: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", part)
        given, rest = (m.group(1).lower(), m.group(2)) if m else (None, part)
        if given is not None and given not in ("etcd", "http", "https"):
            raise ValidationError(f"--cluster: {given}:// is not an etcd scheme (etcd:// or http:// for a plaintext "
                                  "etcd, https:// for TLS)")
        this = {"etcd": "http"}.get(given, given)
        if this is not None and scheme is not None and this != scheme:
            raise ValidationError(f"--cluster mixes plaintext and TLS endpoints ({spec!r}): one etcd cluster serves "
                                  "one scheme; give https:// (or etcd://) for all of them")
        scheme = scheme or this
        if "@" in rest:
            userinfo, rest = rest.rsplit("@", 1)
            user, colon, password = userinfo.partition(":")
            user = unquote(user)
            if url_user is not None and user != url_user:
                raise ValidationError(f"--cluster names two etcd users ({url_user!r}, {user!r})")
            url_user = user or None
            if colon:
                url_password = unquote(password)
        rest = rest.rstrip("/")
        try:
            host, port = _parse_listen(rest)
        except ValidationError:
            raise ValidationError(f"--cluster: {rest!r} is not HOST:PORT (give etcd://HOST:PORT[,HOST:PORT...] or "
                                  "https://HOST:PORT[,...])") from None
        if not port:
            raise ValidationError(f"--cluster: {rest!r} needs a port (etcd's client port, 2379 by default)")
        endpoints.append(f"{_url_host(host)}:{port}")
    if not endpoints:
        raise ValidationError("--cluster needs at least one etcd endpoint: etcd://HOST:PORT or https://HOST:PORT")
    scheme = scheme or "http"

    ca, ca_from = opt("ca")
    cert, cert_from = opt("cert")
    key, key_from = opt("key")
    tls = None
    if scheme == "https":
        if key and not cert:
            raise ValidationError(f"{key_from} (the etcd client key) needs --etcd-cert (its certificate)")
        tls = EtcdTls(ca, cert, key)
        tls.context()  # a file that cannot be read or does not match: refused now, in one line
    else:
        given = [src for value, src in ((ca, ca_from), (cert, cert_from), (key, key_from)) if value]
        if given:
            raise ValidationError(f"{', '.join(given)} set, but --cluster {spec} is plaintext: give https://HOST:PORT "
                                  "for an etcd that serves TLS")

    user, user_from = opt("user")
    if user and url_user and user != url_user:
        raise ValidationError(f"--cluster names etcd user {url_user!r} but {user_from} says {user!r}")
    user = user or url_user
    password_file, file_from = opt("password_file")
    password = None
    if password_file:
        try:
            with open(password_file, encoding="utf-8") as f:
                password = f.readline().rstrip("\r\n")
        except OSError as e:
            raise ValidationError(f"{file_from}: cannot read the etcd password file {password_file}: "
                                  f"{e.strerror or e}") from None
        if not password:
            raise ValidationError(f"{file_from}: the etcd password file {password_file} is empty")
    elif os.environ.get(ETCD_ENV["password"]):
        password = os.environ[ETCD_ENV["password"]]
    elif url_password is not None:
        password = url_password
        print("rallypoint: warning: the etcd password in --cluster shows in `ps` and the shell's history; use "
              "--etcd-password-file FILE or $RALLYPOINT_ETCD_PASSWORD", file=sys.stderr)
    auth = None
    if user:
        if not password:
            raise ValidationError(f"etcd user {user!r} needs a password: --etcd-password-file FILE or "
                                  "$RALLYPOINT_ETCD_PASSWORD")
        auth = EtcdAuth(user, password)
        if scheme == "http" and not all(_is_loopback(e.rsplit(":", 1)[0].strip("[]")) for e in endpoints):
            print(f"rallypoint: warning: etcd user {user!r}'s password and token cross the network in plaintext "
                  "(http://): give https:// endpoints", file=sys.stderr)
    elif password_file or url_password is not None:
        raise ValidationError("an etcd password needs its user: --etcd-user NAME (or https://USER@HOST:PORT)")
    return EtcdAccess(tuple(f"{scheme}://{e}" for e in endpoints), tls=tls, auth=auth)


def _etcd_flags(args) -> str:
    """``--cluster URL`` and the etcd TLS/user flags of ``args``, as a command line
    shows them (never a password)."""
    import shlex

    return " ".join(shlex.quote(a) for a in _etcd_access(args).cli_args())


async def _etcd_preflight(access, cluster: str) -> None:
    """``serve --cluster`` before the node starts: may this node read and write its
    cluster's keys in etcd? A refusal (wrong password, no permission, a TLS failure)
    raises its one-line error; etcd out of reach is only logged (the node waits for
    it, as it always did)."""
    from .cluster.etcd import EtcdUnavailableError

    async with access.client(timeout_s=5.0) as etcd:
        try:
            await etcd.check_access(f"/rallypoint/{cluster}/")
        except EtcdUnavailableError as e:
            log.warning("etcd is not reachable yet (%s); the node waits for it", e.message)


#: The daemon's cyclic-GC thresholds (CPython's default: 700, 10, 10). A full
#: collection walks every container made since start-up -- the event ring, the sets of
#: a run's tasks -- and pauses the event loop for it (measured: 16 ms of CPU each, 4 in 8
#: s of the lifecycle benchmark); the third threshold makes one wait for 100 collections
#: of the middle generation instead of 10. Generation 0 stays as it is (a larger one
#: measured worse). Measured in docs/performance.md ("Issue 18, sixth pass").
DAEMON_GC_THRESHOLDS = (700, 10, 100)


def tune_gc() -> None:
    """The daemon's garbage-collector settings, applied once start-up and recovery are
    done: what they built lives as long as the process, so it is collected once and
    frozen (``gc.freeze``: full collections skip it; their pause grows with what they
    walk), and full collections are made ten times rarer
    (:data:`DAEMON_GC_THRESHOLDS`). Only ``rallypoint serve`` calls this: an embedded
    coordinator leaves its host application's collector alone."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*DAEMON_GC_THRESHOLDS)


def cmd_serve(args) -> int:
    _setup_logging(args.log_level, args.log_format)
    _raise_descriptor_limit()
    from .errors import ValidationError
    from .events import parse_duration_ms, parse_retain_events

    try:
        _parse_listen(args.listen, "--listen")
        try:
            retain_finished_ms = parse_duration_ms(args.retain_finished)
        except ValueError:
            raise ValidationError(f"--retain-finished must be a duration like 7d, 12h, 30s or 0 (got "
                                  f"{args.retain_finished!r})") from None
        try:
            count, age_ms = parse_retain_events(args.retain_events)
        except ValueError:
            raise ValidationError(f"--retain-events must be a count (100000) or an age like 24h (got "
                                  f"{args.retain_events!r})") from None
        args.retention = {"retain_finished_ms": retain_finished_ms or None, "retain_events": count or None,
                          "retain_events_ms": age_ms or None}
        from .limits import parse_limit

        args.limits = dict(parse_limit(x) for x in args.limit or ())
        for flag, addr in (("--metrics", args.metrics), ("--http", args.http), ("--console", args.console)):
            if addr:
                _parse_listen(addr, flag)
        if args.http_host:
            from .http.guard import HostCheck

            try:
                HostCheck(args.http_host)
            except ValueError as e:
                raise ValidationError(f"--http-host: {e}") from None
        for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
            if path is not None and not os.path.isfile(path):
                raise ValidationError(f"{flag}: no such file {path}")
        if args.sync_helper is not None and args.durability == "memory":
            raise ValidationError("--sync-helper chooses where the journal's fdatasync runs: --durability memory "
                                  "has no journal (leave --sync-helper out, or use fsync or interval)")
        if args.sync_helper is None:
            args.sync_helper = "process"
        data_dir = None if args.durability == "memory" else args.data_dir
        if not args.cluster and data_dir is not None:
            host = _parse_listen(args.listen)[0]
            if not os.path.exists(data_dir) and not _is_loopback(host) and not args.insecure:
                # a new data dir has no API key: open mode, refused here before anything is made
                raise ValidationError(
                    f"refusing to listen on {host} without API keys: {data_dir} does not exist yet, so no key does; "
                    f"create one first with `rallypoint keys create --data-dir {data_dir} --space default "
                    "--permission operator` (see README, API keys), or pass --insecure to serve this address "
                    "without authentication")
            if os.path.isdir(data_dir):
                # in use by another daemon: say so before binding anything (its lock is
                # taken for good by the recovery below)
                from .persistence.lock import DataDirLock
                from .persistence.errors import DataDirLocked

                try:
                    with DataDirLock(data_dir):
                        pass
                except DataDirLocked as e:
                    raise ValidationError(str(e)) from None
    except ValidationError as e:
        print(f"rallypoint: {e.message}", file=sys.stderr)
        return 2
    # A single node binds its client ports now, before the imports and the recovery
    # (_bind_listeners: a client that connects during a restart waits, not refused), or
    # takes the ones a supervisor kept open for it (_inherited_listeners).
    args.bound = {}
    inherited = [] if args.cluster else _inherited_listeners()
    for flag, addr in (("--listen", args.listen), ("--metrics", args.metrics), ("--http", args.http),
                       ("--console", args.console)):
        if addr:
            try:
                if flag in ("--metrics", "--console") or args.cluster:
                    _check_listen_free(*_parse_listen(addr))
                else:
                    args.bound[flag] = _take_inherited(inherited, *_parse_listen(addr)) or _bind_listeners(
                        *_parse_listen(addr))
            except OSError as e:
                for socks in args.bound.values():
                    for s in socks:
                        s.close()
                print(f"rallypoint: {_listen_error(addr, flag, e)}", file=sys.stderr)
                return 2
    try:
        rc = trio.run(_serve, args)
        args.fast_exit = rc == 0  # (main() exits without the interpreter's teardown)
        return rc
    except KeyboardInterrupt:
        return 0
    except BaseException as e:  # start-up failures: one clear line, exit 2 (a fail-stop journal: 1)
        from .persistence import JournalWriteError

        leaf = e
        if isinstance(leaf, BaseExceptionGroup):
            failed = leaf.subgroup(lambda x: isinstance(x, JournalWriteError))
            while isinstance(failed, BaseExceptionGroup):  # the first copy (every task saw the same one)
                failed = failed.exceptions[0]
            if failed is not None:
                leaf = failed
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        message = _startup_error_message(leaf, args)
        if message is None:
            raise
        print(f"rallypoint: {message}", file=sys.stderr)
        return 1 if isinstance(leaf, JournalWriteError) else 2


def _listen_error(addr: str, flag: str, e: OSError) -> str:
    """The line for a listener that cannot bind ``addr`` (given as ``flag``)."""
    import errno

    why = {errno.EADDRINUSE: "the address is already in use (another daemon?)",
           errno.EADDRNOTAVAIL: "no such local address"}.get(e.errno, e.strerror or str(e))
    return f"cannot listen on {addr} ({flag}): {why}"


def _startup_error_message(e: BaseException, args) -> str | None:
    """The operator's message for a start-up failure, or None (a bug: re-raise)."""
    import errno
    import ssl

    from .errors import ValidationError
    from .persistence import JournalWriteError, StartupError

    if isinstance(e, ValidationError):
        return e.message
    from .cluster.etcd import EtcdError

    if isinstance(e, EtcdError):  # (the etcd preflight: a refusal, a TLS failure)
        return str(e)
    if isinstance(e, StartupError):
        return str(e)
    if getattr(args, "cluster", None):  # refused by the shard: not a member, a duplicate name, stale data
        from .cluster.leader import NotAMemberError
        from .cluster.member import StaleDataError
        from .cluster.presence import DuplicateNodeError

        if isinstance(e, (NotAMemberError, DuplicateNodeError, StaleDataError)):
            return e.message
    if isinstance(e, JournalWriteError):  # fail-stop at run time
        return f"stopped: {e.message}"
    if isinstance(e, ssl.SSLError):
        return f"cannot load the TLS certificate/key ({args.tls_cert}, {args.tls_key}): {e}"
    if isinstance(e, OSError):
        if e.errno == errno.EADDRINUSE:
            return f"cannot listen on {args.listen}: the address is already in use (another daemon?)"
        if e.errno == errno.EADDRNOTAVAIL:
            return f"cannot listen on {args.listen}: no such local address"
        if e.filename is not None:
            return f"{e.strerror}: {e.filename}"
        return f"cannot start: {e}"
    return None


# ------------------------------------------------------------------------------ client commands
def _client_call(args, fn):
    """Run ``fn(rs)`` on a connection to ``args.connect`` with ``args.api_key``."""
    import rallypoint

    async def main():
        async with rallypoint.connect(args.connect, api_key=args.api_key, tls_ca=getattr(args, "tls_ca", None)) as rs:
            return await fn(rs)

    return trio.run(main)


def _error_line(e, args) -> str:
    """The one line a client command prints for RallypointError ``e``:
    ``CODE: what happened; what to do``, in terms of this command's options (the SDK's
    messages speak Python: ``api_key=...``, ``tls_ca=...``)."""
    from .errors import UnauthenticatedError, UnavailableError

    from .cluster.etcd import EtcdError

    if isinstance(e, EtcdError):  # etcd's refusals say what to do in etcd's terms (not an API key's)
        return str(e)
    if isinstance(e, UnauthenticatedError):
        if getattr(args, "api_key", None):
            return (f"{e.code}: the server refused this API key (unknown or revoked); check --api-key / "
                    "$RALLYPOINT_API_KEY, or ask an admin for a live key")
        return f"{e.code}: this server requires an API key; pass --api-key KEY or set RALLYPOINT_API_KEY"
    tls = (e.details or {}).get("tls") if isinstance(e, UnavailableError) else None
    if tls == "certificate_verify_failed":
        return (f"{e.code}: cannot connect to {args.connect}: the server's TLS certificate failed verification "
                f"({e.details.get('reason')}); pass --tls-ca FILE, the CA certificate that signed it")
    return str(e)


def _run_live(main, args) -> int:
    """``trio.run(main)`` for a command that runs until it ends or Ctrl-C (``watch``,
    ``top``): 0 either way; a RallypointError is its one-line failure (exit 1)."""
    from .errors import RallypointError

    try:
        trio.run(main)
    except KeyboardInterrupt:
        return 0
    except RallypointError as e:
        return _fail(e, args)
    return 0


def _fail(e, args) -> int:
    print(f"rallypoint: {_error_line(e, args)}", file=sys.stderr)
    return 1


def _client_options(*, suppress: bool = False, connect_default: str | None = "env",
                    data_dir: bool = False, json_flag: bool = False) -> argparse.ArgumentParser:
    """--connect / --api-key / --tls-ca (and optionally --data-dir, --json) as a parent
    parser. Used on a command group with real defaults and on its subcommands with
    ``suppress=True``, so each option works before or after the subcommand."""
    def d(value):
        return argparse.SUPPRESS if suppress else value

    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--connect", default=d(os.environ.get("RALLYPOINT_URL", DEFAULT_URL)
                                                 if connect_default == "env" else connect_default),
                        help="server URL, tcp:// or tls:// (default $RALLYPOINT_URL or tcp://127.0.0.1:7411)")
    parent.add_argument("--api-key", default=d(os.environ.get("RALLYPOINT_API_KEY")),
                        help="API key (default $RALLYPOINT_API_KEY); not needed in open mode")
    parent.add_argument("--tls-ca", default=d(None), help="CA file to verify a tls:// server")
    if data_dir:
        parent.add_argument("--data-dir", default=d(None),
                            help="a stopped daemon's data dir (default ./rallypoint-data, if it is one)")
    if json_flag:
        parent.add_argument("--json", action="store_true", default=d(False), help="machine-readable output")
    return parent


def _key_store_options(*, suppress: bool = False) -> argparse.ArgumentParser:
    """``keys``: ``--cluster`` / ``--cluster-name``, the etcd a cluster keeps its keys in
    (as :func:`_client_options`, usable before or after the subcommand)."""
    def d(value):
        return argparse.SUPPRESS if suppress else value

    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--cluster", metavar="URL", default=d(None),
                        help="a cluster's keys: read and write them in its etcd (every shard takes them): "
                             "etcd://HOST:PORT[,...] or https://[USER@]HOST:PORT[,...]")
    parent.add_argument("--cluster-name", default=d("rallypoint"), help="with --cluster (default rallypoint)")
    _etcd_access_arguments(parent, suppress=suppress)
    return parent


def _fmt_age(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def _fmt_time(dt) -> str:
    """An aware datetime as ``YYYY-MM-DDTHH:MM:SSZ`` (UTC, one word: columns stay
    ``awk``-able); ``-`` for None."""
    import datetime as _dt

    if dt is None:
        return "-"
    return dt.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def cmd_status(args) -> int:
    """``status``: version, uptime, durability and LSNs, connections, runs and tasks by
    state, each space's use of its limits, actors active/passive per kind and the depth
    of the nursery tree (``--json``: the server's view as JSON). With a key of one space
    (not ``operator``): that space's figures only."""
    from .errors import RallypointError

    async def both(rs):
        return await rs.status(), await rs.mailboxes.list()

    try:
        st, mailboxes = _client_call(args, both)
    except RallypointError as e:
        return _fail(e, args)
    if args.json:
        out = st.to_dict()
        # issue 44: each work queue's ready backlog per priority and per fairness key
        out["mailboxes"] = {m.name: {"queued": m.queued, "running": m.running,
                                     "ready_by_priority": m.ready_by_priority, "ready_by_key": m.ready_by_key}
                            for m in mailboxes}
        print(json.dumps(out, default=str, indent=2))
        return 0
    print(f"server      {args.connect}")
    print(f"version     {st.version} (protocol {st.protocol_version})")
    print(f"uptime      {_fmt_age(st.uptime_s)}")
    space_view = st.view == "space"  # a key of one space: its own figures only
    if space_view:
        print(f"durability  {st.durability}")
    else:
        print(f"durability  {st.durability}   LSN {st.last_lsn} (durable {st.durable_lsn})")
    if st.sync_helper and not space_view:
        where = ("the sync helper process, pid " + st.sync_helper.split()[1]
                 if st.sync_helper.startswith("process ")
                 else "the event loop (inline)" if st.sync_helper == "inline" else "a thread of the daemon")
        mean = f", mean {st.fsync_seconds / st.fsyncs * 1000:.2f} ms" if st.fsyncs else ""
        calls = "call" if st.fsyncs == 1 else "calls"
        print(f"fsync       in {where}; {st.fsyncs:,} fdatasync {calls}{mean}")
    mine = " (this key's space)" if space_view else ""
    print(f"connections {st.connections}{mine}")
    print("runs        " + "  ".join(f"{k} {v}" for k, v in sorted(st.runs.items())))
    print("tasks       " + ("  ".join(f"{k} {v}" for k, v in sorted(st.tasks.items())) or "none"))
    print(f"entities    {st.entities}{mine}")
    for line in _backlog_lines(mailboxes):
        print(line)
    for line in _limit_lines(st.limits, st.space_use):
        print(line)
    if space_view:
        return 0
    active = sum(a.get("active", 0) for a in st.actors.values())
    passive = sum(a.get("passive", 0) for a in st.actors.values())
    waiters = sum(a.get("waiters", 0) for a in st.actors.values())
    print(f"actors      {active} active, {passive} passive, {waiters} waiters parked; nursery tree depth {st.tree_depth}")
    for line in _actor_lines(st.actors):
        print(line)
    if st.cluster is not None:
        for line in _cluster_lines(st.cluster):
            print(line)
    return 0


def _backlog_lines(mailboxes, keys: int = 5) -> list[str]:
    """``status``'s work queues with ready tasks (issue 44): the ready backlog per
    priority (``p1 12  p3 4``) and the ``keys`` largest per fairness key (``-``: no key)."""
    out = []
    for m in sorted(mailboxes, key=lambda m: m.name):
        if not m.ready_by_priority:
            continue
        prios = "  ".join(f"p{p} {n:,}" for p, n in sorted(m.ready_by_priority.items(), key=lambda kv: int(kv[0])))
        line = f"mailbox     {m.name}: ready {prios}"
        if len(m.ready_by_key) > 1 or "" not in m.ready_by_key:
            top = list(m.ready_by_key.items())[:keys]
            more = f" (+{len(m.ready_by_key) - keys} keys)" if len(m.ready_by_key) > keys else ""
            line += "; by key " + "  ".join(f"{k or '-'} {n:,}" for k, n in top) + more
        out.append(line)
    return out


def cmd_task_submit(args) -> int:
    """``tasks submit MAILBOX INPUT --run RUN``: submit one task (``INPUT``: JSON) with
    ``--priority`` (1 most urgent .. 5), ``--fair-key``, ``--fair-weight`` and ``--key``;
    prints the task's id (``--json``: its view). VALIDATION_FAILED etc. as the server
    says (exit 1)."""
    from .errors import RallypointError

    try:
        value = json.loads(args.input)
    except ValueError:
        print(f"INPUT must be JSON (got {args.input!r}); quote a string: '\"text\"'", file=sys.stderr)
        return 2

    async def submit(rs):
        m = await rs.mailboxes.ensure(args.mailbox)
        return await m.submit(value, args.key, scope=args.run, priority=args.priority, fair_key=args.fair_key,
                              fair_weight=args.fair_weight)

    try:
        ticket = _client_call(args, submit)
    except RallypointError as e:
        return _fail(e, args)
    if args.json:
        print(json.dumps(ticket.info.to_dict(), default=str, indent=2))
    else:
        print(ticket.id)
    return 0


def _limit_lines(limits: dict, space_use: dict) -> list[str]:
    """``status``'s limits per space: one line per space with the use of each limit
    against its value (``use/limit``, ``-`` for no limit) and the highest fraction."""
    if not limits:
        return []
    from .limits import NAMES

    def fmt(n: int, name: str) -> str:
        if name == "payload_bytes":
            return _fmt_bytes(n)
        return f"{n:,}"

    out = ["limits      per space: " + "  ".join(
        f"{n} {fmt(limits[n], n) if limits.get(n) else '-'}" for n in NAMES if n in limits)]
    for space, use in space_use.items():
        cells = []
        top = 0.0
        for n in NAMES:
            if n not in use:
                continue
            lim = limits.get(n) or 0
            cells.append(f"{n} {fmt(use[n], n)}/{fmt(lim, n) if lim else '-'}")
            if lim:
                top = max(top, use[n] / lim)
        out.append(f"  {space:<10} " + "  ".join(cells) + f"   (highest {top:.0%})")
    return out


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n}B"


def _cluster_lines(c) -> list[str]:
    """A replicated shard's node as ``status`` / ``cluster status`` print it."""
    lines = [f"cluster     {c.cluster}, shard {c.shard}: {c.node} is {c.role} at epoch {c.epoch}; lease "
             f"{c.lease_time_left_s:.2f} s left before it fences itself",
             f"members     {' '.join(c.members) or '-'}",
             f"in sync     {' '.join(c.isr) or '-'}" + ("   (--min-insync 2)" if c.min_insync == 2 else "")]
    sb = c.standby
    if sb is None:
        lines.append("standby     none connected")
    else:
        lines.append(f"standby     {sb.node}: {sb.state}, acknowledged LSN {sb.acked_lsn}, {sb.lag_records} "
                     f"record(s) behind, last progress {sb.since_progress_s:.2f} s ago")
    return lines


def cmd_cluster_init(args) -> int:
    """``cluster init``: the slot map of a new sharded cluster (slot i to shard i mod K).
    Refused over a cluster or shard of the same name (one line: what is there);
    ``--force`` replaces a stopped one (rallypoint.cluster.shardmap.create_cluster)."""
    from .cluster.etcd import EtcdError
    from .cluster.shardmap import create_cluster
    from .errors import RallypointError

    async def main():
        async with _etcd_access(args).client() as etcd:
            return await create_cluster(etcd, args.cluster_name, slots=args.slots, shards=args.shards,
                                        replication_factor=args.replicas, force=args.force)

    try:
        m, replaced = trio.run(main)
    except (EtcdError, RallypointError) as e:
        return _fail(e, args)
    if replaced is not None:
        print(f"cluster init --force: deleted {replaced.describe()}. What those nodes' data dirs hold is "
              "part of no cluster now (a node started on one is refused): give the new cluster's nodes empty data "
              "dirs. API keys and the node secret are kept.")
    print(f"cluster {args.cluster_name}: {len(m.owners)} slots over {len(m.shards)} shard(s) of {args.replicas} "
          f"node(s) (map version {m.version}); start each shard's nodes with `rallypoint serve "
          f"{_etcd_flags(args)} --cluster-name {args.cluster_name} --shard N --node NAME`")
    return 0


def cmd_cluster_remove_node(args) -> int:
    """``cluster remove-node``: take a dead node out of its shard's replica set, so a
    node of another name can join in its place (rallypoint.cluster.leader.ShardElection.remove_member)."""
    from .cluster.etcd import EtcdError
    from .cluster.leader import ShardElection
    from .errors import RallypointError

    async def main():
        async with _etcd_access(args).client() as etcd:
            return await ShardElection(etcd, args.cluster_name, args.shard).remove_member(args.node)

    try:
        rec = trio.run(main)
    except (EtcdError, RallypointError) as e:
        return _fail(e, args)
    rep = rec.replicas
    print(f"shard {args.shard}: {args.node} removed; members now {', '.join(rep.members)} ({len(rep.members)} of "
          f"{rep.replication_factor}); the next new node name to start joins (start it on an empty data dir)")
    return 0


def cmd_cluster_add_shard(args) -> int:
    """``cluster add-shard``: each shard's leader releases empty slots (its fair share
    for one more shard), then the map gives them to the new shard in one transaction."""
    import msgspec

    import rallypoint

    from . import protocol as p
    from .cluster.etcd import EtcdError
    from .cluster.shardmap import read_map, set_owners, watch_leaders
    from .errors import RallypointError, ValidationError

    async def main():
        async with _etcd_access(args).client() as etcd:
            m = await read_map(etcd, args.cluster_name)
            if m is None:
                raise ValidationError(f"cluster {args.cluster_name!r} has no slot map: `rallypoint cluster init` first")
            shards = m.shards
            new = args.shard if args.shard is not None else max(shards) + 1
            if new in shards:
                raise ValidationError(f"shard {new} already owns slots")
            share = max(1, len(m.owners) // (len(shards) + 1) // len(shards))
            leaders = {}
            async for leaders in watch_leaders(etcd, args.cluster_name):
                break
            released: dict[int, list[int]] = {}
            for s in shards:
                rec = leaders.get(s)
                if rec is None:
                    raise ValidationError(f"shard {s} has no leader right now; try again")
                async with rallypoint.connect(f"tcp://{rec.info.client_address}", api_key=args.api_key,
                                              reconnect=False) as rs:
                    raw = await rs._transport.call(p.ClusterReleaseSlots(count=share))
                released[s] = msgspec.msgpack.decode(raw, type=p.SlotsReleasedView).released
            owners = list(m.owners)
            moved = 0
            for s, slots in released.items():
                for x in slots:
                    if owners[x] == s:
                        owners[x] = new
                        moved += 1
            if not moved:
                raise ValidationError("no shard had an empty slot to give: every slot holds data")
            return new, moved, await set_owners(etcd, args.cluster_name, m.version, owners)

    try:
        new, moved, m = trio.run(main)
    except (EtcdError, RallypointError) as e:
        return _fail(e, args)
    print(f"shard {new} owns {moved} slot(s) now (map version {m.version}); start its nodes with "
          f"`rallypoint serve {_etcd_flags(args)} --cluster-name {args.cluster_name} --shard {new} --node NAME`")
    return 0


def cmd_cluster_status(args) -> int:
    """``cluster status``: every shard as etcd holds it (leader, epoch, members, in-sync
    set, the leader's lease time to live, the nodes running) and, from each leader, its
    standby's lag and how long it has led (since the shard's last failover);
    ``--shard N``: that shard alone, in detail. Each leader gets 5 s to answer."""
    from .cluster.etcd import EtcdError
    from .errors import RallypointError

    try:
        access = _etcd_access(args)
    except RallypointError as e:
        return _fail(e, args)

    async def main():
        async with access.client() as etcd:
            shards = [args.shard] if args.shard is not None else await _cluster_shards(etcd, args.cluster_name)
            reports = []
            for shard in shards:
                reports.append(await _shard_report(etcd, args.cluster_name, shard, args.api_key))
            return reports

    try:
        reports = trio.run(main)
    except (EtcdError, RallypointError) as e:
        return _fail(e, args)
    if args.shard is not None and reports[0] is None:
        print(f"rallypoint: no shard {args.shard} in cluster {args.cluster_name!r} at {access.url} (no node "
              "has started with --cluster yet)", file=sys.stderr)
        return 1
    if not reports:
        print(f"rallypoint: no shard in cluster {args.cluster_name!r} at {access.url} (no node has started with "
              "--cluster yet, and no `cluster init`)", file=sys.stderr)
        return 1
    if args.json:
        if args.shard is not None:
            print(json.dumps(_report_json(reports[0]), indent=2))
        else:
            print(json.dumps({"cluster": args.cluster_name, "etcd": access.url,
                              "shards": [_report_json(r) for r in reports if r is not None]}, indent=2))
        return 0
    if args.shard is not None or len(reports) == 1:
        _print_shard(reports[0], args.cluster_name, access.url)
        return 0
    print(f"cluster {args.cluster_name} (etcd {access.url}): {len(reports)} shard(s)")
    rows = [["shard", "leader", "epoch", "in sync", "members", "running", "standby", "leading for"]]
    for r in reports:
        if r is None:
            continue
        lead, view = r["leader"], r["view"]
        standby = "-"
        led = "-"
        if isinstance(view, Exception):
            standby = "no answer"
        elif view is not None:
            sb = view.standby
            standby = "none" if sb is None else f"{sb.node} {sb.state}, {sb.lag_records} behind"
            if view.leading_for_s is not None:
                led = f"{view.leading_for_s:.0f} s"
        rows.append([str(r["shard"]), lead["node"] if lead else "NONE", str(lead["epoch"]) if lead else "-",
                     ",".join(r["isr"]), f"{','.join(r['members'])} ({len(r['members'])}/{r['replication_factor']})",
                     ",".join(r["running"]) or "none", standby, led])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    return 0


async def _cluster_shards(etcd, cluster: str) -> list[int]:
    """Every shard of the cluster: the slot map's, and every shard that has keys."""
    from .cluster.shardmap import read_map

    m = await read_map(etcd, cluster)
    found = set(m.shards) if m is not None else set()
    prefix = f"/rallypoint/{cluster}/shards/"
    for kv in (await etcd.range(prefix, prefix=True)).kvs:
        part = kv.key.decode(errors="replace")[len(prefix):].split("/", 1)[0]
        if part.isdigit():
            found.add(int(part))
    return sorted(found)


async def _shard_report(etcd, cluster: str, shard: int, api_key) -> dict | None:
    """One shard as etcd holds it, and its leader's own view (a ClusterView, an error,
    or None without a leader); None when the shard has no replicas key."""
    from .cluster.etcd import EtcdError
    from .cluster.leader import ShardElection
    from .cluster.presence import nodes_prefix
    from .errors import RallypointError, UnavailableError

    import rallypoint

    state = await ShardElection(etcd, cluster, shard).read()
    if state.replicas is None:
        return None
    prefix = nodes_prefix(cluster, shard)
    running = [kv.key.decode(errors="replace")[len(prefix):] for kv in (await etcd.range(prefix, prefix=True)).kvs]
    ttl = None
    if state.leader is not None:
        try:
            ttl = (await etcd.lease_time_to_live(state.leader.lease_id)).ttl_s
        except EtcdError:
            ttl = None
    view = None
    if state.leader is not None:
        view = UnavailableError("no answer within 5 s")
        with trio.move_on_after(5):  # the connection and the call: the leader may be stopped
            try:
                async with rallypoint.connect(f"tcp://{state.leader.info.client_address}", api_key=api_key,
                                              reconnect=False, connect_timeout=5, route=False) as rs:
                    view = (await rs.status()).cluster
            except RallypointError as e:
                view = e
    rep = state.replicas.replicas
    li = state.leader.info if state.leader is not None else None
    return {"shard": shard, "members": list(rep.members), "isr": list(rep.isr),
            "replication_factor": rep.replication_factor, "running": running,
            "leader": None if li is None else {
                "node": li.node, "epoch": state.leader.epoch, "address": li.client_address,
                "replication_address": li.replication_address, "http_address": li.http_address,
                "lease_ttl_s": ttl},
            "view": view}


def _report_json(r: dict) -> dict:
    import msgspec

    view = r["view"]
    out = {k: v for k, v in r.items() if k != "view"}
    out["node"] = None if view is None or isinstance(view, Exception) else msgspec.to_builtins(view)
    if isinstance(view, Exception):
        out["node_error"] = str(view)
    return out


def _print_shard(r: dict, cluster: str, url: str) -> None:
    """``cluster status --shard N``: one shard, readable."""
    print(f"cluster     {cluster}, shard {r['shard']} (etcd {url})")
    lead = r["leader"]
    if lead is None:
        print("leader      none (a failover is under way, or no in-sync node is running)")
    else:
        print(f"leader      {lead['node']} at {lead['address']} (replication {lead['replication_address']}"
              + (f", HTTP {lead['http_address']}" if lead["http_address"] else "") + f"), epoch {lead['epoch']}"
              + ("" if lead["lease_ttl_s"] is None else f", lease {lead['lease_ttl_s']} s to live at etcd"))
    print(f"members     {' '.join(r['members'])} ({len(r['members'])} of {r['replication_factor']})")
    print(f"in sync     {' '.join(r['isr'])}")
    print(f"running     {' '.join(r['running']) or 'none'}")
    view = r["view"]
    if isinstance(view, Exception):
        print(f"standby     unknown: the leader did not answer ({view})")
    elif view is not None:
        for line in _cluster_lines(view)[3:]:
            print(line)


def _actor_lines(actors: dict) -> list[str]:
    """``status``'s per-kind actor lines (kinds with any actor or waiter), in columns
    sized to their widest value, so a kind name of any length (``idempotency``) lines up."""
    shown = [(k, a) for k, a in sorted(actors.items()) if a.get("active") or a.get("passive") or a.get("waiters")]
    rows = [[k, f"{a.get('active', 0)} active", f"{a.get('passive', 0)} passive", f"{a.get('inbox', 0)} queued",
             f"{a.get('waiters', 0)} waiters"] for k, a in shown]
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return ["  " + "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
            for r in rows]


#: The server's largest page for scope.list.
_MAX_PAGE = 10_000


def _list_runs(args):
    """One page of runs, newest first: (rows, more). ``more``: older runs exist."""
    from . import protocol as p
    from .client import types as t

    fetch = min(args.limit + 1, _MAX_PAGE)
    op = p.ScopeList(parent_id=args.parent, roots_only=args.parent is None and not args.all, state=args.state,
                     limit=fetch, before=args.before, order="desc")

    async def page(rs):
        return (await rs._call(op, t._RunList)).scopes

    rows = _client_call(args, page)
    more = len(rows) > args.limit or len(rows) == _MAX_PAGE
    return rows[: args.limit], more


async def _resolve_run(rs, text: str, *, active_only: bool) -> str:
    """``runs show|cancel RUN``: a run id as it is, or a root run's NAME (the runstate
    SDK's named runs, ``scopes.create(name=...)``): the newest root run of that name
    (``active_only``: of those still effectively ACTIVE, as ``PUT /runs/{name}`` joins).
    NOT_FOUND (with a "did you mean" among the names seen) when there is none; CONFLICT
    listing the ids when ``active_only`` finds several (cancel one by id). Several of
    that name otherwise: the newest, and a line on stderr listing them all."""
    from . import protocol as p
    from .actors.common import did_you_mean
    from .client import types as t
    from .errors import ConflictError, NotFoundError
    from .ids import is_id

    if is_id(text, "scp"):
        return text
    found, names, before = [], set(), None
    while True:  # every root run, newest first, a page at a time
        page = (await rs._call(p.ScopeList(roots_only=True, state="ACTIVE" if active_only else None,
                                           limit=_MAX_PAGE, before=before, order="desc"), t._RunList)).scopes
        for r in page:
            if active_only and r.effective != "ACTIVE":
                continue
            names.add(r.name or "")
            if r.name == text:
                found.append(r.id)
        if len(page) < _MAX_PAGE:
            break
        before = page[-1].id
    if not found:
        what = "active root run" if active_only else "root run"
        raise NotFoundError(f"no {what} named {text!r}{did_you_mean(text, names)}; give a run id (scp_...) or a "
                            "name from `rallypoint runs ls`", details={"name": text})
    if active_only and len(found) > 1:
        raise ConflictError(f"{len(found)} active root runs are named {text!r} ({', '.join(found)}); give the id "
                            "of the one to cancel", details={"name": text, "runs": found})
    if len(found) > 1:
        print(f"{len(found)} root runs are named {text!r} (newest first: {', '.join(found)}); showing the newest, "
              f"{found[0]}: give an id for another", file=sys.stderr)
    return found[0]


def _next_page_command(args, last_id: str) -> str:
    """The ``rallypoint runs ls ...`` line that lists the page after ``last_id``."""
    words = ["rallypoint", "runs", "ls"]
    if args.connect != os.environ.get("RALLYPOINT_URL", DEFAULT_URL):
        words += ["--connect", args.connect]
    if args.parent:
        words += ["--parent", args.parent]
    if args.all:
        words.append("--all")
    if args.state:
        words += ["--state", args.state]
    if args.json:
        words.append("--json")
    words += ["--limit", str(args.limit), "--before", last_id]
    return " ".join(shlex.quote(w) for w in words)


def _print_run(st) -> None:
    """``runs show``: one ``label  value`` line per field."""
    effective = st.effective + (f": {st.inactive_reason}" if st.inactive_reason else "")
    tasks = "  ".join(f"{k} {v}" for k, v in sorted(st.tasks.items())) or "none"
    for label, value in (
        ("run", st.id),
        ("name", st.name or "-"),
        ("state", f"{st.stored_state} (effective {effective})"),
        ("parent", st.parent_id or "-"),
        ("group", st.group_id or "-"),
        ("created", _fmt_time(st.created_at)),
        ("deadline", _fmt_time(st.deadline)),
        ("ended", _fmt_time(st.ended_at)),
        ("children", f"{st.children} (limit {st.child_limit})"),
        ("tasks", tasks),
    ):
        print(f"{label:<10}  {value}")


def cmd_runs(args) -> int:
    """``runs ls`` (newest first, paged with ``--before``), ``runs show RUN`` (readable, or
    ``--json``), ``runs cancel RUN``; RUN is an id or a root run's name (:func:`_resolve_run`)."""
    from .errors import RallypointError

    try:
        if args.runs_cmd in ("ls", "list"):
            rows, more = _list_runs(args)
            if args.json:
                print(json.dumps([r.to_dict() for r in rows], default=str, indent=2))
            else:
                print(f"{'ID':32} {'STATE':10} {'EFFECTIVE':9} {'CHILDREN':>8}  {'CREATED':20}  NAME")
                for r in rows:
                    print(f"{r.id:32} {r.stored_state:10} {r.effective:9} {r.children:>8}  "
                          f"{_fmt_time(r.created_at):20}  {r.name or ''}")
            if more and rows:
                print(f"{len(rows)} runs shown, newest first; the next page: "
                      f"{_next_page_command(args, rows[-1].id)}", file=sys.stderr)
            return 0
        if args.runs_cmd == "show":
            async def show(rs):
                return await rs.scope(await _resolve_run(rs, args.id, active_only=False)).status()

            st = _client_call(args, show)
            if args.json:
                print(json.dumps(st.to_dict(), default=str, indent=2))
            else:
                _print_run(st)
            return 0
        if args.runs_cmd == "cancel":
            async def cancel(rs):
                return await rs.scope(await _resolve_run(rs, args.id, active_only=True)).cancel(reason=args.reason)

            st = _client_call(args, cancel)
            print(f"{st.id} {st.stored_state} ({st.effective})")
            return 0
    except RallypointError as e:
        return _fail(e, args)
    return 2


# ------------------------------------------------------------------------------ watch, top
_STYLE = {
    "failed": "bold red", "cancelled": "red", "expired": "red", "deadline": "red", "lease_expired": "yellow",
    "completed": "green", "released": "green", "finalized": "bold", "closed": "cyan", "fired": "cyan",
    "created": "blue", "submitted": "dim", "delivered": "dim", "purged": "magenta",
}


def _event_line(e):
    """One rich Text line for an event: seq, time, type, aggregate, run, data."""
    from rich.text import Text

    what = e.type.split(".", 1)[1]
    style = _STYLE.get(what, "")
    line = Text()
    line.append(f"{e.seq:>8} " if e.shard is None else f"{e.shard:>3}:{e.seq:<6} ", style="dim")
    line.append(e.at.strftime("%H:%M:%S.%f")[:-3] + " ", style="dim")
    line.append(f"{e.type:<24}", style=style)
    line.append(f" {e.kind}:{e.id}")
    if e.run and e.run != e.id:
        line.append(f"  run {e.run}", style="dim")
    if e.data:
        line.append("  " + " ".join(f"{k}={v}" for k, v in e.data.items()), style="italic")
    return line


def _event_json(e, cursor=None) -> str:
    """One event as a JSON line; in a cluster of several shards also its ``shard`` and
    the watch's ``cursor`` after it (the vector ``--cursor`` resumes from)."""
    out = {"seq": e.seq, "type": e.type, "kind": e.kind, "id": e.id, "run": e.run,
           "at": e.at.isoformat().replace("+00:00", "Z"), "data": e.data}
    if e.shard is not None:
        out["shard"] = e.shard
        out["cursor"] = cursor
    return json.dumps(out, separators=(",", ":"))


def cmd_watch(args) -> int:
    """``watch``: print the space's events as they happen (pushed by the server), from
    now (default), after ``--cursor``, or from the oldest kept (``--from-start``);
    ``--types``, ``--run`` (and everything below it), ``--aggregate`` filter; ``--json``
    one object a line; ``--count N`` stops after N events. Resumes by itself across a
    daemon restart. Ctrl-C ends it (exit 0). Against a cluster of several shards it
    merges every shard's events (docs/events.md): lines show ``shard:seq``, ``--json``
    adds ``shard`` and ``cursor`` (the vector ``--cursor`` takes), and ``--count``
    ends by printing the cursor to resume with."""
    import rallypoint
    from rich.console import Console

    from .errors import CursorExpiredError
    from .events import closest_type, unknown_types

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich exits 1 on a closed pipe; main() answers it as SIGPIPE would (141),
            # like --json and every other command
            raise BrokenPipeError

    console = _Console(highlight=False, soft_wrap=True)
    start = "oldest" if args.from_start else "now"
    printed = [0]
    if args.types is not None:
        unknown = unknown_types(x.strip() for x in args.types.split(","))
        if unknown:
            close = closest_type(unknown[0])
            hint = f"did you mean {close!r}? " if close else ""
            print(f"rallypoint watch: unknown event type {unknown[0]!r} ({hint}see docs/events.md; a prefix is "
                  f"written KIND.*, e.g. task.*)", file=sys.stderr)
            return 2
    if args.aggregate is not None and ":" in args.aggregate and not all(args.aggregate.split(":", 1)):
        print(f"rallypoint watch: --aggregate is KIND:ID or an id (got {args.aggregate!r})", file=sys.stderr)
        return 2
    # a live view (no --cursor, no --from-start) that falls behind the events kept goes on
    # from now, saying how far it fell behind; one asked to see every event fails instead
    live = args.cursor is None and not args.from_start

    async def main():
        async with rallypoint.connect(args.connect, api_key=args.api_key, tls_ca=args.tls_ca) as rs:
            cursor, begin = args.cursor, start
            while True:
                try:
                    async with rs.events.watch(cursor=cursor, types=args.types, scope=args.run,
                                               aggregate=args.aggregate, start=begin) as stream:
                        async for e in stream:
                            sharded = e.shard is not None  # (several shards: the cursor is a vector)
                            if args.json:
                                sys.stdout.write(_event_json(e, stream.cursor if sharded else None) + "\n")
                                sys.stdout.flush()
                            else:
                                console.print(_event_line(e))
                            printed[0] += 1
                            if args.count and printed[0] >= args.count:
                                if sharded:  # the vector to resume from, not the last seq
                                    print(f"rallypoint watch: resume with --cursor {stream.cursor}", file=sys.stderr,
                                          flush=True)
                                return
                    return
                except CursorExpiredError as exc:
                    if not live:
                        raise
                    print(f"rallypoint watch: fell behind the events kept ({exc.message}); going on from now",
                          file=sys.stderr, flush=True)
                    cursor, begin = None, "now"

    return _run_live(main, args)


def _top_backlog(q) -> tuple[str, str]:
    """``top``'s two backlog cells of a work queue (issue 44): its ready tasks per
    priority (``p1 2  p3 40``) and its largest fairness keys (``a 30  b 10 +3``: three
    more keys with ready tasks; ``-`` is no key); ``-`` when none is ready."""
    prios = "  ".join(f"p{p} {n:,}" for p, n in sorted(q.ready_by_priority.items(), key=lambda kv: int(kv[0])))
    keys = "  ".join(f"{k or '-'} {n:,}" for k, n in q.ready_top_keys.items())
    named = sum(1 for k in q.ready_top_keys if k)
    if q.ready_keys > named:
        keys += f" +{q.ready_keys - named}"
    return prios or "-", keys or "-"


def _top_frame(ov, st, url: str, rates: dict, limit: int):
    """One frame of ``top``: a rich Group of tables."""
    import datetime as _dt

    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = _dt.datetime.now(_dt.timezone.utc)

    def age(t) -> str:
        return _fmt_age((now - t).total_seconds()) if t is not None else "-"

    head = Text()
    head.append(f"rallypoint {st.version}", style="bold")
    head.append(f"  {url}  up {_fmt_age(st.uptime_s)}  {st.connections} connections  {st.durability}  "
                f"LSN {st.last_lsn}  {ov.entities} entities  events {ov.events.get('newest', 0)} "
                f"({ov.events.get('watchers', 0)} watching)  purged {ov.retention.get('entities', 0)}")
    tasks = "  ".join(f"{k} {v}" for k, v in sorted(ov.tasks.items())) or "no tasks"
    head.append(f"\nruns: {ov.runs_active} active   tasks: {tasks}")

    # ids are never cut (they are what an operator copies into `runs show`): a narrow
    # terminal shortens the names (ellipsis) instead
    id_width = max([len(r.id) for r in ov.runs] + [len(g.id) for g in ov.groups] + [3])
    runs = Table(title=f"active runs (newest {limit})", title_justify="left", expand=True)
    for col in ("run", "name", "age", "queued", "running", "done", "failed", "children"):
        if col == "run":
            runs.add_column(col, no_wrap=True, min_width=id_width)
        elif col == "name":  # (shortened, never dropped: at least 12 characters)
            runs.add_column(col, no_wrap=True, overflow="ellipsis", ratio=1, min_width=12)
        else:
            runs.add_column(col, justify="right", no_wrap=True)
    for r in ov.runs:
        t = r.tasks
        runs.add_row(r.id, r.name or "", age(r.created_at), str(t.get("QUEUED", 0)), str(t.get("RUNNING", 0)),
                     str(t.get("SUCCEEDED", 0)), str(t.get("FAILED", 0) + t.get("CANCELLED", 0) + t.get("EXPIRED", 0)),
                     str(r.children))
    queues = Table(title="work queues (busiest first)", title_justify="left", expand=True)
    for col in ("queue", "depth", "in flight", "done/s", "done since start"):
        if col == "queue":
            queues.add_column(col, no_wrap=True, overflow="ellipsis", ratio=1)
        else:
            queues.add_column(col, justify="right", no_wrap=True)
    busiest = sorted(ov.queues, key=lambda q: (-(q.queued + q.running), -rates.get(q.name, 0.0), q.name))
    for q in busiest:
        queues.add_row(q.name, str(q.queued), str(q.running), f"{rates.get(q.name, 0.0):,.0f}", str(q.done))
    # issue 44: the queues with ready tasks, their backlog per priority and largest keys
    ready = Table(title="ready backlog (per priority; largest fairness keys, - no key)", title_justify="left",
                  expand=True)
    ready.add_column("queue", no_wrap=True, overflow="ellipsis", ratio=1)
    ready.add_column("by priority", no_wrap=True, overflow="ellipsis", ratio=1)
    ready.add_column("largest keys", no_wrap=True, overflow="ellipsis", ratio=2)
    for q in busiest:
        if q.ready_by_priority:
            ready.add_row(q.name, *_top_backlog(q))
    groups = Table(title=f"open groups ({ov.groups_open})", title_justify="left", expand=True)
    for col in ("group", "condition", "state", "members", "accepted", "age"):
        if col == "group":
            groups.add_column(col, no_wrap=True, min_width=id_width)
        else:
            groups.add_column(col, justify="left" if col in ("condition", "state") else "right", no_wrap=True)
    for g in ov.groups:
        groups.add_row(g.id, g.condition, g.state, str(g.members), str(g.accepted), age(g.created_at))
    waits = Table(title="actors and waits", title_justify="left", expand=True)
    for col in ("kind", "active", "passive", "inbox", "waiting"):
        waits.add_column(col, justify="left" if col == "kind" else "right")
    for kind, a in sorted(ov.waits.items()):
        waits.add_row(kind, str(a.get("active", 0)), str(a.get("passive", 0)), str(a.get("inbox", 0)),
                      str(a.get("waiters", 0)))
    return Group(head, runs, queues, ready, groups, waits)


def cmd_top(args) -> int:
    """``top``: a live, refreshing view of the space: active runs (full ids; names are
    shortened to fit), work queues (busiest first: depth + in flight, then completions
    per second; "done since start" counts since the daemon started; the ready backlog per
    priority and the largest fairness keys), open groups, actors
    and parked waits. ``--once`` prints one frame (the default when stdout is not a
    terminal). ``q`` (on a terminal) or Ctrl-C ends it."""
    import rallypoint
    from rich.console import Console
    from rich.live import Live

    console = Console(highlight=False)
    once = args.once or not console.is_terminal
    if args.width or not console.is_terminal:
        # off a terminal rich assumes 80 columns: the real width ($COLUMNS), else wide
        # enough for every column, ids and names whole
        console = Console(highlight=False, width=args.width or int(os.environ.get("COLUMNS") or 0) or 200)

    async def main():
        async with rallypoint.connect(args.connect, api_key=args.api_key, tls_ca=args.tls_ca) as rs:
            prev: dict = {}
            prev_t = None
            rates: dict = {}

            async def frame():
                nonlocal prev, prev_t, rates
                ov, st = await rs.overview(limit=args.limit), await rs.status()
                t = time.monotonic()
                done = {q.name: q.done for q in ov.queues}
                if prev_t is not None and t > prev_t:
                    rates = {n: max(0, d - prev.get(n, d)) / (t - prev_t) for n, d in done.items()}
                prev, prev_t = done, t
                return _top_frame(ov, st, args.connect, rates, args.limit)

            if once:
                console.print(await frame())
                return
            # keys first: a key typed while the first frame is drawn is kept, not flushed
            with _keys_pressed() as keys, \
                    Live(await frame(), console=console, refresh_per_second=4, screen=False) as live:
                async with trio.open_nursery() as n:
                    if keys is not None:
                        n.start_soon(_quit_on_q, keys, n.cancel_scope)
                    while True:
                        await trio.sleep(args.interval)
                        live.update(await frame())

    return _run_live(main, args)


class _keys_pressed:
    """stdin, key by key, while a live view runs (``q`` quits ``top``): the terminal in
    cbreak mode (no line buffering, no echo; Ctrl-C still signals), restored on exit.
    The fd, or None when stdin is not a terminal."""

    def __enter__(self):
        import termios
        import tty

        self._fd = None
        try:
            fd = sys.stdin.fileno()
            if not os.isatty(fd):
                return None
            self._saved = termios.tcgetattr(fd)
            tty.setcbreak(fd, termios.TCSANOW)  # (not TCSAFLUSH: keep what was typed already)
        except (OSError, ValueError, termios.error):
            return None
        self._fd = fd
        return fd

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)


async def _quit_on_q(fd: int, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when ``q`` (or ``Q``) is typed, or stdin closes."""
    while True:
        await trio.lowlevel.wait_readable(fd)
        ch = os.read(fd, 1)
        if not ch or ch in (b"q", b"Q"):
            scope.cancel()
            return


def _print_rows(header: list[str], rows: list[list[str]]) -> None:
    """Aligned columns (every value one word, so the output stays ``awk``-able)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    for r in [header, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


def _fmt_window(ms: int) -> str:
    s = ms / 1000
    return f"{s:g}s" if s < 60 or s % 60 else (f"{s / 60:g}m" if s < 3600 or s % 3600 else f"{s / 3600:g}h")


def _print_quota(q) -> None:
    """``quotas show``: one ``label  value`` line per field, then the waiters in line."""
    cooldown = "-" if q.cooldown_until is None else f"until {_fmt_time(q.cooldown_until)}" + (
        f" ({q.cooldown_reason})" if q.cooldown_reason else "")
    for label, value in (
        ("quota", q.id),
        ("name", q.name),
        ("limit", f"{q.units_limit} units per {_fmt_window(q.window_ms)} (fixed windows)"),
        ("window", f"{_fmt_time(q.window_start)} .. {_fmt_time(q.window_end)}"),
        ("used", f"{q.used} ({q.remaining} left)"),
        ("waiting", str(q.waiting)),
        ("cooldown", cooldown),
        ("consumed", f"{q.consumed_total} units in total"),
        ("created", _fmt_time(q.created_at)),
    ):
        print(f"{label:<10}  {value}")
    if q.waiters:
        print()
        _print_rows(["WAITER", "UNITS", "RUN", "EXPIRES", "HOLDER"],
                    [[w.waiter_id or "-", str(w.units), w.scope_id, _fmt_time(w.expires_at), w.holder or "-"]
                     for w in q.waiters])


def _money(amount: int, b) -> str:
    from .money import format_minor

    return f"{format_minor(amount, b.scale)} {b.currency}"


def _print_budget(b) -> None:
    """``budgets show``: the budget's figures, then its open reservations."""
    from .money import format_minor

    for label, value in (
        ("budget", b.id),
        ("name", b.name),
        ("limit", f"{_money(b.limit_minor, b)} ({b.limit_minor} minor units, scale {b.scale})"),
        ("settled", _money(b.settled_minor, b)),
        ("reserved", f"{_money(b.reserved_minor, b)} in {b.open_reservations} open reservation(s)"),
        ("available", _money(b.available_minor, b)),
        ("overrun", _money(b.overrun_minor, b) + " (asked beyond what was left; not charged)"),
        ("created", _fmt_time(b.created_at)),
    ):
        print(f"{label:<10}  {value}")
    if b.reservations:
        print()
        _print_rows(["RESERVATION", "STATE", "HELD", "SETTLED", "RUN", "SETTLE_BY"],
                    [[r.id, r.state, format_minor(r.remaining_minor, b.scale), format_minor(r.settled_minor, b.scale),
                      r.scope_id, _fmt_time(r.settle_by)] for r in b.reservations])


def _ls_show(args, list_fn, header: list[str], row, show_fn, print_one) -> int:
    """``ls``: ``list_fn(rs)`` as columns (``row(x)`` -> words) or ``--json``; ``show
    NAME``: ``show_fn(rs)`` printed by ``print_one`` or as ``--json``. Errors: one line."""
    from .errors import RallypointError

    try:
        if args.sub_cmd in ("ls", "list"):
            rows = _client_call(args, list_fn)
            if args.json:
                print(json.dumps([r.to_dict() for r in rows], default=str, indent=2))
            else:
                _print_rows(header, [row(x) for x in rows])
            return 0
        one = _client_call(args, show_fn)
        if args.json:
            print(json.dumps(one.to_dict(), default=str, indent=2))
        else:
            print_one(one)
        return 0
    except RallypointError as e:
        return _fail(e, args)


def cmd_quotas(args) -> int:
    """``quotas ls`` (every quota of the space: used/remaining in the current window,
    waiters, cooldown) and ``quotas show NAME`` (readable, with the waiters in line;
    ``--json`` for scripts)."""
    return _ls_show(
        args, lambda rs: rs.quotas.list(),
        ["NAME", "LIMIT", "WINDOW", "USED", "REMAINING", "WAITING", "COOLDOWN_UNTIL"],
        lambda q: [q.name, str(q.units_limit), _fmt_window(q.window_ms), str(q.used), str(q.remaining),
                   str(q.waiting), _fmt_time(q.cooldown_until)],
        lambda rs: rs.quota(args.name).status(waiters=True), _print_quota,
    )


def _print_schedule(d) -> None:
    """``schedules describe``: the settings, the next fires, the recent actions."""
    spec = " + ".join([f"cron {c!r}" for c in d.cron] + ([f"every {d.interval_ms / 1000:g}s (+{d.offset_ms / 1000:g}s)"]
                                                         if d.interval_ms else []))
    for label, value in (
        ("schedule", d.id), ("name", d.name), ("spec", f"{spec} in {d.timezone}"),
        ("window", f"{_fmt_time(d.start) if d.start else '-'} .. {_fmt_time(d.end) if d.end else '-'}"),
        ("jitter", f"{d.jitter_ms / 1000:g}s"), ("overlap", d.overlap),
        ("catch-up", f"{d.catchup_window_ms / 1000:g}s"), ("on failure", "pause" if d.pause_on_failure else "go on"),
        ("remaining", "unlimited" if d.remaining_actions is None else str(d.remaining_actions)),
        ("action", f"run {d.run_name!r}" + (f" + task to {d.mailbox}" if d.mailbox else "")),
        ("state", ("PAUSED" + (f" ({d.note})" if d.note else "")) if d.paused else "active"),
        ("taken", f"{d.actions} action(s), {d.skipped} time(s) skipped, {len(d.running)} running"),
    ):
        print(f"{label:<10}  {value}")
    if d.next_fires:
        print()
        _print_rows(["NEXT_FIRE"], [[_fmt_time(f)] for f in d.next_fires])
    if d.recent:
        print()
        _print_rows(["SCHEDULED", "FIRED", "ORIGIN", "RUN", "STATE", "OUTCOME"],
                    [[_fmt_time(a.scheduled_at), _fmt_time(a.fired_at), a.origin, a.run_id, a.state,
                      a.outcome or "-"] for a in d.recent])


def cmd_schedules(args) -> int:
    """``schedules create NAME (--cron EXPR | --every S) ...``, ``ls``, ``describe NAME``,
    ``pause NAME [--note]``, ``unpause NAME``, ``trigger NAME``, ``backfill NAME --start
    --end``, ``delete NAME``: one line per error, ``--json`` for scripts."""
    from .errors import RallypointError

    sc = args.sub_cmd
    try:
        if sc in ("ls", "list"):
            rows = _client_call(args, lambda rs: rs.schedules.list())
            if args.json:
                print(json.dumps([r.to_dict() for r in rows], default=str, indent=2))
            else:
                _print_rows(["NAME", "SPEC", "OVERLAP", "STATE", "ACTIONS", "SKIPPED", "NEXT_FIRE"],
                            [[r.name, " + ".join(r.cron + ([f"every {r.interval_ms / 1000:g}s"] if r.interval_ms
                                                          else [])), r.overlap, "PAUSED" if r.paused else "active",
                              str(r.actions), str(r.skipped), _fmt_time(r.next_fires[0]) if r.next_fires else "-"]
                             for r in rows])
            return 0

        async def one(rs):
            if sc == "create":
                s = await rs.schedules.create(
                    args.name, cron=args.cron or None, every=args.every, offset=args.offset, timezone=args.timezone,
                    start=args.start, end=args.end, jitter=args.jitter, run_name=args.run_name,
                    run_deadline=args.run_deadline, mailbox=args.mailbox,
                    input=json.loads(args.input) if args.input is not None else None, overlap=args.overlap,
                    catchup_window=args.catchup_window, pause_on_failure=args.pause_on_failure,
                    remaining_actions=args.remaining_actions, paused=args.paused)
                return await s.describe()
            h = await rs.schedules.get(args.name)
            if sc == "describe":
                return await h.describe(next_n=args.next, recent=args.recent)
            if sc == "pause":
                return await h.pause(args.note)
            if sc == "unpause":
                return await h.unpause(args.note)
            if sc == "trigger":
                return await h.trigger(args.overlap)
            if sc == "backfill":
                return await h.backfill(args.start, args.end, args.overlap)
            if sc == "delete":
                return await h.delete()
            raise AssertionError(sc)

        d = _client_call(args, one)
        if args.json:
            print(json.dumps(d.to_dict(), default=str, indent=2))
        else:
            _print_schedule(d)
        return 0
    except RallypointError as e:
        return _fail(e, args)


def cmd_budgets(args) -> int:
    """``budgets ls`` (every budget of the space: limit, settled, reserved, available)
    and ``budgets show NAME`` (readable, with the open reservations; ``--json``)."""
    from .money import format_minor

    return _ls_show(
        args, lambda rs: rs.budgets.list(),
        ["NAME", "CURRENCY", "LIMIT", "SETTLED", "RESERVED", "AVAILABLE", "OPEN"],
        lambda b: [b.name, b.currency, *(format_minor(v, b.scale) for v in (
            b.limit_minor, b.settled_minor, b.reserved_minor, b.available_minor)), str(b.open_reservations)],
        lambda rs: rs.budget(args.name).status(reservations=True), _print_budget,
    )


def _json_text(value) -> str:
    """Views (nested ones too) as indented JSON: instants ISO 8601, payloads as values."""
    import msgspec

    return json.dumps(msgspec.to_builtins(value), default=str, indent=2)


def _payload_text(value) -> str:
    """A payload (observation, result) on one line: JSON, ``-`` for none."""
    if value is None:
        return "-"
    return json.dumps(value, default=str, separators=(",", ":"))


def _print_claim(c) -> None:
    """``claims show``: one ``label  value`` line per field, then the queue."""
    for label, value in (
        ("claim", c.id),
        ("key", c.key),
        ("state", c.state),
        ("generation", c.generation),
        ("run", c.scope_id),
        ("holder", c.holder or "-"),
        ("acquired", _fmt_time(c.acquired_at)),
        ("expires", _fmt_time(c.lease_expires_at)),
        ("observation", _payload_text(c.observation)),
        ("result", _payload_text(c.result) if c.state == "COMPLETED" else "-"),
        ("completed", _fmt_time(c.completed_at)),
        ("created", _fmt_time(c.created_at)),
        ("waiters", len(c.waiters)),
    ):
        print(f"{label:<12}  {value}")
    for i, w in enumerate(c.waiters, 1):
        print(f"  {i:>3}. run {w.scope_id}  holder {w.holder or '-'}  queued {_fmt_time(w.queued_at)}  "
              f"gives up {_fmt_time(w.expires_at)}")


def cmd_claims(args) -> int:
    """``claims ls`` (key order; ``--state``, ``--limit``, ``--after``), ``claims show KEY``
    (readable, or ``--json``). Tokens are never shown."""
    from .errors import RallypointError

    try:
        if args.claims_cmd in ("ls", "list"):
            rows = _client_call(args, lambda rs: rs.claims.list(state=args.state, limit=args.limit, after=args.after))
            if args.json:
                print(_json_text(rows))
            else:
                print(f"{'KEY':40} {'STATE':9} {'GEN':>5} {'WAITERS':>7}  {'EXPIRES':20}  HOLDER")
                for c in rows:
                    print(f"{c.key:40} {c.state:9} {c.generation:>5} {len(c.waiters):>7}  "
                          f"{_fmt_time(c.lease_expires_at):20}  {c.holder or '-'}")
                if len(rows) == args.limit:
                    print(f"{len(rows)} claims shown; the next page: add --after {shlex.quote(rows[-1].key)}",
                          file=sys.stderr)
            return 0
        if args.claims_cmd == "show":
            c = _client_call(args, lambda rs: rs.claims.status(args.key))
            if args.json:
                print(_json_text(c))
            else:
                _print_claim(c)
            return 0
    except RallypointError as e:
        return _fail(e, args)
    return 2


def _print_pool(pl) -> None:
    """``pools show``: the pool, then its queue (FIFO) and its active grants."""
    for label, value in (
        ("pool", pl.id),
        ("name", pl.name),
        ("units", f"{pl.units_used} used of {pl.units_total} ({pl.units_free} free)"),
        ("waiting", pl.waiting),
        ("grants", pl.active_grants),
        ("created", _fmt_time(pl.created_at)),
    ):
        print(f"{label:<8}  {value}")
    if pl.waiters:
        print("queue (first come, first served):")
        for i, w in enumerate(pl.waiters, 1):
            print(f"  {i:>3}. {w.units:>5} unit(s)  run {w.scope_id}  holder {w.holder or '-'}  "
                  f"gives up {_fmt_time(w.expires_at)}")
    if pl.grants:
        print("active grants:")
        for g in pl.grants:
            held = f"task {g.task_id}" if g.task_id else f"expires {_fmt_time(g.lease_expires_at)}"
            print(f"  {g.id}  {g.units:>5} unit(s)  run {g.scope_id}  {held}  holder {g.holder or '-'}")


def cmd_pools(args) -> int:
    """``pools ls`` (every pool of the space with its units), ``pools show NAME``."""
    from .errors import RallypointError

    try:
        if args.pools_cmd in ("ls", "list"):
            rows = _client_call(args, lambda rs: rs.pools.list())
            if args.json:
                print(_json_text(rows))
            else:
                print(f"{'NAME':32} {'TOTAL':>8} {'USED':>8} {'FREE':>8} {'WAITING':>8} {'GRANTS':>7}")
                for pl in rows:
                    print(f"{pl.name:32} {pl.units_total:>8} {pl.units_used:>8} {pl.units_free:>8} "
                          f"{pl.waiting:>8} {pl.active_grants:>7}")
            return 0
        if args.pools_cmd == "show":
            async def show(rs):
                return await rs.pool(args.name).status()

            pl = _client_call(args, show)
            if args.json:
                print(_json_text(pl))
            else:
                _print_pool(pl)
            return 0
    except RallypointError as e:
        return _fail(e, args)
    return 2


class _OpenModeRefused(Exception):
    """``keys create`` on a running open-mode daemon without ``--force``."""


def _something_listens(url: str) -> bool:
    """Whether a TCP connection to the first address of ``url`` is accepted (0.3 s)."""
    import socket

    from .client.follow import split_urls
    from .transport.connection import parse_url

    try:
        host, port = parse_url(split_urls(url)[0])
    except Exception:
        return False
    try:
        with socket.create_connection((host, port), timeout=0.3):
            return True
    except OSError:
        return False


def cmd_keys(args) -> int:
    """``keys create|list|revoke``: over a connection (``--connect``, needs ``admin`` once
    keys exist), in a cluster's etcd (``--cluster etcd://...``: its key store, every
    shard's leader takes the keys from there; rallypoint.cluster.keystore) or, by
    default, directly on a stopped daemon's ``--data-dir``.

    Creating the first key on a running daemon, or in the etcd of a cluster some shard
    of which is running, ends open mode (every client without a key is refused from
    then on): refused with exit 2 unless ``--force``."""
    import msgspec

    from . import protocol as p
    from .errors import RallypointError

    cmd = {"ls": "list"}.get(args.keys_cmd, args.keys_cmd)
    if args.cluster and args.connect:
        print("rallypoint: keys --cluster and --connect exclude each other (in a cluster, keys are made in etcd)",
              file=sys.stderr)
        return 2

    def op():
        if cmd == "create":
            return p.KeyCreate(space=args.space, permissions=args.permission, name=args.name)
        if cmd == "list":
            return p.KeyList(space=args.space)
        return p.KeyRevoke(key_id=args.id)

    async def online():
        import rallypoint

        async with rallypoint.connect(args.connect, api_key=args.api_key, tls_ca=args.tls_ca) as rs:
            # Connected without a key: the server has none, it is in open mode.
            if cmd == "create" and not args.api_key and not args.force:
                raise _OpenModeRefused
            return msgspec.msgpack.decode(await rs._transport.call(op()))

    async def offline():
        from .node import open_node
        from .service import Service, Session

        async with open_node(args.data_dir, "fsync") as node:
            # The same operation path as over TCP, as the local operator of the data dir.
            res = await Service(node.coordinator).call(Session(local=True), op())
            return msgspec.msgpack.decode(res)

    async def in_etcd():
        from .cluster import keystore
        from .cluster.shardmap import watch_leaders
        from .clock import to_iso

        def view(rec, secret=None) -> dict:
            out = {"id": rec.id, "space": rec.space, "name": rec.name, "permissions": list(rec.permissions),
                   "created_at": to_iso(rec.created_at_ms), "revoked_at": to_iso(rec.revoked_at_ms)}
            if secret is not None:
                out["secret"] = secret
            return out

        async with _etcd_access(args).client() as etcd:
            name = args.cluster_name
            if cmd == "list":
                return {"keys": [view(r) for r in await keystore.list_keys(etcd, name, args.space)]}
            if cmd == "revoke":
                return view(await keystore.revoke_key(etcd, name, args.id))
            if not args.force and not await keystore.list_keys(etcd, name):
                async for leaders in watch_leaders(etcd, name):
                    if leaders:  # a shard is serving, in open mode
                        raise _OpenModeRefused
                    break
            rec, secret = await keystore.create_key(etcd, name, args.space, args.permission, args.name)
            return view(rec, secret)

    def line(view: dict) -> str:
        state = "revoked " + view["revoked_at"] if view.get("revoked_at") else "live"
        perms = ",".join(view["permissions"])
        return f"{view['id']}  space={view['space']}  permissions={perms}  name={view.get('name') or ''}  {state}"

    explicit = args.data_dir is not None
    if not explicit:
        args.data_dir = DEFAULT_DATA_DIR
    try:
        if not args.connect and not args.cluster and cmd == "create" and not explicit:
            # (made silently before, while a daemon ran elsewhere: a key it never saw)
            url = os.environ.get("RALLYPOINT_URL") or DEFAULT_URL
            if _something_listens(url):
                print(f"rallypoint: a daemon answers at {url}, and a key made in {args.data_dir} would not reach "
                      f"it: give --connect {url} (with an admin --api-key, or --force in open mode), or the "
                      "--data-dir of a stopped daemon", file=sys.stderr)
                return 2
            if not os.path.exists(os.path.join(args.data_dir, "FORMAT")):
                print(f"rallypoint: no data dir at {args.data_dir} yet: making one for this key; start the daemon "
                      f"on it (rallypoint serve --data-dir {args.data_dir})", file=sys.stderr)
        if (not args.connect and not args.cluster and cmd != "create"
                and not os.path.exists(os.path.join(args.data_dir, "FORMAT"))):
            print(f"rallypoint: {args.data_dir} is not a rallypoint data dir (give --data-dir, --connect URL or "
                  "--cluster etcd://HOST:PORT)", file=sys.stderr)
            return 2
        out = trio.run(in_etcd if args.cluster else online if args.connect else offline)
    except _OpenModeRefused:
        where = f"cluster {args.cluster_name!r} (its shards)" if args.cluster else args.connect
        print(f"rallypoint: {where} is in open mode (no API keys): a first key turns authentication on "
              "and every client without a key is refused from then on; make it an admin key and rerun with "
              "--force", file=sys.stderr)
        return 2
    except RallypointError as e:  # (etcd's errors too)
        return _fail(e, args)
    except Exception as e:
        from .persistence import StartupError

        if isinstance(e, StartupError):
            print(f"rallypoint: {e}\n(is the daemon running? then use --connect URL --api-key ADMIN_KEY)",
                  file=sys.stderr)
            return 2
        raise
    if cmd == "create" and args.secret_only:
        print(out["secret"])
        return 0
    views = out["keys"] if cmd == "list" else [out]
    if args.json:
        print(json.dumps(views if cmd == "list" else out, indent=2))
        return 0
    for v in views:
        print(line(v))
    if cmd == "list" and not views:
        print("no API keys (open mode: the daemon serves without authentication on loopback)" if not args.cluster
              else f"no API keys in cluster {args.cluster_name!r} (open mode on loopback)", file=sys.stderr)
    if cmd == "create":
        print(f"secret: {out['secret']}")
        print("(shown once: only its SHA-256 is stored)", file=sys.stderr)
    return 0


def cmd_repair(args) -> int:
    """Check the journal of a stopped daemon; print exactly what a repair would cut (LSN
    range, files, record count) and do it after asking (or with ``--yes``). Exit 0 intact
    or repaired, 1 declined, 2 unusable (not a data dir, daemon running, snapshot store
    unreadable)."""
    _setup_logging("WARNING")
    from .persistence import DataDirLocked, SnapshotCorruptError
    from .persistence.repair import apply_repair, plan_repair

    if not os.path.exists(os.path.join(args.data_dir, "FORMAT")):
        print(f"rallypoint: {args.data_dir} is not a rallypoint data dir", file=sys.stderr)
        return 2
    try:
        from .persistence import DataDirLock

        with DataDirLock(args.data_dir):  # never repair under a running daemon
            try:
                plan = plan_repair(args.data_dir)
            except SnapshotCorruptError as e:
                print(f"rallypoint: {e}{_journal_from_lsn_1(args.data_dir)}", file=sys.stderr)
                return 2
            print(plan.describe())
            if not plan.needed:
                return 0
            if not args.yes:
                try:
                    answer = input("Apply this repair? [y/N] ")
                except EOFError:
                    answer = ""
                if answer.strip().lower() not in ("y", "yes"):
                    print("rallypoint: nothing changed")
                    return 1
            report = apply_repair(plan)
    except DataDirLocked as e:
        print(f"rallypoint: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"rallypoint: repair failed: {e}; the journal may be half repaired: run `rallypoint repair` "
              f"again once the cause is fixed", file=sys.stderr)
        return 2
    print(f"repaired: the journal now ends at LSN {report.last_lsn}; {len(report.deleted_segments)} "
          f"segment file(s) deleted, {report.bytes_dropped} bytes dropped")
    return 0


def _journal_from_lsn_1(data_dir: str) -> str:
    """For a corrupt snapshot store: can the state be rebuilt from the journal alone?"""
    from .persistence import JournalCorruptError
    from .persistence.journal import list_segments, scan_journal

    segs = list_segments(data_dir)
    if not segs or segs[0][0] != 1:
        first = segs[0][0] if segs else None
        return (f" The journal starts at LSN {first}, not 1: the records before it exist only in the snapshot; "
                f"restore the snapshot from a backup." if first else
                " The journal is empty: restore the snapshot from a backup.")
    try:
        res = scan_journal(data_dir, 0, cut_torn_tail=False)
    except JournalCorruptError as e:
        return f" The journal starts at LSN 1 but is damaged too ({e.reason})."
    return (f" The journal holds every record from LSN 1 to {res.last_lsn}: moving the snapshot directory "
            f"aside loses nothing.")


# ------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rallypoint", description="A coordination server for swarms of agents and workers.")
    ap.add_argument("--version", action="version", version=f"rallypoint {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--listen", default=DEFAULT_LISTEN, help="HOST:PORT or tcp://HOST:PORT (default %(default)s; port 0 picks one)")
    s.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where the journal and snapshots live (default %(default)s)")
    s.add_argument("--durability", default="fsync", choices=["fsync", "interval", "memory"],
                   help="fsync: every ack is on disk; interval: fsync every --interval-ms; memory: no files (default %(default)s)")
    s.add_argument("--interval-ms", type=_bounded(int, 1), default=10, help="fsync period in interval mode, ms (default %(default)s)")
    s.add_argument("--snapshot-every-records", type=_bounded(int, 1), default=100_000,
                   help="snapshot after this many journal entries (default %(default)s)")
    s.add_argument("--snapshot-every-s", type=_bounded(float, 0, inclusive=False), default=60.0,
                   help="snapshot after this many seconds if anything changed (default %(default)s)")
    s.add_argument("--snapshot-retry-s", type=_bounded(float, 0, inclusive=False), default=5.0,
                   help="retry a snapshot that failed (e.g. no room in LMDB) after this many seconds "
                        "(default %(default)s)")
    s.add_argument("--min-free-mb", type=_bounded(float, 0), default=64.0,
                   help="refuse writes (UNAVAILABLE, reads go on) while the data dir's filesystem has less free "
                        "space than this many MiB; they resume by themselves (default %(default)s; 0: only when "
                        "a write fails)")
    s.add_argument("--ballast-mb", type=_bounded(float, 0), default=4.0,
                   help="MiB reserved in DATA_DIR/BALLAST and given back when the disk fills up, so the writes "
                        "already in flight still reach the journal (default %(default)s)")
    s.add_argument("--preallocate-kb", type=_bounded(int, 0), default=1024,
                   help="KiB of zeros the journal keeps written ahead of its records, so an fsync writes data "
                        "only, not also the file's new size (default %(default)s; 0: off, e.g. on copy-on-write "
                        "filesystems such as btrfs or ZFS, where it saves nothing)")
    s.add_argument("--sync-helper", choices=("process", "thread", "inline"), default=None,
                   help="where the journal's fdatasync runs: a small helper process (default; the event loop "
                        "waits for it like for a socket), a worker thread of the daemon, or inline on the event "
                        "loop (no wake-up of another process per fsync, as Redis's appendfsync always: faster "
                        "on a disk whose fdatasync is reliably fast; every client waits while one runs, and a "
                        "stuck disk stops the whole node)")
    s.add_argument("--slow-fsync-s", type=_bounded(float, 0, inclusive=False), default=1.0,
                   help="log an fdatasync of the journal that takes this many seconds or more (WARNING, at most "
                        "once per 10 s), and report one still running after ten times as long while it runs "
                        "(default %(default)s)")
    s.add_argument("--max-connections", type=_bounded(int, 1), default=1024,
                   help="connections open at once, per listener (TCP, and HTTP with --http); one more is "
                        "answered UNAVAILABLE and closed. Also the HTTP requests in progress at once (then 429) "
                        "(default %(default)s)")
    s.add_argument("--max-inflight", type=_bounded(int, 1), default=256,
                   help="requests in flight per connection before backpressure (default %(default)s)")
    s.add_argument("--handshake-timeout", type=_bounded(float, 0, inclusive=False), default=10.0,
                   help="seconds a new connection has to send its hello (HTTP: its first request) before it is "
                        "dropped (default %(default)s)")
    s.add_argument("--idle-ping", type=_bounded(float, 0), default=30.0,
                   help="ping a connection idle this many seconds, drop it after 3 silent intervals; 0 disables "
                        "(default %(default)s)")
    s.add_argument("--max-outgoing-bytes", type=_bounded(int, 1), default=4 * 1024 * 1024,
                   help="bytes of replies waiting for a slow reader (queued or being sent) before the server stops "
                        "reading its requests; a connection that lets twice this wait (at least this plus 1 MiB) "
                        "is closed (SLOW_CONSUMER) (default %(default)s)")
    _listener_flags(s)
    s.add_argument("--drain-timeout", type=_bounded(float, 0), default=30.0,
                   help="seconds to finish in-flight requests on SIGTERM (default %(default)s)")
    s.add_argument("--http", metavar="HOST:PORT", default=None,
                   help="also serve the HTTP API (the runstate SDK's, /v1/spaces/{spaceId}/...) on HOST:PORT (or http://HOST:PORT) "
                        "over the same coordinator: same keys, spaces and TLS (off by default)")
    s.add_argument("--console", metavar="HOST:PORT", default=None,
                   help="also serve the web console for operators (runs, queues with trends, groups, join "
                        "sets, live events, resources; actions for a key that may write) on HOST:PORT: same keys "
                        "(a key sees its space) and TLS "
                        "(off by default; with --cluster: every shard's pages and the cluster's health, from any node)")
    s.add_argument("--http-host", metavar="NAME", action="append", default=None,
                   help="a name (or address) clients reach --http and --console by, besides localhost and the "
                        "listen address; repeat for more. A request whose Host header names anything else is "
                        "refused (421), so a web page cannot reach the daemon through a DNS name it controls "
                        "(DNS rebinding)")
    s.add_argument("--http-idempotency-hours", type=_bounded(float, 0, inclusive=False), default=24.0,
                   help="how long answers to HTTP requests with an Idempotency-Key are kept (default %(default)s)")
    s.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (clients use tls:// URLs)")
    s.add_argument("--tls-key", help="PEM private key for --tls-cert")
    s.add_argument("--insecure", action="store_true",
                   help="allow serving a non-loopback address without API keys (and --metrics without a key)")
    s.add_argument("--retain-finished", default="7d", metavar="DURATION",
                   help="delete finished runs (with their tasks, groups, barriers, timers, join sets) and finished "
                        "tasks this long after they ended: 30s, 15m, 12h, 7d; 0 keeps everything (default %(default)s)")
    s.add_argument("--retain-events", default="100000", metavar="COUNT|AGE",
                   help="events kept per space: a count, or an age such as 24h; 0 keeps every event; a watch or "
                        "list with an older cursor gets CURSOR_EXPIRED (default %(default)s)")
    from .limits import DEFAULTS as _LIMITS, DESCRIPTIONS as _LIMIT_TEXT, NAMES as _LIMIT_NAMES

    s.add_argument("--limit", action="append", default=None, metavar="NAME=VALUE",
                   help="a limit per space, every space the same (repeatable; VALUE a positive integer, for "
                        "payload_bytes also 512MiB or 2GiB, or none); a space at its limit is refused what would "
                        "pass it, LIMIT_EXCEEDED (README, Limits; per shard in a sharded cluster). The limits, "
                        "with their defaults: " + "; ".join(f"{n}={_LIMITS[n]}: {_LIMIT_TEXT[n]}" for n in _LIMIT_NAMES))
    s.add_argument("--watch-buffer-bytes", type=_bounded(int, 4096), default=1 << 20,
                   help="unsent output a connection may hold before its watches wait (default %(default)s)")
    s.add_argument("--watch-stall", type=_bounded(float, 0, inclusive=False), default=10.0,
                   help="seconds a watch may be unable to take events before it is cut off (SLOW_CONSUMER; the SDK "
                        "resumes from its cursor) (default %(default)s)")
    s.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (e.g. 127.0.0.1:9411 or "
                        "http://127.0.0.1:9411); on a non-loopback address every scrape needs an operator key "
                        "(Authorization: Bearer), unless --insecure; at most 64 connections, 8 per address")
    s.add_argument("--slow-request-ms", type=_bounded(float, 0), default=1000.0,
                   help="log requests slower than this (ms, 0: never; a wait the client asked for, such as a "
                        "result or an acquire with wait_ms, never is) (default %(default)s)")
    s.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default %(default)s)")
    s.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json: one JSON object a line (default %(default)s)")
    c = s.add_argument_group("cluster (a replicated shard: etcd decides who leads; README, Run two nodes)")
    c.add_argument("--cluster", metavar="URL", default=None,
                   help="run this node as one replica of a shard whose leadership lives in this etcd (off: a "
                        "single node, the default): etcd://HOST:PORT[,...] (plaintext; http:// too) or "
                        "https://[USER@]HOST:PORT[,...] (TLS, see --etcd-ca)")
    _etcd_access_arguments(c)
    c.add_argument("--node", metavar="NAME", help="this node's name, unique in its shard (with --cluster)")
    c.add_argument("--cluster-name", default="rallypoint",
                   help="the cluster's name: its etcd keys live under /rallypoint/NAME/ (default %(default)s)")
    c.add_argument("--shard", type=_bounded(int, 0), default=0, help="the shard this node replicates (default %(default)s)")
    c.add_argument("--replication", metavar="HOST:PORT", default="127.0.0.1:0",
                   help="where the leader takes its standby's connection (default %(default)s: a free port, "
                        "advertised in etcd)")
    c.add_argument("--advertise", metavar="HOST", default=None,
                   help="the host other nodes and clients reach this node at (default: the listen host)")
    c.add_argument("--advertise-replication", metavar="HOST:PORT", default=None,
                   help="the address standbys connect to for replication, when it is not the --replication "
                        "listener's (a proxy or port forward in front of it; default: --advertise host and the "
                        "listener's port)")
    c.add_argument("--replicas", type=int, choices=(1, 2), default=None,
                   help="how many nodes the shard has, for the node that creates it (a shard made without "
                        "`cluster init`): its members are the first that many node names to start, then fixed "
                        "(default: the cluster's `cluster init --replicas`, else 2)")
    c.add_argument("--min-insync", type=int, choices=(1, 2), default=1,
                   help="2: refuse writes while no standby is in sync, instead of running alone (default %(default)s)")
    c.add_argument("--peer-cert", metavar="PEM", default=None,
                   help="this node's certificate for the replication link's mutual TLS (it must name --node as a "
                        "DNS subject alternative name; `rallypoint cluster certs` makes one); with --peer-key and "
                        "--peer-ca. Without them the link is plaintext, allowed on loopback addresses only unless "
                        "--insecure; it is authenticated by the cluster secret in etcd either way")
    c.add_argument("--peer-key", metavar="PEM", default=None, help="the private key of --peer-cert")
    c.add_argument("--peer-ca", metavar="PEM", default=None,
                   help="the CA every peer's certificate must be signed by (the cluster's own CA)")
    c.add_argument("--lease-ttl", type=_bounded(int, 2), default=2,
                   help="seconds the leader's etcd lease lives without renewal; failover takes about this long "
                        "(default %(default)s, etcd's minimum)")
    c.add_argument("--isr-timeout", type=_bounded(float, 0, inclusive=False), default=1.0,
                   help="seconds a standby may leave records unacknowledged before the leader drops it from the "
                        "in-sync set (default %(default)s)")
    s.set_defaults(fn=cmd_serve)

    st = sub.add_parser("status", help="server version, uptime, connections, runs by state",
                        parents=[_client_options(json_flag=True)])
    st.set_defaults(fn=cmd_status)

    tk = sub.add_parser("tasks", help="submit a task (priority, fairness key)", parents=[_client_options()])
    tks = tk.add_subparsers(dest="tasks_cmd", required=True)
    tsub = tks.add_parser("submit", parents=[_client_options(suppress=True, json_flag=True)],
                          help="submit one task to a mailbox (made if missing) under a run")
    tsub.add_argument("mailbox")
    tsub.add_argument("input", help="the task's input, JSON")
    tsub.add_argument("--run", required=True, help="the run (scp_...) the task belongs to")
    tsub.add_argument("--key", help="idempotency key (the same key and input: the same task)")
    tsub.add_argument("--priority", type=int, help="1 (most urgent) .. 5; default: the run's, else 3")
    tsub.add_argument("--fair-key", help="fairness key (a tenant, an agent): shares within a priority")
    tsub.add_argument("--fair-weight", type=int, help="the fairness key's weight, 1 .. 1000 (default 1)")
    tsub.set_defaults(fn=cmd_task_submit)

    r = sub.add_parser("runs", help="list, show and cancel runs", parents=[_client_options()])
    rs = r.add_subparsers(dest="runs_cmd", required=True)
    client = _client_options(suppress=True)
    ls = rs.add_parser("ls", aliases=["list"], parents=[client])
    ls.add_argument("--parent", default=None, help="list the children of this run")
    ls.add_argument("--all", action="store_true", help="all runs, not only roots")
    ls.add_argument("--state", choices=["ACTIVE", "CANCELLED", "COMPLETED"])
    ls.add_argument("--limit", type=_bounded(int, 1, maximum=_MAX_PAGE), default=100,
                    help="runs per page, newest first (default %(default)s)")
    ls.add_argument("--before", metavar="RUN_ID", type=_run_id,
                    help="the next page: runs created before this one (the hint after a full page gives it)")
    ls.add_argument("--json", action="store_true", help="machine-readable output (a JSON array)")
    sh = rs.add_parser("show", parents=[client], help="one run, readable (or --json)")
    sh.add_argument("id", metavar="RUN", help="a run id, or a root run's name (the newest of that name)")
    sh.add_argument("--json", action="store_true", help="machine-readable output")
    ca = rs.add_parser("cancel", parents=[client], help="cancel a run and everything below it")
    ca.add_argument("id", metavar="RUN", help="a run id, or the name of an active root run (a runstate named run)")
    ca.add_argument("--reason")
    r.set_defaults(fn=cmd_runs)

    w = sub.add_parser("watch", help="print the space's events live (pushed by the server)",
                       parents=[_client_options()])
    w.add_argument("--types", help="comma-separated event types or prefixes (task.failed,scope.*)")
    w.add_argument("--run", metavar="RUN_ID", help="only this run and the runs below it")
    w.add_argument("--aggregate", metavar="KIND:ID", help="only this entity (task:tsk_..., or an id)")
    wpos = w.add_mutually_exclusive_group()
    wpos.add_argument("--cursor", type=_event_cursor,
                      help="start after this event seq (resume); in a cluster of several shards the position "
                           "per shard as --json's cursor gives it (SHARD:SEQ,...)")
    wpos.add_argument("--from-start", action="store_true", help="start at the oldest event kept (default: now)")
    w.add_argument("--json", action="store_true", help="one JSON object a line")
    w.add_argument("--count", type=_bounded(int, 1), help="stop after this many events")
    w.set_defaults(fn=cmd_watch)

    tp = sub.add_parser("top", help="a live view of runs, queues, groups and waits", parents=[_client_options()])
    tp.add_argument("--interval", type=_bounded(float, 0, inclusive=False), default=1.0,
                    help="seconds between refreshes (default %(default)s)")
    tp.add_argument("--limit", type=_bounded(int, 1, maximum=1000), default=15,
                    help="rows of runs and groups (default %(default)s)")
    tp.add_argument("--once", action="store_true", help="print one frame and exit (the default off a terminal)")
    tp.add_argument("--width", type=_bounded(int, 40), default=None,
                    help="columns to draw in (default: the terminal's; off a terminal $COLUMNS, else 200)")
    tp.set_defaults(fn=cmd_top)
    c = sub.add_parser("claims", help="list and show claims (fenced leases on keys)", parents=[_client_options()])
    cs = c.add_subparsers(dest="claims_cmd", required=True)
    cls_ = cs.add_parser("ls", aliases=["list"], parents=[client])
    cls_.add_argument("--state", choices=["FREE", "HELD", "COMPLETED"])
    cls_.add_argument("--limit", type=_bounded(int, 1, maximum=10_000), default=100,
                      help="claims per page, in key order (default %(default)s)")
    cls_.add_argument("--after", metavar="KEY", help="the next page: keys after this one")
    cls_.add_argument("--json", action="store_true", help="machine-readable output (a JSON array)")
    csh = cs.add_parser("show", parents=[client], help="one claim: lease, queue, observation, result")
    csh.add_argument("key")
    csh.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(fn=cmd_claims)

    pl = sub.add_parser("pools", help="list and show pools (units, queue, grants)", parents=[_client_options()])
    ps = pl.add_subparsers(dest="pools_cmd", required=True)
    pls = ps.add_parser("ls", aliases=["list"], parents=[client])
    pls.add_argument("--json", action="store_true", help="machine-readable output (a JSON array)")
    psh = ps.add_parser("show", parents=[client], help="one pool: units, FIFO queue, active grants")
    psh.add_argument("name")
    psh.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(fn=cmd_pools)

    sch = sub.add_parser("schedules", help="recurring actions: create, list, describe, pause, trigger, backfill",
                         parents=[_client_options()])
    schs = sch.add_subparsers(dest="sub_cmd", required=True)
    scc = schs.add_parser("create", parents=[client], help="a schedule: --cron and/or --every, an action, policies")
    scc.add_argument("name")
    scc.add_argument("--cron", action="append", default=[], help="a cron expression (repeatable), e.g. '*/5 * * * *'")
    scc.add_argument("--every", type=float, default=None, help="an interval, seconds")
    scc.add_argument("--offset", type=float, default=0, help="the interval's offset, seconds")
    scc.add_argument("--timezone", default="UTC", help="IANA time zone the cron is read in (default %(default)s)")
    scc.add_argument("--start", default=None, help="ISO 8601: no fire before")
    scc.add_argument("--end", default=None, help="ISO 8601: no fire after")
    scc.add_argument("--jitter", type=float, default=0, help="max jitter, seconds (deterministic per time)")
    scc.add_argument("--run-name", default="{schedule} {time}", help="the run's name ({schedule} {time} {local})")
    scc.add_argument("--run-deadline", type=float, default=None, help="the run's deadline after the fire, seconds")
    scc.add_argument("--mailbox", default=None, help="also submit a task to this work queue in the run")
    scc.add_argument("--input", default=None, help="the task's input, JSON")
    scc.add_argument("--overlap", default="skip", help="skip | buffer_one | buffer_all | cancel_other | allow_all")
    scc.add_argument("--catchup-window", type=float, default=60.0, help="seconds (default %(default)s)")
    scc.add_argument("--pause-on-failure", action="store_true")
    scc.add_argument("--remaining-actions", type=int, default=None)
    scc.add_argument("--paused", action="store_true", help="create it paused")
    scl = schs.add_parser("ls", aliases=["list"], parents=[client], help="every schedule of the space")
    scd = schs.add_parser("describe", parents=[client], help="settings, next fires, recent actions")
    scd.add_argument("--next", type=int, default=5)
    scd.add_argument("--recent", type=int, default=10)
    scp = schs.add_parser("pause", parents=[client])
    scu = schs.add_parser("unpause", parents=[client])
    for x in (scp, scu):
        x.add_argument("--note", default=None)
    sct = schs.add_parser("trigger", parents=[client], help="fire the action now")
    scb = schs.add_parser("backfill", parents=[client], help="fire every past time of [--start, --end] not yet fired")
    scb.add_argument("--start", required=True)
    scb.add_argument("--end", required=True)
    for x in (sct, scb):
        x.add_argument("--overlap", default=None)
    scx = schs.add_parser("delete", parents=[client])
    for x in (scd, scp, scu, sct, scb, scx):
        x.add_argument("name", help="the schedule's name or id")
    for x in (scc, scl, scd, scp, scu, sct, scb, scx):
        x.add_argument("--json", action="store_true", help="machine-readable output")
    sch.set_defaults(fn=cmd_schedules)

    for what, fn, noun in (("quotas", cmd_quotas, "quota"), ("budgets", cmd_budgets, "budget")):
        g = sub.add_parser(what, help=f"list and show {what}", parents=[_client_options()])
        gs = g.add_subparsers(dest="sub_cmd", required=True)
        gl = gs.add_parser("ls", aliases=["list"], parents=[client], help=f"every {noun} of the space")
        gl.add_argument("--json", action="store_true", help="machine-readable output (a JSON array)")
        gsh = gs.add_parser("show", parents=[client], help=f"one {noun}, readable (or --json)")
        gsh.add_argument("name", help=f"the {noun}'s name or id")
        gsh.add_argument("--json", action="store_true", help="machine-readable output")
        g.set_defaults(fn=fn)

    cl = sub.add_parser("cluster", help="a replicated shard: who leads, at which epoch, the in-sync set")
    cls_ = cl.add_subparsers(dest="cluster_cmd", required=True)
    cst = cls_.add_parser("status", help="leader, epoch, members, in-sync set, lease time left, standby lag")
    cst.add_argument("--cluster", metavar="URL", default=os.environ.get("RALLYPOINT_CLUSTER"),
                     required=os.environ.get("RALLYPOINT_CLUSTER") is None,
                     help="the etcd the shard's leadership lives in: etcd://HOST:PORT[,...] or "
                          "https://[USER@]HOST:PORT[,...] (default $RALLYPOINT_CLUSTER)")
    _etcd_access_arguments(cst)
    cst.add_argument("--cluster-name", default="rallypoint", help="(default %(default)s)")
    cst.add_argument("--shard", type=_bounded(int, 0), default=None,
                     help="one shard, in detail (default: every shard, a line each)")
    cst.add_argument("--api-key", default=os.environ.get("RALLYPOINT_API_KEY"),
                     help="API key for the leader (default $RALLYPOINT_API_KEY); not needed in open mode")
    cst.add_argument("--json", action="store_true", help="machine-readable output")
    cst.set_defaults(fn=cmd_cluster_status)
    ci = cls_.add_parser("init", help="make a sharded cluster: its slot count (fixed) and its first shards")
    ci.add_argument("--cluster", metavar="URL", default=os.environ.get("RALLYPOINT_CLUSTER"),
                    required=os.environ.get("RALLYPOINT_CLUSTER") is None,
                    help="etcd://HOST:PORT[,...] or https://[USER@]HOST:PORT[,...] (default $RALLYPOINT_CLUSTER)")
    _etcd_access_arguments(ci)
    ci.add_argument("--cluster-name", default="rallypoint", help="(default %(default)s)")
    ci.add_argument("--slots", type=_bounded(int, 1, maximum=1024), default=1024,
                    help="slots, fixed for the cluster's life: the unit a shard owns (default %(default)s, the most)")
    ci.add_argument("--shards", type=_bounded(int, 1), default=1, help="shards to deal the slots to (default %(default)s)")
    ci.add_argument("--replicas", type=int, choices=(1, 2), default=2,
                    help="nodes per shard: each shard's members are the first that many names to start, then fixed "
                         "(default %(default)s: a leader and a standby)")
    ci.add_argument("--force", action="store_true",
                    help="replace a cluster or shard of this name whose nodes are all stopped: deletes its shards' "
                         "state in etcd (members, in-sync sets, epochs); their data dirs then belong to no cluster. "
                         "Refused while any node of it runs")
    ci.set_defaults(fn=cmd_cluster_init)
    cc = cls_.add_parser("certs", help="make the cluster's peer certificates: a CA and one certificate per node "
                                       "(the replication link's mutual TLS; --etcd: etcd's too)")
    cc.add_argument("--out", required=True, metavar="DIR",
                    help="where to write ca.pem/ca.key and NODE.pem/NODE.key (created; keys mode 0600; an "
                         "existing ca.pem/ca.key there is reused, so nodes can be added later)")
    cc.add_argument("--nodes", required=True, metavar="A,B,...", help="node names (--node of each serve)")
    cc.add_argument("--hosts", default="", metavar="H1,H2,...",
                    help="host names and IP addresses the nodes (and etcd) are reached at, added to every "
                         "certificate (localhost, 127.0.0.1 and ::1 always are)")
    cc.add_argument("--etcd", action="store_true",
                    help="also etcd.pem/etcd.key (etcd's server certificate) and client.pem/client.key (for the "
                         "CLI's --etcd-cert)")
    cc.add_argument("--days", type=_bounded(int, 1), default=825, help="validity of the certificates (default %(default)s)")
    cc.set_defaults(fn=cmd_cluster_certs)
    cea = cls_.add_parser("etcd-auth", help="turn on etcd's authentication: root, and a user for the nodes that may "
                                            "read and write /rallypoint/ only")
    cea.add_argument("--cluster", metavar="https://HOST:PORT[,...]", default=os.environ.get("RALLYPOINT_CLUSTER"),
                     required=os.environ.get("RALLYPOINT_CLUSTER") is None, help="(default $RALLYPOINT_CLUSTER)")
    cea.add_argument("--root-password-file", required=True, metavar="FILE", help="root's password (first line)")
    _etcd_access_arguments(cea)
    cea.set_defaults(fn=cmd_cluster_etcd_auth)
    crm = cls_.add_parser("remove-node", help="take a dead node out of its shard's members, so another name can join")
    crm.add_argument("node", metavar="NAME", help="the member to remove")
    crm.add_argument("--cluster", metavar="etcd://HOST:PORT[,...]", default=os.environ.get("RALLYPOINT_CLUSTER"),
                     required=os.environ.get("RALLYPOINT_CLUSTER") is None, help="(default $RALLYPOINT_CLUSTER)")
    crm.add_argument("--cluster-name", default="rallypoint", help="(default %(default)s)")
    crm.add_argument("--shard", type=_bounded(int, 0), default=0, help="(default %(default)s)")
    crm.set_defaults(fn=cmd_cluster_remove_node)
    ca = cls_.add_parser("add-shard", help="give a new shard empty slots, so it takes new root runs")
    ca.add_argument("--cluster", metavar="URL", default=os.environ.get("RALLYPOINT_CLUSTER"),
                    required=os.environ.get("RALLYPOINT_CLUSTER") is None,
                    help="etcd://HOST:PORT[,...] or https://[USER@]HOST:PORT[,...] (default $RALLYPOINT_CLUSTER)")
    _etcd_access_arguments(ca)
    ca.add_argument("--cluster-name", default="rallypoint", help="(default %(default)s)")
    ca.add_argument("--shard", type=_bounded(int, 0), default=None,
                    help="the new shard's number (default: one more than the highest)")
    ca.add_argument("--api-key", default=os.environ.get("RALLYPOINT_API_KEY"),
                    help="an operator key for the shards' leaders (default $RALLYPOINT_API_KEY; open mode: none)")
    ca.set_defaults(fn=cmd_cluster_add_shard)

    k = sub.add_parser("keys", help="create, list and revoke API keys (offline on --data-dir, --connect, or a "
                                    "cluster's in etcd with --cluster)",
                       parents=[_client_options(connect_default=None, data_dir=True, json_flag=True),
                                _key_store_options()])
    ks = k.add_subparsers(dest="keys_cmd", required=True)
    kopts_client = _client_options(suppress=True, connect_default=None, data_dir=True, json_flag=True)
    kopts = argparse.ArgumentParser(add_help=False, parents=[kopts_client, _key_store_options(suppress=True)])
    kc = ks.add_parser("create", parents=[kopts])
    kc.add_argument("--space", required=True)
    kc.add_argument("--permission", action="append", required=True,
                    choices=["resource_config", "coordination_write", "coordination_read", "admin", "operator"],
                    help="repeatable; admin: the keys of its own space; operator: the keys of every "
                         "space (offline only: on --data-dir, or in a cluster's etcd with --cluster)")
    kc.add_argument("--name")
    kc.add_argument("--force", action="store_true",
                    help="create the first key on a running open-mode daemon or cluster (turns authentication on)")
    kc.add_argument("--secret-only", action="store_true",
                    help="print only the secret (for $(...) in scripts)")
    kl = ks.add_parser("list", aliases=["ls"], parents=[kopts])
    kl.add_argument("--space")
    kr = ks.add_parser("revoke", parents=[kopts])
    kr.add_argument("id")
    k.set_defaults(fn=cmd_keys)

    rp = sub.add_parser("repair", help="cut a damaged journal after its last intact record (says what first)")
    rp.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="the stopped daemon's data dir (default %(default)s)")
    rp.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    rp.set_defaults(fn=cmd_repair)

    from .loadtest.runner import add_arguments as _bench_arguments, cmd_bench

    b = sub.add_parser("bench", help="load-test a daemon: throughput, latency percentiles, JSON report")
    _bench_arguments(b)
    b.set_defaults(fn=cmd_bench)
    return ap


def _stdout_gone() -> bool:
    """True if stdout is a pipe whose reader has gone (``| head`` exited)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _join_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--opt -5s`` -> ``--opt=-5s`` for every option that takes a value: argparse reads
    a token like ``-5s`` as an unknown option and says only "expected one argument";
    joined, the value reaches the option's own check and its message."""
    takes_value: set[str] = set()

    def walk(p: argparse.ArgumentParser) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    walk(sub)
            elif a.option_strings and a.nargs != 0:
                takes_value.update(o for o in a.option_strings if o.startswith("--"))

    walk(parser)
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in takes_value and i + 1 < len(argv) and re.match(r"-\d", argv[i + 1]):
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the ``rallypoint`` command line; returns the exit code (see the module doc)."""
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(parser, list(sys.argv[1:] if argv is None else argv)))
    try:
        rc = args.fn(args) or 0
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        if argv is None and getattr(args, "fast_exit", False):
            # the process's own entry (not a caller's main([...])) after a clean stop:
            # everything is on disk and closed; skip tearing down the heap object by
            # object (half a second and more with a large state), so a restart can bind
            # the ports again sooner
            logging.shutdown()
            sys.stderr.flush()
            os._exit(rc)
        return rc
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        # `rallypoint ... | head`: the reader is gone; say nothing, exit as SIGPIPE would.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
