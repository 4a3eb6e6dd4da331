"""``dew train``'s ``jax.distributed`` start-up (docs/clusters.md), without a cluster:
the environments JAX's own cluster detection reads (SLURM variables, a Kubernetes
JobSet pod through a fake ``kubernetes`` client, GKE TPU variables and a Cloud TPU
VM's metadata server, faked) and a recording ``jax.distributed.initialize``.

The fake resolves each call as JAX would (``ClusterEnv.auto_detect_unset_distributed_
params``, the step ``initialize`` takes first), so each test checks the coordinator,
process count and id a real start would use, against values written out from the
environment; and that a single-process environment (one SLURM task, one pod, a
single-host TPU VM) never calls it."""

import os
import socket
import sys
import types

import jax
import pytest
from jax._src import clusters
from jax._src.clusters import cloud_tpu_cluster, k8s_cluster

from dew.cli import _parser, main
from dew.cli.cluster import detected_cluster, initialize_distributed
from dew.cli.recipe import RecipeError

# the variables any cluster environment JAX knows would read
CLUSTER_VARIABLES = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_NUM_NODES",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "OMPI_MCA_orte_hnp_uri",
    "KUBERNETES_SERVICE_HOST",
    "JOB_COMPLETION_INDEX",
    "TPU_WORKER_HOSTNAMES",
    "TPU_PROCESS_ADDRESSES",
    "TPU_WORKER_ID",
    "TPU_SKIP_MDS_QUERY",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
    "JAX_COORDINATOR_PORT",
    "DEW_DISTRIBUTED",
)


@pytest.fixture
def calls(monkeypatch):
    """Each ``jax.distributed.initialize`` call: ``(kwargs, (coordinator, processes,
    id))``, the second as JAX resolves the call against the environment."""
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    recorded = []

    def initialize(**kwargs):
        resolved = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            kwargs.get("coordinator_address"),
            kwargs.get("num_processes"),
            kwargs.get("process_id"),
            None,
            None,
            300,  # initialize's default initialization_timeout
        )
        recorded.append((kwargs, tuple(resolved[:3])))

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    collectives = jax.config.jax_cpu_collectives_implementation
    yield recorded
    jax.config.update("jax_cpu_collectives_implementation", collectives)


def start(*flags):
    initialize_distributed(_parser().parse_args(["train", "recipe.yaml", *flags]))


def slurm(monkeypatch, tasks, task, job=4242):
    for key, value in {
        "SLURM_JOB_ID": job,
        "SLURM_STEP_NODELIST": "node[003-006],gpu9",
        "SLURM_STEP_NUM_NODES": tasks,
        "SLURM_NTASKS": tasks,
        "SLURM_PROCID": task,
        "SLURM_LOCALID": 0,
    }.items():
        monkeypatch.setenv(key, str(value))


def test_no_cluster_one_process(calls):
    assert detected_cluster() is None
    start()
    assert calls == []


def test_slurm_tasks_are_detected_one_task_is_not(calls, monkeypatch):
    slurm(monkeypatch, tasks=4, task=2)
    assert detected_cluster() == ("SlurmCluster", 4)
    start()
    # the first host of the step, port job id % 4096 in the top 4096 ports
    assert calls == [({}, (f"node003:{4242 % 4096 + 65535 - 4095}", 4, 2))]
    assert jax.config.jax_cpu_collectives_implementation == "gloo"
    calls.clear()
    slurm(monkeypatch, tasks=1, task=0)
    assert detected_cluster() == ("SlurmCluster", 1)
    start()
    assert calls == []


def fake_kubernetes(monkeypatch, parallelism, index):
    """The API a JobSet pod's ``kubernetes`` client answers: pod ``dew-lm-workers-0-<i>``
    of Job ``dew-lm-workers-0`` (JobSet ``dew-lm``), ``parallelism`` pods, Indexed."""
    ns = types.SimpleNamespace
    job_name = "dew-lm-workers-0"
    pod = ns(
        metadata=ns(
            name=f"{job_name}-{index}",
            labels={"job-name": job_name},
            owner_references=[ns(controller=True, kind="Job")],
        ),
        spec=ns(subdomain="dew-lm"),
    )
    job = ns(
        metadata=ns(name=job_name, labels={"jobset.sigs.k8s.io/jobset-name": "dew-lm"}),
        spec=ns(parallelism=parallelism),
    )

    class CoreV1Api:
        def list_namespaced_pod(self, namespace, field_selector):
            assert namespace == "team" and field_selector == "status.podIP=10.0.0.9"
            return ns(items=[pod])

    class BatchV1Api:
        def read_namespaced_job(self, name, namespace):
            assert (name, namespace) == (job_name, "team")
            return job

    client = ns(CoreV1Api=CoreV1Api, BatchV1Api=BatchV1Api, exceptions=ns(ApiException=OSError))
    module = ns(config=ns(load_incluster_config=lambda: None), client=client)
    monkeypatch.setitem(sys.modules, "kubernetes", module)
    monkeypatch.setattr(k8s_cluster.K8sCluster, "_namespace", classmethod(lambda cls: "team"))
    for name in ("_pod", "_job", "_controller"):  # JAX caches each per process
        getattr(k8s_cluster.K8sCluster, name).__func__.cache_clear()
    # the cluster's DNS: this pod, and the coordinator pod JAX waits for
    names = {f"{job_name}-{index}": "10.0.0.9", f"{job_name}-0.dew-lm": "10.0.0.5"}
    real = socket.gethostbyname
    monkeypatch.setattr(socket, "gethostbyname", lambda host: names.get(host) or real(host))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("HOSTNAME", f"{job_name}-{index}")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", str(index))


