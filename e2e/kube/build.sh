#!/usr/bin/env bash
# Build the real-Kubernetes tier's binaries from the Go module proxy, with the Go on PATH, and
# cache them: kube-apiserver, kube-scheduler, kube-controller-manager, kubelet and kubectl of
# Kubernetes $KUBE_VERSION (default below), containerd 2 with its runc shim and ctr, and etcd
# 3.6 for the API server. Stock upstream code: nothing is patched.
#
#   e2e/kube/build.sh                     # the default version
#   KUBE_VERSION=1.35.4 e2e/kube/build.sh # another release (1.35 or later)
#
# k8s.io/kubernetes requires its staging modules (k8s.io/api, k8s.io/client-go, ...) at v0.0.0
# and replaces them with ./staging/..., which Go ignores in a dependency (kubernetes#79384); a
# scratch module replaces each of them, as listed by the go.mod the proxy serves, with its
# published v0.<minor>.<patch>. The version is stamped as Kubernetes' own build does.
#
# Cache: $GPULEDGER_CACHE (default ~/.cache/gpuledger)/kube/v<kube>-containerd<c>-etcd<e>-r<RECIPE>/
# (540 MB), so a second run starts at once, and Go's module cache beside it (go/mod, 1.4 GB), so
# a build of another version downloads only what differs. Go's build cache (4.6 GB for one
# version) is removed after a successful build: nothing else reuses it. Progress goes to
# stderr; stdout is only the directory that holds the binaries.
set -euo pipefail
KUBE_VERSION="${KUBE_VERSION:-1.37.2}"
KUBE_VERSION="${KUBE_VERSION#v}"
CONTAINERD_VERSION="${CONTAINERD_VERSION:-2.2.9}"
ETCD_VERSION="${ETCD_VERSION:-3.6.16}"
CACHE="${GPULEDGER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuledger}"
# Bump when the way the binaries are built changes (flags, components): the cache key has it.
RECIPE=1
KUBE_CMDS=(kube-apiserver kube-scheduler kube-controller-manager kubelet kubectl)
CONTAINERD_CMDS=(containerd containerd-shim-runc-v2 ctr)
COMPONENTS=("${KUBE_CMDS[@]}" "${CONTAINERD_CMDS[@]}" etcd)

