"""The deployment recipes of deploy/: each file checked by the tool its kind has (the Kubernetes
schemas, ``systemd-analyze verify``, hadolint, shellcheck), and every command line in them parsed by
the real ``kcoral`` argparse, so that a renamed or removed flag fails here rather than on a cluster.
The Slurm batch script also runs, on loopback, against a real router.

What is not run here: a container build (no engine), a cluster, systemd as PID 1, Slurm itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from benchmarks.simulated_hosts import BROKER_UNIT, ROUTER_UNIT, Keys, python_command, unit_command, unit_settings
from kcoral import protocol
from kcoral.cli import arguments, build_parser
from kcoral.testing import free_port, start_router

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
BATCH_SCRIPT = DEPLOY / "slurm" / "kcoral-broker.sbatch"
# Programs may run this long (protocol.MAX_TIMEOUT_SECONDS); a drain must be allowed as much.
LONGEST_PROGRAM_SECONDS = protocol.MAX_TIMEOUT_SECONDS


def tool(name: str) -> str:
    """A linter installed by the test extra: on PATH, or beside this interpreter (an unactivated venv)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """``kcoral ARGV`` parsed by the real parser; the key files named need not exist here."""
    parser = build_parser()
    for action in _all_actions(parser):
        if action.type is arguments.existing_path:
            action.type = arguments.absolute_path
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"kcoral does not take {shlex.join(argv)} (exit {exc.code})") from None


def _all_actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_actions(sub)


# --- Kubernetes -----------------------------------------------------------------------------------


def kustomization_documents(directory: Path) -> list[dict[str, Any]]:
    """The resources a kustomization lists, read as kustomize would for these simple ones: its
    resources and components (recursively), with its namespace set."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    documents: list[dict[str, Any]] = []
    for entry in [*kustomization.get("resources", []), *kustomization.get("components", [])]:
        path = (directory / entry).resolve()
        if path.is_dir():
            documents += kustomization_documents(path)
        else:
            documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    namespace = kustomization.get("namespace")
    for document in documents:
        if namespace and document["kind"] != "Namespace":
            document["metadata"]["namespace"] = namespace
    return documents


def rendered(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIRECTORY`` where kubectl is installed, else the resources read here."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return kustomization_documents(directory)
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    documents = rendered(KUBERNETES / "overlays" / "prometheus-operator")
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    assert len(by_kind) == len(documents)
    return by_kind


@pytest.mark.parametrize("overlay", ["base", "overlays/prometheus-operator"])
def test_the_manifests_are_valid_against_the_kubernetes_schemas(overlay: str) -> None:
    documents = rendered(KUBERNETES / overlay)
    kinds = sorted(d["kind"] for d in documents)
    version = kubernetes_validate.latest_version()
    checked = 0
    for document in documents:
        if document["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # the Prometheus Operator's kinds: see test_the_monitors_scrape_the_metrics_ports
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{document['kind']}/{document['metadata']['name']}: {exc.message}") from None
        checked += 1
    assert {"Namespace", "Service", "Deployment", "DaemonSet"} <= set(kinds) and checked >= 4
    assert all(d["metadata"].get("namespace") == "kcoral" for d in documents if d["kind"] != "Namespace")


def containers(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in manifest["spec"]["template"]["spec"]["containers"]}


def mounted(path: str, container: dict[str, Any], pod: dict[str, Any]) -> dict[str, Any]:
    """The pod volume that ``path`` lies in, through the container's mounts."""
    for mount in container["volumeMounts"]:
        if path.startswith(mount["mountPath"].rstrip("/") + "/") or path == mount["mountPath"]:
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            return volume
    raise AssertionError(f"{path} is on no volume of the container")


