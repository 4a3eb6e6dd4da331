"""The one place ``dew`` reaches into another library's private modules, each
behind a function that says what it needs and which versions it was written for
(:data:`WRITTEN_FOR`; ``tests/test_cli_compat.py`` fails on another version, so
an upgrade re-reads these lines before it lands).

- :func:`cluster_environments`: JAX's cluster environments in the order
  ``jax.distributed.initialize()`` tries them (``jax._src.clusters.ClusterEnv``
  keeps that list; JAX has no public one).
"""

from __future__ import annotations

__all__ = ["WRITTEN_FOR", "cluster_environments"]

# library -> the versions the private names below were read from
WRITTEN_FOR = {"jax": ("0.10.2",)}


def cluster_environments() -> list[type]:
    """JAX's ``ClusterEnv`` subclasses in JAX's own detection order; each has
    ``opt_in_only_method``, ``is_env_present()`` and ``get_process_count()``."""
    from jax._src import clusters

    return list(clusters.ClusterEnv._cluster_types)
