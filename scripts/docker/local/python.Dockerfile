# A stand-in for python:3.11-slim-bookworm where no registry is reachable: Debian 12's own
# Python 3.11 on the debootstrap base that scripts/docker/local/build.sh imports. pip installs as
# root into /usr/local, as in the official image (Debian's PEP 668 marker removed).
#   docker build -f scripts/docker/local/python.Dockerfile -t devicefarm-local/python:3.11-bookworm scripts/docker/local
ARG BASE_IMAGE=devicefarm-local/debian:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3.11/EXTERNALLY-MANAGED \
    && ln -s /usr/bin/python3 /usr/local/bin/python \
    && ln -s /usr/bin/pip3 /usr/local/bin/pip
CMD ["python3"]
