"""Start (or join) Ray and deploy the engine replicas: the only module that sets Ray up.

``deploy`` runs in a worker thread of the server (Ray's start and Serve's deploy block).
Without ``--ray-address`` it starts a Ray instance of this server's own, deploys the replicas,
and removes both again at ``close``. With ``--ray-address`` it joins that cluster: if the
application is already there (deployed by another rill server, or by a KubeRay ``RayService``
through ``build_app``), it uses it as it is; otherwise it deploys it, and leaves it running at
``close`` (the cluster's operator removes it: ``serve delete rill``), so that one server's
restart never takes the replicas from another. Serve's HTTP proxy is not started: rill's own
listeners serve every protocol, and reach the replicas through the deployment handle only.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from rill.config import ClusterConfig, EngineConfig
from rill.errors import ConfigError
from rill.frontend.ratelimit import AsyncLimiter, RateLimits

log = logging.getLogger("rill.cluster")

APP = "rill"
"""The Serve application's name."""

DEPLOYMENT = "rill-engine"
"""The engine replicas' deployment name."""

NAMESPACE = "rill"
"""The Ray namespace the server's driver joins."""

HEALTH_CHECK_PERIOD_S = 2.0
"""How often Ray asks each replica whether its engine still runs."""

OBJECT_STORE_BYTES = 128 * 2**20
"""Ray's shared object store of a local instance."""

WORKER_NICENESS = 0
"""The niceness of a local instance's worker processes, the engine replicas among them.
Ray's default (15) let the server process and Ray's own daemons preempt the engine at every
token: in alternating runs on 2 cores a replica made 3-14 % fewer tokens/s at 32 streams and
10-30 % fewer at one."""

CONTROL_HEADROOM = 64
"""Calls a replica takes beyond ``--replica-max-requests`` generations: its controls and
stats reads must never wait behind generations."""


@dataclass
class Deployed:
    """The deployed replicas: the deployment handle, whether this server started Ray,
    whether the application is this server's to remove, and the cluster's shared rate limits
    (None: none were asked for)."""

    handle: Any
    started_ray: bool
    owns_app: bool
    limiter: AsyncLimiter | None = None

    def close(self) -> None:
        """Remove the application if it is ours (its replicas free their memory) and stop Ray
        if this server started it; a joined cluster keeps its replicas."""
        import ray
        from ray import serve

        try:
            if self.owns_app:
                serve.delete(APP)
            if self.started_ray:
                serve.shutdown()
        finally:
            if self.started_ray:
                ray.shutdown()


def deploy(engine: EngineConfig, cluster: ClusterConfig, limits: RateLimits | None = None) -> Deployed:
    """Start or join Ray, start or find the cluster's shared rate limits (``limits``, when
    given: ``rill.cluster.limits``), deploy ``cluster.replicas`` replicas of ``engine`` and
    wait until they have loaded the model.

    Raises:
        ConfigError: Ray is not installed.
    """
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ConfigError("--replicas needs Ray: pip install 'rill[ray]'") from exc

    assert cluster.replicas is not None
    started_ray = False
    if not ray.is_initialized():
        if cluster.ray_address:
            ray.init(address=cluster.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING)
        else:
            # Ray's CPU count is a placement budget: enough for every replica's reservation
            # even where the machine has fewer cores (the engines' threads are --num-threads).
            cpus = max(os.cpu_count() or 1, int(cluster.replicas * cluster.replica_cpus + 0.999))
            _start_local_ray(ray, cpus)
            started_ray = True
    limiter = None
    if limits is not None:
        from rill.cluster.limits import start_store

        limiter = start_store(ray, limits, NAMESPACE)
    serve.start(http_options={"location": "NoServer"}, logging_config={"log_level": "WARNING"})
    if not started_ray and APP in serve.status().applications:
        log.info("using the engine replicas already deployed on the cluster (application %r)", APP)
        handle = _by_value(serve.get_app_handle(APP))
        return Deployed(handle=handle, started_ray=False, owns_app=False, limiter=limiter)
    log.info("deploying %d engine replica(s) on Ray", cluster.replicas)
    handle = serve.run(replica_app(engine, cluster), name=APP, route_prefix=None)
    return Deployed(handle=_by_value(handle), started_ray=started_ray, owns_app=started_ray, limiter=limiter)


LOCAL_RAY_ATTEMPTS = 2
"""Starts of Ray's local instance tried before ``rill serve --replicas`` gives up."""


GCS_PORT_WAIT_S = "90"
"""Seconds Ray waits for a local instance's GCS to write its port file (Ray's default: 30)."""

