"""TLS of the daemon's TCP listener: the operator's certificate, or one made on first start.

    cert, key = server_certificate(cert=None, key=None)   # state_dir()/tls/daemon.{crt,key}
    fingerprint(cert)                                      # "AB:CD:..." (SHA-256 of the DER)

A made certificate is self-signed (ECDSA P-256, ten years), names localhost, the
loopback addresses and this host's names, and is kept: its fingerprint is what
clients pin (HUTCH_FINGERPRINT), so it never changes by itself. The key is 0600;
the certificate is public (a local client may name it in HUTCH_CA).
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import ipaddress
import os
import socket
import ssl
from pathlib import Path

from hutch._core import paths
from hutch._core.atomic import atomic_write
from hutch._core.errors import ConfigError

CERT_NAME = "daemon.crt"
KEY_NAME = "daemon.key"
VALID_DAYS = 3650


def tls_dir() -> Path:
    """Where a made certificate lives: state_dir()/tls."""
    return paths.state_dir() / "tls"


def server_certificate(cert: str | os.PathLike | None = None, key: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """The (certificate, key) files to serve: the given pair, else the made one (made now if missing)."""
    if cert or key:
        if not (cert and key):
            raise ConfigError("give both --tls-cert and --tls-key (PEM files), or neither to use a made certificate.")
        cert, key = Path(cert), Path(key)
        for p in (cert, key):
            if not p.is_file():
                raise ConfigError(f"{p} is not a file; give PEM files for --tls-cert and --tls-key.")
    else:
        cert = made_certificate()
        key = cert.with_name(KEY_NAME)
    st = key.stat()
    if st.st_uid not in (0, os.geteuid()):   # its owner holds the key: it could answer as this daemon
        raise ConfigError(f"the TLS key {key} belongs to uid {st.st_uid}, who could answer as this daemon and read "
                          f"its clients' tokens: `chown root {key}`.")
    if st.st_mode & 0o077:
        raise ConfigError(f"the TLS key {key} may be read by other users: `chmod 600 {key}`.")
    return cert, key


def made_certificate() -> Path:
    """The certificate the daemon made under tls_dir(), made now if there is none (which takes root)."""
    d = tls_dir()
    crt, k = d / CERT_NAME, d / KEY_NAME
    if crt.is_file() and k.exists():
        return crt
    if os.geteuid() != 0:
        raise ConfigError(f"there is no daemon certificate in {d} yet; `hutch serve --listen` makes it, or run "
                          "`sudo hutch tls-fingerprint` to make it now.")
    d.mkdir(parents=True, exist_ok=True)
    os.chown(d, 0, 0)
    os.chmod(d, 0o755)
    with open(d / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # daemons sharing a state dir make one certificate
        if not (crt.is_file() and k.is_file()):
            _make_self_signed(crt, k)
    return crt


def _make_self_signed(crt: Path, key_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    host = socket.gethostname()
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                     x509.IPAddress(ipaddress.ip_address("::1"))]
    for n in dict.fromkeys([host, socket.getfqdn()]):
        if n and n != "localhost":
            names.append(x509.DNSName(n))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"hutch daemon on {host}"[:64])])
    now = datetime.datetime.now(datetime.timezone.utc)
    pub = key.public_key()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(pub)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(pub), critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    atomic_write(key_path, key_pem, mode=0o600)   # mkstemp's 0600 from the start: never readable by others
    atomic_write(crt, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)


def fingerprint(cert: str | os.PathLike) -> str:
    """SHA-256 of the certificate's DER, as `openssl x509 -fingerprint -sha256` prints it (AB:CD:...)."""
    try:
        der = ssl.PEM_cert_to_DER_cert(Path(cert).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cert} is not a PEM certificate ({e}).") from e
    return format_fingerprint(hashlib.sha256(der).hexdigest())


def format_fingerprint(hexdigest: str) -> str:
    h = hexdigest.upper()
    return ":".join(h[i:i + 2] for i in range(0, len(h), 2))


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot load the TLS certificate {cert} and key {key} ({e}); give a matching PEM pair.") from e
    return ctx


__all__ = ["fingerprint", "format_fingerprint", "made_certificate", "server_certificate", "server_context", "tls_dir"]
