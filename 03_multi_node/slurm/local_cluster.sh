#!/usr/bin/env bash
# A real two-node Slurm cluster on one Linux machine, to practise sbatch without a cluster.
#
#   sudo bash 03_multi_node/slurm/local_cluster.sh start    # start it and print how to use it
#   sudo bash 03_multi_node/slurm/local_cluster.sh status   # daemons, nodes, jobs
#   sudo bash 03_multi_node/slurm/local_cluster.sh stop     # stop it and leave the machine clean
#
# What it builds (`stop` removes all of it but the logs):
#   - a bridge ddpbr0 with 10.213.0.1/24 in the machine's own network namespace, where slurmctld
#     (the controller) and munged (the authentication daemon) run;
#   - per compute node N (node1, node2): a network namespace ddp-nodeN joined to the bridge by a
#     veth pair, with address 10.213.0.1N and its own loopback, and a slurmd started in it with
#     its own hostname (a UTS namespace) and its own /etc/hosts (a file of the state folder
#     bind-mounted in a private mount namespace, which lists node1 and node2). So each node is a
#     separate host, as on a real cluster: its name resolves to its own address, and torchrun
#     and gloo bind to that address rather than to 127.0.0.1. The machine's own hostname and
#     /etc/hosts are never changed, and the nodes share its filesystems (/tmp, the repository);
#   - a state folder, /tmp/ddp-slurm unless DDP_SLURM_DIR says otherwise, with the generated
#     slurm.conf, the cluster's own munge key and socket, spool folders, pid files and logs.
#
# The cluster uses its own munge key (generated in the state folder) and its own munged and
# socket, so a munge key or munged already on this machine is neither read nor replaced. Its
# ports (6917 for slurmctld, 6918 for each slurmd) differ from Slurm's defaults, so it does not
# clash with a Slurm installation on the machine either. Client commands find the cluster
# through SLURM_CONF, which `start` tells you to export.
#
# Needs root (namespaces, bridge) and the Debian/Ubuntu packages slurm-wlm and munge.
set -euo pipefail
# The daemons live in sbin, which the PATH of `su` or of a non-login root shell may lack.
PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

STATE_DIR="${DDP_SLURM_DIR:-/tmp/ddp-slurm}"
# The state folder is wiped on start, so it must be ours: a marker file says it is.
MARKER="$STATE_DIR/.ddp-local-cluster"
CONF="$STATE_DIR/slurm.conf"
LOGS="$STATE_DIR/logs"
MUNGE_DIR="$STATE_DIR/munge"
MUNGE_SOCKET="$MUNGE_DIR/munge.socket"

# A private /24 that home, office and cloud networks rarely use, so no route on the host clashes.
SUBNET=10.213.0
BRIDGE=ddpbr0
CONTROLLER_ADDR="$SUBNET.1"
NODES=(node1 node2)
SLURMCTLD_PORT=6917
SLURMD_PORT=6918
# How long start waits for both nodes to report idle before it gives up.
START_TIMEOUT_S=60

usage() {
    cat <<EOF
usage: $(basename "$0") {start|stop|status|--help}

  start    start a two-node Slurm cluster on this machine (restarts it if it is running)
  stop     stop its daemons and jobs, remove its network namespaces and bridge (safe to repeat)
  status   show its daemons, nodes and jobs

State, configuration and logs go to \$DDP_SLURM_DIR (now: $STATE_DIR).
Needs root and the packages slurm-wlm and munge.
EOF
}

fail() {
    echo "error: $*" >&2
    exit 1
}

node_namespace() { echo "ddp-$1"; }
# node1 -> 10.213.0.11, node2 -> 10.213.0.12
node_addr() { echo "$SUBNET.1${1#node}"; }

require_root_and_tools() {
    [ "$(id -u)" -eq 0 ] || fail "the local cluster needs root (network namespaces, a bridge," \
        "daemons): run it with sudo"
    local missing=() tool
    for tool in slurmctld slurmd munged munge sbatch srun sinfo squeue scontrol ip nsenter \
        unshare; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] || fail "${missing[*]} not found; install Slurm and munge with:" \
        "apt-get install slurm-wlm munge"
}

# The pid in a pid file, if that process is still alive and is the program we expect (a pid can
# be reused by an unrelated process after ours has ended; that one must not be signalled).
live_pid() {
    local pid_file=$1 program=$2 pid
    [ -f "$pid_file" ] || return 1
    pid=$(cat "$pid_file" 2>/dev/null) || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$program" ] || return 1
    echo "$pid"
}

