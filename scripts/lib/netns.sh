# "Nodes" on one machine as network namespaces (shared/NETWORK.md). Source it, then either
# - `netns_pair_up TAG SUBNET` (e.g. netns_pair_up md2n 10.231.57): two namespaces joined by a
#   veth pair; sets NS_A NS_B VETH_A VETH_B ADDR_A ADDR_B; or
# - `netns_hosts_up TAG SUBNET COUNT`: COUNT host namespaces, each joined by its own veth pair
#   to a bridge in a switch namespace (a star: every host has its own uplink and downlink); sets
#   the arrays NS_HOSTS VETH_HOSTS (the host's end) VETH_SWITCH (the switch's end, same index)
#   ADDR_HOSTS (SUBNET.1, SUBNET.2, ...) and NS_SWITCH. `limit_host INDEX RATE` limits host
#   INDEX's uplink and downlink to RATE each; or
# - `netns_sites_up TAG SUBNET RATE...`: one host a RATE (sites, e.g. 100mbit 10mbit 100mbit),
#   each limited to its rate both ways: between two sites the slower one's (a star), so uneven
#   links from one rate per site; sets SITE_RATES as well.
# Names are unique per invocation (other runs may hold their own namespaces); an EXIT trap kills
# every process in the namespaces and deletes them. `limit_link NAMESPACE VETH RATE` rate-limits
# one direction ("none": no limit). Traffic only reaches the namespaces' own addresses and
# loopback. Needs root.

NS_HOSTS=() VETH_HOSTS=() VETH_SWITCH=() ADDR_HOSTS=() NS_SWITCH=""

netns_cleanup() {
  local ns pid veth
  for ns in "${NS_A:-}" "${NS_B:-}" "${NS_HOSTS[@]}" "$NS_SWITCH"; do
    if [ -n "$ns" ] && ip netns list | grep -qw "$ns"; then
      for pid in $(ip netns pids "$ns"); do kill -TERM "$pid" 2>/dev/null || true; done
      sleep 0.5
      for pid in $(ip netns pids "$ns"); do kill -KILL "$pid" 2>/dev/null || true; done
      ip netns del "$ns"
    fi
  done
  for veth in "${VETH_A:-}" "${VETH_HOSTS[@]}"; do  # only left if setup failed before the move
    [ -n "$veth" ] && ip link del "$veth" 2>/dev/null || true
  done
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

netns_hosts_up() {
  local tag=$1 subnet=$2 count=$3 i
  NS_SWITCH="$tag-$$-sw"
  trap netns_cleanup EXIT
  trap 'exit 130' INT TERM
  ip netns add "$NS_SWITCH"
  ip -n "$NS_SWITCH" link add br0 type bridge
  ip -n "$NS_SWITCH" link set br0 up
  ip -n "$NS_SWITCH" link set lo up
  for ((i = 0; i < count; i++)); do
    NS_HOSTS[i]="$tag-$$-h$i" VETH_HOSTS[i]="$tag$$h$i" VETH_SWITCH[i]="$tag$$s$i"
    ADDR_HOSTS[i]="$subnet.$((i + 1))"
    ip netns add "${NS_HOSTS[i]}"
    ip link add "${VETH_HOSTS[i]}" type veth peer name "${VETH_SWITCH[i]}"
    ip link set "${VETH_HOSTS[i]}" netns "${NS_HOSTS[i]}"
    ip link set "${VETH_SWITCH[i]}" netns "$NS_SWITCH"
    ip -n "$NS_SWITCH" link set "${VETH_SWITCH[i]}" master br0 up
    ip -n "${NS_HOSTS[i]}" addr add "${ADDR_HOSTS[i]}/24" dev "${VETH_HOSTS[i]}"
    ip -n "${NS_HOSTS[i]}" link set lo up
    ip -n "${NS_HOSTS[i]}" link set "${VETH_HOSTS[i]}" up
  done
}

# netns_sites_up TAG SUBNET RATE...: netns_hosts_up with one host per RATE, each limited to it.
SITE_RATES=()
netns_sites_up() {
  local tag=$1 subnet=$2 i
  shift 2
  SITE_RATES=("$@")
  netns_hosts_up "$tag" "$subnet" "$#"
  for ((i = 0; i < $#; i++)); do limit_host "$i" "${SITE_RATES[i]}"; done
}

# limit_host INDEX RATE: host INDEX's uplink (its end's egress) and downlink (the switch end's
# egress) each limited to RATE.
limit_host() {
  limit_link "${NS_HOSTS[$1]}" "${VETH_HOSTS[$1]}" "$2"
  limit_link "$NS_SWITCH" "${VETH_SWITCH[$1]}" "$2"
}

# wait_ranks WHAT LOG PID...: wait for every rank's process; if one failed, say WHAT failed with
# the last lines of LOG (rank 0's) and exit with its status.
wait_ranks() {
  local what=$1 log=$2 status=0 pid
  shift 2
  for pid in "$@"; do wait "$pid" || status=$?; done
  if [ "$status" -ne 0 ]; then
    echo "$what failed ($status); rank 0's log:" >&2
    tail -30 "$log" >&2
    exit "$status"
  fi
}

# text_corpus_flags DIR PYTHON [VOCAB]: make benchmarks/text_corpus.py's corpus in DIR (its
# tokenizer of VOCAB pieces, default 8000) if it is not there, and set TEXT_FLAGS to the data
# and tokenizer flags that read it (the netns benchmarks' real text).
text_corpus_flags() {
  local dir=$1 python=$2 vocab=${3:-8000}
  if [ ! -f "$dir/tok.model" ]; then
    "$python" benchmarks/text_corpus.py --out "$dir" --vocab-size "$vocab"
  fi
  TEXT_FLAGS=(--data-path "$dir/corpus_text_document" --tokenizer-type SentencePieceTokenizer
              --tokenizer-model "$dir/tok.model")
}
