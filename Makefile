# gpuledger — the two commands: `make demo` and `make test`.
# Both install what is missing (Debian: protobuf-compiler for the protobuf build, etcd-server
# for the real etcd every test and the demo start), then build.

SHELL := /bin/bash
CARGO ?= cargo
DEMO_FLAGS ?=
# Incremental compilation pays off only on rebuilds, and its cache is the largest thing a clean
# build leaves in target/ (4 GB after `make test`): off unless asked for (CARGO_INCREMENTAL=1).
export CARGO_INCREMENTAL ?= 0
# The one debug build the tests use. With every target, so with the features the tests'
# dev-dependencies turn on, and so every later `cargo test --workspace …` finds it built: a plain
# `cargo build`, or `cargo test -p X`, resolves other features and builds the workspace again.
BUILD_FOR_TESTS := $(CARGO) build --workspace --all-targets
# CI runs the demo on the debug build `make test` made (saves a second, release, build).
DEMO_PROFILE ?= release
# `make image` tag; push it to your registry and set it in deploy/ (see deploy/README.md).
IMAGE ?= gpuledger:0.1.0
# The dependency checkers `make test` runs, built from crates.io when missing or of another version.
CARGO_MACHETE_VERSION := 0.9.2
CARGO_DENY_VERSION := 0.20.2
# Where cargo-deny keeps the RustSec advisory database (its default; it follows CARGO_HOME).
ADVISORY_DBS := $(or $(CARGO_HOME),$(HOME)/.cargo)/advisory-dbs

.PHONY: all deps build release test fmt-check clippy dev-tools machete deny demo chaos bench bench-allocator bench-failover bench-replay clean deploy-check gpu-check image install-plugin test-deps test-e2e e2e-deps

all: build

# $(call apt_install,command:package ...): apt-get install the packages whose command is missing
# (with sudo when not root), then fail with a clear message if one is still missing.
define apt_install
missing=""; \
for pair in $(1); do command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
if [ -n "$$missing" ]; then \
  echo "installing:$$missing"; \
  SUDO=""; [ "$$(id -u)" -ne 0 ] && SUDO=sudo; \
  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
fi; \
for pair in $(1); do command -v $${pair%%:*} >/dev/null 2>&1 || { echo "could not install: $${pair#*:}" >&2; exit 1; }; done
endef

## Install the system packages the build and the tests need, when they are missing.
deps:
	@$(call apt_install,protoc:protobuf-compiler etcd:etcd-server)

## What only the tests need: Chromium for the browser test of the allocator's /ui; iproute2
## and iptables for the chaos run's partitions (it makes a network namespace of its own).
test-deps: deps
	@$(call apt_install,chromium:chromium ip:iproute2 iptables:iptables)

# $(call cargo_tool,command,crate,version,minutes): cargo install --locked the crate when
# `cargo command --version` does not print that version (minutes: the build on 2 idle cores;
# measured 126 CPU-seconds for cargo-machete, 229 for cargo-deny).
define cargo_tool
if ! $(CARGO) $(1) --version 2>/dev/null | grep -qx '\(cargo-$(1) \)\?$(3)'; then \
  echo "installing $(2) $(3): cargo install --locked, about $(4) min on 2 cores"; \
  $(CARGO) install --locked --quiet $(2)@$(3) || exit 1; \
fi
endef

## The dependency checkers: cargo-machete (unused dependencies) and cargo-deny (deny.toml).
dev-tools:
	@$(call cargo_tool,machete,cargo-machete,$(CARGO_MACHETE_VERSION),2)
	@$(call cargo_tool,deny,cargo-deny,$(CARGO_DENY_VERSION),4)

## Unused dependencies in any Cargo.toml.
machete: dev-tools
	$(CARGO) machete

## deny.toml: licences, duplicate versions and sources always; the RustSec advisories when the
## advisory database is on this machine. No package registry ships that database: it is a git
## checkout under $(ADVISORY_DBS), refreshed from GitHub when GitHub can be reached. Without it
## the advisories are NOT checked, and the run says so in a line of its own.
deny: dev-tools
	@$(CARGO) fetch --locked --quiet
	@$(CARGO) deny fetch db >/dev/null 2>&1 || true
	@db=$$(ls -d $(ADVISORY_DBS)/advisory-db-*/ 2>/dev/null | head -n 1); \
	if [ -n "$$db" ] && git -C "$$db" rev-parse -q --verify HEAD >/dev/null; then \
	  echo "advisory database: $$db at $$(git -C "$$db" log -1 --format='%h of %cs')"; \
	  $(CARGO) deny --offline check; \
	else \
	  echo "ADVISORIES NOT CHECKED: no RustSec advisory database in $(ADVISORY_DBS) and GitHub, its only" >&2; \
	  echo "source, cannot be reached. On a machine that reaches GitHub run 'cargo deny fetch db' and copy" >&2; \
	  echo "$(ADVISORY_DBS) here. Licences, duplicate versions and sources are checked:" >&2; \
	  $(CARGO) deny --offline check licenses bans sources; \
	fi