# Whether a process still runs. A daemon that has ended stays a zombie until its parent (here
# init) collects it, and `kill -0` would still find it, so zombies count as ended.
is_running() {
    local state
    # The state is the field after the parenthesised command name in /proc/PID/stat.
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

# Send TERM to the given pids, wait up to 10 s for them to end, then KILL what is left.
end_pids() {
    [ $# -gt 0 ] || return 0
    kill -TERM "$@" 2>/dev/null || true
    local _ pid alive
    for _ in $(seq 50); do
        alive=()
        for pid in "$@"; do
            is_running "$pid" && alive+=("$pid")
        done
        [ ${#alive[@]} -eq 0 ] && return 0
        sleep 0.2
    done
    kill -KILL "${alive[@]}" 2>/dev/null || true
}

# ---------------------------------------------------------------------------------------------
# stop
# ---------------------------------------------------------------------------------------------
stop_cluster() {
    local node ns pids pid
    # Jobs first: every process inside a node's namespace was started by that node's slurmd
    # (slurmd itself, slurmstepd, the job's torchrun and ranks). Ending only slurmd would leave
    # running jobs behind, and they would keep the namespace alive after its name is gone.
    for node in "${NODES[@]}"; do
        ns=$(node_namespace "$node")
        if ip netns list | awk '{print $1}' | grep -qx "$ns"; then
            mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null)
            end_pids "${pids[@]}"
            ip netns delete "$ns"
        fi
    done
    # Deleting a namespace deletes its end of each veth pair, and with it the end on the bridge.
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link delete "$BRIDGE"
    fi
    # Then the daemons in this namespace, each by the pid it wrote, checked against its name.
    for pid in $(live_pid "$STATE_DIR/ctld/slurmctld.pid" slurmctld) \
        $(live_pid "$MUNGE_DIR/munged.pid" munged); do
        end_pids "$pid"
    done
    # Keep the logs to read after a failure; everything else (the key included) goes.
    if [ -f "$MARKER" ]; then
        find "$STATE_DIR" -mindepth 1 -maxdepth 1 ! -name logs ! -name .ddp-local-cluster \
            -exec rm -rf {} +
    fi
}

# ---------------------------------------------------------------------------------------------
# start
# ---------------------------------------------------------------------------------------------
make_state_dir() {
    # Refuse to wipe a folder that is not ours (DDP_SLURM_DIR=/home/me would be a disaster).
    if [ -e "$STATE_DIR" ] && [ ! -f "$MARKER" ] && [ -n "$(ls -A "$STATE_DIR" 2>/dev/null)" ]; then
        fail "$STATE_DIR exists and was not made by this script; choose another DDP_SLURM_DIR"
    fi
    rm -rf "$STATE_DIR"
    # munged refuses folders that others can write to, and clients must reach its socket:
    # everything here is writable by root alone and readable by all, except the key (0600).
    install -d -m 0755 "$STATE_DIR" "$LOGS" "$STATE_DIR/ctld" "$STATE_DIR/ctld/state"
    install -d -m 0755 "$MUNGE_DIR"
    touch "$MARKER"
    local node
    for node in "${NODES[@]}"; do
        install -d -m 0755 "$STATE_DIR/nodes/$node" "$STATE_DIR/nodes/$node/spool"
    done
}

start_munge() {
    # A fresh 1024-byte random key for this cluster: munge credentials made with it are
    # accepted only by this munged, so the cluster neither needs nor touches /etc/munge.
    (umask 077 && head -c 1024 /dev/urandom >"$MUNGE_DIR/munge.key")
    munged --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCKET" \
        --pid-file="$MUNGE_DIR/munged.pid" --seed-file="$MUNGE_DIR/munged.seed" \
        --log-file="$LOGS/munged.log" \
        || fail "munged did not start; see $LOGS/munged.log"
    # A credential that round-trips through our socket proves munge is usable.
    munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET" >/dev/null \
        || fail "munge does not work; see $LOGS/munged.log"
}

write_slurm_conf() {
    local cpus node
    # Each node claims every CPU of the machine, and at least 2 (the lesson's job asks for 2 a
    # node): the nodes share the machine's CPUs, which is fine for a teaching cluster.
    cpus=$(nproc)
    [ "$cpus" -ge 2 ] || cpus=2
    {
        echo "# Generated by 03_multi_node/slurm/local_cluster.sh; rewritten on every start."
        echo "ClusterName=ddp-local"
        # slurmctld checks that it runs on the host named here; nodes reach it at the address.
        echo "SlurmctldHost=$(hostname -s)($CONTROLLER_ADDR)"
        echo "SlurmctldPort=$SLURMCTLD_PORT"
        echo "SlurmdPort=$SLURMD_PORT"
        # Trust the CPU counts below even where they exceed what slurmd finds (the nodes share
        # the machine's CPUs), instead of draining such a node as misconfigured.
        echo "SlurmdParameters=config_overrides"
        # Root runs the daemons, so no slurm user or file ownership needs setting up.
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "AuthInfo=socket=$MUNGE_SOCKET"
        echo "StateSaveLocation=$STATE_DIR/ctld/state"
        echo "SlurmctldPidFile=$STATE_DIR/ctld/slurmctld.pid"
        echo "SlurmctldLogFile=$LOGS/slurmctld.log"
        # %n is the node name, so each slurmd has its own spool folder, pid file and log.
        echo "SlurmdSpoolDir=$STATE_DIR/nodes/%n/spool"
        echo "SlurmdPidFile=$STATE_DIR/nodes/%n/slurmd.pid"
        echo "SlurmdLogFile=$LOGS/slurmd-%n.log"
        # Track a job's processes through /proc: works without cgroups, which containers and
        # namespaces often do not delegate. No CPU binding, no accounting database.
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "MpiDefault=none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        # A node that was down comes back by itself when its slurmd registers again.
        echo "ReturnToService=2"
        # A dead node is noticed within 30 s.
        echo "SlurmdTimeout=30"
        # `sbatch --wait` polls the job's state at intervals that grow up to MinJobAge/2 (so
        # that the finished job is still known when it looks): with Slurm's default of 300 s a
        # 20 s job is reported done after 42 s; with 5 s it is reported within 2 s. The cost:
        # a finished job leaves `scontrol show job` soon; its output file stays.
        echo "MinJobAge=5"
        for node in "${NODES[@]}"; do
            echo "NodeName=$node NodeAddr=$(node_addr "$node") CPUs=$cpus State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES" \
            "MaxTime=INFINITE State=UP"
    } >"$CONF"
}

make_network() {
    local node ns addr veth hosts
    ip link add "$BRIDGE" type bridge
    ip addr add "$CONTROLLER_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    # Every node sees every node by name, like the hosts of a real cluster. The second set of
    # lines answers reverse look-ups of the IPv4-mapped IPv6 form in which torch's TCPStore
    # sees its peers: the nodes cannot reach the machine's DNS server, and without these lines
    # every rank would print "The hostname of the client socket cannot be retrieved".
    hosts="127.0.0.1 localhost"$'\n'
    for node in "${NODES[@]}"; do
        hosts+="$(node_addr "$node") $node"$'\n'
    done
    for node in "${NODES[@]}"; do
        hosts+="::ffff:$(node_addr "$node") $node"$'\n'
    done
    for node in "${NODES[@]}"; do
        ns=$(node_namespace "$node")
        addr=$(node_addr "$node")
        veth="ddpv${node#node}"
        ip netns add "$ns"
        # One end on the bridge, the other inside the node, renamed eth0 like a real NIC.
        ip link add "$veth" type veth peer name "${veth}n"
        ip link set "$veth" master "$BRIDGE" up
        ip link set "${veth}n" netns "$ns"
        ip -n "$ns" link set "${veth}n" name eth0
        ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
        # Programs inside reach their own node at 127.0.0.1 too (torchrun, gloo, slurmstepd).
        ip -n "$ns" link set lo up
        printf '%s' "$hosts" >"$STATE_DIR/nodes/$node/hosts"
    done
}

start_daemons() {
    local node ns
    # The controller runs here, in the machine's own namespace, on the bridge address.
    slurmctld -f "$CONF" || fail "slurmctld did not start; see $LOGS/slurmctld.log"
    for node in "${NODES[@]}"; do
        ns=$(node_namespace "$node")
        # nsenter enters the node's network. unshare gives the node its own hostname (a UTS
        # namespace) and its own mounts, private ones, so that the node's hosts file can be
        # bind-mounted over /etc/hosts for the node alone. slurmd and every job it starts
        # inherit all three. (`ip netns exec` would remount /sys and hide the cgroup
        # filesystems, without which slurmd refuses to start.)
        nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private bash -c \
            "mount --bind '$STATE_DIR/nodes/$node/hosts' /etc/hosts && hostname $node \
             && exec slurmd -f '$CONF' -N $node" \
            || fail "slurmd on $node did not start; see $LOGS/slurmd-$node.log"
    done
}

# Say clearly when a firewall on the machine (for example one that filters bridged traffic)
# keeps the nodes apart, rather than leaving a learner with a rendezvous timeout later.
check_network() {
    local node other target
    for node in "${NODES[@]}"; do
        for other in "${NODES[@]}"; do
            # Each node must reach the controller and every other node (torchrun's rendezvous
            # and gloo connect node to node, not only through slurmctld).
            if [ "$node" = "$other" ]; then
                target="$CONTROLLER_ADDR:$SLURMCTLD_PORT"
            else
                target="$(node_addr "$other"):$SLURMD_PORT"
            fi
            # bash opens a TCP connection to /dev/tcp/HOST/PORT; no ping or nc needed. (Each
            # probe sends no message, so slurmd logs one "Zero Bytes were transmitted" error.)
            if ! ip netns exec "$(node_namespace "$node")" timeout 5 bash -c \
                "exec 3<>/dev/tcp/${target%:*}/${target#*:}" 2>/dev/null; then
                echo "error: $node cannot reach $target; if Docker or another firewall filters" \
                    "bridged traffic, allow it: iptables -I FORWARD -i $BRIDGE -o $BRIDGE" \
                    "-j ACCEPT" >&2
                return 1
            fi
        done
    done
}

wait_until_idle() {
    local deadline states
    deadline=$((SECONDS + START_TIMEOUT_S))
    while [ $SECONDS -lt $deadline ]; do
        states=$(SLURM_CONF="$CONF" sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)
        if [ "$(grep -c ' idle$' <<<"$states")" -eq ${#NODES[@]} ]; then
            return 0
        fi
        sleep 1
    done
    {
        echo "error: the nodes were not idle after ${START_TIMEOUT_S} s; their states:"
        echo "${states:-  (sinfo did not answer)}"
        echo "logs: $LOGS/slurmctld.log, $LOGS/slurmd-node1.log, $LOGS/slurmd-node2.log," \
            "$LOGS/munged.log"
    } >&2
    return 1
}

on_failed_start() {
    stop_cluster
    if [ -f "$MARKER" ]; then
        echo "logs kept in $LOGS" >&2
    fi
}

start_cluster() {
    if [ -f "$MARKER" ] && live_pid "$STATE_DIR/ctld/slurmctld.pid" slurmctld >/dev/null; then
        echo "A local cluster is already running; restarting it (its jobs are ended)."
    fi
    # Stopping first makes start idempotent and clears what a crashed run left behind.
    stop_cluster
    # If any step below fails, take down what was started, but keep the logs to read.
    trap on_failed_start EXIT
    make_state_dir
    start_munge
    write_slurm_conf
    make_network
    start_daemons
    # Idle nodes prove that the controller and each node talk; the check then covers the
    # node-to-node paths, and after a failed wait it says whether the network is the cause.
    wait_until_idle && check_network || exit 1
    trap - EXIT
    cat <<EOF
A two-node Slurm cluster is running: node1 ($(node_addr node1)) and node2 ($(node_addr node2)).

Use it from this shell, in the repository root, with your virtual environment active:
  export SLURM_CONF=$CONF
  sinfo                                             # both nodes idle
  sbatch 03_multi_node/slurm/train.sbatch --epochs 5
  squeue                                            # the job while it runs
  cat ddp-lesson03-<jobid>.out                      # its output
Stop it (ends running jobs, removes namespaces and bridge):
  bash $0 stop
Logs: $LOGS
EOF
}

status_cluster() {
    local pid node
    if pid=$(live_pid "$MUNGE_DIR/munged.pid" munged); then
        echo "munged     running (pid $pid)"
    else
        echo "munged     not running"
    fi
    if pid=$(live_pid "$STATE_DIR/ctld/slurmctld.pid" slurmctld); then
        echo "slurmctld  running (pid $pid)"
    else
        echo "slurmctld  not running"
    fi
    for node in "${NODES[@]}"; do
        if pid=$(live_pid "$STATE_DIR/nodes/$node/slurmd.pid" slurmd); then
            echo "slurmd     running on $node, $(node_addr "$node") (pid $pid)"
        else
            echo "slurmd     not running on $node"
        fi
    done
    if live_pid "$STATE_DIR/ctld/slurmctld.pid" slurmctld >/dev/null; then
        echo
        SLURM_CONF="$CONF" sinfo -N
        echo
        SLURM_CONF="$CONF" squeue
        echo
        echo "export SLURM_CONF=$CONF   # to use it from this shell"
    else
        return 1
    fi
}

case "${1:-}" in
    start) require_root_and_tools && start_cluster ;;
    stop) require_root_and_tools && stop_cluster && echo "Local cluster stopped." ;;
    status) require_root_and_tools && status_cluster ;;
    -h | --help | help) usage ;;
    *) usage >&2 && exit 2 ;;
esac
