# The gpu-agent image (cluster agent, node agent, control plane, hooks, fake-gpu).
#   With Docker:   make wheels && docker build -t gpu-agent:dev .          (base from a registry)
#   Without one:   make -C ci images   (ci/tools/oci_image.py runs this file on a debootstrap
#                  base: BASE=local resolves to that root filesystem; no network inside the build)
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG BUILD_COMMIT=unknown
COPY build/wheels/ /tmp/wheels/
RUN python3 -m venv /opt/gpu-agent \
 && /opt/gpu-agent/bin/pip install --quiet --no-index --no-cache-dir --find-links=/tmp/wheels gpu-agent \
 && rm -rf /tmp/wheels
ENV PATH=/opt/gpu-agent/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ENV GPU_AGENT_BUILD_COMMIT=${BUILD_COMMIT}
LABEL org.opencontainers.image.title=gpu-agent org.opencontainers.image.source=https://example.invalid/gpu-agent
USER 65532:65532
ENTRYPOINT ["gpu-agent"]
