# Sourced by the Dockerfile's RUN steps. When the optional build secret `ca_bundle` is given
# (docker build --secret id=ca_bundle,src=corp-ca.pem), trust it in addition to the system
# CAs for this one step: pip, radixctl's downloads (pip underneath) and apt over https.
# Nothing of it stays in a layer: the secret is mounted for the step only, the merged bundle
# lives in /tmp and is removed by the step's `ca_cleanup`.
RADIX_CA=/run/secrets/ca_bundle
if [ -s "$RADIX_CA" ]; then
    RADIX_CA_MERGED=$(mktemp /tmp/radix-ca.XXXXXX.pem)
    for system in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
        [ -f "$system" ] && cat "$system" >>"$RADIX_CA_MERGED" && break
    done
    cat "$RADIX_CA" >>"$RADIX_CA_MERGED"
    export PIP_CERT="$RADIX_CA_MERGED" SSL_CERT_FILE="$RADIX_CA_MERGED" REQUESTS_CA_BUNDLE="$RADIX_CA_MERGED"
    printf 'Acquire::https::CaInfo "%s";\n' "$RADIX_CA_MERGED" >/etc/apt/apt.conf.d/99radix-build-ca
fi
ca_cleanup() {
    rm -f /etc/apt/apt.conf.d/99radix-build-ca "${RADIX_CA_MERGED:-/nonexistent}"
}
