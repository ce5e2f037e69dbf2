#!/usr/bin/env bash
# Build the peers — the systems a user would pick instead of gpuledger — from their source
# archives, with the Go on PATH and every dependency from the Go module proxy, and cache them:
# HAMi's `scheduler` (scheduler extender + admission webhook) and kubernetes-sigs/
# dra-example-driver's `dra-example-controller` and `dra-example-kubeletplugin`. Test material
# only: nothing of them goes into the product. Stock upstream code: nothing is patched.
#
#   e2e/peers/build.sh                       # archives from $GPULEDGER_PEERS_SRC
#   GPULEDGER_PEERS_SRC=/path/to/peers e2e/peers/build.sh
#
# The archives (HAMi-v$HAMI_VERSION.tar.gz, dra-example-driver-$DRAEX_COMMIT.tar.gz) are read from
# $GPULEDGER_PEERS_SRC (default: testdata/peers of the checkout, where the project keeps
# them: 3.7 MB, Apache-2.0, test material) and extracted into a temporary directory, never
# into the repository.
#
# Cache: $GPULEDGER_CACHE (default ~/.cache/gpuledger)/peers/hami<v>-draex<c>-r<RECIPE>/, with
# hami/scheduler and draex/dra-example-{controller,kubeletplugin} (about 200 MB); Go's module
# cache is the one e2e/kube/build.sh fills (go/mod), Go's build cache is removed afterwards.
# Progress goes to stderr; stdout is only the directory that holds the binaries, which the e2e
# harness also finds by itself (or through GPULEDGER_PEERS_BIN).
set -euo pipefail
HAMI_VERSION="${HAMI_VERSION:-2.10.0}"
DRAEX_COMMIT="${DRAEX_COMMIT:-31914ce}"
CACHE="${GPULEDGER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuledger}"
here="$(cd "$(dirname "$0")" && pwd)"
SRC="${GPULEDGER_PEERS_SRC:-$here/../../testdata/peers}"
# Bump when the way the binaries are built changes (flags, components): the cache key has it.
RECIPE=1
COMPONENTS=(hami/scheduler draex/dra-example-controller draex/dra-example-kubeletplugin)

say() { printf '[peers-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }
# shellcheck source=e2e/go-build.sh
. "$(dirname "$0")/../go-build.sh"
complete() { local c; for c in "${COMPONENTS[@]}"; do [ -x "$1/$c" ] || return 1; done; }

out="$CACHE/peers/hami$HAMI_VERSION-draex$DRAEX_COMMIT-r$RECIPE"
if complete "$out"; then echo "$out"; exit 0; fi

hami_tgz="$SRC/HAMi-v$HAMI_VERSION.tar.gz"
draex_tgz="$SRC/dra-example-driver-$DRAEX_COMMIT.tar.gz"
for a in "$hami_tgz" "$draex_tgz"; do
    [ -f "$a" ] || die "no $a: set GPULEDGER_PEERS_SRC to the directory that holds the peers' source archives (HAMi-v$HAMI_VERSION.tar.gz from github.com/Project-HAMi/HAMi, dra-example-driver-$DRAEX_COMMIT.tar.gz from github.com/kubernetes-sigs/dra-example-driver)"
done
need_go "the peers"

export GOTOOLCHAIN=local GOFLAGS=-mod=mod GOPROXY="${GOPROXY:-$(go env GOPROXY)}"
export GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build-peers"
mkdir -p "$GOMODCACHE" "$GOCACHE"

start=$(date +%s)
work="$(mktemp -d "${TMPDIR:-/tmp}/gpuledger-peers-build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
say "building HAMi $HAMI_VERSION's scheduler and dra-example-driver $DRAEX_COMMIT into $out"
say "cold on 2 cores: about 6-8 minutes; cached afterwards"

# peer <name> <archive> <subdir> <package>...: extract, resolve and build into $work/bin/<name>/
peer() {
    local name="$1" tgz="$2" sub="$3"; shift 3
    local dir="$work/src/$sub" log="$work/build-$name.log" total
    mkdir -p "$work/src" "$work/bin/$name"
    say "$name: extracting $(basename "$tgz")"
    tar -xzf "$tgz" -C "$work/src" || die "$name: cannot extract $tgz"
    [ -f "$dir/go.mod" ] || die "$name: $tgz holds no $sub/go.mod"
    say "$name: resolving the module graph (downloads)"
    (cd "$dir" && go list -deps "$@" >/dev/null 2>"$log") \
        || { tail -30 "$log" >&2; die "$name: resolving the module graph failed"; }
    total="$(cd "$dir" && go list -deps "$@" 2>>"$log" | sort -u | wc -l)"
    say "$name: go build $* ($total packages, less those already compiled)"
    if ! (cd "$dir" && go build -v -trimpath -ldflags "-s -w" -o "$work/bin/$name/" "$@") 2>&1 \
            | progress "$name" "$total" "$log"; then
        tail -30 "$log" >&2; die "$name: go build failed (log above)"
    fi
}

peer hami "$hami_tgz" "HAMi-v$HAMI_VERSION" ./cmd/scheduler
peer draex "$draex_tgz" "dra-example-driver-$DRAEX_COMMIT" \
    ./cmd/dra-example-controller ./cmd/dra-example-kubeletplugin

complete "$work/bin" || die "a binary is missing from $work/bin: $(cd "$work/bin" && ls -R | tr '\n' ' ')"
mkdir -p "$(dirname "$out")"
rm -rf "$out.tmp" && mv "$work/bin" "$out.tmp" && rm -rf "$out" && mv "$out.tmp" "$out"
go clean -cache
rm -rf "$GOCACHE"
say "done in $(( $(date +%s) - start )) s: $(du -sh "$out" | cut -f1) in $out"
echo "$out"
