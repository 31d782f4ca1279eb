# PostgreSQL 15 from Debian 12's packages for docker-compose.yml's `postgres` service where the
# official image cannot be pulled (scripts/docker/compose.local.yml). postgres-entrypoint.sh
# keeps the official image's contract as far as the compose file uses it: POSTGRES_USER,
# POSTGRES_PASSWORD and POSTGRES_DB on the first start of an empty data volume, then the scripts
# of /docker-entrypoint-initdb.d; pg_isready on PATH; data in /var/lib/postgresql/data.
ARG BASE_IMAGE=devicefarm-local/debian:bookworm
FROM ${BASE_IMAGE}
# No cluster of the package's own: the entrypoint makes the only one, in the volume.
RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql-common \
    && sed -ri 's/#(create_main_cluster) .*$/\1 = false/' /etc/postgresql-common/createcluster.conf \
    && apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/postgresql/data /var/run/postgresql /docker-entrypoint-initdb.d \
    && chown postgres:postgres /var/lib/postgresql/data /var/run/postgresql \
    && chmod 700 /var/lib/postgresql/data
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
USER postgres
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["sh", "/usr/local/bin/postgres-entrypoint.sh"]
CMD ["postgres"]
