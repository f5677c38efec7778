"""Real etcd for tests: one member or three on free 127.0.0.1 ports, each in a temp dir,
and a loopback TCP proxy that can cut or black-hole a link to etcd.

A secure etcd: ``EtcdCluster(root, tls_dir=DIR, client_cert_auth=True,
auth_token_ttl=2)`` serves ``https://`` with certificates made in DIR by
``rallypoint.cluster.pki.write_cluster_pki`` (ca.pem, etcd.pem/key, client.pem/key);
``enable_auth(password)`` adds the ``root`` user and turns etcd's authentication on
(through the JSON gateway, as ``etcdctl user add`` / ``auth enable`` do);
``add_user`` makes a user whose role may read/write one prefix; ``access()`` is the
:class:`~rallypoint.cluster.etcd.EtcdAccess` a client or node of the tests uses.

``require_etcd()`` skips when the ``etcd`` binary is missing, but fails under ``CI=true``
(``.ci/run`` installs Debian's ``etcd-server``). Election timeout and heartbeat stay at
etcd's defaults: the minimum lease TTL (2 s) follows from them.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import pytest
import trio


def require_etcd() -> str:
    path = shutil.which("etcd")
    if path:
        return path
    if os.environ.get("CI") == "true":
        pytest.fail("etcd is not installed and CI=true: install Debian's etcd-server (.ci/run does)", pytrace=False)
    pytest.skip("etcd is not installed (apt-get install etcd-server)")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def member_status(client_url: str, timeout: float = 0.5, context: ssl.SSLContext | None = None) -> dict | None:
    """The member's /v3/maintenance/status as a dict, or None if it does not answer
    (``context``: TLS for an https:// member; etcd answers status without a token)."""
    req = urllib.request.Request(client_url + "/v3/maintenance/status", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def gateway_call(url: str, path: str, body: dict, *, token: str | None = None,
                 context: ssl.SSLContext | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    """One POST to an etcd member's JSON gateway: ``(HTTP status, decoded body)``."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": token} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"message": raw.decode(errors="replace")}


def _b64(x: str | bytes) -> str:
    return base64.b64encode(x.encode() if isinstance(x, str) else x).decode()


class EtcdMember:
    """One etcd process. ``client_url`` is its gateway; ``stop()``/``start()`` keep the
    data dir and ports, so a restart is the same member."""

    def __init__(self, binary: str, name: str, data_root: str, client_port: int, peer_port: int, *,
                 tls_dir: str | None = None, client_cert_auth: bool = False, extra: list[str] | None = None) -> None:
        self.binary = binary
        self.name = name
        self.data_dir = os.path.join(data_root, name)
        self.log_path = os.path.join(data_root, f"{name}.log")
        self.client_url = f"{'https' if tls_dir else 'http'}://127.0.0.1:{client_port}"
        self.peer_url = f"http://127.0.0.1:{peer_port}"
        self.tls_dir = tls_dir
        self.client_cert_auth = client_cert_auth
        self.extra = list(extra or [])
        self.proc: subprocess.Popen | None = None
        self.stopped = True
        self.initial_cluster = f"{name}={self.peer_url}"

    def start(self) -> "EtcdMember":
        args = [
            self.binary,
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", "rallypoint-test",
        ]  # fmt: skip
        if self.tls_dir:
            args += ["--cert-file", os.path.join(self.tls_dir, "etcd.pem"),
                     "--key-file", os.path.join(self.tls_dir, "etcd.key")]
            if self.client_cert_auth:
                args += ["--client-cert-auth", "--trusted-ca-file", os.path.join(self.tls_dir, "ca.pem")]
        args += self.extra
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.stopped = False
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.stopped = True
        if self.running():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


class EtcdCluster:
    """``size`` members (1 or 3) started together; ``endpoints`` their client URLs.

    ``tls_dir``: serve https:// with the certificates there (made by
    ``write_cluster_pki(tls_dir, [], etcd=True)`` unless ``ca.pem`` exists);
    ``client_cert_auth``: etcd wants a client certificate signed by ``ca.pem``;
    ``auth_token_ttl``: etcd's ``--auth-token-ttl`` (seconds a simple token lives unused)."""

    def __init__(self, data_root: str, size: int = 1, *, tls_dir: str | None = None,
                 client_cert_auth: bool = False, auth_token_ttl: int | None = None) -> None:
        binary = require_etcd()
        ports = free_ports(2 * size)
        self.tls_dir = tls_dir
        self.client_cert_auth = client_cert_auth
        self.root_password: str | None = None
        if tls_dir and not os.path.exists(os.path.join(tls_dir, "ca.pem")):
            from rallypoint.cluster.pki import write_cluster_pki

            write_cluster_pki(tls_dir, [], etcd=True)
        # (bcrypt cost 4, etcd's least: a test's authentications are cheap)
        extra = ["--bcrypt-cost", "4"] + (["--auth-token-ttl", str(auth_token_ttl)] if auth_token_ttl else [])
        self.members = [
            EtcdMember(binary, f"m{i}", data_root, ports[2 * i], ports[2 * i + 1], tls_dir=tls_dir,
                       client_cert_auth=client_cert_auth, extra=extra) for i in range(size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    # ------------------------------------------------------------------ TLS and auth
    def path(self, name: str) -> str:
        """A file of the TLS dir: ``ca.pem``, ``client.pem``, ``client.key`` ..."""
        assert self.tls_dir is not None
        return os.path.join(self.tls_dir, name)

    def tls(self, *, client_cert: bool | None = None):
        """The :class:`EtcdTls` of a client of this etcd (None: plaintext); a client
        certificate when etcd wants one (or as ``client_cert`` says)."""
        from rallypoint.cluster.etcd import EtcdTls

        if self.tls_dir is None:
            return None
        cert = self.client_cert_auth if client_cert is None else client_cert
        return EtcdTls(self.path("ca.pem"), self.path("client.pem") if cert else None,
                       self.path("client.key") if cert else None)

    def access(self, user: str | None = "root", password: str | None = None, **tls_kw):
        """The :class:`EtcdAccess` of a client: TLS as :meth:`tls`, and ``user`` with
        ``password`` (default: root's) once authentication is on."""
        from rallypoint.cluster.etcd import EtcdAccess, EtcdAuth

        auth = None
        if user is not None and self.root_password is not None:
            auth = EtcdAuth(user, password if password is not None else self.root_password)
        return EtcdAccess(tuple(self.endpoints), tls=self.tls(**tls_kw), auth=auth)

    def ssl_context(self) -> ssl.SSLContext | None:
        """For the harness's own calls (urllib): the CA, and the client certificate."""
        tls = self.tls()
        return tls.context() if tls is not None else None

    def call(self, path: str, body: dict, token: str | None = None) -> tuple[int, dict]:
        """:func:`gateway_call` to the first running member."""
        m = next(m for m in self.members if m.running())
        return gateway_call(m.client_url, path, body, token=token, context=self.ssl_context())

    def token(self, user: str = "root", password: str | None = None) -> str:
        """A token from ``/v3/auth/authenticate``."""
        status, out = self.call("/v3/auth/authenticate",
                                {"name": user, "password": password if password is not None else self.root_password})
        assert status == 200, out
        return out["token"]

    def token_valid(self, token: str) -> bool:
        """Does etcd still take ``token`` (a read of one key with it)?"""
        status, out = self.call("/v3/kv/range", {"key": _b64("/")}, token=token)
        if status == 200:
            return True
        assert "invalid auth token" in out.get("message", ""), out
        return False

    def wait_unused_tokens_expired(self, ttl_s: float, timeout: float = 60.0) -> None:
        """Return once every token etcd granted before this call and nobody used since
        has expired (``--auth-token-ttl`` = ``ttl_s``). A try renews the token it uses, so
        the probe is a batch of tokens granted now, each tried once, one every 0.2 s:
        the first one etcd no longer takes is younger than every such token."""
        probes = [self.token() for _ in range(int((ttl_s + 2) / 0.2) + 5)]
        deadline = time.monotonic() + timeout
        for probe in probes:
            if not self.token_valid(probe):
                return
            assert time.monotonic() < deadline, "etcd's tokens did not expire"
            time.sleep(0.2)  # (the pace of the probes; the condition is a probe refused)
        raise AssertionError(f"no probe token expired within {len(probes) * 0.2:.1f} s (--auth-token-ttl {ttl_s})")

    def enable_auth(self, password: str) -> None:
        """Add user ``root`` (role root) and turn authentication on."""
        for path, body in (("/v3/auth/user/add", {"name": "root", "password": password}),
                           ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                           ("/v3/auth/enable", {})):
            status, out = self.call(path, body)
            assert status == 200, (path, out)
        self.root_password = password

    def add_user(self, name: str, password: str, *, readwrite: str | None = None, read: str | None = None) -> None:
        """A user whose own role may read and write keys under ``readwrite`` (or only
        read under ``read``); neither: a user with no permission at all."""
        from rallypoint.cluster.etcd import prefix_end

        root = self.token()
        steps = [("/v3/auth/user/add", {"name": name, "password": password})]
        prefix, perm = (readwrite, "READWRITE") if readwrite else (read, "READ")
        if prefix:
            role = f"{name}-role"
            steps += [("/v3/auth/role/add", {"name": role}),
                      ("/v3/auth/role/grant", {"name": role, "perm": {
                          "permType": perm, "key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}}),
                      ("/v3/auth/user/grant", {"user": name, "role": role})]
        for path, body in steps:
            status, out = self.call(path, body, token=root)
            assert status == 200, (path, out)

    def start(self) -> "EtcdCluster":
        for m in self.members:
            m.start()
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Poll until every member that should run answers its status and names a raft
        leader (a condition, polled every 50 ms); raises with the log if one exited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = [m for m in self.members if not m.stopped]
            for m in up:
                if not m.running():
                    raise RuntimeError(f"etcd {m.name} exited {m.proc.returncode}:\n{m.log_tail()}")
            ctx = self.ssl_context()
            statuses = [member_status(m.client_url, context=ctx) for m in up]
            if all(s is not None and int(s.get("leader", 0)) != 0 for s in statuses):
                return
            time.sleep(0.05)
        raise RuntimeError("etcd did not become ready:\n" + "\n".join(m.log_tail() for m in self.members))

    def leader(self) -> EtcdMember:
        """The member that is the raft leader now."""
        for m in self.members:
            s = member_status(m.client_url, context=self.ssl_context()) if m.running() else None
            if s is not None and s.get("leader") == s["header"]["member_id"]:
                return m
        raise RuntimeError("no etcd member is the leader")

    def stop(self) -> None:
        for m in self.members:
            m.stop()


class TcpProxy:
    """A loopback TCP proxy to ``target_port`` that a test can break.

    ``blackhole()``: connections stay open but nothing is forwarded (a partition: the
    peer hears nothing and no error); ``cut()``: every connection is closed and new ones
    are closed at once (a dead port); ``restore()``: forward again. Run it with
    ``async with TcpProxy(port) as proxy:`` inside the test's Trio run."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.mode = "pass"
        self._changed = trio.Event()
        self._conn_scopes: set[trio.CancelScope] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> "TcpProxy":
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        self._nursery.start_soon(trio.serve_listeners, self._serve, listeners)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._nursery.cancel_scope.cancel()
        await self._nursery_cm.__aexit__(None, None, None)

    def _set(self, mode: str) -> None:
        self.mode = mode
        self._changed.set()
        self._changed = trio.Event()

    def blackhole(self) -> None:
        self._set("blackhole")

    def cut(self) -> None:
        self._set("cut")
        for scope in list(self._conn_scopes):
            scope.cancel()

    def restore(self) -> None:
        self._set("pass")

    async def _serve(self, down: trio.SocketStream) -> None:
        with trio.CancelScope() as scope:
            self._conn_scopes.add(scope)
            try:
                if self.mode == "cut":
                    return
                up = await trio.open_tcp_stream("127.0.0.1", self.target_port)
                async with up, trio.open_nursery() as n:
                    n.start_soon(self._pump, down, up, n.cancel_scope)
                    n.start_soon(self._pump, up, down, n.cancel_scope)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                self._conn_scopes.discard(scope)
        await down.aclose()

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, link: trio.CancelScope) -> None:
        """Copy src to dst until either side ends, then end the whole link."""
        try:
            while True:
                data = await src.receive_some(65536)
                while self.mode == "blackhole":
                    await self._changed.wait()
                if not data:
                    return
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            link.cancel()


# ------------------------------------------------------------------ the benchmarks' etcd
#: the password of the ``rallypoint`` user of a ``--secure-etcd`` benchmark etcd
BENCH_NODE_PASSWORD = "bench-node-password"


def add_bench_etcd_arguments(ap) -> None:
    """The etcd options of scripts/bench_failover.py and scripts/bench_remote.py: the
    same ``--cluster`` and ``--etcd-*`` flags as ``rallypoint serve`` (an etcd of yours),
    or ``--secure-etcd`` (the benchmark starts one with TLS, client certificates and
    authentication); neither: a plaintext one-member etcd, as the tests start it."""
    from rallypoint.cli import _etcd_access_arguments

    g = ap.add_argument_group("etcd (default: the benchmark starts a plaintext one-member etcd)")
    g.add_argument("--cluster", metavar="URL", default=None,
                   help="use this etcd (etcd://HOST:PORT or https://[USER@]HOST:PORT), with the flags below, as "
                        "`rallypoint serve --cluster` takes them")
    _etcd_access_arguments(g)
    g.add_argument("--secure-etcd", action="store_true",
                   help="start a one-member etcd with TLS (https://, --client-cert-auth, certificates made by "
                        "rallypoint.cluster.pki) and authentication on (user rallypoint, readwrite on /rallypoint/)")


class BenchEtcd:
    """The etcd a benchmark runs on, from :func:`add_bench_etcd_arguments`'s options:
    ``access`` (an :class:`EtcdAccess`), and ``node_args``/``node_env`` for a
    :class:`_cluster.ClusterNode` (``--cluster`` URL, the TLS and user flags, the
    password in ``RALLYPOINT_ETCD_PASSWORD``). ``with BenchEtcd(args, root) as etcd:``."""

    def __init__(self, args, root: str) -> None:
        self.args = args
        self.root = root
        self.cluster: EtcdCluster | None = None
        self.access = None

    def __enter__(self) -> "BenchEtcd":
        from rallypoint.cli import _etcd_access

        if self.args.cluster:
            self.access = _etcd_access(self.args)
        else:
            data = os.path.join(self.root, "etcd")
            os.makedirs(data, exist_ok=True)
            secure = self.args.secure_etcd
            self.cluster = EtcdCluster(data, tls_dir=os.path.join(self.root, "etcd-pki") if secure else None,
                                       client_cert_auth=secure).start()
            if secure:
                self.cluster.enable_auth("bench-root-password")
                self.cluster.add_user("rallypoint", BENCH_NODE_PASSWORD, readwrite="/rallypoint/")
                self.access = self.cluster.access("rallypoint", BENCH_NODE_PASSWORD)
            else:
                self.access = self.cluster.access(None)
        return self

    def __exit__(self, *exc) -> None:
        if self.cluster is not None:
            self.cluster.stop()

    def describe(self) -> str:
        """What the benchmark ran on, for its report."""
        a = self.access
        what = "TLS" + (" + client certificate" if a.tls and a.tls.cert_file else "") if a.secure else "plaintext"
        return f"{what}{' + auth' if a.auth else ''} ({a.url})"

    @property
    def node_args(self) -> list[str]:
        """``[URL, --etcd-ca F, ...]``: ``ClusterNode(etcd=node_args[0], extra=node_args[1:])``."""
        return self.access.cli_args()[1:]

    @property
    def node_env(self) -> dict[str, str]:
        return {"RALLYPOINT_ETCD_PASSWORD": self.access.auth.password} if self.access.auth else {}
