#!/usr/bin/env bash
# bench-pki.sh DIR: a throw-away CA and one agent certificate for
# localhost / 127.0.0.1, for benchmarks of agents with [tls]. Writes
# DIR/ca.pem, DIR/agent.pem and DIR/agent.key, and prints the [tls] table
# that uses them. Needs no /dev/fd (the soft-RoCE VM has none).
set -euo pipefail
pki=$1
mkdir -p "$pki"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
    -subj "/CN=bench CA" -keyout "$pki/ca.key" -out "$pki/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=localhost" \
    -keyout "$pki/agent.key" -out "$pki/agent.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$pki/san.cnf"
openssl x509 -req -in "$pki/agent.csr" -CA "$pki/ca.pem" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 1 -extfile "$pki/san.cnf" \
    -out "$pki/agent.pem" 2>/dev/null
printf '[tls]\ncert_file = "%s"\nkey_file = "%s"\nca_file = "%s"\n' \
    "$pki/agent.pem" "$pki/agent.key" "$pki/ca.pem"
