"""The farm's certificate authority (orchestrator/infra/ca.py) and `farm ca ...`:

- the CA folder: 0700, keys 0600, no stray temporary files; an existing CA kept unless forced;
  a CA key readable by group or others refused;
- the server certificate: serverAuth, SAN names and addresses, at most 397 days, issued by the
  CA; kept while it covers what is asked, re-issued for new names (keeping the old ones) and
  near its end;
- real TLS: a Python client trusting the exported CA reaches an http.server using
  server_ssl_context; one with the default trust store fails verification; a certificate for
  other names fails the hostname check;
- the exports parse back (PEM, DER, the iOS profile and its DER payload) and never hold a key;
- headless Chromium (Debian's) cannot load the farm's page while the CA is not trusted, and
  loads it once the CA is in its profile's NSS database ($HOME/.pki/nssdb, added with certutil
  from libnss3-tools): Chromium on Linux verifies against the Chrome Root Store plus the CAs a
  user trusts there. Chromium and certutil are installed by scripts/ensure-chromium.sh; without
  them the test skips locally and fails in CI."""

from __future__ import annotations

import datetime as dt
import hashlib
import http.server
import json
import os
import plistlib
import shutil
import socket
import ssl
import stat
import subprocess
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from ci_support import missing
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from orchestrator.infra import ca

MARKER = "farm-page-3f9c1d"
LAB_NAMES = ["farm.lan", "farm.test", "localhost", "127.0.0.1", "::1", "10.0.0.5", "10.9.9.9"]
PAGE = f"<!doctype html><html><body><p id=marker>{MARKER}</p></body></html>".encode()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def folder(tmp_path) -> Path:
    return tmp_path / "config" / "ca"


@pytest.fixture
def made(folder) -> Path:
    """`folder` holding a fresh CA."""
    ca.init_ca(folder, "devicefarm test CA", names=LAB_NAMES)
    return folder


# ---- an https http.server ----------------------------------------------------------------------


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802  (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # clients that refuse the certificate hang up mid-request: expected here


@contextmanager
def https_server(context: ssl.SSLContext) -> Iterator[int]:
    """An http.server on 127.0.0.1 serving PAGE over TLS with `context`; yields its port."""
    server = _Server(("127.0.0.1", 0), _Page)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _get(url: str, context: ssl.SSLContext) -> str:
    with urllib.request.urlopen(url, context=context, timeout=5) as response:
        return response.read().decode()


def _handshake(port: int, context: ssl.SSLContext, server_hostname: str) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=server_hostname):
            pass


# ---- the CA folder -----------------------------------------------------------------------------


def test_init_makes_a_private_folder_with_a_ca_certificate(folder):
    cert = ca.init_ca(folder, "devicefarm test CA")
    assert _mode(folder) == 0o700 and _mode(folder / ca.CA_KEY) == 0o600 and _mode(folder / ca.CA_CERT) == 0o644
    assert sorted(p.name for p in folder.iterdir()) == [ca.CA_KEY, ca.CA_CERT]  # no temporary files left
    assert x509.load_pem_x509_certificate((folder / ca.CA_CERT).read_bytes()) == cert
    key = serialization.load_pem_private_key((folder / ca.CA_KEY).read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    cert.verify_directly_issued_by(cert)  # self-signed, with that key
    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign
    assert not usage.value.digital_signature
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=729) < lifetime <= dt.timedelta(days=730)  # two years, not ten
    assert cert.not_valid_before_utc < dt.datetime.now(dt.UTC)  # already valid on a phone a little behind


def test_init_keeps_an_existing_ca_unless_forced(made):
    before = {p.name: p.read_bytes() for p in made.iterdir()}
    with pytest.raises(ca.CaError, match="already holds a CA.*--force"):
        ca.init_ca(made, "another CA")
    assert {p.name: p.read_bytes() for p in made.iterdir()} == before
    (made / ca.CA_CERT).unlink()  # a torn CA (key, no certificate) is not replaced silently either
    with pytest.raises(ca.CaError, match="already holds a CA"):
        ca.init_ca(made, "another CA")
    cert = ca.init_ca(made, "another CA", force=True)
    assert (made / ca.CA_KEY).read_bytes() != before[ca.CA_KEY] and "another CA" in cert.subject.rfc4514_string()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_ca_key_others_can_read_is_refused(made, mode):
    os.chmod(made / ca.CA_KEY, mode)
    with pytest.raises(ca.CaError, match=rf"ca\.key is readable by others.*mode {mode:o}.*chmod 600"):
        ca.issue_server_cert(made, ["localhost"])
    assert not (made / ca.SERVER_CERT).exists()


