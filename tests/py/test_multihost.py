"""More than one machine, for real (issue 16): two hosts made of network namespaces.

The test makes two network namespaces on this machine, joined by a veth pair, as two
hosts with their own addresses (10.77.0.1 and 10.77.0.2) and their own host names
(each in its own UTS namespace). mpirun runs in the first one with a hostfile naming
the two addresses (2 slots each) and a launch agent in place of ssh
(`plm_rsh_agent`): given "HOST cmd...", as ssh would be, it starts the command inside
the namespace that owns HOST, with a fresh environment (`env -i`, as a login over ssh
would give). So OpenMPI starts its daemon (orted) on the second "host" through the
agent, exactly as it would over ssh, and the ranks there reach the others only over
TCP on the veth: `--mca pml ob1 --mca btl tcp,self` (no shared memory, no UCX) and
`btl_tcp_if_include` / `oob_tcp_if_include` naming the veth network.
docs/distributed.md, "Across machines", is the same recipe for real hosts.

Checked: each rank ran in the namespace of its host (the rank's /proc/self/ns/net
against /run/netns/NAME, and its host name); gradients really crossed the veth (its
byte counters); and the run trains like one process: every step's loss, the validation
losses and the final weights, with test_dist.py's recipe and tolerances
(assert_same_run: 1e-5 relative, weights 1e-5 norm-wise).

The layouts are LAYOUTS, (name, [parallelism] overrides) over 2 hosts x 2 ranks. This
needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) for `ip netns`; where namespaces cannot be
made the test skips, saying what `ip netns add` answered. `ip` (iproute2) and mpirun
missing are failures: scripts/setup.sh installs both."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import oracle
from conftest import BIN, crashed
from test_dist import STEPS, assert_same_run, train_args

HOSTS = ("10.77.0.1", "10.77.0.2")
NET = "10.77.0.0/24"
SLOTS = 2  # ranks per host
WORLD = SLOTS * len(HOSTS)

# (name, [parallelism] overrides); every layout runs on WORLD = 4 ranks, 2 per host, and
# must train like one process. Ranks are numbered host by host (0, 1 on the first), and
# the mesh's first dimension varies slowest, so in dp2_x_fsdp2 each FSDP group is on one
# host and the replicas' gradient all-reduce crosses the network; fsdp4's all-gathers
# and reduce-scatters all cross it; in pp2_x_fsdp2 (issue 16's acceptance) each pipeline
# stage is one host's FSDP group and the activations and their gradients cross it (point
# to point). The first layout also runs the resume test. (The data-parallel degree, which
# sets the validation batch per rank, is derived from the overrides by dp_degree below.)
LAYOUTS = [
    ("pp2_x_fsdp2", ["--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2"]),
    ("dp2_x_fsdp2", ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=2"]),
    ("fsdp4", ["--parallelism.data_parallel_shard_degree=4"]),
]

# Shared by both hosts' ranks; the second host's orted starts with `env -i`, so whatever a
# rank there needs is forwarded with -x (FORWARD). One thread per rank: 4 ranks share the
# cores. CTITAN_KERNEL_TUNE=0 (conftest): the registry's kernels, not a timed choice.
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
           OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
ENV.pop("CTITAN_LOG_RANKS", None)
FORWARD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CTITAN_KERNEL_TUNE")


def dp_degree(overrides):
    """Data-parallel degree of a layout: the world over the non-data-parallel degrees."""
    other = 1
    for o in overrides:
        key, _, val = o.removeprefix("--parallelism.").partition("=")
        if key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
            other *= int(val)
    return WORLD // other


def ip(*args, check=True):
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def veth_bytes(ns, dev):
    st = json.loads(ip("-j", "-s", "-n", ns, "link", "show", "dev", dev).stdout)[0]["stats64"]
    return st["tx"]["bytes"], st["rx"]["bytes"]


AGENT = """#!/bin/sh
# OpenMPI's remote launch agent (plm_rsh_agent) in place of ssh: "agent HOST cmd..."
# runs cmd inside the network namespace of HOST, under its host name, with a fresh
# environment as an ssh login would give. Like ssh, the words of cmd are joined with
# spaces and given to a shell. With CTITAN_TEST_UNSHARED=DIR in mpirun's environment,
# the host sees its own empty DIR (a tmpfs in the mount namespace of `ip netns exec`):
# a folder that is not on a shared file system.
host=$1; shift
case "$host" in
{cases}
  *) echo "agent: no host $host" >&2; exit 255;;
