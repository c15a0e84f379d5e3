#!/usr/bin/env bash
# Builds the seed corpora from spec/vectors (STYLE: golden samples used three ways).
# frame_decoder seeds: a split-step byte, then one vector. receiver_state seeds: an op
# header that accepts, grants and marks resident, then one sequence.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p corpus/frame_decoder corpus/receiver_state
for f in ../spec/vectors/frames/*.bin ../spec/vectors/sequences/*.bin; do
  name=$(basename "${f%.bin}")
  { printf '\x05'; cat "$f"; } > "corpus/frame_decoder/seed-$name"
done
for f in ../spec/vectors/sequences/*.bin; do
  name=$(basename "${f%.bin}")
  # 8 ops: feed METADATA, accept, grant 255<<6 (op 0x63 = 3 | 6<<4), feed x4 ... then the rest.
  { printf '\x08\x00\x02\x63\xff\x00\x00\x00\x00'; cat "$f"; } > "corpus/receiver_state/seed-$name"
done
mkdir -p corpus/session_ops
for f in ../spec/vectors/sequences/*.bin; do
  name=$(basename "${f%.bin}")
  # 12 ops on stream 0: feed METADATA, accept, grant x2, feed x4, release, feed x2, close.
  { printf '\x0c\x00\x03\x04\x04\x00\x01\x02\x00\x25\x01\x02\x07'; cat "$f"; } > "corpus/session_ops/seed-$name"
done
mkdir -p corpus/exec_message
for f in ../spec/vectors/exec/*.bin; do
  cp "$f" "corpus/exec_message/seed-$(basename "${f%.bin}")"
done
mkdir -p corpus/version_negotiation
# A server's minor version byte, then a case's client offers (spec/vectors/versions.txt).
n=0
while IFS=';' read -r client _; do
  case "$client" in '#'*|'') continue ;; esac
  for minor in 4 5; do
    printf "\\x0$minor%s" "$(echo "$client" | tr -d ' ')" > "corpus/version_negotiation/seed-$n-$minor"
  done
  n=$((n + 1))
done < ../spec/vectors/versions.txt
mkdir -p corpus/tcp_framing
# A split-step byte, then a case's bytes (spec/vectors/tcp_framing.txt).
n=0
while IFS=';' read -r bytes _; do
  case "$bytes" in '#'*|'') continue ;; esac
  bytes=$(echo "$bytes" | tr -d ' ')
  [ "$bytes" = - ] && bytes=
  for step in 00 02; do
    { printf "\\x$step"; printf '%s' "$bytes" | xxd -r -p; } > "corpus/tcp_framing/seed-$n-$step"
  done
  n=$((n + 1))
done < ../spec/vectors/tcp_framing.txt
echo "seeded $(ls corpus/exec_message | wc -l) exec messages; $(ls corpus/frame_decoder | wc -l) + $(ls corpus/receiver_state | wc -l) + $(ls corpus/session_ops | wc -l) inputs"
