"""The farm's signing key: <config_dir>/farm.key (private, 0600) and farm.pub, the public key
every device checks bundles with. Made on first use, by whichever part of the farm needs it
first (a build, a deploy to a web device, the demo); this module never prints: the CLI says
where the public key must go when it made one."""

from __future__ import annotations

from pathlib import Path

PRIVATE_KEY = "farm.key"
PUBLIC_KEY = "farm.pub"  # copy it to each device's agent root (farm-agent checks bundles with it)


def ensure_farm_key(config_dir: Path) -> tuple[Path, bool]:
    """(the private key's path, whether it was made now), making the pair on first use."""
    from agent.bundle import generate_keypair

    private, public = Path(config_dir) / PRIVATE_KEY, Path(config_dir) / PUBLIC_KEY
    if private.exists():
        return private, False
    # The public key is derived from the private one: a stale farm.pub alone is replaced.
    generate_keypair(private, public, overwrite=True)
    return private, True
