"""etcd as a real deployment runs it (issue 40): TLS on the client URLs (a CA, client
certificates for ``--client-cert-auth``) and etcd's user/password authentication, for
the Trio client (rallypoint/cluster/etcd.py), the command line (``--cluster https://...``
and the ``--etcd-*`` flags) and real ``serve --cluster`` nodes.

The etcds are real (tests/_etcd.py), with certificates made in the test by
``rallypoint.cluster.pki.write_cluster_pki``. Token lifetimes are etcd's own (real
seconds, ``--auth-token-ttl``): a test that needs a token gone waits for the condition
"etcd no longer takes a token younger than it" (``wait_unused_tokens_expired``), or
restarts etcd (simple tokens live in its memory only).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid

import pytest
import trio

import rallypoint
from _cluster import ClusterNode
from rallypoint import protocol as p
from _etcd import EtcdCluster
from rallypoint.cli import _etcd_access, build_parser
from rallypoint.cluster import pki
from rallypoint.cluster.etcd import (
    EtcdAccess,
    EtcdAuth,
    EtcdAuthError,
    EtcdClient,
    EtcdPermissionError,
    EtcdTls,
    EtcdTlsError,
    EtcdUnavailableError,
    plaintext_hint,
)
from rallypoint.cluster.leader import ShardElection
from rallypoint.cluster.member import MemberConfig, ShardMember
from rallypoint.cluster.shardmap import read_map
from rallypoint.errors import ForbiddenError, UnauthenticatedError, ValidationError

pytestmark = pytest.mark.timeout(240)

ROOT_PASSWORD = "root-Pa55-" + uuid.uuid4().hex[:6]
NODE_PASSWORD = "node-Pa55-" + uuid.uuid4().hex[:6]
TOKEN_TTL = 2  # etcd's --auth-token-ttl in the auth etcd (seconds a token lives unused)


@pytest.fixture(autouse=True)
def _no_etcd_env(monkeypatch):
    for name in ("CA", "CERT", "KEY", "USER", "PASSWORD", "PASSWORD_FILE"):
        monkeypatch.delenv(f"RALLYPOINT_ETCD_{name}", raising=False)


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    """https://, client certificates required (--client-cert-auth), no authentication."""
    root = tmp_path_factory.mktemp("tls-etcd")
    cluster = EtcdCluster(str(root), tls_dir=str(root / "pki"), client_cert_auth=True).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory):
    """https:// with client certificates and authentication on: ``root``, ``rallypoint``
    (readwrite on /rallypoint/ and /t/), ``reader`` (read only), ``nobody`` (no role)."""
    root = tmp_path_factory.mktemp("auth-etcd")
    cluster = EtcdCluster(str(root), tls_dir=str(root / "pki"), client_cert_auth=True,
                          auth_token_ttl=TOKEN_TTL).start()
    cluster.enable_auth(ROOT_PASSWORD)
    cluster.add_user("rallypoint", NODE_PASSWORD, readwrite="/rallypoint/")
    cluster.add_user("reader", "reader-pw", read="/")
    cluster.add_user("nobody", "nobody-pw")
    yield cluster
    cluster.stop()


@pytest.fixture
def key():
    return f"/t/{uuid.uuid4().hex[:10]}/"


def cli_access(*argv: str):
    """The EtcdAccess ``cluster status ARGV`` builds (the one builder every command uses)."""
    return _etcd_access(build_parser().parse_args(["cluster", "status", *argv]))


# ------------------------------------------------------------------ settings, no etcd
def test_cluster_https_url_with_user_and_flags_builds_tls_and_auth(tmp_path):
    d = str(tmp_path / "pki")
    pki.write_cluster_pki(d, [], etcd=True)
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    a = cli_access("--cluster", "https://rp@127.0.0.1:2379,127.0.0.2:2379", "--etcd-ca", f"{d}/ca.pem",
                   "--etcd-cert", f"{d}/client.pem", "--etcd-key", f"{d}/client.key", "--etcd-password-file", str(pw))
    assert a.endpoints == ("https://127.0.0.1:2379", "https://127.0.0.2:2379")
    assert a.tls == EtcdTls(f"{d}/ca.pem", f"{d}/client.pem", f"{d}/client.key")
    assert a.auth == EtcdAuth("rp", "s3cret")
    assert a.url == "https://rp@127.0.0.1:2379,127.0.0.2:2379"
    assert "s3cret" not in " ".join(a.cli_args()) and "s3cret" not in repr(a)


