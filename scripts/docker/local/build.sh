#!/usr/bin/env bash
# The base images docker-compose.yml needs on a machine that reaches no container registry, made
# from Debian's own packages (scripts/docker/compose.local.yml points the stack at them):
#   devicefarm-local/debian:bookworm      a minbase root file system made by debootstrap, imported
#   devicefarm-local/python:3.11-bookworm  the farm image's base (Dockerfile's PYTHON_IMAGE)
#   devicefarm-local/redis:7.0             Debian's redis-server
#   devicefarm-local/postgres:15           Debian's postgresql-15, postgres-entrypoint.sh
# Idempotent: the debootstrap base is made only when missing (REBUILD_BASE=1 remakes it), the
# others are `docker build`s whose layers are cached. Runs as root, against a running dockerd.
# The legacy builder builds them (DOCKER_BUILDKIT=0): the docker CLI needs no buildx plugin then.
# Debian's mirror: DEBIAN_MIRROR (default http://deb.debian.org/debian); the security suite comes
# from deb.debian.org/debian-security. The host's own CA certificates
# (/usr/local/share/ca-certificates, e.g. a TLS-inspecting proxy's) are trusted in the base, as
# on the host, so that pip reaches PyPI from the builds.
set -euo pipefail
cd "$(dirname "$0")"

suite=bookworm
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
base=devicefarm-local/debian:$suite

if [ -n "${REBUILD_BASE:-}" ] || ! docker image inspect "$base" >/dev/null 2>&1; then
    if ! command -v debootstrap >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap
    fi
    root="$(mktemp -d /var/tmp/devicefarm-rootfs.XXXXXX)"
    trap 'rm -rf "$root"' EXIT
    echo "debootstrap $suite from $mirror"
    debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
        || { tail -n 20 "$root.log"; rm -f "$root.log"; exit 1; }
    rm -f "$root.log"
    cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
EOF
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        mkdir -p "$root/usr/local/share/ca-certificates"
        cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    fi
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar --numeric-owner -C "$root" -c . | docker import -c 'CMD ["bash"]' - "$base" >/dev/null
    echo "imported $base"
fi

for spec in python:devicefarm-local/python:3.11-bookworm redis:devicefarm-local/redis:7.0 \
            postgres:devicefarm-local/postgres:15; do
    file="${spec%%:*}.Dockerfile"
    tag="${spec#*:}"
    DOCKER_BUILDKIT=0 docker build --quiet --build-arg "BASE_IMAGE=$base" -f "$file" -t "$tag" . \
        2> >(grep -v -e DEPRECATED -e "BuildKit is currently disabled" -e "environment-variable" \
             -e "^ *$" >&2) >/dev/null
    echo "built $tag"
done
