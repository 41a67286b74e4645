# Sourced by the Dockerfile's RUN steps. Behind a TLS-inspecting proxy, the extra CA bundle is
# trusted, in addition to the system CAs, for this one step: pip, radixctl's downloads (pip
# underneath) and apt over https. Two ways in, both mounted for the step only, so no layer,
# no history entry and no image config ever holds the CA (make deploy-test checks every layer):
#   - the certificates (*.pem, *.crt) in deploy/ca/ of the build context, bind-mounted at
#     /run/radix-ca: works with docker-compose v1, compose v2 and docker build alike;
#   - the build secret `ca_bundle` (docker build --secret id=ca_bundle,src=corp-ca.pem, or
#     compose v2's build.secrets), at /run/secrets/ca_bundle.
# The merged bundle lives in /tmp and the apt setting in /etc/apt; the step's `ca_cleanup`
# removes both before the step ends.
RADIX_CA_FILES=
for f in /run/secrets/ca_bundle /run/radix-ca/*.pem /run/radix-ca/*.crt; do
    [ -s "$f" ] && RADIX_CA_FILES="$RADIX_CA_FILES $f"
done
if [ -n "$RADIX_CA_FILES" ]; then
    RADIX_CA_MERGED=$(mktemp /tmp/radix-ca.XXXXXX.pem)
    for system in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
        [ -f "$system" ] && cat "$system" >>"$RADIX_CA_MERGED" && break
    done
    # shellcheck disable=SC2086 # a list of paths without spaces
    cat $RADIX_CA_FILES >>"$RADIX_CA_MERGED"
    export PIP_CERT="$RADIX_CA_MERGED" SSL_CERT_FILE="$RADIX_CA_MERGED" REQUESTS_CA_BUNDLE="$RADIX_CA_MERGED"
    printf 'Acquire::https::CaInfo "%s";\n' "$RADIX_CA_MERGED" >/etc/apt/apt.conf.d/99radix-build-ca
fi
ca_cleanup() {
    rm -f /etc/apt/apt.conf.d/99radix-build-ca "${RADIX_CA_MERGED:-/nonexistent}"
}