def test_no_ca_yet_says_to_make_one(folder, tmp_path):
    for call in (lambda: ca.issue_server_cert(folder, ["localhost"]),
                 lambda: ca.export_ca(folder, tmp_path / "ca.pem"),
                 lambda: ca.server_ssl_context(folder, ["localhost"])):
        with pytest.raises(ca.NoCa, match="farm ca init"):
            call()


# ---- the server certificate --------------------------------------------------------------------


def test_the_server_certificate_is_a_tls_leaf_of_the_ca(made):
    server = ca.issue_server_cert(made, ["localhost", "127.0.0.1", "Farm.LAN.", "::1"])
    assert server.issued and server.names == ("farm.lan", "localhost", "127.0.0.1", "::1")
    assert _mode(server.key) == 0o600
    leaf, chain_ca = x509.load_pem_x509_certificates(server.cert.read_bytes())
    ca_cert = ca.load_ca_cert(made)
    assert chain_ca == ca_cert  # the chain served: leaf, then the CA
    leaf.verify_directly_issued_by(ca_cert)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["farm.lan", "localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc <= dt.timedelta(days=397)
    assert server.fingerprint == ca.fingerprint(leaf)


def test_the_server_certificate_is_kept_while_it_covers_the_names(made):
    first = ca.issue_server_cert(made, ["localhost", "127.0.0.1"])
    pem, key = first.cert.read_bytes(), first.key.read_bytes()
    again = ca.issue_server_cert(made, ["127.0.0.1", "LOCALHOST"])  # the same names, another order and case
    subset = ca.issue_server_cert(made, ["localhost"])
    assert not again.issued and not subset.issued and subset.names == first.names
    assert first.cert.read_bytes() == pem and first.key.read_bytes() == key


def test_new_names_reissue_the_server_certificate_keeping_the_old_ones(made):
    first = ca.issue_server_cert(made, ["localhost", "127.0.0.1"])
    key = first.key.read_bytes()
    renewed = ca.issue_server_cert(made, ["farm.lan", "10.0.0.5"])
    assert renewed.issued and renewed.names == ("farm.lan", "localhost", "10.0.0.5", "127.0.0.1")
    assert renewed.key.read_bytes() != key and renewed.fingerprint != first.fingerprint


def test_a_server_certificate_near_its_end_is_renewed(made, monkeypatch):
    monkeypatch.setattr(ca, "SERVER_VALIDITY", dt.timedelta(days=29))
    short = ca.issue_server_cert(made, ["localhost"])
    monkeypatch.setattr(ca, "SERVER_VALIDITY", dt.timedelta(days=397))
    renewed = ca.issue_server_cert(made, ["localhost"])
    assert renewed.issued and renewed.not_after - short.not_after > dt.timedelta(days=300)
    assert not ca.issue_server_cert(made, ["localhost"]).issued


def test_a_new_ca_replaces_the_server_certificate_of_the_old_one(made):
    old = ca.issue_server_cert(made, ["localhost"])
    ca.init_ca(made, "devicefarm test CA 2", names=["farm.lan"], force=True)
    new = ca.issue_server_cert(made, ["farm.lan"])
    assert new.issued and new.names == ("farm.lan",)  # the old CA's names are not carried over
    x509.load_pem_x509_certificates(new.cert.read_bytes())[0].verify_directly_issued_by(ca.load_ca_cert(made))
    assert new.fingerprint != old.fingerprint


@pytest.mark.parametrize("bad", ["", "https://farm.lan", "farm.lan:8443", "farm lan", "a..b", "-farm.lan"])
def test_names_that_are_not_host_names_or_addresses_are_refused(made, bad):
    with pytest.raises(ca.CaError, match="not a host name or IP address|at least one"):
        ca.issue_server_cert(made, [bad])


# ---- real TLS with Python's ssl ----------------------------------------------------------------


def test_a_client_trusting_the_exported_ca_reaches_the_server(made, tmp_path):
    exported = ca.export_ca(made, tmp_path / "farm-ca.pem")
    client = ssl.create_default_context(cafile=str(exported))
    with https_server(ca.server_ssl_context(made, ["localhost", "127.0.0.1"])) as port:
        assert MARKER in _get(f"https://localhost:{port}/", client)
        assert MARKER in _get(f"https://127.0.0.1:{port}/", client)


def test_a_client_without_the_farm_ca_fails_verification(made):
    with https_server(ca.server_ssl_context(made, ["localhost"])) as port:
        with pytest.raises(ssl.SSLCertVerificationError) as caught:
            _handshake(port, ssl.create_default_context(), "localhost")
    # 19: self-signed certificate in chain (the server sends the CA), 20: no local issuer
    assert caught.value.verify_code in (19, 20), caught.value.verify_message


def test_a_certificate_for_other_names_fails_the_hostname_check(made, tmp_path):
    client = ssl.create_default_context(cafile=str(ca.export_ca(made, tmp_path / "farm-ca.pem")))
    with https_server(ca.server_ssl_context(made, ["farm.test", "10.9.9.9"])) as port:
        for host in ("localhost", "127.0.0.1"):
            with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
                _handshake(port, client, host)
        _handshake(port, client, "farm.test")  # the chain itself is good


# ---- exports -----------------------------------------------------------------------------------


def test_exports_parse_back_and_hold_no_key(made, tmp_path):
    ca_cert = ca.load_ca_cert(made)
    der = ca_cert.public_bytes(serialization.Encoding.DER)
    pem = ca.export_ca(made, tmp_path / "farm.pem")
    crt = ca.export_ca(made, tmp_path / "farm.crt")
    cer = ca.export_ca(made, tmp_path / "farm.cer")
    profile = ca.export_ca(made, tmp_path / "farm.mobileconfig")
    assert pem.read_bytes() == crt.read_bytes() == (made / ca.CA_CERT).read_bytes()
    assert x509.load_der_x509_certificate(cer.read_bytes()) == ca_cert
    doc = plistlib.loads(profile.read_bytes())
    assert doc["PayloadType"] == "Configuration" and doc["PayloadVersion"] == 1
    (payload,) = doc["PayloadContent"]
    assert payload["PayloadType"] == "com.apple.security.root" and payload["PayloadContent"] == der
    assert x509.load_der_x509_certificate(payload["PayloadContent"]) == ca_cert
    uuids = {doc["PayloadUUID"], payload["PayloadUUID"]}
    assert len(uuids) == 2 and all(uuid.UUID(u) for u in uuids)
    assert payload["PayloadIdentifier"].startswith(doc["PayloadIdentifier"])
    # Re-exporting the same CA gives the same profile identity (iOS replaces instead of adding).
    again = plistlib.loads(ca.export_ca(made, tmp_path / "again.mobileconfig").read_bytes())
    assert again["PayloadUUID"] == doc["PayloadUUID"]
    key_der = serialization.load_pem_private_key((made / ca.CA_KEY).read_bytes(), None).private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    for path in (pem, crt, cer, profile):
        data = path.read_bytes()
        assert b"PRIVATE KEY" not in data and key_der not in data and _mode(path) == 0o644


def test_export_format_comes_from_the_suffix_unless_given(made, tmp_path):
    assert ca.export_format(Path("x.PEM")) == "pem" and ca.export_format(Path("x.cer")) == "der"
    assert ca.export_format(Path("x.txt"), "der") == "der"
    with pytest.raises(ca.CaError, match="cannot tell the format.*--format"):
        ca.export_ca(made, tmp_path / "farm.txt")
    ca.export_ca(made, tmp_path / "farm.txt", "der")
    assert x509.load_der_x509_certificate((tmp_path / "farm.txt").read_bytes()) == ca.load_ca_cert(made)
    with pytest.raises(ca.CaError, match="is a folder"):
        ca.export_ca(made, tmp_path, "pem")


def test_fingerprint_is_colon_hex_sha256_of_the_der(made):
    cert = ca.load_ca_cert(made)
    digest = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest().upper()
    assert ca.fingerprint(cert) == ":".join(digest[i:i + 2] for i in range(0, 64, 2))


# ---- `farm ca ...` ------------------------------------------------------------------------------


@pytest.fixture
def farm(tmp_path, monkeypatch):
    """`farm(*args, code=0)` runs the CLI with its config dir in tmp_path."""
    from typer.testing import CliRunner

    from orchestrator.cli import app

    monkeypatch.setenv("FARM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FARM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FARM_HOST_NAME", "testhost")
    runner = CliRunner()

    def invoke(*args: str, code: int = 0):
        result = runner.invoke(app, list(args))
        assert result.exit_code == code, result.output
        return result

    return invoke


def test_cli_before_init_says_to_run_farm_ca_init(farm, tmp_path):
    for args in (["show"], ["issue", "localhost"], ["export", str(tmp_path / "ca.pem")]):
        out = farm("ca", *args, code=3).output
        assert "no farm CA" in out and "farm ca init" in out and "Traceback" not in out


def test_cli_init_show_issue_export(farm, tmp_path):
    folder = tmp_path / "config" / "ca"
    out = farm("ca", "init").output
    assert "devicefarm CA testhost" in out and str(folder) in out
    assert "already holds a CA" in farm("ca", "init", code=3).output
    out = farm("ca", "init", "--name", "lab CA", "--force", "--name-constraint", "farm.lan",
               "--name-constraint", "127.0.0.1").output
    assert "lab CA" in out and "may vouch for: farm.lan, 127.0.0.1" in out
    fp = ca.fingerprint(ca.load_ca_cert(folder))
    shown = farm("ca", "show").output
    assert fp in shown and "lab CA" in shown and str(folder / ca.CA_KEY) in shown and "no server certificate" in shown

    out = farm("ca", "issue", "farm.lan", "127.0.0.1").output
    assert "issued" in out and "farm.lan, 127.0.0.1" in out
    issued = json.loads(farm("ca", "issue", "127.0.0.1", "--json").output)
    assert issued["issued"] is False and issued["names"] == ["farm.lan", "127.0.0.1"]
    assert "not a host name" in farm("ca", "issue", "https://farm.lan/", code=3).output

    data = json.loads(farm("ca", "show", "--json").output)
    assert data["fingerprint"] == fp and data["folder"] == str(folder) and data["subject"].endswith("CN=lab CA")
    assert data["server"]["names"] == ["farm.lan", "127.0.0.1"] and data["server"]["cert"] == str(folder / "server.pem")

    out = farm("ca", "export", str(tmp_path / "farm.mobileconfig")).output
    assert fp in out and "Certificate Trust Settings" in out
    payload = plistlib.loads((tmp_path / "farm.mobileconfig").read_bytes())["PayloadContent"][0]["PayloadContent"]
    assert x509.load_der_x509_certificate(payload) == ca.load_ca_cert(folder)
    farm("ca", "export", str(tmp_path / "farm.bin"), "--format", "der")
    assert x509.load_der_x509_certificate((tmp_path / "farm.bin").read_bytes()) == ca.load_ca_cert(folder)
    assert "cannot tell the format" in farm("ca", "export", str(tmp_path / "farm.txt"), code=3).output

    os.chmod(folder / ca.CA_KEY, 0o644)
    assert "chmod 600" in farm("ca", "issue", "new.lan", code=3).output


# ---- headless Chromium -------------------------------------------------------------------------


def _chromium() -> str:
    from engine.browser import find_chromium

    chromium = os.environ.get("FARM_CHROMIUM") or find_chromium()
    if not chromium:
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    if not shutil.which("certutil"):
        missing("no certutil (Debian's libnss3-tools): bash scripts/ensure-chromium.sh installs it", "CI needs it")
    return chromium


def _dump_dom(chromium: str, url: str, home: Path, profile: Path) -> subprocess.CompletedProcess:
    """Chromium's DOM of `url` once loaded, with HOME (where it finds its NSS database) and its
    profile both private to the test."""
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME")}
    env["HOME"] = str(home)
    args = [chromium, "--headless=new", "--no-sandbox", "--no-first-run", "--no-default-browser-check",
            "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--dump-dom", url]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=15, stdin=subprocess.DEVNULL)


