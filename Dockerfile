# nodemedic agent image: `docker build -t nodemedic .`
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent agent
COPY checks checks
COPY recovery recovery
RUN pip install --no-cache-dir --upgrade pip 'setuptools>=68' wheel \
 && pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
LABEL org.opencontainers.image.title="nodemedic" \
      org.opencontainers.image.description="Per-node health agent for GPU/Trainium training clusters"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
 && useradd --system --uid 10001 --home-dir /var/lib/nodemedic --shell /usr/sbin/nologin nodemedic \
 && install -d -o nodemedic -g nodemedic -m 0750 /var/lib/nodemedic
ENV NODEMEDIC_STATE_DIR=/var/lib/nodemedic \
    PYTHONUNBUFFERED=1
# Non-root by default. Reading the host's /dev/kmsg needs CAP_SYSLOG when kernel.dmesg_restrict=1, which a
# non-root container cannot hold in Kubernetes: the DaemonSet then runs this image with runAsUser: 0.
USER 10001
EXPOSE 9870
ENTRYPOINT ["nodemedic", "run"]
