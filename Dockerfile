# Build: a release binary of behest (rustls: no OpenSSL needed at run time).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY migrations ./migrations
RUN cargo build --release --locked --bin behest

# Run: a small Debian image, a non-root user, the SQLite file on a volume. It listens on all
# interfaces, so it starts only with API keys (BEHEST_AUTH__KEYS, or [auth] in a mounted config)
# or when told to serve without them (`serve --allow-unauthenticated`).
FROM debian:bookworm-slim
# The system's root certificates: outgoing TLS (providers, MCP over HTTPS) verifies with them.
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 behest && mkdir /data && chown behest /data
COPY --from=build /src/target/release/behest /usr/local/bin/behest
USER behest
VOLUME ["/data"]
ENV BEHEST_BIND=0.0.0.0:8080 \
    BEHEST_DATABASE_URL=sqlite:///data/behest.db
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["behest", "healthcheck"]
ENTRYPOINT ["behest"]
CMD ["serve"]