say() { printf '[kube-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }
# shellcheck source=e2e/go-build.sh
. "$(dirname "$0")/../go-build.sh"
complete() { local c; for c in "${COMPONENTS[@]}"; do [ -x "$1/$c" ] || return 1; done; }

[[ "$KUBE_VERSION" =~ ^1\.([0-9]+)\.([0-9]+)$ ]] || die "KUBE_VERSION=$KUBE_VERSION is not a release like 1.37.2"
minor="${BASH_REMATCH[1]}"
[ "$minor" -ge 35 ] || die "KUBE_VERSION=$KUBE_VERSION: the tier runs Kubernetes 1.35 or later"
staging="v0.$minor.${BASH_REMATCH[2]}"

out="$CACHE/kube/v$KUBE_VERSION-containerd$CONTAINERD_VERSION-etcd$ETCD_VERSION-r$RECIPE"
if complete "$out"; then echo "$out"; exit 0; fi

need_go "Kubernetes 1.$minor"

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod GOPROXY="${GOPROXY:-$(go env GOPROXY)}"
export GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build"
mkdir -p "$GOMODCACHE" "$GOCACHE"

start=$(date +%s)
work="$(mktemp -d "${TMPDIR:-/tmp}/gpuledger-kube-build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
say "building Kubernetes $KUBE_VERSION, containerd $CONTAINERD_VERSION and etcd $ETCD_VERSION into $out"
say "cold on 2 cores: about 30-40 minutes and 1.5 GB of modules; cached afterwards"

# gobuild <name> <module dir> <ldflags> <tags> <package>...: into $work/bin
gobuild() {
    local name="$1" dir="$2" ld="$3" tags="$4"; shift 4
    local total log="$work/build-$name.log"
    total="$(cd "$dir" && go list -tags "$tags" -deps "$@" 2>>"$log" | sort -u | wc -l)"
    say "$name: go build $* ($total packages, less those already compiled)"
    if ! (cd "$dir" && go build -v -trimpath -tags "$tags" -ldflags "$ld" -o "$work/bin/" "$@") 2>&1 \
            | progress "$name" "$total" "$log"; then
        tail -30 "$log" >&2; die "$name: go build failed (log above)"
    fi
}
# scratch <dir> <module@version>: a module that requires it, ready for go build
scratch() {
    mkdir -p "$1"
    printf 'module gpuledger.invalid/build\n\ngo 1.26.0\n' > "$1/go.mod"
    (cd "$1" && go mod edit -require="$2")
}

mkdir -p "$work/bin"

# --- Kubernetes --------------------------------------------------------------------------------
say "kubernetes: fetching k8s.io/kubernetes@v$KUBE_VERSION's go.mod"
gomod="$(go mod download -json "k8s.io/kubernetes@v$KUBE_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
[ -f "$gomod" ] || die "k8s.io/kubernetes@v$KUBE_VERSION: the module proxy served no go.mod (is $GOPROXY reachable?)"
k="$work/kubernetes"
scratch "$k" "k8s.io/kubernetes@v$KUBE_VERSION"
replaced=0
for m in $(sed -n 's|^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => \./staging/.*|\1|p' "$gomod"); do
    (cd "$k" && go mod edit -replace="$m=$m@$staging")
    replaced=$((replaced + 1))
done
[ "$replaced" -gt 0 ] || die "k8s.io/kubernetes@v$KUBE_VERSION's go.mod replaces no staging module: the recipe needs a look"
say "kubernetes: $replaced staging modules at $staging; resolving the module graph (downloads)"
# The cmd packages are main packages, which Go refuses to import: resolve them with `go list`.
(cd "$k" && go list -deps $(printf 'k8s.io/kubernetes/cmd/%s ' "${KUBE_CMDS[@]}") >/dev/null 2>"$work/resolve.log") \
    || { tail -30 "$work/resolve.log" >&2; die "kubernetes: resolving the module graph failed"; }
ld="-s -w"
for kv in "gitVersion=v$KUBE_VERSION" "gitMajor=1" "gitMinor=$minor" "gitTreeState=clean" \
          "buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"; do
    ld="$ld -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
done
gobuild kubernetes "$k" "$ld" "" $(printf 'k8s.io/kubernetes/cmd/%s ' "${KUBE_CMDS[@]}")

# --- containerd 2 (CDI is on by default in its CRI plugin) --------------------------------------
c="$work/containerd"
say "containerd: resolving github.com/containerd/containerd/v2@v$CONTAINERD_VERSION"
scratch "$c" "github.com/containerd/containerd/v2@v$CONTAINERD_VERSION"
(cd "$c" && go list -tags no_btrfs,no_devmapper,no_zfs -deps github.com/containerd/containerd/v2/cmd/containerd \
    >/dev/null 2>"$work/resolve-c.log") || { tail -30 "$work/resolve-c.log" >&2; die "containerd: resolving failed"; }
gobuild containerd "$c" "-s -w -X github.com/containerd/containerd/v2/version.Version=v$CONTAINERD_VERSION" \
    no_btrfs,no_devmapper,no_zfs \
    github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
    github.com/containerd/containerd/v2/cmd/ctr

# --- etcd 3.6, for the API server (the ledger's etcd is the machine's own) ------------------------
e="$work/etcd"
say "etcd: resolving go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
scratch "$e" "go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
(cd "$e" && go list -deps go.etcd.io/etcd/server/v3 >/dev/null 2>"$work/resolve-e.log") \
    || { tail -30 "$work/resolve-e.log" >&2; die "etcd: resolving failed"; }
gobuild etcd "$e" "-s -w" "" go.etcd.io/etcd/server/v3
# Go names a /vN module's binary after the element before the version: server.
mv "$work/bin/server" "$work/bin/etcd"

complete "$work/bin" || die "a binary is missing from $work/bin: $(ls "$work/bin" | tr '\n' ' ')"
mkdir -p "$(dirname "$out")"
rm -rf "$out.tmp" && mv "$work/bin" "$out.tmp" && rm -rf "$out" && mv "$out.tmp" "$out"
go clean -cache
say "done in $(( $(date +%s) - start )) s: $(du -sh "$out" | cut -f1) in $out ($(du -sh "$CACHE/go" | cut -f1) of Go caches beside it)"
echo "$out"
