#!/usr/bin/env bash
# examples/cluster-onprem.yaml brought up with `ray up` on this very machine, then the
# whole flow (import -> train -> eval -> export, `ray=cluster`, submitted as Ray jobs as
# the README's cluster section does), the HTTP service on it (two shard groups, queried
# with curl, then shut down), then `ray down`. Not run by CI: it needs root and
# apt-get, and takes a few minutes.
#
#   sudo examples/ray_up_local.sh            # run from anywhere; output in the terminal
#
# What it starts, and removes again on exit (also on failure or Ctrl-C):
#   - openssh-server and rsync (apt-get; Ray's local provider logs in over ssh, and
#     rsyncs the file mounts), with an sshd of its own listening on 127.0.0.1 only, on
#     port $SSH_PORT, with a generated host key, and a login by a generated key only;
#   - a user $CLUSTER_USER, the cluster file's ssh_user. The cluster runs as this user
#     and not as root because `ray up` and `ray down` run `ray stop` on every node, and
#     `ray stop` ends every Ray process on the machine that its user may signal: as an
#     unprivileged user it can't touch the Ray of anyone else on the machine. Its Ray
#     keeps its files in its own RAY_TMPDIR, so `ray.init()` elsewhere never joins it.
#   - its Python environment, ~/pbg_ray-env, which the cluster file's setup commands
#     activate and install pbg_ray into: made here a virtual environment of the user's own
#     over this Python's packages, so that nothing is downloaded, and the user installs
#     into an environment it owns (this Python's may be root's, a virtual environment
#     under sudo as much as a system one).
#   - a head node at 127.0.0.1 (provider.head_ip) and no worker (worker_ips: one machine).
# The cluster file is examples/cluster-onprem.yaml with only these fields changed:
# head_ip, worker_ips, max_workers, ssh_user, ssh_private_key, and the head's `ray start`
# given ports for the dashboard apart from others'. (Ray's own servers take the machine's
# address, as every local Ray does: `ray start` turns 127.0.0.1 into it.)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CLUSTER_USER=${CLUSTER_USER:-pbgray}
SSH_PORT=${SSH_PORT:-22}
DASHBOARD_PORT=${DASHBOARD_PORT:-8275}  # not Ray's 8265 and 52365, which others' Rays here use
AGENT_PORT=${AGENT_PORT:-52375}
SERVE_PORT=${SERVE_PORT:-8276}  # the HTTP service's, not Serve's default 8000
PYTHON=$(python -c 'import sys; print(sys.executable)')
WORK=$(mktemp -d /tmp/ray_up_local.XXXXXX)
chmod 755 "$WORK"
HOME_DIR=/home/$CLUSTER_USER
ROOT_MODE=$(stat -c %a /root)
SSHD_PID=

