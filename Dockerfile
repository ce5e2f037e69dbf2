# syntax=docker/dockerfile:1
# One image with every gpuledger binary: gpuledger-allocator, gpuledger-extender,
# gpuledger-node-agent and gpuledger (also as kubectl-gpuledger). Build: `make image`.
# The image runs as the non-root user 65532; the node agent's DaemonSet runs it as root
# (kubelet sockets, enforcement), everything else keeps the default.

FROM rust:1.95-bookworm AS build
# protoc for the protobuf build. Not version-pinned: bookworm's security updates replace the
# exact version, and a pin would break the build instead of taking the fix.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
        -p gpuledger-allocator -p gpuledger-extender -p gpuledger-node-agent -p gpuledger-ctl \
    && mkdir -p /out \
    && cp target/release/gpuledger-allocator target/release/gpuledger-extender \
          target/release/gpuledger-node-agent target/release/gpuledger /out/

# glibc and libgcc for the binaries (NVML is loaded at run time from the NVIDIA container
# toolkit's mounts); no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/gpuledger-allocator /usr/local/bin/gpuledger-allocator
COPY --from=build /out/gpuledger-extender /usr/local/bin/gpuledger-extender
COPY --from=build /out/gpuledger-node-agent /usr/local/bin/gpuledger-node-agent
COPY --from=build /out/gpuledger /usr/local/bin/gpuledger
COPY --from=build /out/gpuledger /usr/local/bin/kubectl-gpuledger
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gpuledger-allocator"]