def test_jobset_pods_are_detected_one_pod_is_not(calls, monkeypatch):
    fake_kubernetes(monkeypatch, parallelism=4, index=3)
    assert detected_cluster() == ("K8sCluster", 4)
    start()
    # JAX's JobSet coordinator: pod 0 of the job under the JobSet's headless service
    assert calls == [({}, ("dew-lm-workers-0-0.dew-lm:55527", 4, 3))]
    calls.clear()
    fake_kubernetes(monkeypatch, parallelism=1, index=0)
    start()
    assert calls == []


def test_kubernetes_without_its_client_package_is_one_process(calls, monkeypatch):
    """JAX's K8s detection needs ``pip install 'jax[k8s]'``; without it JAX warns and
    a pod runs alone (docs/clusters.md says to install it)."""
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import fails
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with pytest.warns(UserWarning, match=r"jax\[k8s\]"):
        start()
    assert calls == []


def test_gke_tpu_slice_is_detected_one_host_is_not(calls, monkeypatch):
    # GKE: no worker number in the metadata (JAX asks GCE's first), the hosts in variables
    fake_metadata(monkeypatch, "", worker=None, tpu_env="")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "127.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    assert detected_cluster() == ("GkeTpuCluster", 4)
    start()
    assert calls == [({}, ("127.0.0.1:8482", 4, 1))]
    calls.clear()
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    monkeypatch.setenv("TPU_WORKER_ID", "0")
    start()
    assert calls == []


def test_gke_tpu_host_without_a_metadata_server_is_one_process(calls, monkeypatch, capsys):
    """A single-host GKE TPU v5e machine as it is (TPU_WORKER_HOSTNAMES=localhost,
    TPU_SKIP_MDS_QUERY=true, no metadata server: JAX's process count asks it for the
    slices and fails): one process and a warning. With several hosts listed that is
    a bad configuration, not N separate runs."""

    def unreachable(key):
        raise ConnectionError("metadata.google.internal unreachable")

    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata", unreachable)
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "true")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    monkeypatch.setenv("TPU_WORKER_ID", "0")
    assert detected_cluster() == ("GkeTpuCluster", 1)
    start()
    assert calls == []
    assert "could not read its process count (ConnectionError" in capsys.readouterr().err
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "h0,h1")
    with pytest.raises(RecipeError, match="GkeTpuCluster environment of 2 hosts"):
        start()
    assert calls == []


def fake_metadata(monkeypatch, endpoints, worker, tpu_env=None):
    """A Cloud TPU VM's metadata server (what ``GceTpuCluster`` asks); ``worker`` None:
    no worker number (404, GKE); ``tpu_env`` None: two slices, this host in slice 1."""
    if tpu_env is None:
        tpu_env = "MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'"
    values = {
        "agent-worker-number": str(worker),
        "worker-network-endpoints": endpoints,
        "tpu-env": tpu_env,
    }
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)

    def get_metadata(key):
        return ("", 404) if values[key] == "None" else (values[key], 200)

    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata", get_metadata)


def test_tpu_vm_hosts_are_detected_from_the_metadata_server(calls, monkeypatch):
    fake_metadata(monkeypatch, "w0:0:127.0.0.1,w1:1:10.0.0.2", worker=1)
    assert detected_cluster() == ("GceTpuCluster", 4)  # 2 hosts x 2 slices
    start()
    assert calls == [({}, ("127.0.0.1:8482", 4, 3))]  # host 1 of slice 1


def test_single_host_tpu_vm_is_one_process(calls, monkeypatch):
    fake_metadata(monkeypatch, "127.0.0.1", worker=0, tpu_env="")  # one slice
    assert detected_cluster() == ("GceTpuCluster", 1)
    start()
    assert calls == []


def test_a_metadata_server_that_fails_leaves_one_process(calls, monkeypatch, capsys):
    def unreachable(key):
        raise ConnectionError("metadata.google.internal unreachable")

    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata", unreachable)
    start()
    assert calls == []
    err = capsys.readouterr().err
    assert "JAX's detection of GceTpuCluster failed (ConnectionError" in err, err


def test_explicit_flags_override_the_environment(calls, monkeypatch):
    slurm(monkeypatch, tasks=4, task=2)
    start("--coordinator", "10.1.1.1:1234", "--num-processes", "2", "--process-id", "1")
    given = {"coordinator_address": "10.1.1.1:1234", "num_processes": 2, "process_id": 1}
    assert calls == [(given, ("10.1.1.1:1234", 2, 1))]
    calls.clear()
    start("--process-id", "3")  # the rest from SLURM
    assert calls == [({"process_id": 3}, (f"node003:{4242 % 4096 + 65535 - 4095}", 4, 3))]
    calls.clear()
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    start("--coordinator", "127.0.0.1:9999", "--num-processes", "1", "--process-id", "0")
    assert calls[0][1] == ("127.0.0.1:9999", 1, 0)  # asked for: initialised as given


def test_dew_distributed_forces_or_refuses(calls, monkeypatch):
    slurm(monkeypatch, tasks=4, task=2)
    monkeypatch.setenv("DEW_DISTRIBUTED", "0")
    start()
    assert calls == []
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DEW_DISTRIBUTED", "1")
    start()
    assert calls == [({}, (None, None, None))]  # JAX's own call: it would say what is missing


def test_a_bad_dew_distributed_is_a_bad_configuration(calls, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("DEW_DISTRIBUTED", "yes")
    recipe = os.path.join(os.path.dirname(__file__), "..", "recipes", "lm_scratch.yaml")
    assert main(["train", recipe, f"run_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert "DEW_DISTRIBUTED='yes': use 1" in err and err.count("\n") == 1, err
    assert calls == [] and not os.path.exists(tmp_path / "run")
