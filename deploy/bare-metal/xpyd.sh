#!/usr/bin/env bash
# An xPyD fleet of stock vLLM (NixlConnector, or P2pNcclConnector on the releases that ship it)
# behind pdproxy on GPU hosts: one proxy, x prefill and y decode servers, a `pdproxy announce`
# sidecar beside each. See README.md here.
#
#   MODEL=/models/Llama-3.1-8B-Instruct PROXY_HOST=10.0.0.1 \
#   PREFILL=10.0.0.2:0,10.0.0.2:1 DECODE=10.0.0.3:0,10.0.0.3:1 deploy/bare-metal/xpyd.sh --dry-run
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: xpyd.sh [--dry-run] [start|stop] [--model M] [--prefill LIST] [--decode LIST]
               [--proxy-host ADDR] [--tp N]

start (the default) starts pdproxy, every vLLM server and every announce sidecar; stop stops
them (sidecars first) by the PID files start left in RUN_DIR on each host. Hosts are reached
with ssh, or run directly when local (localhost, 127.x, or an address of this machine).
--dry-run prints one line per process, "[HOST] NAME: COMMAND", and runs nothing.

Flags win over the environment variable of the same name:
  MODEL        model path or name given to `vllm serve` (required to start)
  PREFILL      prefill instances: HOST:GPUS[,HOST:GPUS...]; GPUS is one GPU per TP rank,
  DECODE       joined by '+', each N or gpuN (10.0.0.2:0, 10.0.0.2:gpu2+gpu3); same for decode
  PROXY_HOST   the proxy's IP, reachable from every worker (default 127.0.0.1 if all are local)
  TP           tensor-parallel size of every instance (default 1; P2pNccl needs it symmetric)
Environment only [default]:
  CONNECTOR [nixl]: nixl = vLLM's NixlConnector (vLLM >= 0.32; its handshake side channel
    listens on the instance's KV port, which the sidecar announces); p2p_nccl = P2pNcclConnector
    (only vLLM releases before 0.32 ship it; SEND_TYPE, *_BUFFER_SIZE, MEM_POOL_SIZE_GB are its)
  SERVED_MODEL_NAME [MODEL]  MODEL_CONFIG [MODEL/config.json when MODEL is an absolute path]
  PROXY_PORT [8000]  REGISTRY_PORT [30001]  PREFILL_HTTP_PORT [20001]  PREFILL_KV_PORT [21001]
  DECODE_HTTP_PORT [20101]  DECODE_KV_PORT [22001]: the n-th (from 0) instance of a role on a
    host listens on HTTP_PORT+n and KV_PORT+n*TP; its TP rank r on KV_PORT+n*TP+r
  BLOCK_SIZE [16]  KV_LAYOUT [HND for nixl, NHD for p2p_nccl]  KV_CACHE_DTYPE [model's]
  SEND_TYPE [PUT_ASYNC]
  PREFILL_BUFFER_SIZE [1e1]  DECODE_BUFFER_SIZE [8e9]  MEM_POOL_SIZE_GB [vLLM's: 32]
  ANNOUNCE [sidecar]: sidecar = `pdproxy announce` (v1, geometry, load) and vLLM's own v0 pings
    off; vllm = vLLM pings the registry itself (v0: no model, geometry or load), no sidecar
    (p2p_nccl only: NixlConnector does not announce)
  VLLM_ARGS, then PREFILL_ARGS or DECODE_ARGS: extra words for `vllm serve` (all, one role)
  VLLM_ENV (K=V ...): extra environment of every vLLM; PROXY_ARGS: extra words for pdproxy serve
  VLLM_BIN [vllm]  PDPROXY_BIN [pdproxy]  RUN_DIR [/tmp/pdproxy-xpyd]  SSH [ssh -o BatchMode=yes]
  SSH_USER [the ssh default]
EOF
}

die() { echo "xpyd.sh: $*" >&2; exit 2; }

DRY_RUN=0 ACTION=start
while (($#)); do
  case $1 in
    --dry-run) DRY_RUN=1 ;;
    start | stop) ACTION=$1 ;;
    -h | --help) usage; exit 0 ;;
    --model | --prefill | --decode | --proxy-host | --tp)
      (($# >= 2)) || die "$1 needs a value"
      case $1 in
        --model) MODEL=$2 ;; --prefill) PREFILL=$2 ;; --decode) DECODE=$2 ;;
        --proxy-host) PROXY_HOST=$2 ;; --tp) TP=$2 ;;
      esac
      shift ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done