step() { printf '\n=== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }
# `ray stop` as the cluster's user lists, one long line each, the Ray processes of others
# that it may not end: left out of the transcript.
others() { grep -v "Could not terminate" || true; }

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    set +e  # remove everything that can be removed
    step "cleaning up"
    if [ -n "$SSHD_PID" ] && [ -f "$WORK/cluster.yaml" ] && kill -0 "$SSHD_PID" 2>/dev/null; then
        RAY_TMPDIR=$WORK/client ray down -y "$WORK/cluster.yaml" 2>&1 | others | tail -3 \
            || echo "ray down failed"
    fi
    if id "$CLUSTER_USER" >/dev/null 2>&1; then
        # ray down stopped the cluster's Ray; whatever of this user's is left is ours.
        for pid in $(pgrep -u "$CLUSTER_USER" || true); do kill "$pid" 2>/dev/null || true; done
        sleep 2
        for pid in $(pgrep -u "$CLUSTER_USER" || true); do kill -9 "$pid" 2>/dev/null || true; done
    fi
    if [ -n "$SSHD_PID" ]; then
        kill "$SSHD_PID" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$SSHD_PID" 2>/dev/null || break; sleep 0.1; done
    fi
    if id "$CLUSTER_USER" >/dev/null 2>&1; then userdel -r "$CLUSTER_USER" 2>/dev/null || true; fi
    chmod "$ROOT_MODE" /root
    # The launcher's files on this side: its config cache (naming this run's key) and
    # its ssh control sockets of this cluster.
    grep -l "$WORK/" /tmp/ray-config-* 2>/dev/null | xargs -r rm -f
    rm -rf /tmp/ray_ssh_*/"$("$PYTHON" -c 'import hashlib; print(hashlib.sha256(b"pbg-ray-onprem").hexdigest()[:10])')"
    rmdir /tmp/ray_ssh_* 2>/dev/null || true
    rm -rf "$WORK" "/tmp/$CLUSTER_USER-ray"
    echo "left: sshd processes $(pgrep -cx sshd || true), user $CLUSTER_USER" \
         "$(id "$CLUSTER_USER" >/dev/null 2>&1 && echo yes || echo no), /root mode $(stat -c %a /root)"
    exit "$rc"
}
if id "$CLUSTER_USER" >/dev/null 2>&1; then  # the cleanup removes the user: never someone's
    echo "user $CLUSTER_USER exists; run with CLUSTER_USER=<a new name>" >&2
    exit 1
fi
trap cleanup EXIT INT TERM

step "installing openssh-server and rsync"
if ! command -v /usr/sbin/sshd >/dev/null || ! command -v rsync >/dev/null; then
    apt-get install -y --no-install-recommends openssh-server rsync >"$WORK/apt.log" 2>&1 \
        || { apt-get update >/dev/null && apt-get install -y --no-install-recommends \
             openssh-server rsync >"$WORK/apt.log" 2>&1; }
fi
/usr/sbin/sshd -V 2>&1 | head -1 || true

step "user $CLUSTER_USER with a generated key; sshd on 127.0.0.1:$SSH_PORT"
useradd -m -s /bin/bash "$CLUSTER_USER"
usermod -p '*' "$CLUSTER_USER"  # no password, but not a locked account: key logins work
chmod 711 /root  # the user runs root's Python (under /root/.pyenv): traverse only
ssh-keygen -q -t ed25519 -N '' -f "$WORK/id_ed25519" -C "ray up on 127.0.0.1"
ssh-keygen -q -t ed25519 -N '' -f "$WORK/host_key"
install -d -m 700 -o "$CLUSTER_USER" -g "$CLUSTER_USER" "$HOME_DIR/.ssh"
install -m 600 -o "$CLUSTER_USER" -g "$CLUSTER_USER" "$WORK/id_ed25519.pub" \
    "$HOME_DIR/.ssh/authorized_keys"
# The nodes' environment: Ray's files kept apart; the Python environment below.
echo "export RAY_TMPDIR=/tmp/$CLUSTER_USER-ray" >>"$HOME_DIR/.bashrc"
cat >"$WORK/sshd_config" <<EOF
ListenAddress 127.0.0.1
Port $SSH_PORT
HostKey $WORK/host_key
PidFile $WORK/sshd.pid
AllowUsers $CLUSTER_USER
PermitRootLogin no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
AuthorizedKeysFile .ssh/authorized_keys
UsePAM no
MaxStartups 50
EOF
mkdir -p /run/sshd
/usr/sbin/sshd -f "$WORK/sshd_config" -E "$WORK/sshd.log"
for _ in $(seq 50); do [ -s "$WORK/sshd.pid" ] && break; sleep 0.1; done
SSHD_PID=$(cat "$WORK/sshd.pid")
ssh -q -p "$SSH_PORT" -i "$WORK/id_ed25519" -o StrictHostKeyChecking=no \
    -o UserKnownHostsFile=/dev/null "$CLUSTER_USER@127.0.0.1" 'echo "ssh: logged in as $(whoami) on $(hostname)"'

