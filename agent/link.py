"""The device link's public surface for the control plane: what a transport on the farm's side
(orchestrator/transports) may call of the device side, beside the wire contract in
agent/protocol.py. `__all__` is the contract, and an import-linter contract in pyproject.toml
keeps orchestrator.transports from importing any other agent module: everything else in agent/
is the agent's own and may change without a transport noticing.

What it holds: receiving and verifying a signed build in an agent root on the transport's own
host (the local and browser transports: what is installed, what a deploy lacks, a file received
a verified chunk at a time, the staged manifest chunks are checked against), the farm key a root
is provisioned with and a page is enrolled with, the farm side of a browser device's hub (its
header and request), the readers of a device's identity and temperatures, and the cool-down wait
before a timed job. A phone is reached through the `farm-agent` command instead (adb), so only
the on-device layout it needs (RESUME) and the Android readers are named for it."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization

from agent.bundle import (
    RESUME,
    BundleError,
    arrived_bytes,
    current_build,
    load_public_key,
    missing_files,
    provision_public_key,
    verify_build,
)
from agent.deviceinfo import adapter_id, collect_android, parse_user_agent, parse_user_agent_os
from agent.hubpage import HUB_KEY_HEADER, hub_request
from agent.jobs import cool_down, write_agent_config
from agent.protocol import MANIFEST, Manifest, ManifestFile
from agent.uploads import receive_chunks, staged_manifest

__all__ = [
    # receiving and verifying a build in an agent root on this host
    "BundleError",
    "RESUME",
    "installed_build_is",
    "lacking_files",
    "receive_chunks",
    "staged_manifest",
    # the farm key
    "provision_public_key",
    "farm_key_bytes",
    # the farm side of a browser device's hub
    "HUB_KEY_HEADER",
    "hub_request",
    # a device's identity and temperatures
    "adapter_id",
    "collect_android",
    "parse_user_agent",
    "parse_user_agent_os",
    # before a timed job
    "cool_down",
    # the agent's configuration (protocol.AgentConfig), which its host's farm writes
    "write_agent_config",
]


def installed_build_is(root: Path, manifest_bytes: bytes) -> bool:
    """Whether the agent root's current build is the one signed as `manifest_bytes` and every
    file of it still hashes as signed (a file damaged in place means: deploy again)."""
    current = current_build(root) if Path(root).is_dir() else None
    return (current is not None and (current.path / MANIFEST).read_bytes() == manifest_bytes
            and not verify_build(root, current))


def lacking_files(manifest: Manifest, root: Path, staging: Path) -> tuple[list[ManifestFile], dict[str, int]]:
    """What a deploy of `manifest` into `root` must send: the files (one per blob) neither the
    root's store nor the staged folder `staging` holds whole, and of those, sha256 -> the bytes
    an interrupted upload already left, verified chunk by chunk (sent again: only the rest)."""
    lacking = missing_files(manifest, root, staged=staging)
    return lacking, arrived_bytes(manifest, root, lacking)


def farm_key_bytes(public_key: Path) -> bytes:
    """The farm's Ed25519 public key (PEM or OpenSSH file) as its 32 raw bytes: what a browser
    device's page is enrolled with and checks signed manifests against (WebCrypto)."""
    return load_public_key(public_key).public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
