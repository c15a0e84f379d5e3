#!/usr/bin/env bash
# Two "hosts" on one machine: a sender and a receiver in network namespaces of their own,
# joined by a veth pair at a real Ethernet MTU, so every packet crosses the kernel's network
# stack as it would between hosts. Measures, in the same run and over the same path:
# `sender` -> `receiver` over UDP and over TCP (`--transport quic|tcp`, spec §16), raw quinn
# as two processes, and TCP + TLS 1.3 (rustls over tokio's TCP) as two processes, each with
# the same connection count and bytes; prints the rates, the ratios and each side's CPU
# seconds per GiB (all threads of each process). Then, with UDP dropped by the receiver's
# host (nftables, or a tc filter where nft is missing), how long `sender --transport auto`
# takes to deliver, and what it says. Needs root (or CAP_NET_ADMIN), `ip`, and `tc` for
# NETEM, RATE or the UDP drop without nft.
#
#   benches/two-hosts.sh BIN_DIR [CONNECTIONS] [MIB_PER_CONNECTION] [DEVICE]
#
# BIN_DIR holds receiver, sender and bench (cargo build --release -p tensorwire-examples
# -p tensorwire-bench). DEVICE is where the receiver lands tensors (host, the default, or
# cuda:0). MTUS lists the link MTUs to measure (default "1500 9000"). The programs find the
# path's MTU as users run them (path MTU discovery from 1200 bytes; FIXED_MTU=1 gives them
# the link's largest UDP payload, MTU - 28, from the start); raw quinn is given that payload
# from the start. NETEM adds a netem
# qdisc on both ends (e.g. "delay 1ms loss 0.1%"), RATE a rate limit on both ends (e.g.
# "2gbit"). ROUNDS=N repeats every measurement N times and prints the medians.
# WARM=1 times a second push into the same receiver, after an untimed first one: a
# long-running receiver's steady state, whose host buffers are reused rather than fresh
# memory the kernel must fault in and zero.
# PROFILE_DIR=DIR records the programs with `perf record` (receiver-MTU.perf,
# sender-MTU.perf) and prints each one's hottest symbols: where their CPU per byte goes.
# UDP_BLOCKED=0 skips the run with UDP dropped. The namespaces and the pair are removed on
# exit.
set -euo pipefail
. "$(dirname "$0")/common.sh"
bin=$(cd "${1:?usage: benches/two-hosts.sh BIN_DIR [CONNECTIONS] [MIB_PER_CONNECTION] [DEVICE]}" && pwd)
connections=${2:-2}
mib=${3:-256}
device=${4:-host}
mtus=${MTUS:-1500 9000}
rounds=${ROUNDS:-1}
tx=tw-bench-tx-$$
rx=tw-bench-rx-$$
tx_ip=10.231.0.1
rx_ip=10.231.0.2
work=$(mktemp -d)
chmod 755 "$work"
cleanup() {
  stop_jobs
  ip netns del "$tx" 2>/dev/null || true
  ip netns del "$rx" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

ip netns add "$tx"
ip netns add "$rx"
ip link add tw-b0 netns "$tx" type veth peer name tw-b1 netns "$rx"
ip -n "$tx" addr add "$tx_ip/24" dev tw-b0
ip -n "$rx" addr add "$rx_ip/24" dev tw-b1
for ns in "$tx" "$rx"; do ip -n "$ns" link set lo up; done
ip -n "$tx" link set tw-b0 up
ip -n "$rx" link set tw-b1 up
if [ -n "${NETEM:-}${RATE:-}" ]; then
  # shellcheck disable=SC2086 # NETEM is a list of netem arguments.
  ip netns exec "$tx" tc qdisc add dev tw-b0 root netem ${NETEM:-} ${RATE:+rate $RATE}
  # shellcheck disable=SC2086
  ip netns exec "$rx" tc qdisc add dev tw-b1 root netem ${NETEM:-} ${RATE:+rate $RATE}
fi
in_tx() { ip netns exec "$tx" "$@"; }
in_rx() { ip netns exec "$rx" "$@"; }

# One tensor per connection: the sender opens its connections and sends them side by side.
random_safetensors "$work/model.safetensors" "$connections" "$mib"
total_mib=$((connections * mib))
gib=$(awk -v m="$total_mib" 'BEGIN { print m / 1024 }')

# Gbit/s for TOTAL_MIB moved between two `date +%s.%N` stamps.
rate() { awk -v b="$total_mib" -v s="$1" -v e="$2" 'BEGIN { printf "%.2f", b * 1048576 * 8 / (e - s) / 1e9 }'; }
# CPU seconds per GiB in a `with_cpu_time` file.
per_gib() { awk -v c="$(cpu_seconds "$1")" -v g="$gib" 'BEGIN { printf "%.2f", c / g }'; }

# The tensorwire programs: `receiver` in the receiver's namespace, `sender` in the other.
programs() {
  local payload=$1 transport=$2 receiver addr start end mtu_flag=() rx_perf=() tx_perf=() pushes=1 rx_flags=()
  [ "${FIXED_MTU:-0}" != 1 ] || mtu_flag=(--mtu "$payload")
  mtu_flag+=(--transport "$transport")
  if [ "${WARM:-0}" = 1 ]; then
    # Room to keep every buffer of the first push for the second.
    pushes=2
    rx_flags=(--host-memory-mib $((4 * total_mib)) --kept-host-mib $((2 * total_mib)))
  fi
  if [ -n "${PROFILE_DIR:-}" ]; then
    rx_perf=(perf record -F 999 -g -o "$PROFILE_DIR/receiver-$((payload + 28))-$transport.perf" --)
    tx_perf=(perf record -F 999 -g -o "$PROFILE_DIR/sender-$((payload + 28))-$transport.perf" --)
  fi
  : > "$work/receiver.log"
  with_cpu_time "$work/receiver.cpu" "$work/receiver.log" \
    in_rx "${rx_perf[@]}" "$bin/receiver" --listen "$rx_ip:0" "${mtu_flag[@]}" --device "$device" \
    --count $((pushes * connections)) "${rx_flags[@]}" &
  receiver=$!
  addr=$(listening_address "$work/receiver.log")
  local rx_pid rx_before=0
  # Anchored: under PROFILE_DIR, perf's own command line names the receiver too.
  rx_pid=$(pgrep -n -f "^$bin/receiver --listen $rx_ip" || true)
  if [ "$pushes" -eq 2 ]; then
    in_tx "$bin/sender" --connect "$addr" "${mtu_flag[@]}" --quiet \
      --connections "$connections" "$work/model.safetensors" > "$work/warm-up.log" 2>&1 \
      || { cat "$work/warm-up.log" >&2; return 1; }
    rx_before=$(cpu_ticks "$rx_pid")
  fi
  start=$(date +%s.%N)
  with_cpu_time "$work/sender.cpu" "$work/sender.log" \
    in_tx "${tx_perf[@]}" "$bin/sender" --connect "$addr" "${mtu_flag[@]}" --quiet \
    --connections "$connections" "$work/model.safetensors" || { cat "$work/sender.log" >&2; return 1; }
  end=$(date +%s.%N)
  local rx_cpu
  # The receiver's CPU over the timed push alone, read from /proc while it still runs.
  rx_cpu=$(awk -v a="$(cpu_ticks "$rx_pid")" -v b="$rx_before" -v hz="$(getconf CLK_TCK)" -v g="$gib" \
    'BEGIN { printf "%.2f", (a - b) / hz / g }')
  wait "$receiver" || { cat "$work/receiver.log" >&2; return 1; }
  [ "$pushes" -eq 2 ] || rx_cpu=$(per_gib "$work/receiver.cpu")
  # The packet size the connections ended at (path MTU discovery's result).
  local packets
  packets=$(grep -o "packets of [0-9]* bytes" "$work/sender.log" | grep -o "[0-9]*" || echo "?")
  echo "$(rate "$start" "$end") $(per_gib "$work/sender.cpu") $rx_cpu $packets"
}

# User and system CPU ticks a process has used so far (0 if it is gone).
cpu_ticks() {
  awk '{ print $14 + $15 }' "/proc/$1/stat" 2>/dev/null || echo 0
}

# An anchor as two processes: `bench --KIND-server` in the receiver's namespace and
# `bench --KIND-client` sending the file's bytes from the other, with EXTRA flags on both
# (raw: raw quinn; tls: TCP + TLS 1.3, rustls over tokio's TCP).
anchor() {
  local kind=$1 server addr start end
  shift
  : > "$work/$kind-server.log"
  with_cpu_time "$work/$kind-server.cpu" "$work/$kind-server.log" \
    in_rx "$bin/bench" "--$kind-server" "$work/$kind.der" --listen "$rx_ip:0" \
    --connections "$connections" "$@" &
  server=$!
  addr=$(listening_address "$work/$kind-server.log")
  start=$(date +%s.%N)
  TOKIO_WORKER_THREADS=$((2 * connections)) with_cpu_time "$work/$kind-client.cpu" "$work/$kind-client.log" \
    in_tx "$bin/bench" "--$kind-client" "$addr" --cert "$work/$kind.der" --connections "$connections" \
    "$@" --mib "$mib" --source "$work/model.safetensors" \
    || { cat "$work/$kind-client.log" >&2; return 1; }
  end=$(date +%s.%N)
  wait "$server" || { cat "$work/$kind-server.log" >&2; return 1; }
  echo "$(rate "$start" "$end") $(per_gib "$work/$kind-client.cpu") $(per_gib "$work/$kind-server.cpu")"
}

# With UDP dropped at the receiver's host, `sender --transport auto` against a receiver on
# both bindings: seconds from start to delivery, and what the sender said.
udp_blocked() {
  local receiver addr start end
  if command -v nft > /dev/null; then
    in_rx nft add table inet tw_bench
    in_rx nft add chain inet tw_bench input '{ type filter hook input priority 0; }'
    in_rx nft add rule inet tw_bench input meta l4proto udp drop
  else
    in_rx tc qdisc add dev tw-b1 ingress
    in_rx tc filter add dev tw-b1 parent ffff: protocol ip u32 match ip protocol 17 0xff action drop
  fi
  : > "$work/receiver.log"
  in_rx "$bin/receiver" --listen "$rx_ip:0" --device "$device" --count "$connections" \
    > "$work/receiver.log" 2>&1 &
  receiver=$!
  addr=$(listening_address "$work/receiver.log")
  start=$(date +%s.%N)
  in_tx "$bin/sender" --connect "$addr" --transport auto --quiet --connections "$connections" \
    "$work/model.safetensors" > "$work/sender.log" 2>&1 || { cat "$work/sender.log" >&2; return 1; }
  end=$(date +%s.%N)
  wait "$receiver" || { cat "$work/receiver.log" >&2; return 1; }
  if command -v nft > /dev/null; then in_rx nft delete table inet tw_bench; else in_rx tc qdisc del dev tw-b1 ingress; fi
  echo "UDP dropped at the receiver: sender --transport auto delivered $gib GiB in $(awk -v s="$start" -v e="$end" 'BEGIN { printf "%.2f", e - s }') s; it said:"
  grep -E "sending over TCP|sent [0-9]" "$work/sender.log" | sed 's/^/  /'
}

echo "two hosts over a veth pair: $connections connections x $mib MiB, receiver --device $device${NETEM:+, netem $NETEM}${RATE:+, rate $RATE}"
printf '| MTU | tensorwire UDP Gbit/s | tensorwire TCP | raw quinn | TCP+TLS | UDP / raw quinn | UDP / TCP+TLS | TCP / TCP+TLS | CPU s/GiB send+receive: tensorwire UDP | tensorwire TCP | raw quinn | TCP+TLS |\n'
printf '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n'
for mtu in $mtus; do
  ip -n "$tx" link set tw-b0 mtu "$mtu"
  ip -n "$rx" link set tw-b1 mtu "$mtu"
  payload=$((mtu - 28)) # IPv4 and UDP headers
  tw=() tw_tcp=() quinn=() tcp=() to_quinn=() to_tcp=() tcp_to_tcp=() tw_cpu=() tw_tcp_cpu=() quinn_cpu=() tcp_cpu=()
  for _ in $(seq "$rounds"); do
    # They take turns within a round, so each ratio compares runs seconds apart.
    read -r t ts tr packets < <(programs "$payload" quic)
    read -r w ws wr _ < <(programs "$payload" tcp)
    read -r q qs qr < <(anchor raw --mtu "$payload")
    read -r c cs cr < <(anchor tls)
    tw+=("$t") tw_tcp+=("$w") quinn+=("$q") tcp+=("$c")
    to_quinn+=("$(ratio_to "$t" "$q")") to_tcp+=("$(ratio_to "$t" "$c")") tcp_to_tcp+=("$(ratio_to "$w" "$c")")
    tw_cpu+=("$(awk -v a="$ts" -v b="$tr" 'BEGIN { printf "%.2f", a + b }')")
    tw_tcp_cpu+=("$(awk -v a="$ws" -v b="$wr" 'BEGIN { printf "%.2f", a + b }')")
    quinn_cpu+=("$(awk -v a="$qs" -v b="$qr" 'BEGIN { printf "%.2f", a + b }')")
    tcp_cpu+=("$(awk -v a="$cs" -v b="$cr" 'BEGIN { printf "%.2f", a + b }')")
    echo "  MTU $mtu: tensorwire over UDP $t Gbit/s in packets of $packets bytes (CPU s/GiB: send $ts + receive $tr), over TCP $w ($ws + $wr), raw quinn $q ($qs + $qr), TCP+TLS $c ($cs + $cr)" >&2
  done
  printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$mtu" \
    "$(median "${tw[@]}")" "$(median "${tw_tcp[@]}")" "$(median "${quinn[@]}")" "$(median "${tcp[@]}")" \
    "$(median "${to_quinn[@]}")" "$(median "${to_tcp[@]}")" "$(median "${tcp_to_tcp[@]}")" \
    "$(median "${tw_cpu[@]}")" "$(median "${tw_tcp_cpu[@]}")" "$(median "${quinn_cpu[@]}")" "$(median "${tcp_cpu[@]}")"
done
[ "${UDP_BLOCKED:-1}" = 0 ] || udp_blocked
if [ -n "${PROFILE_DIR:-}" ]; then
  for profile in "$PROFILE_DIR"/*.perf; do
    echo "== $(basename "$profile"): hottest symbols (self time)"
    # perf is cut off by head: its SIGPIPE is no failure.
    { perf report -i "$profile" --no-children --sort symbol --stdio 2>/dev/null || true; } \
      | grep -E '^ +[0-9]' | head -15 || true
  done
fi