QUIET_RAY = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0",
    "RAY_SERVE_EVENT_LOOP_MONITORING_INTERVAL_S": "60",
    "RAY_raylet_report_resources_period_milliseconds": "1000",
    "RAY_gcs_pull_resource_loads_period_milliseconds": "5000",
    "RAY_metrics_report_interval_ms": "60000",
    "RAY_task_events_report_interval_ms": "10000",
    "RAY_ray_events_report_interval_ms": "10000",
}
"""The periods of Ray's and Serve's own bookkeeping in a local instance, longer than Ray's
defaults (each unless the user set it). Ray's processes wake about 1,500 times a second on an
idle machine by default, mostly for the Serve controller's loop (every 0.1 s), the raylet's
resource reports to the GCS (every 0.1 s) and exports of Ray's own metrics and task events,
which rill does not read (likewise the GCS's pulls of resource loads and Serve's event-loop
monitor); every wake-up on a busy machine preempts an engine thread whose partner then waits
for it. Idle, these take Ray's wake-ups to about 1,000 a second and its CPU from 0.078 to
0.04-0.07 of a core (samples vary); on 2 cores, 32 streams, a replica made 3-5 % more tokens/s
in each of three alternating runs. The cost: a replica that died is replaced up to a second
later, and Ray's state API shows tasks up to 10 s late."""

STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")
"""What Ray's errors say when one of its daemons did not come up in time: the raylet did not
register with the GCS, or the GCS did not write its port file."""


def _start_local_ray(ray: Any, cpus: int, attempts: int = LOCAL_RAY_ATTEMPTS) -> None:
    """Start Ray's local instance, again after a start whose daemons did not come up in time.

    Ray waits a fixed 30 s for the raylet it spawned to register with its GCS, and by default
    30 s for the GCS to write its port file; on a machine whose cores are all busy each has run
    out in this project's runs (the GCS's in a test suite run beside two busy loops), the daemon
    leaving no log at all, while the next start took seconds. So the GCS gets ``GCS_PORT_WAIT_S``
    (unless ``RAY_gcs_server_port_wait_time_s`` is set), and a start that timed out either way is
    shut down, so no half-started instance is left behind, and tried again. Ray's bookkeeping
    runs at ``QUIET_RAY``'s periods (where the user set none).
    """
    # Ray's processes inherit it too, where it only lengthens their retries to reach the GCS.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", GCS_PORT_WAIT_S)
    for name, value in QUIET_RAY.items():  # Ray's processes read them from the environment they inherit
        os.environ.setdefault(name, value)
    for attempt in range(1, attempts + 1):
        try:
            ray.init(
                num_cpus=cpus,
                # Only small objects cross (plans, outputs, the tokenizer once): no need for
                # Ray's default of 30 % of the memory in /dev/shm.
                object_store_memory=OBJECT_STORE_BYTES,
                namespace=NAMESPACE,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=False,
                _system_config={"worker_niceness": WORKER_NICENESS},
            )
            return
        except Exception as exc:
            if attempt == attempts or not any(timeout in str(exc) for timeout in STARTUP_TIMEOUTS):
                raise
            log.warning("Ray's local instance did not start (%s); starting it again", exc)
            ray.shutdown()


def _by_value(handle: Any) -> Any:
    """``handle`` calling the replicas over Serve's direct gRPC channel, answers sent by value.

    By reference (Serve's default) every call and every item of the outputs stream is a Ray
    task return that passes through the object store's bookkeeping; rill only ever awaits the
    values. Measured with ``benchmarks/cluster.py`` (one replica, one stream, three rounds
    beside single-process rill), what a replica adds to TTFT p50: +19 to +39 ms by reference,
    +8 to +19 ms by value.
    """
    return handle.options(_by_reference=False)


def replica_app(engine: EngineConfig, cluster: ClusterConfig) -> Any:
    """The Serve application of ``cluster.replicas`` engine replicas of ``engine``."""
    from ray import serve

    from rill.cluster.replica import EngineReplica

    assert cluster.replicas is not None
    replica = serve.deployment(
        name=DEPLOYMENT,
        num_replicas=cluster.replicas,
        max_ongoing_requests=cluster.replica_max_requests + CONTROL_HEADROOM,
        ray_actor_options={"num_cpus": cluster.replica_cpus},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=2.0,
        # As ``serve.start``'s own: Serve's default logs every call (each start, control and
        # stats read) at INFO into each replica's log file; rill's /metrics counts them.
        logging_config={"log_level": "WARNING", "enable_access_log": False},
        # The router by import path: Ray ships it to every process that routes.
        request_router_config={
            "request_router_class": "rill.cluster.router.RillRouter",
            "request_router_kwargs": {"mode": cluster.routing},
        },
    )(EngineReplica)
    return replica.bind(engine)


def build_app(args: dict[str, Any]) -> Any:
    """Ray Serve application builder for a cluster's own config (KubeRay ``RayService``:
    ``import_path: rill.cluster.launch:build_app``): ``args`` are ``rill serve``'s settings by
    their flag names without dashes (``model``, ``replicas``, ``num_threads``, ...)."""
    from rill.config import load

    config = load({key.replace("-", "_"): value for key, value in args.items()}, env={})
    cluster = config.cluster if config.cluster.replicas is not None else ClusterConfig(replicas=1)
    return replica_app(config.engine, cluster)
