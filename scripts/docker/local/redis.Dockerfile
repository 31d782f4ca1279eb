# Redis from Debian 12's package (7.0) for docker-compose.yml's `redis` service where the
# official image cannot be pulled (scripts/docker/compose.local.yml). Same contract as the
# official image for what the compose file uses: redis-server and redis-cli on PATH, the working
# directory /data (the volume: the append-only file goes there), run by the redis user.
ARG BASE_IMAGE=devicefarm-local/debian:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
