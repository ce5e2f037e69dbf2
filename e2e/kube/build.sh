#!/usr/bin/env bash
# Build kube-apiserver, kube-scheduler, kubectl and kubelet from Debian bookworm's Kubernetes
# source package (1.20.2) with Debian's Go, and cache them. `kubelet` carries the device-plugin
# dial patch next to this script; `kubelet-unpatched` is the stock one, which no tonic device
# plugin can serve (the test tier shows what the node agent does about it). `kube-scheduler`
# carries the extender-preemption patch (kubernetes#102971), without which it never calls an
# extender's `preempt` verb. Prints the directory holding the binaries.
#
# Cache: $GPULEDGER_CACHE (default ~/.cache/gpuledger)/kube/<source version>-<patches' sha256[:12]>-r<RECIPE>/,
# so a second run, or a run after a change that is not the source, a patch or the recipe,
# starts at once.
# Offline with an empty apt list, the newest cached build with these patches is used.
# Progress goes to stderr; stdout is only the directory.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PATCH="$here/kubelet-device-plugin-authority.patch"
SCHED_PATCH="$here/kube-scheduler-extender-preemption.patch"
CACHE="${GPULEDGER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuledger}"
COMPONENTS=(kube-apiserver kube-scheduler kubectl kubelet-unpatched kubelet)
# Bump when the way the binaries are built changes (flags, components): the cache key has it.
RECIPE=2
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo

say() { printf '[kube-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }

need_pkgs() {
    local missing=() p
    for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    say "installing ${missing[*]} (apt)"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >&2
}

complete() { local c; for c in "${COMPONENTS[@]}"; do [ -x "$1/$c" ] || return 1; done; }

patch_key="$(cat "$PATCH" "$SCHED_PATCH" | sha256sum | cut -c1-12)"

# A deb-src line for the machine's own Debian mirror, in lists of our own: the system's apt
# configuration is left as it is.
apt_dir="$CACHE/apt-src"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
mirror="$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
[ -n "$mirror" ] || mirror="$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)"
[ -n "$mirror" ] || die "no Debian mirror found in /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list"
echo "deb-src $mirror bookworm main" > "$apt_dir/sources.list"
APT_OPTS=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=-"
          -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache")

version=""
if apt-get "${APT_OPTS[@]}" update -qq >/dev/null 2>&1; then
    version="$(apt-cache "${APT_OPTS[@]}" showsrc kubernetes 2>/dev/null | awk '/^Version:/{print $2}' | sort -V | tail -1)"
fi
if [ -z "$version" ]; then
    # Offline: any earlier build with the same patches will do.
    cached="$(ls -d "$CACHE"/kube/*-"$patch_key-r$RECIPE" 2>/dev/null | sort -V | tail -1 || true)"
    if [ -n "$cached" ] && complete "$cached"; then say "apt unreachable; using $cached"; echo "$cached"; exit 0; fi
    die "cannot read the kubernetes source package's version from $mirror (deb-src), and nothing is cached"
fi
out="$CACHE/kube/$version-$patch_key-r$RECIPE"
if complete "$out"; then echo "$out"; exit 0; fi

start=$(date +%s)
say "building Kubernetes $version (patch $patch_key) into $out; about 10-15 minutes on 2 cores"
need_pkgs golang-go rsync golang-github-modern-go-reflect2-dev dpkg-dev
reflect2=/usr/share/gocode/src/github.com/modern-go/reflect2
[ -d "$reflect2" ] || die "$reflect2 missing (Debian package golang-github-modern-go-reflect2-dev)"

work="$(mktemp -d "${TMPDIR:-/tmp}/gpuledger-kube-build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cd "$work"
say "fetching the source package"
apt-get "${APT_OPTS[@]}" source --download-only "kubernetes=$version" >/dev/null 2>&1 \
    || die "apt-get source kubernetes=$version failed"
dpkg-source -x kubernetes_*.dsc src >/dev/null 2>&1 || die "dpkg-source -x failed"
rm -f kubernetes_*

# The vendored reflect2 v1.0.1 faults under go >= 1.18; Debian's newer copy works.
rm -rf src/vendor/github.com/modern-go/reflect2
cp -r "$reflect2" src/vendor/github.com/modern-go/

# GOPATH mode: the tree must sit at $GOPATH/src/k8s.io/kubernetes. Nothing is fetched.
mkdir -p gopath/src/k8s.io && ln -s "$work/src" gopath/src/k8s.io/kubernetes
export GOPATH="$work/gopath" GOCACHE="$work/gocache" GO111MODULE=off CGO_ENABLED=0 GOPROXY=off GOFLAGS=
cd gopath/src/k8s.io/kubernetes

say "generating the OpenAPI definitions (make gen_openapi)"
make gen_openapi >"$work/gen_openapi.log" 2>&1 || { tail -30 "$work/gen_openapi.log" >&2; die "make gen_openapi failed"; }

# What `kubectl version` and the node's kubeletVersion report (hack/lib/version.sh sets the
# same variables): Debian's "1.20.5+really1.20.2-1.1+deb12u1" is upstream 1.20.2.
upstream="${version#*really}"; upstream="${upstream%%-*}"; upstream="${upstream#*:}"
minor="${upstream#*.}"; minor="${minor%%.*}"
ldflags="-s -w"
for kv in "gitVersion=v$upstream" "gitMajor=${upstream%%.*}" "gitMinor=$minor" "gitTreeState=clean" \
          "gitCommit=debian-$version" "buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"; do
    for pkg in client-go/pkg/version component-base/version; do
        ldflags="$ldflags -X k8s.io/kubernetes/vendor/k8s.io/$pkg.$kv"
    done
done

# go build -v names each package as it is compiled: a progress line every 10 %.
progress() { # progress <name> <total> <log>: count the names on stdin
    local n=0 next=0 line
    while IFS= read -r line; do
        printf '%s\n' "$line" >> "$3"
        n=$((n + 1))
        if [ $((n * 100)) -ge $((next * $2)) ]; then
            say "$1: $n/$2 packages compiled"; next=$((next + 10))
        fi
    done
}
build() { # build <output name> <cmd dir>
    local total; total="$(go list -deps "./cmd/$2" 2>/dev/null | wc -l)"
    say "go build ./cmd/$2 -> $1 ($total packages, less those already compiled)"
    if ! go build -v -ldflags "$ldflags" -o "$work/bin/$1" "./cmd/$2" 2>&1 | progress "$1" "$total" "$work/build-$1.log" \
            || [ ! -x "$work/bin/$1" ]; then
        tail -30 "$work/build-$1.log" >&2; die "go build ./cmd/$2 failed"
    fi
}
mkdir -p "$work/bin"
for c in kube-apiserver kubectl; do build "$c" "$c"; done
build kubelet-unpatched kubelet
say "applying $(basename "$SCHED_PATCH")"
patch -p1 --quiet < "$SCHED_PATCH" || die "the kube-scheduler patch does not apply to $version"
build kube-scheduler kube-scheduler
say "applying $(basename "$PATCH")"
patch -p1 --quiet < "$PATCH" || die "the kubelet patch does not apply to $version"
build kubelet kubelet

mkdir -p "$(dirname "$out")"
rm -rf "$out.tmp" && mv "$work/bin" "$out.tmp" && rm -rf "$out" && mv "$out.tmp" "$out"
cp "$PATCH" "$SCHED_PATCH" "$out/"
say "done in $(( $(date +%s) - start )) s: $(du -sh "$out" | cut -f1) in $out"
echo "$out"
