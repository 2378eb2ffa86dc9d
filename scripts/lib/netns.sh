# Two "nodes" on one machine: two network namespaces joined by a veth pair (shared/NETWORK.md).
# Source it, then `netns_pair_up TAG SUBNET` (e.g. netns_pair_up md2n 10.231.57): it sets
# NS_A NS_B VETH_A VETH_B ADDR_A ADDR_B (names unique per invocation: other runs may hold their
# own namespaces), installs an EXIT trap that kills every process in them and deletes them, and
# brings the link up. `limit_link NAMESPACE VETH RATE` rate-limits one direction ("none": no
# limit). Traffic only reaches the two namespaces' addresses and loopback. Needs root.

netns_cleanup() {
  local ns pid
  for ns in "$NS_A" "$NS_B"; do
    if ip netns list | grep -qw "$ns"; then
      for pid in $(ip netns pids "$ns"); do kill -TERM "$pid" 2>/dev/null || true; done
      sleep 0.5
      for pid in $(ip netns pids "$ns"); do kill -KILL "$pid" 2>/dev/null || true; done
      ip netns del "$ns"
    fi
  done
  ip link del "$VETH_A" 2>/dev/null || true  # only left if setup failed before the move
}

netns_pair_up() {
  local tag=$1 subnet=$2
  NS_A="$tag-$$-a" NS_B="$tag-$$-b" VETH_A="$tag$$a" VETH_B="$tag$$b"
  ADDR_A="$subnet.1" ADDR_B="$subnet.2"
  trap netns_cleanup EXIT
  trap 'exit 130' INT TERM
  ip netns add "$NS_A"
  ip netns add "$NS_B"
  ip link add "$VETH_A" type veth peer name "$VETH_B"
  ip link set "$VETH_A" netns "$NS_A"
  ip link set "$VETH_B" netns "$NS_B"
  ip -n "$NS_A" addr add "$ADDR_A/24" dev "$VETH_A"
  ip -n "$NS_B" addr add "$ADDR_B/24" dev "$VETH_B"
  local ns
  for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up; done
  ip -n "$NS_A" link set "$VETH_A" up
  ip -n "$NS_B" link set "$VETH_B" up
}

# limit_link NAMESPACE VETH RATE: netem (rate, 1 ms delay) as NETWORK.md says; where the kernel
# lacks netem (some builds leave it out), a token bucket (tbf) at the same rate without the delay
# (the burst covers one 64 KB segmentation-offload packet, which a smaller bucket would drop
# forever).
limit_link() {
  if [ "$3" = none ]; then
    ip netns exec "$1" tc qdisc del dev "$2" root 2>/dev/null || true
    echo "$2: no rate limit" >&2
  elif ip netns exec "$1" tc qdisc replace dev "$2" root netem rate "$3" delay 1ms limit 100000 \
      2>/dev/null; then
    echo "$2: netem rate $3 delay 1ms" >&2
  else
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$3" burst 256kb limit 8mb
    echo "$2: no netem in this kernel; tbf rate $3 burst 256kb (no added delay)" >&2
  fi
}
