# The store of the proxies' shared remote KV tier (docs/scale-out.md, "Deploy"), from the base
# distribution's package, for the compose stack's `fleet` profile and deploy/k8s/valkey: no
# registry but the distribution's archive is needed to build it.
# valkey-server where the base has it (Debian 13), else redis-server: Debian 12 has no Valkey,
# only Redis 7.0, which Valkey forked from (7.2) and which speaks the same protocol; the
# proxy's remote-tier tests run against it. BASE=debian:trixie-slim (or a local trixie base)
# for Valkey.
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
    && if apt-cache show valkey-server >/dev/null 2>&1; then pkgs="valkey-server valkey-tools"; \
       else pkgs="redis-server redis-tools"; fi \
    && apt-get install -y --no-install-recommends $pkgs \
    && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d && ca_cleanup \
    && useradd --system --uid 10001 --user-group --home-dir /nonexistent --shell /usr/sbin/nologin radix \
    && install -d -o 10001 -g 10001 -m 0700 /run/valkey
# The entrypoint writes the config (with the password, from a file) into /run/valkey, mounted
# as a tmpfs by compose and as a memory emptyDir by Kubernetes; nothing else is written.
COPY deploy/docker/valkey-entrypoint.sh /usr/local/bin/radix-valkey
COPY deploy/docker/valkey-ping.sh /usr/local/bin/radix-valkey-ping
# The images' user: the compose secrets are host files readable by uid 10001 (the header of
# deploy/docker-compose.yml), the password file included.
USER 10001:10001
EXPOSE 6379
ENTRYPOINT ["/usr/local/bin/radix-valkey"]