def _certutil(*args: str) -> None:
    done = subprocess.run(["certutil", *args], capture_output=True, text=True, timeout=15)
    assert done.returncode == 0, f"certutil {' '.join(args)}: {done.stdout}{done.stderr}"


def test_headless_chromium_loads_the_page_only_once_it_trusts_the_ca(made, tmp_path):
    chromium = _chromium()
    home, profile = tmp_path / "home", tmp_path / "chromium-profile"
    home.mkdir()
    exported = ca.export_ca(made, tmp_path / "farm-ca.pem")
    with https_server(ca.server_ssl_context(made, ["localhost", "127.0.0.1"])) as port:
        url = f"https://127.0.0.1:{port}/"
        untrusted = _dump_dom(chromium, url, home, profile)
        assert MARKER not in untrusted.stdout
        assert "ERR_CERT_AUTHORITY_INVALID" in untrusted.stderr, untrusted.stderr[-2000:]

        # What a user does on a Linux desktop: the CA into the NSS database Chromium reads.
        nssdb = home / ".pki" / "nssdb"
        nssdb.mkdir(parents=True)
        _certutil("-N", "-d", f"sql:{nssdb}", "--empty-password")
        _certutil("-A", "-d", f"sql:{nssdb}", "-n", "devicefarm test CA", "-t", "C,,", "-i", str(exported))
        trusted = _dump_dom(chromium, url, home, profile)
        assert MARKER in trusted.stdout, trusted.stderr[-2000:]