def test_cluster_https_without_a_ca_uses_the_system_cas():
    a = cli_access("--cluster", "https://127.0.0.1:2379")
    assert a.tls == EtcdTls() and a.auth is None
    assert EtcdClient(a.endpoints).tls == EtcdTls()  # (https:// alone: verified, against the system's CAs)


def test_cluster_etcd_scheme_stays_plaintext_and_ipv6_keeps_its_brackets():
    a = cli_access("--cluster", "etcd://127.0.0.1:2379,[::1]:2380")
    assert a.endpoints == ("http://127.0.0.1:2379", "http://[::1]:2380") and a.tls is None


@pytest.mark.parametrize("spec", ["https://127.0.0.1:1,etcd://127.0.0.1:2", "http://h:1,https://h:2"])
def test_cluster_mixed_schemes_are_refused(spec):
    with pytest.raises(ValidationError, match="mixes plaintext and TLS"):
        cli_access("--cluster", spec)


def test_cluster_url_password_is_accepted_and_warned_about(capsys):
    a = cli_access("--cluster", "https://rp:pa%3Ass@127.0.0.1:2379")
    assert a.auth == EtcdAuth("rp", "pa:ss")
    err = capsys.readouterr().err
    assert "password in --cluster shows in `ps`" in err and "pa:ss" not in err


def test_env_vars_give_the_tls_files_user_and_password(tmp_path, monkeypatch):
    d = str(tmp_path / "pki")
    pki.write_cluster_pki(d, [], etcd=True)
    monkeypatch.setenv("RALLYPOINT_ETCD_CA", f"{d}/ca.pem")
    monkeypatch.setenv("RALLYPOINT_ETCD_CERT", f"{d}/client.pem")
    monkeypatch.setenv("RALLYPOINT_ETCD_KEY", f"{d}/client.key")
    monkeypatch.setenv("RALLYPOINT_ETCD_USER", "rp")
    monkeypatch.setenv("RALLYPOINT_ETCD_PASSWORD", "from-env")
    a = cli_access("--cluster", "https://127.0.0.1:2379")
    assert a.tls == EtcdTls(f"{d}/ca.pem", f"{d}/client.pem", f"{d}/client.key") and a.auth == EtcdAuth("rp", "from-env")
    # a flag wins over its variable; a password file over $RALLYPOINT_ETCD_PASSWORD
    pw = tmp_path / "pw"
    pw.write_text("from-file")
    a = cli_access("--cluster", "https://127.0.0.1:2379", "--etcd-user", "other", "--etcd-password-file", str(pw))
    assert a.auth == EtcdAuth("other", "from-file")


def test_etcd_ca_with_a_plaintext_cluster_is_refused_naming_the_source(tmp_path, monkeypatch):
    with pytest.raises(ValidationError, match=r"--etcd-ca set, but --cluster etcd://h:1 is plaintext"):
        cli_access("--cluster", "etcd://h:1", "--etcd-ca", "/nope.pem")
    monkeypatch.setenv("RALLYPOINT_ETCD_CA", "/nope.pem")
    with pytest.raises(ValidationError, match=r"\$RALLYPOINT_ETCD_CA set"):
        cli_access("--cluster", "http://h:1")


def test_etcd_user_without_password_and_password_without_user_are_refused(tmp_path):
    with pytest.raises(ValidationError, match="etcd user 'rp' needs a password"):
        cli_access("--cluster", "https://rp@127.0.0.1:2379")
    pw = tmp_path / "pw"
    pw.write_text("x")
    with pytest.raises(ValidationError, match="needs its user"):
        cli_access("--cluster", "https://127.0.0.1:2379", "--etcd-password-file", str(pw))
    with pytest.raises(ValidationError, match="names etcd user 'a' but --etcd-user says 'b'"):
        cli_access("--cluster", "https://a:x@127.0.0.1:2379", "--etcd-user", "b")


