"""Which cluster this process is part of, and ``jax.distributed`` set up from it
before anything is built (``dew train`` / ``dew resume``)."""

from __future__ import annotations

import os
import sys

from dew.cli.recipe import RecipeError

DISTRIBUTED = "DEW_DISTRIBUTED"  # 1: always jax.distributed.initialize(); 0: never


def detected_cluster() -> tuple[str, int] | None:
    """``(environment, process count)`` of the cluster JAX's own detection finds here
    (what ``jax.distributed.initialize()`` without arguments would use: JAX's
    ``ClusterEnv`` subclasses in JAX's order, opt-in ones such as mpi4py left out):
    Open MPI, SLURM, a GKE TPU slice, a Cloud TPU VM, a Kubernetes Job / JobSet.
    None where none is present. An environment whose detection itself fails (a
    metadata server that does not answer) counts as absent, and one whose process
    count cannot be read as one process, each with a warning; except a GKE TPU slice
    whose variables list several hosts (a configuration error: say how many)."""
    from dew.cli.compat import cluster_environments

    for env in cluster_environments():
        if env.opt_in_only_method:
            continue
        try:
            present = env.is_env_present()
        except Exception as error:  # JAX's detection of one environment
            print(
                f"dew: JAX's detection of {env.__name__} failed ({type(error).__name__}: "
                f"{error}); running as one process unless {DISTRIBUTED}=1 or --coordinator",
                file=sys.stderr,
            )
            continue
        if not present:
            continue
        try:
            count = int(env.get_process_count())
        except Exception as error:
            # e.g. a GKE TPU host whose metadata server does not answer JAX's question
            # about slices: one process, unless its variables list several hosts
            hosts = _tpu_hosts_in_variables() if env.__name__ == "GkeTpuCluster" else 0
            if hosts > 1:
                raise RecipeError(
                    f"JAX detected a {env.__name__} environment of {hosts} hosts but could "
                    f"not read its process count ({type(error).__name__}: {error}); give "
                    f"--coordinator, --num-processes and --process-id"
                ) from None
            print(
                f"dew: JAX detected {env.__name__} but could not read its process count "
                f"({type(error).__name__}: {str(error)[:200]}); running as one process "
                f"unless {DISTRIBUTED}=1 or --coordinator",
                file=sys.stderr,
            )
            return env.__name__, 1
        return env.__name__, count
    return None


def _tpu_hosts_in_variables() -> int:
    """The hosts of a GKE TPU slice as GKE's variables list them (no network)."""
    names = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES")
    return len(names.split(",")) if names else 0


def initialize_distributed(args) -> None:
    """``jax.distributed.initialize`` before anything is built, or not at all:

    - ``--coordinator`` / ``--num-processes`` / ``--process-id``: with those (any
      left out JAX detects from the environment);
    - else ``DEW_DISTRIBUTED=1``: ``initialize()`` (JAX's detection, its errors);
      ``DEW_DISTRIBUTED=0``: one process, whatever the environment;
    - else where JAX's detection finds a cluster of more than one process
      (:func:`detected_cluster`: SLURM with several tasks, a Kubernetes JobSet of
      several pods, a multi-host TPU slice): ``initialize()``. One process (a
      single-host TPU VM, one pod, one SLURM task) or no cluster: nothing.

    CPU processes reduce over gloo (accelerators use their own collectives)."""
    import jax

    given = {
        "coordinator_address": getattr(args, "coordinator", None),
        "num_processes": getattr(args, "num_processes", None),
        "process_id": getattr(args, "process_id", None),
    }
    given = {k: v for k, v in given.items() if v is not None}
    setting = os.environ.get(DISTRIBUTED, "").strip().lower()
    if setting not in ("", "0", "1"):
        raise RecipeError(
            f"{DISTRIBUTED}={os.environ[DISTRIBUTED]!r}: use 1 (always initialise "
            f"jax.distributed from the environment), 0 (one process) or leave it unset "
            f"(JAX's cluster detection decides)"
        )
    if not given:
        if setting == "0":
            return
        if setting == "":
            found = detected_cluster()
            if found is None or found[1] <= 1:
                return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**given)