: "${PREFILL:=}" "${DECODE:=}" "${MODEL:=}" "${PROXY_HOST:=}" "${TP:=1}"
: "${PROXY_PORT:=8000}" "${REGISTRY_PORT:=30001}" "${PREFILL_HTTP_PORT:=20001}"
: "${PREFILL_KV_PORT:=21001}" "${DECODE_HTTP_PORT:=20101}" "${DECODE_KV_PORT:=22001}"
: "${CONNECTOR:=nixl}"
[[ $CONNECTOR =~ ^(nixl|p2p_nccl)$ ]] || die "CONNECTOR must be nixl or p2p_nccl, not '$CONNECTOR'"
# NIXL transfers whole heads per block: vLLM asks for a head-major cache with it.
if [[ $CONNECTOR == nixl ]]; then : "${KV_LAYOUT:=HND}"; else : "${KV_LAYOUT:=NHD}"; fi
: "${BLOCK_SIZE:=16}" "${KV_CACHE_DTYPE:=}" "${SEND_TYPE:=PUT_ASYNC}"
: "${PREFILL_BUFFER_SIZE:=1e1}" "${DECODE_BUFFER_SIZE:=8e9}" "${MEM_POOL_SIZE_GB:=}"
: "${ANNOUNCE:=sidecar}" "${VLLM_ARGS:=}" "${VLLM_ENV:=}" "${PROXY_ARGS:=}" "${SSH_USER:=}"
: "${PREFILL_ARGS:=}" "${DECODE_ARGS:=}"
: "${VLLM_BIN:=vllm}" "${PDPROXY_BIN:=pdproxy}" "${RUN_DIR:=/tmp/pdproxy-xpyd}"
: "${SERVED_MODEL_NAME:=$MODEL}" "${SSH:=ssh -o BatchMode=yes}"
if [[ -z ${MODEL_CONFIG+set} ]]; then
  MODEL_CONFIG=""
  [[ $MODEL == /* ]] && MODEL_CONFIG=${MODEL%/}/config.json
fi

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
for v in TP PROXY_PORT REGISTRY_PORT PREFILL_HTTP_PORT PREFILL_KV_PORT DECODE_HTTP_PORT \
  DECODE_KV_PORT BLOCK_SIZE; do
  { is_uint "${!v}" && ((10#${!v} > 0)); } || die "$v must be a positive integer, not '${!v}'"
done
for v in PREFILL_BUFFER_SIZE DECODE_BUFFER_SIZE MEM_POOL_SIZE_GB; do
  [[ ${!v} =~ ^([0-9]+(\.[0-9]*)?([eE][0-9]+)?)?$ ]] || die "$v must be a number, not '${!v}'"
done
[[ $SEND_TYPE =~ ^(PUT_ASYNC|PUT|GET)$ ]] || die "SEND_TYPE must be PUT_ASYNC, PUT or GET"
[[ $ANNOUNCE =~ ^(sidecar|vllm)$ ]] || die "ANNOUNCE must be sidecar or vllm, not '$ANNOUNCE'"
[[ $CONNECTOR == p2p_nccl || $ANNOUNCE == sidecar ]] ||
  die "ANNOUNCE=vllm needs CONNECTOR=p2p_nccl: NixlConnector does not announce itself"
[[ $KV_LAYOUT =~ ^(NHD|HND)$ ]] || die "KV_LAYOUT must be NHD or HND, not '$KV_LAYOUT'"
[[ -n $PREFILL ]] || die "no prefill instances: set PREFILL (or --prefill) to HOST:GPUS[,...]"
[[ -n $DECODE ]] || die "no decode instances: set DECODE (or --decode) to HOST:GPUS[,...]"
[[ $ACTION == stop || -n $MODEL ]] || die "MODEL is not set: the model path or name to serve"

# One word, quoted for a POSIX shell only when it needs it; qall: a whole command line.
q() {
  if [[ $1 =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}
qall() { local out="" w; for w in "$@"; do out+="${out:+ }$(q "$w")"; done; printf '%s' "$out"; }

is_loopback() { [[ $1 == localhost || $1 == 127.* ]]; }
LOCAL_ADDRS=" $(hostname -I 2>/dev/null || true) $(hostname 2>/dev/null || true) "
is_local() { is_loopback "$1" || [[ $LOCAL_ADDRS == *" $1 "* ]]; }
addr() { if [[ $1 == localhost ]]; then echo 127.0.0.1; else echo "$1"; fi; }
check_host() {  # an address vLLM's request-id regexes and pdproxy's registry accept
  [[ $1 =~ ^[A-Za-z0-9._-]+$ && $1 != *__* ]] || die "bad host '$1' in $2: use an IPv4 address"
}

# Every process: where it runs, its name (and PID/log file stem), its command line.
P_HOST=() P_NAME=() P_CMD=() HOSTS=()
declare -A USED=() GPU_USED=() COUNT=()
add_proc() { P_HOST+=("$1"); P_NAME+=("$2"); P_CMD+=("$3"); add_host "$1"; }
add_host() { [[ " ${HOSTS[*]} " == *" $1 "* ]] || HOSTS+=("$1"); }
claim() {  # host port owner: no two processes may listen on one port of one host
  local key="$1:$2"
  [[ -z ${USED[$key]:-} ]] ||
    die "port $2 on $1 is wanted by ${USED[$key]} and $3: move a *_PORT base"
  USED[$key]=$3
}

IFS=, read -ra PREFILL_SPECS <<<"$PREFILL"
IFS=, read -ra DECODE_SPECS <<<"$DECODE"
loopback=0 remote=0
for spec in "${PREFILL_SPECS[@]}" "${DECODE_SPECS[@]}"; do
  [[ $spec =~ ^[^:]+:[^:]+$ ]] || die "bad instance '$spec' in PREFILL/DECODE: expected HOST:GPUS"
  if is_loopback "${spec%%:*}"; then loopback=1; else remote=1; fi
done
((loopback && remote)) && die "PREFILL/DECODE mix loopback and other hosts: KV cannot cross them"
if [[ -z $PROXY_HOST ]]; then
  ((remote)) && die "PROXY_HOST is not set: the proxy's IP, reachable from every worker host"
  PROXY_HOST=127.0.0.1
fi
check_host "$PROXY_HOST" PROXY_HOST
((remote)) && is_loopback "$PROXY_HOST" &&
  die "PROXY_HOST $PROXY_HOST is loopback: remote workers cannot reach it"
PROXY_ADDR=$(addr "$PROXY_HOST")
REGISTRY="$PROXY_ADDR:$REGISTRY_PORT"

read -ra proxy_extra <<<"$PROXY_ARGS"
claim "$PROXY_ADDR" "$PROXY_PORT" pdproxy
claim "$PROXY_ADDR" "$REGISTRY_PORT" "pdproxy registry"
add_proc "$PROXY_ADDR" pdproxy "$(qall "$PDPROXY_BIN" serve --host 0.0.0.0 --port "$PROXY_PORT" \
  --registry-bind "tcp://$PROXY_ADDR:$REGISTRY_PORT" ${proxy_extra[@]+"${proxy_extra[@]}"})"

read -ra vllm_extra <<<"$VLLM_ARGS"
read -ra vllm_env <<<"$VLLM_ENV"
SIDECARS=()
add_worker() {  # role (prefill|decode), number, HOST:GPUS
  local role=$1 n=$2 spec=$3 host gpu_list=${3#*:} g gpus="" k r
  check_host "${spec%%:*}" "$spec"
  host=$(addr "${spec%%:*}")
  local name="$role-$n" http_base=$PREFILL_HTTP_PORT kv_base=$PREFILL_KV_PORT
  local kv_role=kv_producer buffer=$PREFILL_BUFFER_SIZE announce_role=P
  if [[ $role == decode ]]; then
    http_base=$DECODE_HTTP_PORT kv_base=$DECODE_KV_PORT
    kv_role=kv_consumer buffer=$DECODE_BUFFER_SIZE announce_role=D
  fi
  local -a list
  IFS=+ read -ra list <<<"$gpu_list"
  ((${#list[@]} == TP)) ||
    die "$role instance '$spec' names ${#list[@]} GPU(s), TP is $TP: one per rank, joined by '+'"
  for g in "${list[@]}"; do
    g=${g#gpu}
    is_uint "$g" || die "bad GPU '$g' in $role instance '$spec': expected N or gpuN"
    [[ -z ${GPU_USED[$host/$g]:-} ]] ||
      die "GPU $g on $host is given to both ${GPU_USED[$host/$g]} and $name"
    GPU_USED[$host/$g]=$name
    gpus+="${gpus:+,}$g"
  done
  k=${COUNT[$role@$host]:-0}
  COUNT[$role@$host]=$((k + 1))
  local http=$((http_base + k)) kv=$((kv_base + k * TP))
  claim "$host" "$http" "$name (http)"
  for ((r = 0; r < TP; r++)); do claim "$host" $((kv + r)) "$name (kv, rank $r)"; done
  # vLLM's P2pNcclEngine binds VLLM_HOST_IP:kv_port+rank and pings proxy_ip:proxy_port (as v0)
  # only when both are set; with the sidecar announcing v1 it must not, or v0 overwrites v1.
  local extra="\"http_port\":\"$http\",\"send_type\":\"$SEND_TYPE\""
  [[ -n $MEM_POOL_SIZE_GB ]] && extra+=",\"mem_pool_size_gb\":\"$MEM_POOL_SIZE_GB\""
  [[ $ANNOUNCE == sidecar ]] || extra+=",\"proxy_ip\":\"$PROXY_ADDR\",\"proxy_port\":\"$REGISTRY_PORT\""
  local kv_config="{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"$kv_role\","
  kv_config+="\"kv_buffer_size\":\"$buffer\",\"kv_port\":$kv,\"kv_connector_extra_config\":{$extra}}"
  local -a connector_env=("VLLM_HOST_IP=$host")
  if [[ $CONNECTOR == nixl ]]; then
    # NIXL's handshake listens on the side channel (one per instance: its KV port), which the
    # prefill's answer names to the decode; P2pNcclConnector's keys mean nothing to it.
    kv_config="{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"$kv_role\"}"
    connector_env+=("VLLM_NIXL_SIDE_CHANNEL_HOST=$host" "VLLM_NIXL_SIDE_CHANNEL_PORT=$kv")
  fi
  local role_args=${role^^}_ARGS
  local -a role_extra cmd
  read -ra role_extra <<<"${!role_args}"
  cmd=(env "CUDA_VISIBLE_DEVICES=$gpus" "${connector_env[@]}" VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1
    ${vllm_env[@]+"${vllm_env[@]}"} "$VLLM_BIN" serve "$MODEL" --host "$host" --port "$http"
    --served-model-name "$SERVED_MODEL_NAME" --tensor-parallel-size "$TP" --block-size "$BLOCK_SIZE")
  [[ -n $KV_CACHE_DTYPE ]] && cmd+=(--kv-cache-dtype "$KV_CACHE_DTYPE")
  cmd+=(--kv-transfer-config "$kv_config" ${vllm_extra[@]+"${vllm_extra[@]}"}
    ${role_extra[@]+"${role_extra[@]}"})
  [[ $ACTION == start ]] && echo "# $name on $host: GPUs $gpus, http $http, kv $kv (rank r: $kv+r)"
  add_proc "$host" "$name" "$(qall "${cmd[@]}")"
  [[ $ANNOUNCE == sidecar ]] || return 0
  cmd=("$PDPROXY_BIN" announce --role "$announce_role" --http-address "$host:$http"
    --zmq-address "$host:$kv" --registry "$REGISTRY" --model "$SERVED_MODEL_NAME"
    --connector "$CONNECTOR" --tp-size "$TP" --block-size "$BLOCK_SIZE" --kv-layout "$KV_LAYOUT")
  [[ -n $MODEL_CONFIG ]] && cmd+=(--model-config "$MODEL_CONFIG")
  [[ -n $KV_CACHE_DTYPE ]] && cmd+=(--kv-dtype "$KV_CACHE_DTYPE")
  SIDECARS+=("$host" "announce-$name" "$(qall "${cmd[@]}")")
}
for i in "${!PREFILL_SPECS[@]}"; do add_worker prefill $((i + 1)) "${PREFILL_SPECS[i]}"; done
for i in "${!DECODE_SPECS[@]}"; do add_worker decode $((i + 1)) "${DECODE_SPECS[i]}"; done
for ((i = 0; i < ${#SIDECARS[@]}; i += 3)); do
  add_proc "${SIDECARS[i]}" "${SIDECARS[i + 1]}" "${SIDECARS[i + 2]}"
done

# Run a bash script on a host (arguments as $1...): directly when local, else over ssh.
read -ra SSH_CMD <<<"$SSH"
on_host() {
  local host=$1 body=$2
  shift 2
  if is_local "$host"; then bash -c "$body" xpyd "$@"
  else "${SSH_CMD[@]}" "${SSH_USER:+$SSH_USER@}$host" "bash -c $(qall "$body" xpyd "$@")"; fi
}
# $1 run dir, $2 name, $3 command line. Its own session: stop kills the whole process group.
# shellcheck disable=SC2016  # expanded on the host, not here
LAUNCH='mkdir -p "$1" && cd "$1" || exit 1
if [ -f "$2.pid" ] && kill -0 "$(cat "$2.pid")" 2>/dev/null; then
  echo "$2: already running (pid $(cat "$2.pid"))"; exit 0; fi
setsid nohup bash -c "exec $3" >"$2.log" 2>&1 </dev/null &
echo $! >"$2.pid"; echo "$2: started on $(hostname), pid $!, log $1/$2.log"'
# $1 run dir, then PID file patterns: TERM to every group, KILL those still running after 30 s.
# A group runs while one of its processes is not a zombie (kill -0 counts those until reaped).
# shellcheck disable=SC2016
STOP='cd "$1" 2>/dev/null || exit 0; shift
running() { ps -e -o pgid=,stat= | awk -v g="$1" "\$1 == g && \$2 !~ /^Z/ { f = 1 } END { exit !f }"
}
files=$(for pattern in "$@"; do for f in $pattern; do [ -f "$f" ] && echo "$f"; done; done)
for f in $files; do p=$(cat "$f"); kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null; done
i=0  # one 30 s deadline for all
for f in $files; do
  p=$(cat "$f")
  while running "$p" && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
  if running "$p"; then kill -KILL -- "-$p" 2>/dev/null || true; fi
  rm -f "$f"; echo "${f%.pid}: stopped (pid $p)"
done'

stop_all() {
  local patterns h
  for patterns in 'announce-*.pid' 'prefill-*.pid decode-*.pid' 'pdproxy.pid'; do
    for h in "${HOSTS[@]}"; do
      [[ $patterns == pdproxy.pid && $h != "$PROXY_ADDR" ]] && continue
      if ((DRY_RUN)); then echo "[$h] stop: $RUN_DIR/{$patterns}"
      else on_host "$h" "$STOP" "$RUN_DIR" "$patterns" || echo "xpyd.sh: stop on $h failed" >&2; fi
    done
  done
}

[[ $ANNOUNCE == sidecar && -z $MODEL_CONFIG && $ACTION == start ]] &&
  echo "xpyd.sh: warning: no MODEL_CONFIG: the sidecars cannot announce layers, heads or dtype" >&2
if [[ $ACTION == stop ]]; then stop_all; exit 0; fi
for i in "${!P_NAME[@]}"; do
  if ((DRY_RUN)); then echo "[${P_HOST[i]}] ${P_NAME[i]}: ${P_CMD[i]}"
  else on_host "${P_HOST[i]}" "$LAUNCH" "$RUN_DIR" "${P_NAME[i]}" "${P_CMD[i]}"; fi
done
state=started
((DRY_RUN)) && state="dry run, nothing started"
cat <<EOF
# ${#PREFILL_SPECS[@]}P${#DECODE_SPECS[@]}D $state. vLLM takes minutes to load; then check:
#   curl -s http://$PROXY_ADDR:$PROXY_PORT/ready
#   curl -s http://$PROXY_ADDR:$PROXY_PORT/v1/instances/pairs
#   curl -s http://$PROXY_ADDR:$PROXY_PORT/v1/completions -H 'Content-Type: application/json' \\
#        -d '{"model": "$SERVED_MODEL_NAME", "prompt": "Hello", "max_tokens": 16}'
EOF