step "$CLUSTER_USER's Python environment ~/pbg_ray-env, over $PYTHON's packages"
# A virtual environment of the user's own whose site-packages names this Python's (a .pth
# file: their own .pth files, such as root's editable pbg_ray, stay out), with their
# commands (ray, serve, ...) run by its python: its pip installs into it alone.
runuser -u "$CLUSTER_USER" -- "$PYTHON" - "$HOME_DIR/pbg_ray-env" <<'EOF'
import os
import site
import sys
import sysconfig
import venv
from importlib.metadata import distributions

env = sys.argv[1]
venv.create(env, with_pip=True)
root_site = site.getsitepackages()
with open(f"{sysconfig.get_path('purelib', vars={'base': env})}/root_packages.pth", "w") as f:
    f.write("".join(f"{path}\n" for path in root_site))
for dist in distributions(path=root_site):
    for ep in dist.entry_points.select(group="console_scripts"):
        script = f"{env}/bin/{ep.name}"
        if not os.path.exists(script):
            with open(script, "w") as f:
                f.write(f"#!{env}/bin/python\nimport sys\nfrom importlib.metadata import "
                        f"EntryPoint\nsys.exit(EntryPoint({ep.name!r}, {ep.value!r}, "
                        "'console_scripts').load()())\n")
            os.chmod(script, 0o755)
print(f"{env}: python {sys.version.split()[0]}, {len(os.listdir(f'{env}/bin'))} commands")
EOF

step "the cluster file: examples/cluster-onprem.yaml on 127.0.0.1"
"$PYTHON" - "$REPO" "$WORK" "$CLUSTER_USER" "$DASHBOARD_PORT" "$AGENT_PORT" <<'EOF'
import sys
import yaml
repo, work, user, dashboard, agent = sys.argv[1:]
config = yaml.safe_load(open(f"{repo}/examples/cluster-onprem.yaml"))
config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
config["max_workers"] = 0
config["auth"] = {"ssh_user": user, "ssh_private_key": f"{work}/id_ed25519"}
config["file_mounts"] = {"~/pbg_ray": repo}
ports = f"--dashboard-port={dashboard} --dashboard-agent-listen-port={agent}"
config["head_start_ray_commands"] = [c.replace("ray start --head", f"ray start --head {ports}")
                                     for c in config["head_start_ray_commands"]]
yaml.safe_dump(config, open(f"{work}/cluster.yaml", "w"), sort_keys=False)
EOF
diff <(sed '/^#/d' "$REPO/examples/cluster-onprem.yaml") "$WORK/cluster.yaml" || true
if [ "$SSH_PORT" != 22 ]; then
    echo "ssh_proxy_command is needed for a port other than 22" >&2
    exit 1
fi

step "ray up"
export RAY_TMPDIR=$WORK/client  # the launcher's own state files, on this side
mkdir -p "$RAY_TMPDIR"
(cd "$REPO" && ray up -y --no-config-cache "$WORK/cluster.yaml") 2>&1 | others
ray exec --no-config-cache "$WORK/cluster.yaml" \
    'ray status; cd / && python -c "import pbg_ray; print(\"the head imports\", pbg_ray.__file__)"'

step "a graph of 20,000 edges: train shards (Parquet) and a test file (TSV)"
DATA=$HOME_DIR/graph
install -d -o "$CLUSTER_USER" -g "$CLUSTER_USER" "$DATA" "$DATA/raw" "$DATA/raw/train"
"$PYTHON" - "$DATA" <<'EOF'
import sys
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
data = sys.argv[1]
rng = np.random.default_rng(0)
n = 20_000
users = np.array([f"user{i}" for i in range(2000)])
items = np.array([f"item{i}" for i in range(300)])
rel = rng.choice(["follows", "likes"], n)
lhs = users[rng.zipf(1.5, n) % len(users)]
rhs = np.where(rel == "follows", users[rng.integers(len(users), size=n)],
               items[rng.zipf(1.5, n) % len(items)])
table = pa.table({"lhs": lhs, "rel": rel, "rhs": rhs})
for i in range(4):
    pq.write_table(table.slice(i * 4500, 4500), f"{data}/raw/train/part-{i}.parquet")
