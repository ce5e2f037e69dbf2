# Sourced by e2e/kube/build.sh and e2e/peers/build.sh (which define `say` and `die`): what both
# need to build Go programs from the module proxy with the Go on PATH.

# need_go <what>: Go 1.26 or later on PATH, or die saying that <what> needs it.
need_go() {
    command -v go >/dev/null || die "no go on PATH: install Go 1.26 or later (https://go.dev/dl, or the machine's own)"
    local minor
    minor="$(go env GOVERSION | sed -n 's/^go1\.\([0-9]*\).*/\1/p')"
    [ -n "$minor" ] && [ "$minor" -ge 26 ] || die "$(go env GOVERSION) on PATH: $1 needs Go 1.26 or later"
}

# progress <name> <total> <log>: go build -v names each package as it is compiled (on stdin):
# append every line to <log> and say a progress line every 10 % of <total>.
progress() {
    local n=0 next=0 line
    while IFS= read -r line; do
        printf '%s\n' "$line" >> "$3"
        case "$line" in go:\ *|*:[0-9]*:*|\#*) continue ;; esac
        # cgo's own lines and the main packages' come on top of `go list`'s count: cap it.
        [ "$n" -lt "$2" ] && n=$((n + 1))
        if [ $((n * 100)) -ge $((next * $2)) ]; then
            say "$1: $n/$2 packages compiled"; next=$((next + 10))
        fi
    done
}
