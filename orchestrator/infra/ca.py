"""The farm's own certificate authority. Phones and browsers reach the farm's web page over
HTTPS (WebGPU exists only in a secure context), so the farm keeps a small local CA whose
certificate each lab device installs once, and issues from it the server certificate the farm's
HTTPS servers present. This module owns the CA's folder (by default <config_dir>/ca, mode 0700):
the CA key and certificate, the server key and certificate (renewed when asked for names it does
not cover or near its end), the SSL context a server uses, and the exports devices install
(PEM, DER, an iOS configuration profile). The keys never leave that folder.

| file        | what                                                             | mode |
|-------------|------------------------------------------------------------------|------|
| ca.key      | the CA's private key (EC P-256, PKCS#8 PEM)                      | 0600 |
| ca.pem      | the self-signed CA certificate: what devices trust               | 0644 |
| server.key  | the server's private key (EC P-256)                              | 0600 |
| server.pem  | the server certificate followed by the CA's: the chain served    | 0644 |
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import plistlib
import re
import ssl
import stat
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_KEY, CA_CERT = "ca.key", "ca.pem"
SERVER_KEY, SERVER_CERT = "server.key", "server.pem"

# Each lab device installs the CA by hand (and on iOS also switches on full trust by hand), so a
# new CA costs a visit to every device; a leaked CA key vouches for its names until the CA ends.
# Two years bounds the second and keeps the first rare; `farm ca rotate` replaces it sooner.
CA_VALIDITY = dt.timedelta(days=730)
# What a CA made without names vouches for: this machine alone.
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
# The limit browsers and Apple set for TLS leaf certificates (398 days for public CAs; iOS holds
# certificates from user-installed roots to 825 days): 397 days is within every one of them.
SERVER_VALIDITY = dt.timedelta(days=397)
RENEW_BEFORE = dt.timedelta(days=30)
# Phones' clocks run a little off; a certificate that starts "now" is not yet valid for them.
CLOCK_SKEW = dt.timedelta(hours=1)
DEFAULT_CA_NAME = "devicefarm CA"

FORMATS = ("pem", "der", "mobileconfig")
SUFFIX_FORMATS = {".pem": "pem", ".crt": "pem", ".cer": "der", ".der": "der", ".mobileconfig": "mobileconfig"}

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_DNS_NAME = re.compile(rf"^(?:\*\.)?{_LABEL}(?:\.{_LABEL})*$")

Name = str | ipaddress.IPv4Address | ipaddress.IPv6Address


class CaError(RuntimeError):
    """A CA folder that is missing, incomplete, unsafe or asked for something it cannot do; the
    message names the file or value and the fix."""


class NoCa(CaError):
    """There is no CA in the folder yet."""


def default_dir(config_dir: Path) -> Path:
    """Where the farm keeps its CA: <config_dir>/ca."""
    return Path(config_dir) / "ca"


@dataclass(frozen=True)
class ServerCert:
    """The server certificate of a CA folder, as `issue_server_cert` left it."""

    cert: Path  # the leaf followed by the CA certificate
    key: Path
    names: tuple[str, ...]  # what its SAN covers: DNS names, then IP addresses
    not_after: dt.datetime
    fingerprint: str
    issued: bool  # True: written by this call; False: the one there already covered the names


# ---- the CA -----------------------------------------------------------------------------------


def init_ca(folder: Path, name: str = DEFAULT_CA_NAME, *, names: Iterable[str] = LOCAL_NAMES,
            force: bool = False) -> x509.Certificate:
    """Make the CA in `folder`: an EC P-256 key (0600) and a self-signed certificate valid for
    two years, name-constrained to `names` (the lab's host names, each with its subdomains,
    and IP addresses): whoever takes its key can impersonate those and nothing else to the
    devices that trust it (without constraints, accounts.google.com or *.apple.com). An
    existing CA is kept (CaError) unless `force`: devices trust it, and a new one must be
    installed on every device again."""
    folder = Path(folder)
    name = name.strip()
    if not name or len(name) > 64:  # X.520 caps a common name at 64 characters
        raise CaError(f"CA name {name!r}: give 1 to 64 characters")
    existing = [p for p in (folder / CA_KEY, folder / CA_CERT) if p.exists()]
    if existing and not force:
        raise CaError(f"{folder} already holds a CA ({', '.join(p.name for p in existing)}); devices that "
                      "trust it would have to install a new one. Keep it, or replace it with --force")
    constraints = name_constraints(parse_names(names))
    _make_private_dir(folder)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "devicefarm")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW).not_valid_after(now - CLOCK_SKEW + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(constraints, critical=True)  # RFC 5280: critical
        .sign(key, hashes.SHA256())
    )
    # Key first: a CA folder interrupted here has a key and no certificate, which load refuses.
    _write_atomic(folder / CA_KEY, _key_pem(key), 0o600)
    _write_atomic(folder / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert


def name_constraints(names: list[Name]) -> x509.NameConstraints:
    """Permitted: each DNS name with its subdomains, each IP address alone. No IP address given:
    every IP address excluded (without an IP subtree, RFC 5280 leaves IP addresses free)."""
    dns = [x509.DNSName(n) for n in names if isinstance(n, str)]
    ips = [x509.IPAddress(ipaddress.ip_network(n)) for n in names if not isinstance(n, str)]
    if not dns:
        raise CaError("the CA needs at least one host name to vouch for (localhost, the farm's name)")
    excluded = None if ips else [x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")),
                                 x509.IPAddress(ipaddress.ip_network("::/0"))]
    return x509.NameConstraints(permitted_subtrees=dns + ips, excluded_subtrees=excluded)


def permitted_names(cert: x509.Certificate) -> list[str] | None:
    """What the CA may vouch for, as text (None: no constraints, a CA made before they were)."""
    try:
        constraints = cert.extensions.get_extension_for_class(x509.NameConstraints).value
    except x509.ExtensionNotFound:
        return None
    return [str(g.value.network_address) if isinstance(g, x509.IPAddress) and g.value.num_addresses == 1
            else str(g.value) for g in constraints.permitted_subtrees or []]


def _covered(name: Name, cert: x509.Certificate) -> bool:
    """Whether the CA's name constraints let it vouch for `name`."""
    try:
        constraints = cert.extensions.get_extension_for_class(x509.NameConstraints).value
    except x509.ExtensionNotFound:
        return True
    for subtree in constraints.permitted_subtrees or []:
        if isinstance(name, str) and isinstance(subtree, x509.DNSName):
            base = subtree.value.lower()
            if name == base or name.endswith("." + base):
                return True
        if not isinstance(name, str) and isinstance(subtree, x509.IPAddress):
            if subtree.value.version == name.version and name in subtree.value:
                return True
    return False