def test_unreadable_etcd_files_are_one_line_errors(tmp_path):
    with pytest.raises(ValidationError, match="cannot read the etcd CA file /no/such/ca.pem"):
        cli_access("--cluster", "https://127.0.0.1:2379", "--etcd-ca", "/no/such/ca.pem")
    notpem = tmp_path / "ca.pem"
    notpem.write_text("not a certificate")
    with pytest.raises(ValidationError, match="holds no usable PEM certificate"):
        cli_access("--cluster", "https://127.0.0.1:2379", "--etcd-ca", str(notpem))
    with pytest.raises(ValidationError, match="cannot read the etcd password file"):
        cli_access("--cluster", "https://rp@127.0.0.1:2379", "--etcd-password-file", str(tmp_path / "none"))
    d = str(tmp_path / "pki")
    pki.write_cluster_pki(d, [], etcd=True)
    with pytest.raises(ValidationError, match="do not match"):
        cli_access("--cluster", "https://127.0.0.1:2379", "--etcd-cert", f"{d}/client.pem", "--etcd-key",
                   f"{d}/etcd.key")


def test_etcd_client_refuses_credentials_in_an_endpoint_url():
    # (httpx would send them as HTTP Basic auth, which etcd reads as a bad token)
    with pytest.raises(ValidationError, match="not in the URL"):
        EtcdClient("http://root:pw@127.0.0.1:2379")
    with pytest.raises(ValidationError, match="mix http:// and https://"):
        EtcdClient(["https://h:1", "http://h:2"])
    with pytest.raises(ValidationError, match="need https:// endpoints"):
        EtcdClient(["http://h:1"], tls=EtcdTls("/x.pem"))


def test_etcd_auth_repr_hides_the_password():
    assert "hunter2" not in repr(EtcdAuth("root", "hunter2"))
    assert "hunter2" not in repr(EtcdAccess(("https://h:1",), auth=EtcdAuth("root", "hunter2")))


def test_store_url_keeps_the_scheme_user_and_tls_flags_never_the_password(tmp_path):
    d = str(tmp_path / "pki")
    pki.write_cluster_pki(d, [], etcd=True)
    access = EtcdAccess(("https://127.0.0.1:2379",), tls=EtcdTls(f"{d}/ca.pem"), auth=EtcdAuth("rp", "s3cret"))
    member = ShardMember(MemberConfig(etcd=list(access.endpoints), etcd_access=access, node="n1",
                                      data_dir=str(tmp_path / "n1")), make_server=lambda node: None)
    assert member._store_url() == f"https://rp@127.0.0.1:2379 --etcd-ca {d}/ca.pem"
    plain = ShardMember(MemberConfig(etcd=["http://127.0.0.1:2379"], node="n1", data_dir=str(tmp_path / "n1")),
                        make_server=lambda node: None)
    assert plain._store_url() == "etcd://127.0.0.1:2379"


def test_cluster_client_certificate_has_no_common_name(tmp_path):
    """etcd 3.4 with --client-cert-auth and auth on refuses a gateway request whose
    client certificate has a Common Name (HTTP 400): pki's client.pem has none."""
    from cryptography import x509

    pki.write_cluster_pki(str(tmp_path), [], etcd=True)
    cert = x509.load_pem_x509_certificate((tmp_path / "client.pem").read_bytes())
    assert list(cert.subject) == []
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.critical and san.value.get_values_for_type(x509.DNSName) == ["rallypoint-client"]


# ------------------------------------------------------------------ TLS
async def test_tls_etcd_with_the_ca_and_a_client_certificate_works(tls_etcd, key):
    async with tls_etcd.access().client() as etcd:
        put = await etcd.put(key + "a", "v")
        assert (await etcd.get(key + "a")).value == b"v"
        lease = await etcd.lease_grant(5)
        assert await etcd.lease_keepalive(lease.lease_id) > 0
        async with etcd.watch(key + "w", start_revision=put.revision) as events:
            await etcd.put(key + "w", "1")
            ev = await events.__anext__()
            assert ev.kv.value == b"1"
        await etcd.lease_revoke(lease.lease_id)


