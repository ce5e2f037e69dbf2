#!/usr/bin/env bash
# Create gpuledger's certificates, for clusters without cert-manager, and install them:
#   1. two CAs, gpuledger's and the bundled etcd's own (so that no other certificate opens etcd);
#      each kept when --out-dir already holds it (ca.crt + ca.key, etcd-ca.crt + etcd-ca.key), so
#      a renewal changes no trust,
#   2. from them (openssl, ECDSA P-256, valid --days):
#      - gpuledger-extender.<ns>.svc: the extender's serving certificate (webhook and scheduler
#        port) -> Secret gpuledger-webhook-tls
#      - gpuledger-allocator.<ns>.svc: the allocator's serving certificate -> Secret
#        gpuledger-allocator-tls
#      - kube-scheduler's client certificate for the extender -> Secret gpuledger-scheduler-tls
#      - from etcd's CA, the bundled etcd's member certificate (client and peer port) -> Secret
#        gpuledger-etcd-tls, and the allocator's etcd client certificate -> Secret
#        gpuledger-etcd-client (not with --external-etcd: that Secret is yours then)
#      each Secret of type kubernetes.io/tls with tls.crt, tls.key and ca.crt, as cert-manager
#      writes them,
#   3. the CA as ConfigMap gpuledger-ca (key ca.crt), which every client of the allocator mounts,
#   4. the CA as caBundle of the gpuledger Mutating/ValidatingWebhookConfiguration,
#   5. a rollout restart of gpuledger-scheduler (kube-scheduler reads its extender certificates
#      at start; gpuledger's components and etcd re-read theirs when the files change).
# Run it after `kubectl apply -k ...`, and again before the certificates expire (--days).
# With --no-apply it only writes the files into --out-dir.
set -euo pipefail

NAMESPACE=gpuledger-system
WEBHOOK=gpuledger
DAYS=825
OUT_DIR=""
APPLY=1
ETCD=1

usage() {
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    echo
    echo "usage: $0 [--namespace NS] [--days N] [--out-dir DIR] [--no-apply] [--external-etcd]"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --namespace) NAMESPACE="${2:?--namespace needs a value}"; shift 2 ;;
        --days) DAYS="${2:?--days needs a value}"; shift 2 ;;
        --out-dir) OUT_DIR="${2:?--out-dir needs a value}"; shift 2 ;;
        --no-apply) APPLY=0; shift ;;
        --external-etcd) ETCD=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpuledger-certs.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
case "$DAYS" in
    ''|*[!0-9]*|0) echo "gpuledger-certs.sh: --days must be a positive whole number, not '$DAYS'" >&2; exit 2 ;;
esac
command -v openssl >/dev/null || { echo "gpuledger-certs.sh: openssl not found (apt-get install openssl)" >&2; exit 1; }
if [ "$APPLY" = 1 ]; then
    command -v kubectl >/dev/null || { echo "gpuledger-certs.sh: kubectl not found (or use --no-apply --out-dir DIR)" >&2; exit 1; }
fi

if [ -z "$OUT_DIR" ]; then
    OUT_DIR="$(mktemp -d)"
    trap 'rm -rf "$OUT_DIR"' EXIT
fi
mkdir -p "$OUT_DIR"
chmod 700 "$OUT_DIR"
cd "$OUT_DIR"
umask 077

# ca NAME CN: NAME.crt and NAME.key, a self-signed CA, unless they exist already.
ca() {
    if [ -s "$1.crt" ] && [ -s "$1.key" ]; then
        echo "reusing the CA $OUT_DIR/$1.crt"
        return
    fi
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 \
        -days "$DAYS" -subj "/CN=$2" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -keyout "$1.key" -out "$1.crt" 2>/dev/null
}