def test_the_router_deployment_serves_clients_and_nodes_with_keys_from_secrets(
    manifests: dict[tuple[str, str], dict[str, Any]],
) -> None:
    deployment = manifests[("Deployment", "kcoral-router")]
    pod = deployment["spec"]["template"]["spec"]
    router = containers(deployment)["router"]
    args = parse_cli(router["args"])
    assert args.command == "router" and args.log_json
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert args.listen.endswith(f":{ports['clients']}") and args.nodes_listen.endswith(f":{ports['nodes']}")
    assert args.metrics_listen.endswith(f":{ports['metrics']}")
    for path in (args.curve_secret_key, args.authorized_keys, args.authorized_node_keys):
        assert "secret" in mounted(str(path), router, pod), path
    # Readiness: `kcoral status` against its own client port, as a client with an authorised key.
    probe = router["readinessProbe"]["exec"]["command"]
    assert probe[0] == "kcoral"
    status = parse_cli(probe[1:])
    assert status.command == "status" and status.ready and status.url.endswith(f":{ports['clients']}")
    for path in (status.server_key, status.client_key):
        assert "secret" in mounted(str(path), router, pod), path
    assert pod["terminationGracePeriodSeconds"] >= LONGEST_PROGRAM_SECONDS
    service = manifests[("Service", "kcoral-router")]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_the_broker_daemonset_claims_the_gpus_and_dials_the_router_as_its_node(
    manifests: dict[tuple[str, str], dict[str, Any]],
) -> None:
    daemonset = manifests[("DaemonSet", "kcoral-broker")]
    pod = daemonset["spec"]["template"]["spec"]
    broker = containers(daemonset)["broker"]
    env = {e["name"]: e for e in broker["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Kubernetes expands $(NODE_NAME) in args; a node name parses as a node id.
    argv = [a.replace("$(NODE_NAME)", "gpu-node-7.example") for a in broker["args"]]
    args = parse_cli(argv)
    assert args.command == "broker" and args.node_id == "gpu-node-7.example"
    assert "$(NODE_NAME)" in broker["args"]
    service = manifests[("Service", "kcoral-router")]
    nodes_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "nodes")
    assert args.upstream == f"tcp://{service['metadata']['name']}:{nodes_port}"
    assert "secret" in mounted(str(args.upstream_server_key), broker, pod)
    assert "secret" in mounted(str(args.upstream_key), broker, pod)
    assert "emptyDir" in mounted(str(args.run_dir), broker, pod)
    assert "hostPath" in mounted(str(args.cache_dir), broker, pod)
    assert int(broker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert any(e["key"] == "nvidia.com/gpu.present" for t in terms for e in t["matchExpressions"])
    probe = broker["readinessProbe"]["exec"]["command"]
    assert probe[0] == "kcoral" and parse_cli(probe[1:]).ready and parse_cli(probe[1:]).url == args.listen
    assert pod["terminationGracePeriodSeconds"] >= LONGEST_PROGRAM_SECONDS
    metrics_port = next(p["containerPort"] for p in broker["ports"] if p["name"] == "metrics")
    assert args.metrics_listen.endswith(f":{metrics_port}")
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics_port)


def test_the_monitors_scrape_the_metrics_ports(manifests: dict[tuple[str, str], dict[str, Any]]) -> None:
    service_monitor = manifests[("ServiceMonitor", "kcoral-router")]
    service = manifests[("Service", "kcoral-router")]
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in service_monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    pod_monitor = manifests[("PodMonitor", "kcoral-broker")]
    daemonset = manifests[("DaemonSet", "kcoral-broker")]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in containers(daemonset)["broker"]["ports"]}
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= ports


# --- bubblewrap in a container --------------------------------------------------------------------

# Paths a container runtime masks in /proc by default, and how: a file gets /dev/null, a directory
# an empty read-only tmpfs.
CONTAINER_MASKS = ("/proc/kcore", "/proc/timer_list", "/proc/sched_debug", "/proc/acpi", "/proc/scsi")


