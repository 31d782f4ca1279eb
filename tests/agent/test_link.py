"""agent/link.py, the device link's public surface for the transports: every name of its
contract is there and documented, and the functions of its own do what a transport relies on."""

from __future__ import annotations

import base64

from cryptography.hazmat.primitives import serialization

import agent.link as link
from agent.bundle import generate_keypair, install_bundle, provision_public_key
from agent.packing import build_bundle
from agent.protocol import MANIFEST


def test_every_name_of_the_contract_is_public_and_documented():
    for name in link.__all__:
        assert not name.startswith("_") and hasattr(link, name), name
        value = getattr(link, name)
        if callable(value) and not isinstance(value, type):
            assert (value.__doc__ or "").strip(), f"agent.link.{name} has no docstring"


def test_farm_key_bytes_is_the_raw_ed25519_key(tmp_path):
    key = generate_keypair(tmp_path / "farm.key", tmp_path / "farm.pub")
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert link.farm_key_bytes(tmp_path / "farm.pub") == raw and len(raw) == 32
    assert base64.urlsafe_b64encode(raw)  # what an enrolment URL carries


def test_a_deploy_lacks_what_the_root_does_not_hold_and_an_installed_build_is_known(tmp_path):
    key = generate_keypair(tmp_path / "farm.key", tmp_path / "farm.pub")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    (src / "b.txt").write_text("b\n")
    manifest = build_bundle({"files": src}, tmp_path / "bundle", "b1", "0.1.0", key)
    root, staging = tmp_path / "root", tmp_path / "root" / "incoming" / "b1"
    manifest_bytes = (tmp_path / "bundle" / MANIFEST).read_bytes()
    lacking, arrived = link.lacking_files(manifest, root, staging)
    assert {f.path for f in lacking} == {"files/a.txt", "files/b.txt"} and arrived == {}
    assert not link.installed_build_is(root, manifest_bytes)
    provision_public_key(root, tmp_path / "farm.pub")
    install_bundle(tmp_path / "bundle", root)
    assert link.installed_build_is(root, manifest_bytes)
    assert link.lacking_files(manifest, root, staging) == ([], {})
    damaged = root / "builds" / "b1" / "files" / "a.txt"
    damaged.chmod(0o644)
    damaged.write_text("x\n")  # damaged in place: deploy again
    assert not link.installed_build_is(root, manifest_bytes)
