"""A local Ray cluster for the module (2 CPUs, started in this process) and pagoda deployed on
it through Ray Serve: the tiny Llama, 1 to 2 engine replicas with autoscaling tuned to react in
seconds, Serve's HTTP proxy on a free 127.0.0.1 port."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import ray  # in the test extra: these modules run, they do not skip
from ray import serve

from pagoda.executor.multiproc import free_port

CLUSTER_CPUS = 2
ENGINE = {"dtype": "float32", "kv_cache_memory": 0.05, "max_model_len": 4096}


# how often replicas and handles report their ongoing requests to Serve's autoscaler (10 s by
# default): read by the cluster's processes, which inherit this one's environment. And no token
# authentication: Ray 2.60's ray.init() would write ~/.ray/auth_token, which the `ray start`
# clusters of tests/executor/test_ray.py then require and their clients do not send.
CLUSTER_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
               "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5", "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def ray_cluster():
    with pytest.MonkeyPatch.context() as env:
        for name, value in CLUSTER_ENV.items():
            env.setenv(name, value)
        ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False, log_to_driver=False)
        try:
            yield
        finally:
            serve.shutdown()
            ray.shutdown()


def poll(condition: Callable[[], object], deadline_s: float, what: str, interval_s: float = 0.25):
    """`condition()`'s first truthy answer within `deadline_s` seconds, else a failure naming `what`."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        answer = condition()
        if answer:
            return answer
        time.sleep(interval_s)  # a polling interval, not a wait for correctness
    pytest.fail(f"not within {deadline_s:.0f}s: {what}")


def running_replicas(deployment: str = "pagoda-engine", app: str = "pagoda") -> int:
    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    return status.deployments[deployment].replica_states.get("RUNNING", 0)