def test_a_broker_whose_proc_is_masked_as_in_a_container_refuses_to_start_and_names_the_fix(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("masking /proc in a mount namespace of the test's own needs root and unshare")
    masks = [p for p in CONTAINER_MASKS if Path(p).exists()]
    if not masks:
        pytest.skip(f"none of {CONTAINER_MASKS} exists here to mask")
    mount = [
        f"mount -t tmpfs -o ro,size=4k tmpfs {p}" if Path(p).is_dir() else f"mount --bind /dev/null {p}" for p in masks
    ]
    broker = shlex.join(python_command(["kcoral", "broker", "--listen", f"tcp://127.0.0.1:{free_port()}"]))
    script = " && ".join([*mount, f"exec {broker} --device cpu --workers 1 --run-dir {tmp_path / 'run'}"])
    # A mount namespace of its own (private: nothing reaches the host's), gone when the broker exits.
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == arguments.EXIT_CONFIG, done.stdout + done.stderr
    assert "Can't mount proc" in done.stderr and "systempaths=unconfined" in done.stderr
    assert "procMount: Unmasked" in done.stderr and masks[0] in done.stderr


def test_masked_proc_paths_reads_the_mounts_below_proc() -> None:
    from kcoral.sandbox.bubblewrap import masked_proc_paths

    mountinfo = "\n".join(
        [
            "22 1 0:21 / /proc rw,nosuid - proc proc rw",
            "23 22 0:5 /null /proc/kcore rw - devtmpfs udev rw",
            "24 22 0:40 / /proc/acpi ro - tmpfs tmpfs ro",
            "25 22 0:41 / /proc/sys/fs/binfmt_misc rw - autofs systemd-1 rw",
            "26 1 0:42 / /process-data rw - ext4 /dev/sda1 rw",
        ]
    )
    assert masked_proc_paths(mountinfo) == ["/proc/kcore", "/proc/acpi"]


# --- readiness ------------------------------------------------------------------------------------


def ready(url: str) -> subprocess.CompletedProcess[str]:
    """``kcoral status --ready URL``, as the readiness probes run it."""
    argv = python_command(["kcoral", "status", "--ready", url])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_status_ready_says_whether_a_broker_has_joined_its_router(tmp_path: Path, broker_factory: Any) -> None:
    nodes_url = f"tcp://127.0.0.1:{free_port()}"
    broker = broker_factory("--workers", "1", "--upstream", nodes_url, "--node-id", "n1")
    # Every slot is ready, but no router listens at --upstream yet: not ready, and why.
    waiting = ready(broker.url)
    assert waiting.returncode == arguments.EXIT_NOT_READY and not waiting.stdout, waiting
    assert f"not registered with the router at {nodes_url} as node n1" in waiting.stderr
    router = start_router(tmp_path, nodes_url=nodes_url, timeout_seconds=30)
    try:
        deadline = time.monotonic() + 30
        while (done := ready(broker.url)).returncode != 0:
            assert time.monotonic() < deadline, done.stderr
            time.sleep(0.5)
        assert done.stdout == "" and ready(router.url).returncode == 0
        status = subprocess.run(
            python_command(["kcoral", "status", broker.url]), capture_output=True, text=True, timeout=60
        )
        assert f"upstream  {nodes_url} as node n1: registered (router " in status.stdout
    finally:
        router.stop()
    unreachable = ready(f"tcp://127.0.0.1:{free_port()}")
    assert unreachable.returncode == arguments.EXIT_UNAVAILABLE


def test_not_ready_names_the_reason() -> None:
    from kcoral.cli.status import not_ready

    assert not_ready({"status": "ok", "role": "router"}) is None
    assert not_ready({"status": "draining", "role": "router"}) == "status 'draining'"
    starting = {"status": "ok", "ready": False, "workers": {"idle": 1, "slots": 2}}
    assert not_ready(starting) == "worker slots starting: 1 of 2 ready"
    joined = {"status": "ok", "ready": True, "upstream": {"url": "tcp://r:6001", "node_id": "a", "registered": True}}
    assert not_ready(joined) is None and not_ready({"status": "ok", "ready": True}) is None


# --- systemd ---------------------------------------------------------------------------------------


def test_the_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # A root of the units' own: the system's units (verify needs their targets), the two units,
    # and a stand-in for the installed kcoral at the path ExecStart names.
    (tmp_path / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", tmp_path / "usr/lib/systemd/system", symlinks=True)
    units = tmp_path / "etc/systemd/system"
    units.mkdir(parents=True)
    for unit in (ROUTER_UNIT, BROKER_UNIT):
        shutil.copy(unit, units)
        executable = tmp_path / unit_settings(unit, "ExecStart")[0].split()[0].lstrip("/")
        executable.parent.mkdir(parents=True, exist_ok=True)
        executable.write_text("#!/bin/sh\n")
        executable.chmod(0o755)
    done = subprocess.run(
        [analyze, "verify", f"--root={tmp_path}", ROUTER_UNIT.name, BROKER_UNIT.name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr


def test_the_units_drain_on_stop_and_their_command_lines_parse() -> None:
    for unit in (ROUTER_UNIT, BROKER_UNIT):
        assert unit_settings(unit, "KillMode") == ["mixed"] and unit_settings(unit, "KillSignal") == ["SIGTERM"]
        assert int(unit_settings(unit, "TimeoutStopSec")[0]) >= LONGEST_PROGRAM_SECONDS
        assert unit_settings(unit, "Restart") == ["on-failure"]
        assert set(unit_settings(unit, "RestartPreventExitStatus")[0].split()) == {"2", str(arguments.EXIT_CONFIG)}
    router = unit_command(ROUTER_UNIT, {}, {"d": "/run/credentials/kcoral-router.service"})
    args = parse_cli(python_command(router)[3:])
    assert args.command == "router" and str(args.curve_secret_key).startswith("/run/credentials/")
    environment = {"KCORAL_UPSTREAM": "tcp://router.example:6001", "KCORAL_BROKER_ARGS": "--workers-per-gpu 2"}
    specifiers = {"d": "/run/credentials/kcoral-broker.service", "S": "/var/lib", "C": "/var/cache", "H": "gpu-7"}
    args = parse_cli(python_command(unit_command(BROKER_UNIT, environment, specifiers))[3:])
    assert args.command == "broker" and args.node_id == "gpu-7" and args.workers_per_gpu == 2
    # The run directory and the cache are the unit's StateDirectory and CacheDirectory.
    assert args.run_dir == Path("/var/lib") / unit_settings(BROKER_UNIT, "StateDirectory")[0]
    assert args.cache_dir == Path("/var/cache") / unit_settings(BROKER_UNIT, "CacheDirectory")[0]
    # Without KCORAL_UPSTREAM (no EnvironmentFile yet) the broker refuses to start: exit 2, not restarted.
    with pytest.raises(AssertionError, match="exit 2"):
        parse_cli(python_command(unit_command(BROKER_UNIT, {}, specifiers))[3:])


# --- the container image ---------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_the_dockerfile_passes_hadolint() -> None:
    done = subprocess.run([tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_image_runs_kcoral_on_a_cuda_runtime_base_and_its_sources_build(tmp_path: Path) -> None:
    instructions = dockerfile_instructions()
    arguments_ = {k: v for k, v in (a.split("=", 1) for i, a in instructions if i == "ARG")}
    assert re.fullmatch(r"nvidia/cuda:[0-9.]+-runtime-ubuntu[0-9.]+", arguments_["CUDA_IMAGE"])
    entrypoint = json.loads(next(a for i, a in instructions if i == "ENTRYPOINT"))
    command = json.loads(next(a for i, a in instructions if i == "CMD"))
    assert Path(entrypoint[-1]).name == "kcoral" and "tini" in entrypoint[0]
    args = parse_cli(command)
    assert args.command == "broker"
    volumes = json.loads(next(a for i, a in instructions if i == "VOLUME"))
    assert {str(args.run_dir), str(args.cache_dir)} == set(volumes)
    # What COPY puts in the image is enough to build kcoral: a wheel builds from those files alone.
    image = tmp_path / "image"
    for instruction, text in instructions:
        if instruction == "COPY":
            *sources, destination = text.split()
            for source in sources:
                target = image / destination.lstrip("/")
                if destination.endswith("/"):
                    target = target / Path(source).name
                target.parent.mkdir(parents=True, exist_ok=True)
                if (ROOT / source).is_dir():
                    shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(ROOT / source, target)
    assert any(i == "RUN" and '"/src[gpu]"' in a for i, a in instructions)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=image / "src",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.glob("kcoral-*.whl"))


# --- Slurm -----------------------------------------------------------------------------------------


def test_the_batch_script_passes_shellcheck() -> None:
    done = subprocess.run([tool("shellcheck"), str(BATCH_SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_batch_script_runs_a_broker_that_joins_the_router_and_drains_on_sigterm(
    tmp_path: Path, short_tmp_path: Path
) -> None:
    keys = Keys(tmp_path / "keys", nodes=("node",), clients=("alice",))
    key_dir = keys.root / "keys"
    shutil.copy(keys.node_secret("node"), key_dir / "node.key_secret")
    router = start_router(
        tmp_path,
        "--curve-secret-key", str(key_dir / "router.key_secret"),
        "--authorized-keys", str(keys.root / "clients"),
        "--authorized-node-keys", str(keys.root / "nodes"),
        client_options={"keys": keys.client("alice")},
        timeout_seconds=30,
    )  # fmt: skip
    kcoral = tmp_path / "kcoral"
    kcoral.write_text(f'#!/bin/sh\nexec {shlex.join(python_command(["kcoral"]))} "$@"\n')
    kcoral.chmod(0o755)
    environment = {
        **os.environ,
        "KCORAL": str(kcoral),
        "KCORAL_UPSTREAM": str(router.nodes_url),
        "KCORAL_KEYS": str(key_dir),
        "KCORAL_LISTEN": f"tcp://127.0.0.1:{free_port()}",
        "KCORAL_BROKER_ARGS": "--device cpu --workers 1 --sandbox none",
        "SLURM_JOB_ID": "4242",
        "SLURMD_NODENAME": "gpu-7",
        "SLURM_TMPDIR": str(short_tmp_path / "local"),  # the job's run dir, its sockets, below it
        "CUDA_VISIBLE_DEVICES": "0",
    }
    log = (tmp_path / "job.log").open("wb")
    job = subprocess.Popen(["bash", str(BATCH_SCRIPT)], env=environment, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "gpu-7-4242" not in router.nodes():
            assert job.poll() is None, (tmp_path / "job.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "job.log").read_text()
            time.sleep(0.2)
        assert (short_tmp_path / "local" / "kcoral-run-4242").is_dir()
        job.send_signal(signal.SIGTERM)  # the job's end: --signal=B:TERM, or scancel --batch
        assert job.wait(60) == 0, (tmp_path / "job.log").read_text()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        log.close()
        router.stop()
    text = (tmp_path / "job.log").read_text()
    assert "signal_received" in text and "Traceback" not in text
    assert not (short_tmp_path / "local" / "kcoral-run-4242").exists()  # the job's run directory is removed
    assert (short_tmp_path / "local" / "kcoral-cache").is_dir()  # the node's cache stays for the next job