# ---- name constraints (issue 27, item 13) ------------------------------------------------------


def test_the_ca_vouches_only_for_the_lab_names(made):
    """`farm ca issue accounts.google.com '*.apple.com'` worked and verified: whoever took ca.key
    could impersonate any site to every lab device. The CA is name-constrained now."""
    for names in (["accounts.google.com"], ["*.apple.com"], ["farm.lan.evil.example"], ["10.0.0.6"],
                  ["localhost", "8.8.8.8"]):
        with pytest.raises(ca.CaError, match="may not vouch for"):
            ca.issue_server_cert(made, names)
    assert ca.issue_server_cert(made, ["pixel.farm.lan", "farm.lan", "10.0.0.5"]).issued  # subdomains too
    assert ca.permitted_names(ca.load_ca_cert(made)) == ["farm.lan", "farm.test", "localhost", "10.0.0.5",
                                                         "10.9.9.9", "127.0.0.1", "::1"]


def _forge_leaf(folder: Path, name: str) -> tuple[bytes, bytes]:
    """A leaf for `name` signed with the CA's own key, as a thief of ca.key would sign it."""
    ca_cert, ca_key = ca.load_ca(folder)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    chain = leaf.public_bytes(serialization.Encoding.PEM) + ca_cert.public_bytes(serialization.Encoding.PEM)
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return chain, pem_key