esac
exec ip netns exec "$ns" unshare --uts sh -c '
  if [ -n "$4" ]; then mount -t tmpfs none "$4" || exit 1; fi
  hostname "$1" && exec env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$3" sh -c "$2"' \
  sh "$name" "$*" "$HOME" "${{CTITAN_TEST_UNSHARED:-}}"
"""

# Each rank records where it runs, then becomes ctitan (exec: same process, same namespaces).
RANK = """#!/bin/sh
echo "$(hostname) $(stat -L -c %i /proc/self/ns/net)" > "{dir}/rank-$OMPI_COMM_WORLD_RANK"
exec "$@"
"""


def remove_namespace(ns):
    # processes left in a namespace (an orted after a failed run) are this test's own
    for pid in ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass
    ip("netns", "del", ns, check=False)  # takes its end of the veth pair, and so the pair, with it


def sweep_stale():
    """Namespaces of an earlier run of this test that was killed before its clean-up
    (ctmh<pid>a/b whose pid is gone)."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith("ctmh") and ns[4:-1].isdigit() and ns[-1] in "ab" and not Path(f"/proc/{ns[4:-1]}").exists():
            remove_namespace(ns)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two network namespaces joined by a veth pair, as two hosts; removed afterwards."""
    if shutil.which("ip") is None:
        pytest.fail("ip not found: run scripts/setup.sh (installs iproute2)", pytrace=False)
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun not found: run scripts/setup.sh (installs openmpi-bin)", pytrace=False)
    d = tmp_path_factory.mktemp("multihost")
    sweep_stale()
    tag = f"ctmh{os.getpid()}"
    names = [f"{tag}{c}" for c in "ab"]  # namespaces; the veth ends take the same names (<= 15 chars)
    made = []
    try:
        for ns in names:
            p = ip("netns", "add", ns, check=False)
            if p.returncode != 0:
                pytest.skip(f"cannot make network namespaces here (uid {os.getuid()}): `ip netns add {ns}` "
                            f"exit {p.returncode}: {p.stderr.strip()}")
            made.append(ns)
        ip("link", "add", names[0], "type", "veth", "peer", "name", names[1])
        for ns, addr in zip(names, HOSTS):
            ip("link", "set", ns, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", ns, "up")
        (d / "hosts").write_text("".join(f"{h} slots={SLOTS}\n" for h in HOSTS))
        cases = "\n".join(f"  {h}) ns={ns}; name=host{i};;" for i, (h, ns) in enumerate(zip(HOSTS, names)))
        agent = d / "agent"
        agent.write_text(AGENT.format(cases=cases))
        agent.chmod(0o755)
        yield {"dir": d, "ns": names, "hostfile": d / "hosts", "agent": agent}
    finally:
        for ns in made:
            remove_namespace(ns)


def mpirun_across(h, args, rankdir, timeout=120, check=True, env=ENV):
    """mpirun in the first host's namespace (under its host name), WORLD ranks over the hostfile."""
    rank = rankdir / "rank.sh"
    rank.write_text(RANK.format(dir=rankdir))
    rank.chmod(0o755)
    cmd = ["ip", "netns", "exec", h["ns"][0], "unshare", "--uts", "sh", "-c", 'hostname host0 && exec "$@"', "sh",
           shutil.which("mpirun"), "-np", str(WORLD), "--hostfile", str(h["hostfile"]), "--bind-to", "none",
           "--mca", "plm_rsh_agent", str(h["agent"]), "--mca", "plm_rsh_no_tree_spawn", "1",
           "--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "coll", "^sm",
           "--mca", "btl_tcp_if_include", NET, "--mca", "oob_tcp_if_include", NET,
           *[a for v in FORWARD if v in ENV for a in ("-x", v)],
           str(rank), str(BIN), *[str(a) for a in args]]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 0 or not check, f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """test_dist.py's untied model and data, and the one-process run every layout must equal."""
    d = tmp_path_factory.mktemp("multihost_recipe")
    oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=3, heads=4, kv_heads=2, head_dim=8,
                       tied=False).save_pretrained(d / "model")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    single = d / "single"
    p = subprocess.run([str(BIN), *[str(a) for a in train_args(d / "model", data, single)]], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return d, data, single


@pytest.mark.parametrize("name,overrides", LAYOUTS, ids=[n for n, _ in LAYOUTS])
def test_two_hosts_match_one_process(hosts, recipe, name, overrides):
    d, data, single = recipe
    out = hosts["dir"] / name
    rankdir = out / "ranks"
    rankdir.mkdir(parents=True)
    a, b = hosts["ns"]
    before = veth_bytes(b, b)
    p = mpirun_across(hosts, train_args(d / "model", data, out, *overrides, dp=dp_degree(overrides)), rankdir)
    after = veth_bytes(b, b)

    # every rank ran on the host the hostfile gave it: 0, 1 on the first, 2, 3 on the second
    where = {r: (rankdir / f"rank-{r}").read_text().split() for r in range(WORLD) if (rankdir / f"rank-{r}").exists()}
    assert sorted(where) == list(range(WORLD)), f"ranks that ran: {sorted(where)}"
    own = os.stat("/proc/self/ns/net").st_ino
    for r, (host, ino) in where.items():
        i = r // SLOTS
        want = os.stat(f"/run/netns/{hosts['ns'][i]}").st_ino
        assert (host, int(ino)) == (f"host{i}", want), f"rank {r} ran on {host} in net namespace {ino}, " \
            f"want host{i} in {want} ({hosts['ns'][i]}; this test's own is {own})"

    # the ranks talked over the veth: the second host sent and received at least 8 KiB per
    # step (a pipeline's activations here are ~15 KB a step; data parallel sends gradients)
    sent, got = after[0] - before[0], after[1] - before[1]
    assert min(sent, got) >= STEPS * 8192, f"the second host's veth moved {sent} bytes out, {got} in"

    assert len([l for l in p.stdout.splitlines() if l.startswith("step: 1 ")]) == 1, p.stdout
    assert_same_run(out, single, f"{name} over two hosts")


def test_resume_across_hosts_needs_a_shared_checkpoint_folder(hosts, recipe):
    """Stopped after step 4 (rank 0 saves into the dump folder, shared here as a network file
    system would be), the job resumes across both hosts and the steps after the checkpoint
    equal one process's. Where the second host does not see the folder (its own empty
    directory there), every rank used to pick for itself: the first host's ranks resumed at
    step 4 and the second's started from the initial weights, and the job trained on a mix of
    the two without a word. Now the ranks compare what they found and stop, saying so."""
    d, data, single = recipe
    name, overrides = LAYOUTS[0]
    out = hosts["dir"] / "resume"
    args = train_args(d / "model", data, out, *overrides, "--checkpoint.last_save_model_only=false",
                      dp=dp_degree(overrides))
    ranks = hosts["dir"] / "resume_ranks"
    ranks.mkdir()
    p = mpirun_across(hosts, args + ["--training.stop_at_step=4"], ranks, check=False)
    assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
    assert (out / "checkpoint" / "step-4" / "optim.safetensors").exists()

    p = mpirun_across(hosts, args, ranks, check=False, env=dict(ENV, CTITAN_TEST_UNSHARED=str(out)))
    assert p.returncode != 0, "resumed with a checkpoint folder that only one host sees"
    # every rank reports the disagreement, but the first to abort takes the others down, so
    # which rank's line is printed depends on timing: one that found step-4 must say so
    want = rf"rank \d of {WORLD} found {re.escape(str(out / 'checkpoint' / 'step-4'))}, another rank none"
    assert re.search(want, p.stderr) and "every rank sees" in p.stderr, p.stderr[-3000:]
    assert not (out / "checkpoint" / f"step-{STEPS}").exists()

    p = mpirun_across(hosts, args, ranks)
    assert "resuming from" in p.stderr and "(step 4)" in p.stderr, p.stderr[-3000:]
    assert_same_run(out, single, f"{name} over two hosts, resumed at step 4", steps=range(5, STEPS + 1))