def load_ca_cert(folder: Path) -> x509.Certificate:
    """The CA certificate of `folder`; NoCa when there is none."""
    path = Path(folder) / CA_CERT
    if not path.exists():
        raise NoCa(f"no farm CA in {folder}: run `farm ca init` first")
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError as exc:
        raise CaError(f"{path} is not a PEM certificate ({exc}); replace the CA with `farm ca init --force`") from None


def load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA certificate and its key, checked: the key private to its owner and the pair's own."""
    folder = Path(folder)
    cert = load_ca_cert(folder)
    key_path = folder / CA_KEY
    if not key_path.exists():
        raise CaError(f"{folder} holds {CA_CERT} but not its key {CA_KEY}; the CA cannot issue. Restore the "
                      "key, or make a new CA with `farm ca init --force` (and install it on devices again)")
    key = _load_private_key(key_path)
    if not _same_key(key, cert):
        raise CaError(f"{key_path} is not the key of {folder / CA_CERT}; restore the matching key, or make a "
                      "new CA with `farm ca init --force`")
    if cert.not_valid_after_utc <= dt.datetime.now(dt.UTC):
        raise CaError(f"the farm CA in {folder} expired on {cert.not_valid_after_utc:%Y-%m-%d}; make a new one "
                      "with `farm ca init --force` and install it on devices again")
    return cert, key


def fingerprint(cert: x509.Certificate) -> str:
    """The certificate's SHA-256 fingerprint as colon-separated hex (AB:CD:...), the form iOS,
    Android and browsers show, for people to compare on the device."""
    return cert.fingerprint(hashes.SHA256()).hex(":").upper()


# ---- the server certificate -------------------------------------------------------------------