# leaf CA NAME CN EXTENDED_KEY_USAGE [SUBJECT_ALT_NAME]: NAME.crt and NAME.key signed by CA.
leaf() {
    local ca="$1" name="$2" cn="$3" eku="$4" san="${5:-}"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 -subj "/CN=$cn" \
        -keyout "$name.key" -out "$name.csr" 2>/dev/null
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature"
        echo "extendedKeyUsage=$eku"
        [ -z "$san" ] || echo "subjectAltName=$san"
    } > "$name.ext"
    openssl x509 -req -in "$name.csr" -CA "$ca.crt" -CAkey "$ca.key" -CAcreateserial -sha256 \
        -days "$DAYS" -extfile "$name.ext" -out "$name.crt" 2>/dev/null
    rm -f "$name.csr" "$name.ext"
}
# The names a Service answers to inside the cluster.
svc_names() {
    local s="$1"
    echo "DNS:$s,DNS:$s.$NAMESPACE,DNS:$s.$NAMESPACE.svc,DNS:$s.$NAMESPACE.svc.cluster.local"
}

ca ca gpuledger-ca
leaf ca extender "gpuledger-extender.$NAMESPACE.svc" serverAuth "$(svc_names gpuledger-extender)"
# localhost and 127.0.0.1: `kubectl port-forward` to a replica (the CLI names the Service with
# --tls-server-name, so these are for other tools).
leaf ca allocator "gpuledger-allocator.$NAMESPACE.svc" serverAuth \
    "$(svc_names gpuledger-allocator),DNS:localhost,IP:127.0.0.1"
# The extender checks that the CA signed it; the name is for kube-scheduler's logs.
leaf ca scheduler "gpuledger-scheduler" clientAuth
if [ "$ETCD" = 1 ]; then
    # One certificate per member set: members dial each other (peer) and are dialled by the
    # allocators (client) by their StatefulSet names; etcd's own health checks use localhost.
    ca etcd-ca gpuledger-etcd-ca
    leaf etcd-ca etcd-member "gpuledger-etcd" serverAuth,clientAuth \
        "DNS:*.gpuledger-etcd.$NAMESPACE.svc,DNS:*.gpuledger-etcd.$NAMESPACE.svc.cluster.local,$(svc_names gpuledger-etcd),DNS:localhost,IP:127.0.0.1"
    leaf etcd-ca etcd-client "gpuledger-allocator" clientAuth
fi
rm -f ca.srl etcd-ca.srl
echo "certificates valid $DAYS days in $OUT_DIR"

[ "$APPLY" = 1 ] || exit 0

# secret NAME LEAF CA
secret() {
    kubectl -n "$NAMESPACE" create secret generic "$1" --type=kubernetes.io/tls \
        --from-file=tls.crt="$2.crt" --from-file=tls.key="$2.key" --from-file=ca.crt="$3.crt" \
        --dry-run=client -o yaml | kubectl apply -f -
}
secret gpuledger-webhook-tls extender ca
secret gpuledger-allocator-tls allocator ca
secret gpuledger-scheduler-tls scheduler ca
if [ "$ETCD" = 1 ]; then
    secret gpuledger-etcd-tls etcd-member etcd-ca
    secret gpuledger-etcd-client etcd-client etcd-ca
fi
kubectl -n "$NAMESPACE" create configmap gpuledger-ca --from-file=ca.crt=ca.crt \
    --dry-run=client -o yaml | kubectl apply -f -
ca_bundle="$(base64 < ca.crt | tr -d '\n')"
for kind in mutatingwebhookconfiguration validatingwebhookconfiguration; do
    kubectl patch "$kind" "$WEBHOOK" --type=json \
        -p "[{\"op\":\"add\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$ca_bundle\"}]"
done
if kubectl -n "$NAMESPACE" get deployment gpuledger-scheduler >/dev/null 2>&1; then
    kubectl -n "$NAMESPACE" rollout restart deployment/gpuledger-scheduler
fi
echo "installed: Secrets gpuledger-{webhook,allocator,scheduler}-tls$([ "$ETCD" = 1 ] && echo ', gpuledger-etcd-tls, gpuledger-etcd-client'), ConfigMap gpuledger-ca, caBundle of the $WEBHOOK webhooks"
