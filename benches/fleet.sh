#!/usr/bin/env bash
# A fleet on one machine: a sender "host" and N receiver "hosts", each a network namespace
# with its own link to a switch (a bridge in a namespace of its own), every link limited to
# RATE each way so that the links, not the CPU, bound a push. For each N in NS, times how
# long until every receiver has every tensor:
#   alone       one receiver (the time a fleet push should approach);
#   sequential  N `sender` runs, one receiver after another (what one push per host costs);
#   one push    one `sender --connect A,B,...` to all N at once (all bytes cross the
#               sender's own link N times, so it is bound by that link like sequential).
# Prints a table with each time's ratio to "alone". Needs root (or CAP_NET_ADMIN), `ip`
# and `tc`. The namespaces are removed on exit.
#
#   benches/fleet.sh BIN_DIR [TENSORS] [MIB_PER_TENSOR]
#
# BIN_DIR holds receiver and sender (cargo build --release -p tensorwire-examples).
# NS (default "1 2 4") lists the fleet sizes; RATE (default 1gbit) each link's rate; DELAY
# (default none, e.g. 1ms) a delay on each link; ROUNDS=N repeats each and prints medians.
set -euo pipefail
. "$(dirname "$0")/common.sh"
bin=$(cd "${1:?usage: benches/fleet.sh BIN_DIR [TENSORS] [MIB_PER_TENSOR]}" && pwd)
tensors=${2:-8}
mib=${3:-32}
sizes=${NS:-1 2 4}
rate=${RATE:-1gbit}
rounds=${ROUNDS:-1}
largest=$(printf '%s\n' $sizes | sort -n | tail -1)
[ "$largest" -le 32 ] || { echo "at most 32 receivers" >&2; exit 1; }
prefix=tw-fleet-$$
work=$(mktemp -d)
chmod 755 "$work"
namespaces=("$prefix-sw" "$prefix-tx")
for i in $(seq "$largest"); do namespaces+=("$prefix-rx$i"); done
cleanup() {
  stop_jobs
  for ns in "${namespaces[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# The switch, and one link per host: HOST's end is eth0, the switch's end pN.
ip netns add "$prefix-sw"
ip -n "$prefix-sw" link add br0 type bridge
ip -n "$prefix-sw" link set br0 up
attach() {
  local ns=$1 port=$2 ip=$3
  ip netns add "$ns"
  ip link add "$port" netns "$prefix-sw" type veth peer name eth0 netns "$ns"
  ip -n "$prefix-sw" link set "$port" master br0 up
  ip -n "$ns" addr add "$ip/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  # The link's rate (and delay) both ways: leaving the host, and leaving the switch for it.
  limit_link "$ns" eth0
  limit_link "$prefix-sw" "$port"
}
# A token bucket for the rate alone (every kernel has it); netem where a delay is asked.
limit_link() {
  if [ -n "${DELAY:-}" ]; then
    ip netns exec "$1" tc qdisc add dev "$2" root netem rate "$rate" delay "$DELAY" limit 100000
  else
    ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$rate" burst 512kb latency 200ms
  fi
}
attach "$prefix-tx" p0 10.232.0.1
for i in $(seq "$largest"); do attach "$prefix-rx$i" "p$i" "10.232.0.$((10 + i))"; done

random_safetensors "$work/model.safetensors" "$tensors" "$mib"
total_mib=$((tensors * mib))

# Starts receivers 1..N, each until it has COUNT tensors; their addresses in $work/addrs.
start_receivers() {
  local n=$1 count=$2 i
  : > "$work/addrs"
  for i in $(seq "$n"); do
    : > "$work/rx$i.log"
    ip netns exec "$prefix-rx$i" "$bin/receiver" --listen "10.232.0.$((10 + i)):0" \
      --device host --count "$count" > "$work/rx$i.log" 2>&1 &
    listening_address "$work/rx$i.log" >> "$work/addrs"
  done
}
# Waits for every receiver to exit (each has all its tensors by then).
wait_receivers() { wait $(jobs -p) 2>/dev/null || true; }
send_to() {
  ip netns exec "$prefix-tx" "$bin/sender" --quiet --connect "$1" "$work/model.safetensors" \
    > "$work/sender.log" 2>&1 || { cat "$work/sender.log" >&2; return 1; }
}
seconds_since() { awk -v s="$1" -v e="$(date +%s.%N)" 'BEGIN { printf "%.2f", e - s }'; }

alone() {
  local start
  start_receivers 1 "$tensors"
  start=$(date +%s.%N)
  send_to "$(cat "$work/addrs")"
  wait_receivers
  seconds_since "$start"
}
sequential() {
  local n=$1 start addr
  start_receivers "$n" "$tensors"
  start=$(date +%s.%N)
  while read -r addr; do send_to "$addr"; done < "$work/addrs"
  wait_receivers
  seconds_since "$start"
}
one_push() {
  local n=$1 start
  start_receivers "$n" "$tensors"
  start=$(date +%s.%N)
  send_to "$(paste -sd, "$work/addrs")"
  wait_receivers
  seconds_since "$start"
}

echo "fleet on one machine: $tensors tensors x $mib MiB ($total_mib MiB), every link $rate${DELAY:+, delay $DELAY}"
printf '| receivers | alone s | sequential s | one push s | sequential / alone | one push / alone |\n'
printf '| --- | --- | --- | --- | --- | --- |\n'
for n in $sizes; do
  a=() s=() p=()
  for _ in $(seq "$rounds"); do
    a+=("$(alone)")
    s+=("$(sequential "$n")")
    p+=("$(one_push "$n")")
    echo "  N=$n: alone ${a[-1]} s, sequential ${s[-1]} s, one push ${p[-1]} s" >&2
  done
  ma=$(median "${a[@]}") ms=$(median "${s[@]}") mp=$(median "${p[@]}")
  printf '| %s | %s | %s | %s | %s | %s |\n' "$n" "$ma" "$ms" "$mp" "$(ratio_to "$ms" "$ma")" "$(ratio_to "$mp" "$ma")"
done
