# Prometheus from the base distribution's package (Debian's `prometheus`), for the compose
# stack: no registry but the distribution's archive is needed to build it.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
# policy-rc.d: the package's maintainer scripts must not try to start a service in the build.
RUN --mount=type=secret,id=ca_bundle,required=false \
    --mount=type=bind,source=deploy/ca,target=/run/radix-ca \
    --mount=type=bind,source=deploy/docker/ca-env.sh,target=/opt/radix-build/ca-env.sh \
    . /opt/radix-build/ca-env.sh \
    && printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && export DEBIAN_FRONTEND=noninteractive \
    && apt-get update \
    && apt-get install -y --no-install-recommends prometheus curl \
    && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d && ca_cleanup \
    && install -d -o prometheus -g prometheus /prometheus
USER prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