async def test_tls_etcd_without_the_ca_fails_at_once_naming_the_ca(tls_etcd):
    async with EtcdClient(tls_etcd.endpoints, tls=tls_etcd.tls(), timeout_s=2.0) as ok:
        await ok.status()
    async with EtcdClient(tls_etcd.endpoints, tls=EtcdTls(None, tls_etcd.path("client.pem"),
                                                          tls_etcd.path("client.key")), timeout_s=10.0) as etcd:
        started = trio.current_time()
        with pytest.raises(EtcdTlsError) as info:
            await etcd.get("/k")
        assert trio.current_time() - started < 5.0  # raised on the first round, not at the 10 s deadline
    assert info.value.code == "UNAUTHENTICATED" and isinstance(info.value, UnauthenticatedError)
    assert info.value.details["kind"] == "verify" and "--etcd-ca" in info.value.message


async def test_tls_etcd_with_the_system_cas_holding_its_ca_works(tls_etcd, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", tls_etcd.path("ca.pem"))  # (OpenSSL's default verify file)
    async with EtcdClient(tls_etcd.endpoints, tls=EtcdTls(None, tls_etcd.path("client.pem"),
                                                          tls_etcd.path("client.key"))) as etcd:
        assert (await etcd.status()).version.startswith("3.")


async def test_tls_etcd_with_a_wrong_ca_fails_clearly(tls_etcd, tmp_path):
    pki.write_cluster_pki(str(tmp_path), [], etcd=True)  # another CA
    tls = EtcdTls(str(tmp_path / "ca.pem"), tls_etcd.path("client.pem"), tls_etcd.path("client.key"))
    async with EtcdClient(tls_etcd.endpoints, tls=tls) as etcd:
        with pytest.raises(EtcdTlsError, match="not signed by the CA given"):
            await etcd.status()
        with pytest.raises(EtcdTlsError):  # a watch's opening too
            async with etcd.watch("/k") as events:
                await events.__anext__()


async def test_tls_etcd_without_a_client_certificate_fails_clearly(tls_etcd, tmp_path):
    async with EtcdClient(tls_etcd.endpoints, tls=EtcdTls(tls_etcd.path("ca.pem"))) as etcd:
        with pytest.raises(EtcdTlsError, match="refused this client's certificate, or wanted one") as info:
            await etcd.get("/k")
    assert info.value.details["kind"] == "refused"
    pki.write_cluster_pki(str(tmp_path), [], etcd=True)  # a client certificate of another CA
    other = EtcdTls(tls_etcd.path("ca.pem"), str(tmp_path / "client.pem"), str(tmp_path / "client.key"))
    async with EtcdClient(tls_etcd.endpoints, tls=other) as etcd:
        with pytest.raises(EtcdTlsError, match="refused this client's certificate"):
            await etcd.get("/k")


async def test_https_to_a_plaintext_etcd_fails_clearly(etcd):
    https = [e.replace("http://", "https://") for e in etcd.endpoints]
    async with EtcdClient(https) as client:
        with pytest.raises(EtcdTlsError, match="as a plaintext etcd does: give http://") as info:
            await client.status()
    assert info.value.details["kind"] == "closed"


async def test_http_to_a_tls_etcd_says_give_https(tls_etcd):
    plain = [e.replace("https://", "http://") for e in tls_etcd.endpoints]
    async with EtcdClient(plain, timeout_s=0.5) as client:
        with pytest.raises(EtcdUnavailableError, match="give https://"):
            await client.status()


async def test_an_endpoint_that_resets_plaintext_connections_says_give_https_too(nursery):
    # under load, an etcd serving TLS answered a plaintext request with a reset (RST:
    # the request still unread) instead of a close: the hint was missing (found by a
    # full run of the suite on a loaded machine)
    import socket
    import struct

    async def reset(stream):
        await stream.receive_some(1)
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await trio.aclose_forcefully(stream)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(trio.serve_listeners, reset, listeners)
    async with EtcdClient([f"http://127.0.0.1:{port}"], timeout_s=0.5) as client:
        # (the last try's error is the reset or, when the request was all read first, a
        # disconnect: which one is the kernel's timing; both get the hint)
        with pytest.raises(EtcdUnavailableError, match=r"(reset by peer|disconnected).*give https://"):
            await client.status()
    # the reset itself gets the hint (it did not: only the disconnect did)
    reset_error = "http://x/v3/kv/range: ReadError: [Errno 104] Connection reset by peer"
    assert "give https://" in plaintext_hint(reset_error, "http://127.0.0.1:2379")
    assert plaintext_hint(reset_error, "https://127.0.0.1:2379") == ""
    assert plaintext_hint("http://x: ConnectError: refused", "http://127.0.0.1:2379") == ""


# ------------------------------------------------------------------ authentication
async def test_auth_etcd_every_call_carries_the_token(auth_etcd, key):
    async with auth_etcd.access().client() as etcd:
        assert etcd.authentications == 0  # (none before the first call)
        put = await etcd.put(key + "a", "v")
        assert (await etcd.get(key + "a")).value == b"v"
        await etcd.delete(key + "a")
        lease = await etcd.lease_grant(5)
        assert await etcd.lease_keepalive(lease.lease_id) > 0
        async with etcd.watch(key, prefix=True, start_revision=put.revision) as events:
            first = await events.__anext__()
        assert first.kv.key == (key + "a").encode() and first.type == "PUT"
        await etcd.lease_revoke(lease.lease_id)
        assert etcd.authentications == 1


async def test_auth_wrong_password_is_one_unauthenticated_error_not_a_retry_loop(auth_etcd, caplog):
    caplog.set_level(logging.DEBUG)
    async with auth_etcd.access(password="wrong-" + ROOT_PASSWORD).client(timeout_s=10.0) as etcd:
        started = trio.current_time()
        with pytest.raises(EtcdAuthError) as info:
            await etcd.get("/k")
        assert trio.current_time() - started < 5.0
        with pytest.raises(EtcdAuthError):  # asked again within a second: refused without asking etcd
            await etcd.put("/k", "v")
        assert etcd.authentications == 0
    e = info.value
    assert e.code == "UNAUTHENTICATED" and "wrong user name or password" in e.message and "\n" not in str(e)
    assert ROOT_PASSWORD not in str(e) and all(ROOT_PASSWORD not in r.getMessage() for r in caplog.records)


async def test_auth_unknown_user_is_unauthenticated(auth_etcd):
    async with auth_etcd.access("no-such-user", "x").client() as etcd:
        with pytest.raises(EtcdAuthError, match="etcd refused user 'no-such-user'"):
            await etcd.status()
            await etcd.get("/k")


async def test_auth_etcd_without_a_user_says_authentication_is_on(auth_etcd):
    async with auth_etcd.access(None).client() as etcd:
        with pytest.raises(EtcdAuthError, match="etcd has authentication on") as info:
            await etcd.get("/k")
        with pytest.raises(EtcdAuthError, match="etcd has authentication on"):
            async with etcd.watch("/k") as events:
                await events.__anext__()
    assert "--etcd-user" in info.value.message


async def test_auth_user_without_permission_is_forbidden(auth_etcd):
    async with auth_etcd.access("reader", "reader-pw").client() as etcd:
        await etcd.get("/rallypoint/x")  # reading is granted
        with pytest.raises(EtcdPermissionError) as info:
            await etcd.put("/rallypoint/x", "v")
        with pytest.raises(EtcdPermissionError, match="may not write"):
            await etcd.check_access("/rallypoint/c/")
    assert info.value.code == "FORBIDDEN" and isinstance(info.value, ForbiddenError)
    assert "'reader' may not write '/rallypoint/x'" in info.value.message
    async with auth_etcd.access("nobody", "nobody-pw").client() as etcd:
        with pytest.raises(EtcdPermissionError, match="'nobody' may not read '/rallypoint/c/'"):
            await etcd.check_access("/rallypoint/c/")
        with pytest.raises(EtcdPermissionError, match="may not watch"):
            async with etcd.watch("/rallypoint/c/", prefix=True) as events:
                await events.__anext__()
    async with auth_etcd.access("rallypoint", NODE_PASSWORD).client() as etcd:
        await etcd.check_access("/rallypoint/c/")  # its prefix: read and write, nothing written
        assert (await etcd.range("/rallypoint/c/", prefix=True)).kvs == []
        with pytest.raises(EtcdPermissionError):
            await etcd.check_access("/elsewhere/")


async def test_auth_expired_token_is_renewed_transparently(auth_etcd, key):
    async with auth_etcd.access().client() as etcd:
        await etcd.put(key + "a", "1")
        assert etcd.authentications == 1
        await trio.to_thread.run_sync(auth_etcd.wait_unused_tokens_expired, TOKEN_TTL)
        assert not auth_etcd.token_valid(etcd._token)  # (the client's token is gone at etcd)
        assert (await etcd.get(key + "a")).value == b"1"
        assert etcd.authentications == 2


async def test_auth_concurrent_calls_with_an_expired_token_share_one_renewal(auth_etcd, key):
    async with auth_etcd.access().client() as etcd:
        await etcd.put(key + "a", "1")
        await trio.to_thread.run_sync(auth_etcd.wait_unused_tokens_expired, TOKEN_TTL)
        got = []

        async def read() -> None:
            got.append((await etcd.get(key + "a")).value)

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(read)
        assert got == [b"1"] * 8 and etcd.authentications == 2


async def test_auth_watch_opened_with_an_expired_token_renews_it(auth_etcd, key):
    async with auth_etcd.access().client() as etcd, auth_etcd.access().client() as writer:
        await etcd.get(key)
        await trio.to_thread.run_sync(auth_etcd.wait_unused_tokens_expired, TOKEN_TTL)
        async with etcd.watch(key) as events:  # from now: the opening itself meets the dead token
            async with trio.open_nursery() as nursery:
                async def put_once_watching() -> None:
                    while not events.statistics().connected or etcd.authentications < 2:
                        await trio.sleep(0.01)
                    await writer.put(key, "after")

                nursery.start_soon(put_once_watching)
                ev = await events.__anext__()
        assert ev.kv.value == b"after"
        assert etcd.authentications == 2 and events.statistics().connects == 2  # refused once, then opened


async def test_auth_a_cut_watch_reopens_with_a_fresh_token_after_etcd_restarts(tmp_path, key):
    """A simple token lives in etcd's memory: a restarted member takes none of the old
    ones. The watch's stream breaks, it re-opens, renews the token, and delivers the
    next change (nothing lost, nothing repeated)."""
    etcd_ = EtcdCluster(str(tmp_path), tls_dir=str(tmp_path / "pki"), client_cert_auth=True).start()
    try:
        etcd_.enable_auth(ROOT_PASSWORD)
        async with etcd_.access().client() as etcd:
            first = await etcd.put(key, "1")
            async with etcd.watch(key, start_revision=first.revision) as events:
                assert (await events.__anext__()).kv.value == b"1"
                old_token = etcd._token
                await trio.to_thread.run_sync(etcd_.members[0].stop)
                await trio.to_thread.run_sync(etcd_.members[0].start)
                await trio.to_thread.run_sync(etcd_.wait_ready)
                assert not etcd_.token_valid(old_token)
                async with etcd_.access().client() as writer:
                    await writer.put(key, "2")
                    await writer.put(key, "3")
                assert [(await events.__anext__()).kv.value for _ in range(2)] == [b"2", b"3"]
                assert events.statistics().connects == 2
            assert etcd.authentications == 2
    finally:
        etcd_.stop()


async def test_auth_turned_on_later_the_client_authenticates_then(tmp_path, key, caplog):
    """A client with a user against an etcd whose auth is off works without a token
    (one warning); once auth is turned on, its next call authenticates."""
    etcd_ = EtcdCluster(str(tmp_path), tls_dir=str(tmp_path / "pki"), client_cert_auth=True).start()
    try:
        async with EtcdClient(etcd_.endpoints, tls=etcd_.tls(), auth=EtcdAuth("root", ROOT_PASSWORD)) as etcd:
            await etcd.put(key, "before")
            await etcd.put(key, "before again")
            assert etcd.authentications == 0
            assert sum("authentication off" in r.getMessage() for r in caplog.records) == 1
            await trio.to_thread.run_sync(etcd_.enable_auth, ROOT_PASSWORD)
            assert (await etcd.get(key)).value == b"before again"
            assert etcd.authentications == 1
    finally:
        etcd_.stop()


async def test_auth_client_certificate_with_a_common_name_is_refused_with_the_reason(auth_etcd, tmp_path):
    ca = pki.Issued(open(auth_etcd.path("ca.pem"), "rb").read(), open(auth_etcd.path("ca.key"), "rb").read())
    leaf = pki.issue(ca, "someone", [])
    (tmp_path / "cn.pem").write_bytes(leaf.cert_pem)
    (tmp_path / "cn.key").write_bytes(leaf.key_pem)
    tls = EtcdTls(auth_etcd.path("ca.pem"), str(tmp_path / "cn.pem"), str(tmp_path / "cn.key"))
    async with EtcdClient(auth_etcd.endpoints, tls=tls, auth=EtcdAuth("root", ROOT_PASSWORD)) as etcd:
        with pytest.raises(EtcdTlsError, match="carries a Common Name"):
            await etcd.get("/k")


# ------------------------------------------------------------------ the command line and real nodes
def secure_args(etcd: EtcdCluster, user: str = "rallypoint") -> list[str]:
    host = etcd.endpoints[0].removeprefix("https://")
    return ["--cluster", f"https://{user}@{host}", "--etcd-ca", etcd.path("ca.pem"),
            "--etcd-cert", etcd.path("client.pem"), "--etcd-key", etcd.path("client.key")]


def rallypoint_cli(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rallypoint", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def password_file(tmp_path):
    path = tmp_path / "etcd.password"
    path.write_text(NODE_PASSWORD + "\n")
    path.chmod(0o600)
    return str(path)


async def test_two_node_shard_on_a_tls_auth_etcd_elects_serves_fails_over(auth_etcd, tmp_path, password_file):
    cluster = f"s-{uuid.uuid4().hex[:8]}"
    args = secure_args(auth_etcd)
    # one node takes the password from a file, the other from the environment
    a = ClusterNode("a", str(tmp_path), args[1], cluster, extra=args[2:] + ["--etcd-password-file", password_file])
    b = ClusterNode("b", str(tmp_path), args[1], cluster, extra=args[2:],
                    env={"RALLYPOINT_ETCD_PASSWORD": NODE_PASSWORD})
    access = auth_etcd.access("rallypoint", NODE_PASSWORD)
    try:
        a.start()
        await a.wait_ready()
        await a.wait_role("leader")
        b.start()
        await b.wait_ready()
        await b.wait_role("standby")
        async with access.client() as etcd:
            election = ShardElection(etcd, cluster, 0)
            with trio.fail_after(60):
                while sorted((await election.read_replicas()).replicas.isr) != ["a", "b"]:
                    await trio.sleep(0.05)
        out = rallypoint_cli("cluster", "status", *args, "--cluster-name", cluster,
                             env={"RALLYPOINT_ETCD_PASSWORD": NODE_PASSWORD})
        assert out.returncode == 0, out.stderr
        assert "leader      a at" in out.stdout and "in sync     a b" in out.stdout
        async with rallypoint.connect(f"tcp://{a.address},{b.address}",
                                      reconnect=rallypoint.Reconnect(timeout=60)) as rs:
            jobs = await rs.mailboxes.ensure("secure")
            run = await rs.scopes.create(name="secure")
            task = await jobs.submit({"n": 1}, key="k1", scope=run)  # acknowledged: fsynced on a and b
            a.kill()
            await b.wait_role("leader")
            assert (await rs.task(task.id).status()).key == "k1"
            again = await jobs.submit({"n": 2}, key="k2", scope=run)
            assert (await rs.task(again.id).status()).key == "k2"
        # the keys of the cluster live in the secure etcd
        made = rallypoint_cli("keys", "create", *args, "--cluster-name", cluster, "--space", "default",
                              "--permission", "admin", "--force", "--secret-only",
                              env={"RALLYPOINT_ETCD_PASSWORD": NODE_PASSWORD})
        assert made.returncode == 0, made.stderr
        secret = made.stdout.strip()
        listed = rallypoint_cli("keys", "list", *args, "--cluster-name", cluster,
                                env={"RALLYPOINT_ETCD_PASSWORD": NODE_PASSWORD})
        assert listed.returncode == 0 and "permissions=admin" in listed.stdout, listed.stderr
        # the leader takes it; asked to make a key over the wire, it names the etcd with its TLS flags
        with trio.fail_after(60):
            while True:
                try:
                    async with rallypoint.connect(b.url, api_key=secret, reconnect=False) as rs:
                        with pytest.raises(ForbiddenError) as info:
                            await rs._transport.call(p.KeyCreate(space="default", permissions=["coordination_read"]))
                    break
                except UnauthenticatedError:  # (not taken from etcd yet)
                    await trio.sleep(0.05)
        assert f"--cluster {args[1]} --etcd-ca {auth_etcd.path('ca.pem')}" in info.value.message
        assert NODE_PASSWORD not in info.value.message
    finally:
        a.kill()
        b.kill()
    for n in (a, b):
        assert NODE_PASSWORD not in open(n.log_path).read()


def test_cluster_init_on_a_tls_auth_etcd(auth_etcd, password_file):
    cluster = f"i-{uuid.uuid4().hex[:8]}"
    args = secure_args(auth_etcd)
    out = rallypoint_cli("cluster", "init", *args, "--etcd-password-file", password_file, "--cluster-name", cluster,
                         "--slots", "8", "--shards", "2")
    assert out.returncode == 0, out.stderr
    assert f"serve --cluster {args[1]} --etcd-ca {auth_etcd.path('ca.pem')}" in out.stdout
    assert NODE_PASSWORD not in out.stdout + out.stderr

    async def slot_map():
        async with auth_etcd.access("rallypoint", NODE_PASSWORD).client() as etcd:
            return await read_map(etcd, cluster)

    m = trio.run(slot_map)
    assert len(m.owners) == 8 and m.shards == [0, 1]


def test_cluster_commands_with_a_wrong_etcd_password_say_one_line(auth_etcd):
    for argv in (["cluster", "status"], ["cluster", "init"], ["keys", "list"]):
        out = rallypoint_cli(*argv, *secure_args(auth_etcd), env={"RALLYPOINT_ETCD_PASSWORD": "wrong"})
        assert out.returncode == 1, (argv, out.stdout)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("rallypoint: UNAUTHENTICATED: etcd refused user 'rallypoint'"), \
            (argv, out.stderr)


@pytest.mark.parametrize("case", ["wrong password", "no permission", "wrong CA"])
def test_serve_against_a_secure_etcd_it_cannot_use_exits_with_one_line(auth_etcd, tmp_path, case):
    args = secure_args(auth_etcd, user="reader" if case == "no permission" else "rallypoint")
    password = {"wrong password": "Xq7-not-it", "no permission": "reader-pw"}.get(case, NODE_PASSWORD)
    if case == "wrong CA":
        pki.write_cluster_pki(str(tmp_path / "other"), [], etcd=True)
        args[args.index("--etcd-ca") + 1] = str(tmp_path / "other" / "ca.pem")
    out = rallypoint_cli("serve", *args, "--cluster-name", "x", "--node", "n1", "--data-dir", str(tmp_path / "n1"),
                         "--listen", "127.0.0.1:0", env={"RALLYPOINT_ETCD_PASSWORD": password})
    assert out.returncode == 2, out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("rallypoint: ")]
    expected = {"wrong password": "UNAUTHENTICATED: etcd refused user 'rallypoint'",
                "no permission": "FORBIDDEN: etcd user 'reader' may not write",
                "wrong CA": "UNAUTHENTICATED: TLS with etcd"}[case]
    assert len(errors) == 1 and errors[0].startswith("rallypoint: " + expected), out.stderr
    assert "Traceback" not in out.stderr and password not in out.stderr
    assert not (tmp_path / "n1").exists()  # refused before the data dir was made