def test_a_leaf_forged_with_the_stolen_key_for_another_name_fails_verification(made, tmp_path):
    """Even with ca.key, a certificate for a name outside the constraints is refused by a client
    that trusts the farm's CA (OpenSSL enforces name constraints, as browsers do)."""
    client = ssl.create_default_context(cafile=str(ca.export_ca(made, tmp_path / "farm-ca.pem")))
    for name, good in (("accounts.google.com", False), ("farm.lan", True)):
        chain, key = _forge_leaf(made, name)
        (tmp_path / "leaf.pem").write_bytes(chain)
        (tmp_path / "leaf.key").write_bytes(key)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tmp_path / "leaf.pem", tmp_path / "leaf.key")
        with https_server(context) as port:
            if good:
                _handshake(port, client, name)
            else:
                with pytest.raises(ssl.SSLCertVerificationError, match="name constraint|permitted"):
                    _handshake(port, client, name)


def test_cli_rotate_makes_a_new_constrained_ca(farm, tmp_path):
    folder = tmp_path / "config" / "ca"
    farm("ca", "init")
    old = ca.fingerprint(ca.load_ca_cert(folder))
    assert "may vouch for: localhost, testhost, 127.0.0.1" in farm("ca", "show").output
    out = farm("ca", "rotate", "--name-constraint", "farm.lan", "--name-constraint", "10.0.0.5").output
    new = ca.load_ca_cert(folder)
    assert ca.fingerprint(new) != old and ca.fingerprint(new) in out and "rotated" in out
    assert ca.permitted_names(new) == ["farm.lan", "10.0.0.5"]
    assert new.not_valid_after_utc - new.not_valid_before_utc <= dt.timedelta(days=730)
    assert "may not vouch for accounts.google.com" in farm("ca", "issue", "accounts.google.com", code=3).output