with open(f"{data}/raw/test.tsv", "w") as f:
    for row in table.slice(18_000).to_pylist():
        f.write(f"{row['lhs']}\t{row['rel']}\t{row['rhs']}\n")
EOF
sed -e "s|\"data/|\"$DATA/|g" -e "s|checkpoint_path=\"model\"|checkpoint_path=\"$DATA/model\"|" \
    -e 's/num_epochs=5/num_epochs=3/' "$REPO/examples/own_graph/config.py" >"$DATA/config.py"
chown -R "$CLUSTER_USER:$CLUSTER_USER" "$DATA"

submit() {
    step "ray job submit: $*"
    ray job submit --address "http://127.0.0.1:$DASHBOARD_PORT" --working-dir "$DATA" -- "$@"
}
submit python -m pbg_ray.import_edges config.py ray=cluster importer.engine=ray \
    "importer.inputs=[$DATA/raw/train/,$DATA/raw/test.tsv]" "eval_edge_paths=[$DATA/test]"
submit python -m pbg_ray.train config.py ray=cluster ray.num_trainers=2
submit python -m pbg_ray.eval config.py ray=cluster "eval.edge_paths=[$DATA/test]"
submit python -m pbg_ray.export config.py export.format=parquet "export.output=$DATA/export"
ray exec --no-config-cache "$WORK/cluster.yaml" "ls -l $DATA/export; ray status | head -12"

step "ray job submit --no-wait: python -m pbg_ray.serve, two shard groups"
# The service runs until stopped: a job that does not end. Its answers are fetched with
# curl on 127.0.0.1:$SERVE_PORT, the head's address here (serve.host=0.0.0.0 opens it to
# other machines).
SERVE_JOB=$(ray job submit --address "http://127.0.0.1:$DASHBOARD_PORT" --no-wait \
    --working-dir "$DATA" -- python -m pbg_ray.serve config.py ray=cluster \
    serve.shard_groups=2 serve.index=hnsw serve.index_min_rows=0 "serve.port=$SERVE_PORT" \
    2>&1 | sed -n "s/.*Job '\(raysubmit_[A-Za-z0-9]*\)' submitted successfully.*/\1/p")
echo "job $SERVE_JOB"
for _ in $(seq 180); do
    curl -sf "http://127.0.0.1:$SERVE_PORT/health" >/dev/null && break
    sleep 1
done
ray job logs --address "http://127.0.0.1:$DASHBOARD_PORT" "$SERVE_JOB" | grep -v "^INFO\|^(" || true
query() {
    echo "\$ curl $*"
    curl -s --max-time 60 "$@" || echo "curl failed ($?)"
    echo
}
query "http://127.0.0.1:$SERVE_PORT/metadata"
query --json '{"queries": [{"lhs": "user1", "relation": "likes"}], "k": 5}' \
    "http://127.0.0.1:$SERVE_PORT/top_rhs"
query --json '{"queries": [{"entity": "user1"}], "k": 5}' "http://127.0.0.1:$SERVE_PORT/neighbors"
ray exec --no-config-cache "$WORK/cluster.yaml" \
    "serve status -a http://127.0.0.1:$DASHBOARD_PORT | grep -E 'status|Shard|Router'" || true

step "the service shut down: serve shutdown, then the job stopped"
ray exec --no-config-cache "$WORK/cluster.yaml" \
    "serve shutdown -y -a http://127.0.0.1:$DASHBOARD_PORT"
ray job stop --address "http://127.0.0.1:$DASHBOARD_PORT" "$SERVE_JOB" | tail -1
curl -s --max-time 5 "http://127.0.0.1:$SERVE_PORT/health" || echo "port $SERVE_PORT: nothing answers"

step "ray down"
ray down -y "$WORK/cluster.yaml" 2>&1 | others
rm "$WORK/cluster.yaml"  # done: cleanup() has nothing to take down
echo "the whole flow ran on the cluster that ray up started"