def issue_server_cert(folder: Path, hostnames_and_ips: Iterable[str]) -> ServerCert:
    """The folder's server certificate, covering at least `hostnames_and_ips` (DNS names and IP
    addresses). The one there is kept when it was issued by this CA, covers every name and has
    more than 30 days left; otherwise a new key and certificate (397 days) replace it, covering
    the requested names and those the old one covered, so that renewing never drops a name a
    device already uses."""
    folder = Path(folder)
    wanted = parse_names(hostnames_and_ips)
    ca_cert, ca_key = load_ca(folder)
    outside = [str(n) for n in wanted if not _covered(n, ca_cert)]
    if outside:
        raise CaError(f"the farm CA may not vouch for {', '.join(outside)} (it is limited to "
                      f"{', '.join(permitted_names(ca_cert) or [])}); add them to hub_names and make a new CA "
                      "with `farm ca rotate` (every device then installs it again)")
    current = _current_server_cert(folder, ca_cert)
    if current is not None:
        cert, covered = current
        renew_from = cert.not_valid_after_utc - RENEW_BEFORE
        if set(wanted) <= set(covered) and dt.datetime.now(dt.UTC) < renew_from:
            return _server_cert(folder, cert, issued=False)
        wanted = _ordered({*wanted, *(n for n in covered if _covered(n, ca_cert))})
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    not_before = now - CLOCK_SKEW
    # A leaf cannot outlive its CA: chains are checked against the CA's own validity too.
    not_after = min(not_before + SERVER_VALIDITY, ca_cert.not_valid_after_utc)
    dns = [n for n in wanted if isinstance(n, str)]
    common_name = dns[0] if dns and len(dns[0]) <= 64 else "devicefarm server"
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        # Browsers read only the SAN (never the common name) for the names a certificate covers.
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(n) if isinstance(n, str) else x509.IPAddress(n) for n in wanted]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    chain = cert.public_bytes(serialization.Encoding.PEM) + ca_cert.public_bytes(serialization.Encoding.PEM)
    # Key first: a folder interrupted here holds a key that does not match server.pem, which the
    # next call finds and replaces.
    _write_atomic(folder / SERVER_KEY, _key_pem(key), 0o600)
    _write_atomic(folder / SERVER_CERT, chain, 0o644)
    return _server_cert(folder, cert, issued=True)


def server_cert_info(folder: Path) -> ServerCert | None:
    """The server certificate there is (issued by this folder's CA, any names), or None."""
    folder = Path(folder)
    current = _current_server_cert(folder, load_ca_cert(folder))
    return None if current is None else _server_cert(folder, current[0], issued=False)


def server_ssl_context(folder: Path, names: Iterable[str]) -> ssl.SSLContext:
    """A server-side SSL context presenting the folder's server certificate (issued or renewed
    for `names` first) with its chain, TLS 1.2 at least. For an http.server:

        server = ThreadingHTTPServer((host, port), Handler)
        server.socket = server_ssl_context(folder, [host]).wrap_socket(server.socket, server_side=True)
    """
    issued = issue_server_cert(folder, names)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(issued.cert, issued.key)
    return context


def parse_names(values: Iterable[str]) -> list[Name]:
    """Host names (lower-cased, IDNs as punycode) and IP addresses, in order, without repeats;
    CaError naming a value that is neither (a URL, a port, an empty string)."""
    names: list[Name] = []
    for value in values:
        text = str(value).strip()
        try:
            names.append(ipaddress.ip_address(text.strip("[]")))
            continue
        except ValueError:
            pass
        try:
            dns = text.rstrip(".").encode("idna").decode("ascii").lower()
        except UnicodeError:
            dns = ""
        if not dns or len(dns) > 253 or not _DNS_NAME.match(dns):
            raise CaError(f"{value!r} is not a host name or IP address; give bare names such as farm.lan, "
                          "localhost or 10.0.0.5 (no scheme, port or path)")
        names.append(dns)
    if not names:
        raise CaError("give at least one host name or IP address for the server certificate")
    return _ordered(names)


# ---- exports ----------------------------------------------------------------------------------


def export_format(path: Path, format: str | None = None) -> str:
    """The export format: `format` when given, else the one `path`'s suffix names."""
    if format is not None:
        if format not in FORMATS:
            raise CaError(f"unknown export format {format!r}: use one of {', '.join(FORMATS)}")
        return format
    try:
        return SUFFIX_FORMATS[Path(path).suffix.lower()]
    except KeyError:
        raise CaError(f"cannot tell the format from {Path(path).name!r}: name it .pem/.crt (PEM), .cer (DER, "
                      "for Android) or .mobileconfig (iOS profile), or give --format") from None


def export_ca(folder: Path, out_path: Path, format: str | None = None) -> Path:
    """Write the CA certificate (never its key) for devices to install:

    - `pem` (.pem, .crt): PEM text, for browsers' and desktops' certificate managers;
    - `der` (.cer): binary DER, what Android's Settings > Security > Encryption & credentials >
      Install a certificate > CA certificate takes;
    - `mobileconfig` (.mobileconfig): an iOS/iPadOS configuration profile holding the DER
      certificate in a com.apple.security.root payload. The profile is not signed, so iOS shows
      it as "Not Signed" when it is installed; after installing it (Settings > General > VPN &
      Device Management), the user must still switch on full trust for the CA in Settings >
      General > About > Certificate Trust Settings, or Safari does not trust the farm's pages.

    `format` defaults to the one `out_path`'s suffix names. Returns `out_path`."""
    kind = export_format(out_path, format)
    cert = load_ca_cert(folder)
    out_path = Path(out_path)
    if out_path.is_dir():
        raise CaError(f"{out_path} is a folder; give a file name, e.g. {out_path / ('farm-ca.' + kind)}")
    if not out_path.parent.is_dir():
        raise CaError(f"no folder {out_path.parent} to write {out_path.name} in; create it first")
    if kind == "pem":
        data = cert.public_bytes(serialization.Encoding.PEM)
    elif kind == "der":
        data = cert.public_bytes(serialization.Encoding.DER)
    else:
        data = plistlib.dumps(mobileconfig(cert), fmt=plistlib.FMT_XML)
    _write_atomic(out_path, data, 0o644)
    return out_path


