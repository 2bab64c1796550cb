# The gpu-agent image (cluster agent, node agent, control plane, hooks, fake-gpu).
#   With Docker:   make wheels && docker build --build-arg BUILD_COMMIT=$(git rev-parse --short=12 HEAD) \
#                    --build-arg BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ) -t gpu-agent:dev .   (base from a registry)
#   Without one:   make -C ci images   (ci/tools/oci_image.py runs this file on a debootstrap
#                  base: BASE=local resolves to that root filesystem; no network inside the build)
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG BUILD_COMMIT=unknown
ARG BUILD_DATE=unknown
ARG VERSION=dev
COPY build/wheels/ /tmp/wheels/
# Bytecode checked by hash, not by the source's mtime: image layers are written with every mtime
# set to 0 (reproducible archives), which made every timestamp-checked .pyc stale, so each start
# compiled the kubernetes client from source in memory (+80 MiB RSS, seconds of CPU) and could
# not write the result back (read-only root, non-root user). -f: the venv's own pip and setuptools
# were compiled with timestamps when it was made.
RUN python3 -m venv /opt/gpu-agent \
 && /opt/gpu-agent/bin/pip install --quiet --no-index --no-cache-dir --no-compile --find-links=/tmp/wheels gpu-agent \
 && /opt/gpu-agent/bin/python3 -m compileall -q -f -j 0 --invalidation-mode unchecked-hash /opt/gpu-agent/lib \
 && rm -rf /tmp/wheels
ENV PATH=/opt/gpu-agent/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ENV GPU_AGENT_BUILD_COMMIT=${BUILD_COMMIT}
ENV GPU_AGENT_BUILD_DATE=${BUILD_DATE}
LABEL org.opencontainers.image.title=gpu-agent org.opencontainers.image.source=https://example.invalid/gpu-agent \
      org.opencontainers.image.version=${VERSION} org.opencontainers.image.revision=${BUILD_COMMIT} \
      org.opencontainers.image.created=${BUILD_DATE}
USER 65532:65532
ENTRYPOINT ["gpu-agent"]
