# The kvsync agent's image: built with Debian's Rust toolchain, run on Debian
# slim as the non-root user 10001 (the DaemonSet's runAsUser), with the RDMA
# libraries the binary links (it uses RDMA only where the node has a NIC).
#     docker build -t kvsync:0.1.0 .
# then push it where your nodes pull from and set the DaemonSet's image.
FROM rust:1-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends pkg-config libclang-dev clang libibverbs-dev librdmacm-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked && install -m 755 target/release/kvsync /kvsync

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvsync \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvsync
COPY --from=build /kvsync /usr/local/bin/kvsync
USER 10001:10001
ENTRYPOINT ["/usr/local/bin/kvsync"]
CMD ["agent", "--config", "/etc/kvsync/kvsync.toml"]
