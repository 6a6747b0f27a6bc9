# Multi-stage build: compile in the Rust image, run in a slim Debian one as a non-root user.
# (Docker does not run on the development machines; see README, "Deployment".)
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY src src
COPY migrations migrations
COPY config config
COPY web web
# Cargo checks every target the manifest names, benches included, even to build one binary.
COPY microbench microbench
RUN cargo build --release --locked --bin chatd

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --create-home --home-dir /app chatd \
    && mkdir -p /data && chown chatd /data
COPY --from=build /src/target/release/chatd /usr/local/bin/chatd
COPY config /app/config
WORKDIR /app
USER chatd
ENV CHATD_SERVER__HOST=0.0.0.0 \
    CHATD_DATABASE__URL=sqlite:///data/chatd.db
EXPOSE 8080
VOLUME /data
HEALTHCHECK --interval=10s --timeout=3s CMD curl -fsS http://127.0.0.1:8080/readyz || exit 1
CMD ["chatd", "serve"]
