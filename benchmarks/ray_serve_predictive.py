"""Predictive autoscaling inside Ray Serve (issue 42 item 4): pagoda's forecast policy
(pagoda/ray_serve/autoscaling.py, `--predictive-autoscaling`) against Serve's own policy, on a local
Ray cluster, under the same ramp of load.

    python benchmarks/ray_serve_predictive.py [--model smollm2-135m-instruct]

For each policy: a fresh local cluster (2 CPUs), pagoda deployed through `build_app` with 1 to 2
engine replicas (0.5 CPU each), `target_ongoing_requests` 2; the load ramps 1 -> 2 -> 3 -> 4 clients
sending 32-token completions back to back, `--step-s` seconds a step, then stops. Sampled every
0.25 s: the RUNNING replicas (`serve.status()`). Reported: when the second replica was asked for
(the deployment leaves 1 target replica) and when it ran, and when the app was back to one replica
after the load. Writes results/ray-serve-predictive-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from datetime import date
from pathlib import Path

import httpx
import ray
from ray import serve

from pagoda.executor.multiproc import free_port
from pagoda.ray_serve import build_app
from pagoda.ray_serve.app import serve_on
from pagoda.ray_serve.autoscaling import ScalingOptions
from pagoda.ray_serve.engine_replica import ServerOptions

HERE = Path(__file__).parent
ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
       "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5", "RAY_AUTH_MODE": "disabled"}


def replicas() -> tuple[int, int]:
    """(RUNNING replicas, replicas asked for) of the engine deployment: asked counts a replica that
    is starting, so an upscale shows the moment the autoscaler decided."""
    app = serve.status().applications.get("pagoda")
    if app is None or "pagoda-engine" not in app.deployments:
        return 0, 0
    states = {str(k).rsplit(".", 1)[-1]: v for k, v in app.deployments["pagoda-engine"].replica_states.items()}
    running = states.get("RUNNING", 0)
    return running, running + states.get("STARTING", 0) + states.get("PENDING_MIGRATION", 0)


def load(base: str, clients: list[threading.Event], stop: threading.Event) -> None:
    def client(on: threading.Event) -> None:
        while not stop.is_set():
            if not on.wait(0.1):
                continue
            httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": "m", "prompt": "tell me a story", "max_tokens": 32, "ignore_eos": True})
    for on in clients:
        threading.Thread(target=client, args=(on,), daemon=True).start()


def run(policy: str, a: argparse.Namespace) -> dict:
    scaling = ScalingOptions(min_replicas=1, max_replicas=2, target_ongoing_requests=2, upscale_delay_s=1,
                             downscale_delay_s=4, look_back_period_s=2, predictive=policy == "predictive",
                             forecast_interval_s=1, forecast_lead_s=a.lead_s)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve_on(build_app(a.model, scaling=scaling, server=ServerOptions(["m"]), replica_cpus=0.5,
                           max_ongoing_requests=8, max_model_len=2048), "127.0.0.1", port)
        base = f"http://127.0.0.1:{port}"
        clients, stop, samples = [threading.Event() for _ in range(4)], threading.Event(), []
        load(base, clients, stop)
        start = time.monotonic()
        for step in range(4):  # the ramp: one more client each step
            clients[step].set()
            until = start + (step + 1) * a.step_s
            while time.monotonic() < until:
                samples.append((round(time.monotonic() - start, 2), *replicas()))
                time.sleep(0.25)  # sampling interval
        stop.set()
        ended = time.monotonic() - start
        while time.monotonic() - start < ended + a.idle_s:
            samples.append((round(time.monotonic() - start, 2), *replicas()))
            time.sleep(0.25)
    finally:
        serve.shutdown()
        ray.shutdown()
    asked = next((t for t, _, target in samples if target >= 2), None)
    ran = next((t for t, running, _ in samples if running >= 2), None)
    back = next((t for t, running, _ in samples if t > ended and running == 1 and ran is not None), None)
    return {"policy": policy, "second_replica_asked_s": asked, "second_replica_running_s": ran,
            "load_ended_s": ended, "back_to_one_s": back, "samples": samples}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--step-s", type=float, default=8.0)
    p.add_argument("--idle-s", type=float, default=40.0)
    p.add_argument("--lead-s", type=float, default=4.0, help="the forecast's lead (the predictive policy)")
    a = p.parse_args()
    os.environ.update(ENV)
    rows = [run(policy, a) for policy in ("reactive", "predictive")]
    for r in rows:
        print(f"{r['policy']:>10}: 2nd replica asked at {r['second_replica_asked_s']} s, running at "
              f"{r['second_replica_running_s']} s; load ended at {r['load_ended_s']:.1f} s, one replica again at "
              f"{r['back_to_one_s']} s", flush=True)
    out = HERE / "results" / f"ray-serve-predictive-{date.today()}.json"
    out.write_text(json.dumps({"model": a.model, "args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
