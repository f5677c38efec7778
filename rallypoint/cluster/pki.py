"""Certificates for a cluster's private links: a CA and one certificate per node.

``rallypoint cluster certs --out DIR --nodes a,b [--hosts h1,h2] [--etcd]`` writes::

    DIR/ca.pem  DIR/ca.key            the cluster's own CA (keep ca.key offline)
    DIR/<node>.pem  DIR/<node>.key    one per node: DNS:<node> (its identity on the
                                      replication link), plus every --hosts name/IP
    DIR/etcd.pem  DIR/etcd.key        with --etcd: etcd's server certificate
    DIR/client.pem  DIR/client.key    with --etcd: for the CLI (`cluster ...`, `keys ...`)
                                      and the nodes' etcd client; no Common Name
                                      (etcd 3.4's gateway refuses one when auth is on)

Each node certificate is good for both TLS roles (server and client authentication),
as etcd's ``--peer-cert-file`` is: a node is a server to its standby and a client of its
leader. The name a node is known by in etcd (``--node``) is a DNS subject alternative
name of its certificate: the replication link accepts a peer only under the node name
its certificate carries (:mod:`rallypoint.cluster.peerauth`). Keys are ECDSA P-256,
certificates valid for ``days`` (default 825, the longest browsers accept).

Made with the ``cryptography`` package (Python's own ``ssl`` cannot make certificates).
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
from dataclasses import dataclass

__all__ = ["Issued", "make_ca", "issue", "write_cluster_pki", "NODE_NAME_OID_HINT"]

#: where a node's name goes in its certificate (documented for operators who use their
#: own CA): a DNS subject alternative name equal to ``--node``
NODE_NAME_OID_HINT = "subjectAltName DNS:<node>"


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, both PEM bytes."""

    cert_pem: bytes
    key_pem: bytes


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(common_name: str = "rallypoint cluster CA", *, days: int = 3650) -> Issued:
    """A self-signed CA certificate (path length 0: it signs leaves only)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    from cryptography.hazmat.primitives import serialization

    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue(ca: Issued, common_name: str, names: list[str], *, days: int = 825, subject_cn: bool = True) -> Issued:
    """A leaf certificate signed by ``ca`` for ``common_name``, with every entry of
    ``names`` (and ``common_name``) as a subject alternative name -- an IP address
    literal as an IP entry, anything else as DNS -- usable for TLS server and client
    authentication. ``subject_cn=False``: an empty subject (the name in the critical
    subject alternative name only), as etcd 3.4 wants of a client certificate on its
    JSON gateway when its authentication is on. Raises ValueError for an empty name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not common_name:
        raise ValueError("a certificate needs a name")
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    key = _new_key()
    sans: list[x509.GeneralName] = []
    seen: set[str] = set()
    for n in [common_name, *names]:
        n = n.strip()
        if not n or n in seen:
            continue
        seen.add(n)
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n.strip("[]"))))
        except ValueError:
            sans.append(x509.DNSName(n))
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)] if subject_cn else []))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=True, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=not subject_cn)  # RFC 5280 4.2.1.6
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _write(path: str, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_cluster_pki(out: str, nodes: list[str], *, hosts: list[str] = (), etcd: bool = False,
                      days: int = 825) -> list[str]:
    """Write a CA and a certificate for each of ``nodes`` (and etcd's, with ``etcd``)
    into ``out`` (created; keys mode 0600) and return the paths written. An existing
    ``ca.pem``/``ca.key`` pair in ``out`` is reused, so nodes can be added later.
    ``hosts``: names and addresses the nodes are reached at (added to every node's and
    etcd's certificate). Raises ValueError for no node, a repeated node, a node named
    ``ca``/``etcd``/``client``/``localhost`` or a ``hosts`` entry equal to a node name."""
    nodes = [n.strip() for n in nodes if n.strip()]
    if not nodes and not etcd:
        raise ValueError("give at least one node (--nodes a,b)")
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"a node is named twice in {nodes}")
    for n in nodes:
        if n in ("ca", "etcd", "client", "localhost"):
            raise ValueError(f"{n!r} names a file of the CA set or a shared name; choose another node name")
    shared = set(nodes) & {h.strip() for h in hosts}
    if shared:
        # every certificate carries --hosts: a node named like one would be every node
        raise ValueError(f"--hosts must not name a node ({', '.join(sorted(shared))}): a node's name is its "
                         "identity on the replication link, and every certificate carries every --hosts entry")
    os.makedirs(out, exist_ok=True)
    ca_cert, ca_key = os.path.join(out, "ca.pem"), os.path.join(out, "ca.key")
    written: list[str] = []
    if os.path.exists(ca_cert) and os.path.exists(ca_key):
        with open(ca_cert, "rb") as f, open(ca_key, "rb") as g:
            ca = Issued(f.read(), g.read())
    else:
        ca = make_ca()
        _write(ca_cert, ca.cert_pem, False)
        _write(ca_key, ca.key_pem, True)
        written += [ca_cert, ca_key]
    base = ["localhost", "127.0.0.1", "::1", *hosts]
    leaves = [(n, n, base, True) for n in nodes]
    if etcd:
        leaves.append(("etcd", "etcd", base, True))
        # no Common Name: etcd with --client-cert-auth and its authentication on refuses
        # a gateway request whose client certificate has one (HTTP 400)
        leaves.append(("client", "rallypoint-client", [], False))
    for fname, cn, names, subject_cn in leaves:
        leaf = issue(ca, cn, list(names), days=days, subject_cn=subject_cn)
        c, k = os.path.join(out, f"{fname}.pem"), os.path.join(out, f"{fname}.key")
        _write(c, leaf.cert_pem, False)
        _write(k, leaf.key_pem, True)
        written += [c, k]
    return written