def mobileconfig(cert: x509.Certificate) -> dict[str, Any]:
    """An unsigned iOS configuration profile that installs `cert` as a root CA."""
    digest = cert.fingerprint(hashes.SHA256()).hex()
    name = _common_name(cert)
    # Identifiers and UUIDs follow from the certificate, so installing a re-exported profile of
    # the same CA replaces the installed one instead of adding a second.
    identifier = f"devicefarm.ca.{digest[:16]}"

    def payload_uuid(part: str) -> str:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"devicefarm:{digest}:{part}")).upper()

    return {
        "PayloadType": "Configuration",
        "PayloadVersion": 1,
        "PayloadIdentifier": identifier,
        "PayloadUUID": payload_uuid("profile"),
        "PayloadDisplayName": name,
        "PayloadDescription": "Trusts the devicefarm's local certificate authority, so this device can open "
                              "the farm's HTTPS pages (SHA-256 " + fingerprint(cert) + ").",
        "PayloadOrganization": "devicefarm",
        "PayloadRemovalDisallowed": False,
        "PayloadContent": [{
            "PayloadType": "com.apple.security.root",
            "PayloadVersion": 1,
            "PayloadIdentifier": f"{identifier}.root",
            "PayloadUUID": payload_uuid("root"),
            "PayloadDisplayName": name,
            "PayloadCertificateFileName": "devicefarm-ca.cer",
            "PayloadContent": cert.public_bytes(serialization.Encoding.DER),
        }],
    }


# ---- helpers ----------------------------------------------------------------------------------


def _key_usage(**on: bool) -> x509.KeyUsage:
    fields = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
              "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return x509.KeyUsage(**{f: on.get(f, False) for f in fields})


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _same_key(key: Any, cert: x509.Certificate) -> bool:
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return key.public_key().public_bytes(*spki) == cert.public_key().public_bytes(*spki)


def _check_private(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise CaError(f"{path} is readable by others than its owner (mode {mode:o}); a private key must be "
                      f"0600: chmod 600 {path} (and consider the key leaked if others could read it)")


def _load_private_key(path: Path) -> Any:
    _check_private(path)
    try:
        return serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise CaError(f"{path} is not an unencrypted PEM private key ({exc})") from None


def _current_server_cert(folder: Path, ca_cert: x509.Certificate
                         ) -> tuple[x509.Certificate, list[Name]] | None:
    """The server certificate in `folder` and the names it covers, when it is usable: issued
    by `ca_cert`, with its own key beside it. None otherwise (missing, from an old CA, torn)."""
    cert_path, key_path = folder / SERVER_CERT, folder / SERVER_KEY
    if not cert_path.exists() or not key_path.exists():
        return None
    try:
        cert = x509.load_pem_x509_certificates(cert_path.read_bytes())[0]
        cert.verify_directly_issued_by(ca_cert)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return None
    if not _same_key(_load_private_key(key_path), cert):
        return None
    return cert, [*san.get_values_for_type(x509.DNSName), *san.get_values_for_type(x509.IPAddress)]


def _server_cert(folder: Path, cert: x509.Certificate, *, issued: bool) -> ServerCert:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = (*san.get_values_for_type(x509.DNSName), *map(str, san.get_values_for_type(x509.IPAddress)))
    return ServerCert(folder / SERVER_CERT, folder / SERVER_KEY, names, cert.not_valid_after_utc,
                      fingerprint(cert), issued)


def _ordered(names: Iterable[Name]) -> list[Name]:
    """DNS names (sorted), then IP addresses (sorted), each once."""
    unique = set(names)
    dns = sorted(n for n in unique if isinstance(n, str))
    ips = sorted((n for n in unique if not isinstance(n, str)), key=lambda ip: (ip.version, ip))
    return [*dns, *ips]


def _common_name(cert: x509.Certificate) -> str:
    values = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(values[0].value) if values else cert.subject.rfc4514_string()


def _make_private_dir(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)  # the CA's folder: only its owner lists or enters it


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """`data` to `path` with `mode` from the first byte, replacing it whole (never half written)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp makes it 0600
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