build: deps
	$(CARGO) build --workspace

release: deps
	$(CARGO) build --release --workspace

fmt-check:
	$(CARGO) fmt --all -- --check

clippy: deps
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## Everything CI runs: format, lints, the dependency checks, every test (real etcd, real processes).
test: test-deps fmt-check clippy machete deny
	$(BUILD_FOR_TESTS)
	$(CARGO) test --workspace -- --test-threads=2
	./target/debug/gpuledger-chaos run --seed 1 --pods 150 --faults 7
	./deploy/test/deploy-check.sh

## The real-Kubernetes tier (docs/e2e.md): kube-apiserver, kube-controller-manager,
## kube-scheduler, kubelet and kubectl of Kubernetes $(KUBE_VERSION), containerd 2 and etcd 3.6,
## built from the Go module proxy by e2e/kube/build.sh (once, then cached in
## ~/.cache/gpuledger), the machine's runc, pods that really run, the shipped install as it is,
## and the peers beside it (HAMi's scheduler, dra-example-driver: e2e/peers/build.sh, from the
## source archives in GPULEDGER_PEERS_SRC, default testdata/peers; cached too, 6 min cold).
## Needs root and Go 1.26 or later on PATH. Another release: make test-e2e KUBE_VERSION=1.35.4
KUBE_VERSION ?= 1.37.2
e2e-deps: deps
	@command -v go >/dev/null || { echo "test-e2e needs Go 1.26 or later on PATH (https://go.dev/dl; Debian's golang-go is too old)" >&2; exit 1; }
	@$(call apt_install,runc:runc umoci:umoci skopeo:skopeo openssl:openssl /bin/busybox:busybox-static /usr/lib/cni/loopback:containernetworking-plugins)
	@./e2e/peers/build.sh >/dev/null

# Only e2e's tests are #[ignore]d; --workspace keeps the build the one `make test` made.
test-e2e: e2e-deps
	$(BUILD_FOR_TESTS)
	bin="$$(KUBE_VERSION=$(KUBE_VERSION) ./e2e/kube/build.sh)" && peers="$$(./e2e/peers/build.sh)" && \
	  GPULEDGER_KUBE_BIN="$$bin" GPULEDGER_PEERS_BIN="$$peers" $(CARGO) test --workspace --test integration -- --ignored --test-threads=1

## deploy/: render the kustomize overlays and the Helm chart, validate them offline against the
## Kubernetes schemas, check flags, wiring and RBAC against the code (installs its tools).
deploy-check: deps
	$(BUILD_FOR_TESTS)
	./deploy/test/deploy-check.sh

## On a machine with an NVIDIA GPU: allocate up to and past a share in every isolation mode the
## machine supports (node-agent/gpu-check/gpu-check.sh), with the driver, MIG, MPS and cgroup
## state. Builds with gcc alone (the CUDA driver API through dlopen); without a GPU it fails
## after compiling, saying so. CI never runs it.
gpu-check:
	@mkdir -p target/gpu-check
	gcc -O2 -Wall -Wextra -Werror -o target/gpu-check/gpu-alloc node-agent/gpu-check/gpu_alloc.c -ldl
	GPU_CHECK_BIN=target/gpu-check/gpu-alloc ./node-agent/gpu-check/gpu-check.sh

## Install the CLI and the kubectl plugin (kubectl gpuledger …) into $(PREFIX)/bin.
PREFIX ?= /usr/local
install-plugin: release
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 0755 target/release/gpuledger $(DESTDIR)$(PREFIX)/bin/gpuledger
	ln -sf gpuledger $(DESTDIR)$(PREFIX)/bin/kubectl-gpuledger

## The container image with every binary (needs Docker with BuildKit; not buildable here).
image:
	docker build -t $(IMAGE) .

## A chaos run with faults and a history check (see README for a full-size run).
chaos: release
	./target/release/gpuledger-chaos run --seed $(or $(SEED),1) --pods 1000 --faults 20

## The local demo: etcd x3, allocator replicas, a workload, a leader kill, then inspect + verify.
demo: deps
	$(if $(filter release,$(DEMO_PROFILE)),$(CARGO) build --workspace --release,$(BUILD_FOR_TESTS))
	./target/$(DEMO_PROFILE)/gpuledger-chaos demo $(DEMO_FLAGS)

## Benchmarks (release build; each prints a table and a final key=value line).
bench: bench-allocator bench-failover bench-replay

bench-allocator: release
	./target/release/gpuledger-bench allocator

bench-failover: release
	./target/release/gpuledger-bench failover --trials 10

bench-replay: release
	./target/release/gpuledger-bench replay --events 1000000

clean:
	$(CARGO) clean
