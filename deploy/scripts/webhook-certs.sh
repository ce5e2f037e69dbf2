#!/usr/bin/env bash
# Create the admission webhook's TLS certificate for gpuledger-extender and install it:
#   1. a CA and a serving certificate for gpuledger-extender.<namespace>.svc (openssl),
#   2. the Secret gpuledger-webhook-tls (type kubernetes.io/tls) the extender mounts,
#   3. the CA as caBundle of the gpuledger Mutating/ValidatingWebhookConfiguration,
#   4. a rollout restart of the extender, which reads the certificate at start.
# Run it after `kubectl apply -k ...`, and again before the certificate expires (--days).
# With --no-apply it only writes ca.crt, tls.crt and tls.key into --out-dir.
set -euo pipefail

NAMESPACE=gpuledger-system
SERVICE=gpuledger-extender
SECRET=gpuledger-webhook-tls
WEBHOOK=gpuledger
DAYS=825
OUT_DIR=""
APPLY=1

usage() {
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    echo
    echo "usage: $0 [--namespace NS] [--days N] [--out-dir DIR] [--no-apply]"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --namespace) NAMESPACE="${2:?--namespace needs a value}"; shift 2 ;;
        --days) DAYS="${2:?--days needs a value}"; shift 2 ;;
        --out-dir) OUT_DIR="${2:?--out-dir needs a value}"; shift 2 ;;
        --no-apply) APPLY=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "webhook-certs.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
case "$DAYS" in
    ''|*[!0-9]*) echo "webhook-certs.sh: --days must be a whole number, not '$DAYS'" >&2; exit 2 ;;
esac
command -v openssl >/dev/null || { echo "webhook-certs.sh: openssl not found (apt-get install openssl)" >&2; exit 1; }
if [ "$APPLY" = 1 ]; then
    command -v kubectl >/dev/null || { echo "webhook-certs.sh: kubectl not found (or use --no-apply --out-dir DIR)" >&2; exit 1; }
fi

if [ -z "$OUT_DIR" ]; then
    OUT_DIR="$(mktemp -d)"
    trap 'rm -rf "$OUT_DIR"' EXIT
fi
mkdir -p "$OUT_DIR"
cd "$OUT_DIR"

host="$SERVICE.$NAMESPACE.svc"
openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days "$DAYS" \
    -subj "/CN=gpuledger-webhook-ca" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout ca.key -out ca.crt 2>/dev/null
openssl req -newkey rsa:2048 -nodes -sha256 -subj "/CN=$host" \
    -keyout tls.key -out tls.csr 2>/dev/null
printf '%s\n' \
    "basicConstraints=CA:FALSE" \
    "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=serverAuth" \
    "subjectAltName=DNS:$SERVICE,DNS:$SERVICE.$NAMESPACE,DNS:$host,DNS:$host.cluster.local" \
    > tls.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 \
    -days "$DAYS" -extfile tls.ext -out tls.crt 2>/dev/null
rm -f tls.csr tls.ext ca.srl
echo "certificate for $host valid $DAYS days in $OUT_DIR"

[ "$APPLY" = 1 ] || exit 0

kubectl -n "$NAMESPACE" create secret tls "$SECRET" --cert=tls.crt --key=tls.key \
    --dry-run=client -o yaml | kubectl apply -f -
ca_bundle="$(base64 < ca.crt | tr -d '\n')"
for kind in mutatingwebhookconfiguration validatingwebhookconfiguration; do
    kubectl patch "$kind" "$WEBHOOK" --type=json \
        -p "[{\"op\":\"add\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$ca_bundle\"}]"
done
kubectl -n "$NAMESPACE" rollout restart deployment/"$SERVICE"
echo "installed: secret $NAMESPACE/$SECRET, caBundle of the $WEBHOOK webhooks; extender restarting"
