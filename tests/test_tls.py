"""TLS (SPEC §10): ``--tls-cert/--tls-key`` on the daemon, ``tls://`` URLs on the client,
with certificates made by trustme."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio
import trustme

import rallypoint
from rallypoint.errors import RallypointError, UnavailableError


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_pem, key_pem, ca_pem = d / "cert.pem", d / "key.pem", d / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_pem))
    cert.private_key_pem.write_to_path(str(key_pem))
    ca.cert_pem.write_to_path(str(ca_pem))
    proc = subprocess.Popen(
        [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--durability", "memory",
         "--tls-cert", str(cert_pem), "--tls-key", str(key_pem)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("READY tls://"), (line, proc.stderr.read() if proc.poll() is not None else "")
    url = line.split()[1]
    yield url, str(ca_pem)
    proc.terminate()
    assert proc.wait(30) == 0


async def test_tls_end_to_end(tls_daemon):
    url, ca = tls_daemon
    async with rallypoint.connect(url, tls_ca=ca) as rs:
        run = await rs.scopes.create(name="over-tls")
        assert (await run.status()).name == "over-tls"
        assert rs._transport.server_info.server_version


async def test_untrusted_certificate_is_refused(tls_daemon):
    url, _ = tls_daemon
    with pytest.raises(RallypointError):  # verified against the system CAs: not trusted
        async with rallypoint.connect(url, connect_timeout=5) as rs:
            await rs.status()


async def test_plaintext_client_against_tls_daemon_fails_cleanly(tls_daemon):
    url, ca = tls_daemon
    plain = url.replace("tls://", "tcp://")
    with trio.fail_after(15):  # fails, does not hang
        with pytest.raises(RallypointError):
            async with rallypoint.connect(plain, connect_timeout=5) as rs:
                await rs.status()
    # and the daemon is still fine for a TLS client
    async with rallypoint.connect(url, tls_ca=ca) as rs:
        await rs.status()


async def test_tls_client_against_plaintext_daemon_fails_cleanly(daemon):
    url = daemon.url.replace("tcp://", "tls://")
    with trio.fail_after(15):
        with pytest.raises(RallypointError):
            async with rallypoint.connect(url, connect_timeout=5) as rs:
                await rs.status()
    async with rallypoint.connect(daemon.url) as rs:
        await rs.status()


def test_sync_client_verifies_against_a_tls_ca(tls_daemon):
    # rallypoint.sync.connect takes the CA file like rallypoint.connect does.
    url, ca = tls_daemon
    with rallypoint.sync.connect(url, tls_ca=ca) as rs:
        run = rs.scopes.create(name="sync-over-tls")
        assert run.status().name == "sync-over-tls"


async def test_certificate_verification_failure_says_so_not_is_the_server_running(tls_daemon):
    url, ca = tls_daemon
    with pytest.raises(UnavailableError) as ei:
        async with rallypoint.connect(url, connect_timeout=5):
            pass
    assert "certificate failed verification" in ei.value.message and "running" not in ei.value.message
    assert ei.value.details["tls"] == "certificate_verify_failed"
    r = subprocess.run([sys.executable, "-m", "rallypoint", "status", "--connect", url],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "certificate failed verification" in lines[0] and "--tls-ca" in lines[0], lines[0]
    assert "running" not in lines[0] and "tls_ca=" not in lines[0], lines[0]
    ok = subprocess.run([sys.executable, "-m", "rallypoint", "status", "--connect", url, "--tls-ca", ca],
                        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert ok.returncode == 0, ok.stderr
