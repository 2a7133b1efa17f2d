"""The cluster as users use it: a local Ray on loopback, 2 engine replicas of the tiny model with 4 slots each,
40 adapters served from the local hub, the official `openai` client against Serve's ingress. Every answer must
equal the single-machine server's for the same prompt and seed; a replica killed mid-run loses nothing silently."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")
pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from adapter_manager import AdapterManagerConfig, HubConfig, LocalHub, RowOptions, write_synthetic_adapter  # noqa: E402
from adapter_manager.runtime import cli  # noqa: E402
from adapter_manager.runtime.cluster import ClusterConfig, RayOptions, start_cluster, stop_cluster  # noqa: E402
from adapter_manager.runtime.engine.engine import EngineConfig  # noqa: E402
from adapter_manager.runtime.model.checkpoint import write_random_checkpoint  # noqa: E402
from adapter_manager.runtime.model.config import LlamaConfig  # noqa: E402
from adapter_manager.runtime.server.app import BackgroundServer  # noqa: E402
from adapter_manager.runtime.server.launch import build_serving  # noqa: E402
from adapter_manager.runtime.server.state import ServerConfig  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

NAME = "tiny-base"
ADAPTERS = [f"org/lora-{i:02d}" for i in range(40)]
CONFIG = LlamaConfig.tiny()


def _configs(root, hub: LocalHub) -> tuple[AdapterManagerConfig, EngineConfig, ServerConfig]:
    hub_config = HubConfig(endpoint=hub.endpoint, cache_dir=root / "hf-cache", retries=0)
    return (
        AdapterManagerConfig(max_slots=4, rows=RowOptions(max_rank=8), hub=hub_config),
        EngineConfig(max_batch=8, max_seq_len=96),
        ServerConfig(model_name=NAME, port=0),
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _request(i: int) -> dict:
    """Request i of the trace: adapter i mod 40, seeded sampling, every third one streamed, every fifth a chat."""
    return {"model": ADAPTERS[i % len(ADAPTERS)], "seed": i, "stream": i % 3 == 0, "chat": i % 5 == 0}


def _send(client, request: dict) -> str:
    common = dict(model=request["model"], max_tokens=6, temperature=1.0, seed=request["seed"])
    if request["chat"]:
        messages = [{"role": "user", "content": f"hi {request['seed']}"}]
        if request["stream"]:
            stream = client.chat.completions.create(messages=messages, stream=True, **common)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return client.chat.completions.create(messages=messages, **common).choices[0].message.content
    prompt = f"Hello {request['seed']}"
    if request["stream"]:
        return "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **common))
    return client.completions.create(prompt=prompt, **common).choices[0].text


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    write_random_checkpoint(CONFIG, root / "model")
    spec = CONFIG.to_spec(NAME)
    for i, adapter in enumerate(ADAPTERS):
        write_synthetic_adapter(root / "hub" / adapter, spec, r=4 if i % 2 else 8, lora_alpha=8, seed=i)
    return root


@pytest.fixture(scope="module")
def hub(files):
    with LocalHub(files / "hub") as hub:
        yield hub


@pytest.fixture(scope="module")
def expected(files, hub):
    """The single-machine server's answers to the first 120 requests of the trace."""
    manager, engine, server = _configs(files, hub)
    serving = build_serving(files / "model", manager, engine, server)
    for adapter in ADAPTERS:
        serving.manager.register(adapter)
    with BackgroundServer(serving.app) as background:
        client = _client(background.url)
        answers = {i: _send(client, _request(i)) for i in range(120)}
    serving.close()
    return answers


@pytest.fixture(scope="module")
def cluster(files, hub):
    manager, engine, server = _configs(files, hub)
    config = ClusterConfig(
        files / "model", manager, engine, server, replicas=2, replica_cpus=0.5, stats_period_s=0.5, pinned_slots=1
    )
    metrics_port = _free_port()
    url = start_cluster(config, RayOptions(num_cpus=2, port=_free_port(), metrics_export_port=metrics_port))
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            for adapter in ADAPTERS:
                answer = http.post("/v1/adapters", json={"ref": adapter})
                assert answer.status_code == 201, answer.text
            yield url, http, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        stop_cluster(config)


def _replicas(http, count: int = 2, timeout: float = 90.0, after: float = 0.0) -> list[dict]:
    """The replicas' reports once `count` live replicas have reported (with `after`: reports taken after that
    `time.time()`)."""
    deadline = time.monotonic() + timeout
    while True:
        reports = [
            r for r in http.get("/v1/cluster/replicas").json()["data"] if r["age_s"] < 2.0 and r["taken_at"] > after
        ]
        if len(reports) >= count or time.monotonic() > deadline:
            return reports
        time.sleep(0.25)


def test_every_answer_equals_the_single_server_and_nothing_is_lost(cluster, expected):
    url, http, _ = cluster
    client = _client(url)
    with ThreadPoolExecutor(8) as pool:
        answers = dict(zip(range(80), pool.map(lambda i: _send(client, _request(i)), range(80)), strict=True))
    assert answers == {i: expected[i] for i in range(80)}
    ended, deadline = time.time(), time.monotonic() + 30
    while True:  # reports taken once every response ended: only Serve's loaded models hold pins
        reports = _replicas(http, after=ended)  # one taken mid-run may show a pin an unload then dropped
        if all(r["holds"] == dict.fromkeys(r["loaded"], 1) for r in reports) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert len(reports) == 2
    for report in reports:  # Serve's loaded models are then exactly the pool's operator pins, within the pool
        assert report["holds"] == dict.fromkeys(report["loaded"], 1)
        assert len(report["loaded"]) <= report["capacity"] == 2  # 4 slots less the spare and the pinned one
        assert sorted(a for a, s in report["slots"].items() if s["pinned"]) == report["loaded"]
    served = set().union(*(r["heat"] for r in reports))
    assert served and served <= set(ADAPTERS)
    models = {m.id for m in client.models.list().data}
    assert models == {NAME, *ADAPTERS}
    swaps = http.get("/v1/metrics/swaps").json()
    assert swaps["moves"]["host_to_slot"]["count"] >= 40  # every adapter reached a slot somewhere
    assert set(swaps["replicas"]) == {r["replica"] for r in reports}
    assert 0 < swaps["moves"]["host_to_slot"]["p50_s"] <= swaps["moves"]["host_to_slot"]["max_s"]
    assert cli.main(["metrics", "--url", url]) == 0  # the CLI reads the cluster like a single server


def test_prometheus_export_has_every_replicas_pool_metrics_beside_serves_multiplexing(cluster):
    """One scrape of Ray's metrics export carries each replica's swap latency and residency gauges and Serve's
    `ray_serve_multiplexed_*` series, tagged by replica."""
    url, http, metrics = cluster
    client = _client(url)
    for i in range(4):
        _send(client, {"model": ADAPTERS[i], "seed": i, "stream": False, "chat": False})
    replicas = {r["replica"] for r in _replicas(http)}
    deadline = time.monotonic() + 60
    while True:  # replicas set their gauges every report; Ray's agent exports what it has received
        try:
            text = httpx.get(metrics, timeout=10).text
        except httpx.HTTPError:  # Ray's metrics agent starts on its own, after the cluster answers
            text = ""
        series = [line for line in text.splitlines() if line.startswith("ray_")]
        ours = {name: _replicas_of(series, name) for name in ("adapter_manager_move_seconds", "adapter_manager_moves")}
        ours["adapter_manager_multiplexed_adapters"] = _replicas_of(series, "adapter_manager_multiplexed_adapters")
        serves = _replicas_of(series, "serve_multiplexed_model_load_latency_ms")
        p50 = [line for line in series if 'move="host_to_slot"' in line and 'quantile="p50"' in line]
        if all(found == replicas for found in (*ours.values(), serves)) and p50 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert ours == dict.fromkeys(ours, replicas) and serves == replicas
    assert p50, [line for line in series if line.startswith("ray_adapter_manager_move_seconds")]


def _replicas_of(series: list[str], name: str) -> set[str]:
    """The `replica` tags of Ray-exported series `ray_<name>` (a histogram's buckets included)."""
    found = set()
    for line in series:
        if line.startswith(f"ray_{name}{{") or line.startswith(f"ray_{name}_bucket{{"):
            match = re.search(r'replica="([^"]+)"', line)
            if match:
                found.add(match.group(1))
    return found


def test_the_local_ray_talks_on_loopback_only(cluster):
    """Every connection of the local Ray (GCS, raylet, agents, Serve's proxy and replicas: this process's
    descendants) and this driver is between loopback addresses, and every socket they listen on is bound to
    loopback, except one Ray does not let us configure: each Serve replica's inter-deployment gRPC server, bound to
    [::] in ray/serve/_private/replica.py (Ray 2.60), which nothing here talks to (handles use Ray's own calls)."""
    psutil = pytest.importorskip("psutil")
    url, http, _ = cluster
    assert http.get("/v1/models").status_code == 200  # some traffic through the proxy, the ingress and a replica
    me = psutil.Process()
    pids = {me.pid, *(child.pid for child in me.children(recursive=True))}
    try:
        sockets = [c for c in psutil.net_connections("inet") if c.pid in pids]
    except psutil.AccessDenied:
        pytest.skip("this user may not list other processes' sockets")

    def loopback(address) -> bool:
        return ipaddress.ip_address(address.ip.removeprefix("::ffff:")).is_loopback

    listening = [c for c in sockets if c.status == psutil.CONN_LISTEN]
    assert len({c.pid for c in listening}) >= 4  # at least GCS, raylet, the proxy and a replica
    outward = [
        (psutil.Process(c.pid).name(), c.laddr)
        for c in listening
        if not loopback(c.laddr) and not (c.laddr.ip == "::" and psutil.Process(c.pid).name().startswith("ray::Serve"))
    ]
    assert outward == []
    connected = [c for c in sockets if c.raddr]
    assert connected and all(loopback(c.laddr) and loopback(c.raddr) for c in connected)


def test_unknown_and_deleted_adapters_are_refused_with_openai_errors(cluster):
    url, http, _ = cluster
    client = _client(url)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="org/nobody", prompt="Hi", max_tokens=2)
    bad = http.post("/v1/adapters", json={"ref": "org/does-not-exist"})
    assert bad.status_code in (404, 502), bad.text
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2).choices[0].text is not None
    extra = http.post("/v1/adapters", json={"ref": ADAPTERS[0], "id": "team/extra"})
    assert extra.status_code == 201, extra.text
    assert client.completions.create(model="team/extra", prompt="Hi", max_tokens=2).choices
    assert http.delete("/v1/adapters/team/extra").json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="team/extra", prompt="Hi", max_tokens=2)
    # validated by one replica and deleted before that replica's next report (it never adopted the entry)
    assert http.post("/v1/adapters", json={"ref": ADAPTERS[1], "id": "team/gone"}).status_code == 201
    assert http.delete("/v1/adapters/team/gone").json()["deleted"] is True
    deleted = time.time()
    deadline = time.monotonic() + 15
    while True:
        reports = _replicas(http)
        held = {
            r["replica"]: [(a, r["slots"].get(a), r["holds"].get(a)) for a in ("team/extra",) if a in r["slots"]]
            + [a for a in r["unadopted"] if a == "team/gone"]
            for r in reports
        }
        # a report taken after the reconcile that followed the delete (each report precedes its own reconcile)
        fresh = all(time.time() - r["age_s"] > deleted + 2 * 0.5 for r in reports)
        if (fresh and not any(held.values())) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert fresh and not any(held.values()), held  # each replica unregistered both


def _pinned_everywhere(http, adapter: str, pinned: bool, timeout: float = 20.0) -> list[dict]:
    """The replicas' reports once each holds (or no longer holds) `adapter` for the operator's pin."""
    deadline = time.monotonic() + timeout
    while True:
        reports = _replicas(http)
        done = all((adapter in r["pinned"]) == pinned for r in reports)
        if done or time.monotonic() > deadline:
            return reports
        time.sleep(0.25)


def test_an_operator_pin_holds_the_adapter_on_every_replica_until_unpinned(cluster, expected):
    url, http, _ = cluster
    client = _client(url)
    target = ADAPTERS[5]
    assert http.post(f"/v1/adapters/{target}/pin").json() == {"id": target, "pinned": True, "replicas": "all"}
    for report in _pinned_everywhere(http, target, True):
        assert target in report["pinned"] and report["slots"][target]["pinned"], report
        assert target not in report["loaded"] or report["holds"][target] >= 2  # Serve's hold beside the pin's
    full = http.post(f"/v1/adapters/{ADAPTERS[6]}/pin")  # one pinned slot per replica, taken
    assert full.status_code == 409 and full.json()["error"]["code"] == "slots_exhausted", full.text
    refused = http.post("/v1/adapters", json={"ref": ADAPTERS[7], "id": "team/pin-full", "pin": True})
    assert refused.status_code == 409, refused.text  # as on one server: registered, the pin refused
    assert http.get("/v1/adapters/team/pin-full").json()["pinned"] is False
    since, reports, deadline = time.time(), [], time.monotonic() + 20
    while not reports or not all(time.time() - r["age_s"] > since for r in reports) and time.monotonic() < deadline:
        time.sleep(0.25)  # reports taken after the refusal: no replica pinned it on its own
        reports = _replicas(http)
    assert not any(r["slots"].get("team/pin-full", {}).get("pinned") for r in reports), reports
    assert http.delete("/v1/adapters/team/pin-full").status_code == 200
    assert http.post("/v1/adapters/org/nobody/pin").status_code == 404
    assert http.get(f"/v1/adapters/{target}").json()["pinned"] is True
    with ThreadPoolExecutor(4) as pool:  # routed to the shortest queue, served from the pinned slots
        answers = dict(zip((5, 45, 85), pool.map(lambda i: _send(client, _request(i)), (5, 45, 85)), strict=True))
    assert answers == {i: expected[i] for i in (5, 45, 85)}
    assert http.post(f"/v1/adapters/{target}/unpin").json() == {"id": target, "pinned": False}
    again = http.post(f"/v1/adapters/{target}/unpin")
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_pinned"
    assert all(target not in r["pinned"] for r in _pinned_everywhere(http, target, False))
    registered = http.post("/v1/adapters", json={"ref": ADAPTERS[6], "id": "team/pinned", "pin": True})
    assert registered.status_code == 201 and registered.json()["pinned"] is True, registered.text  # the slot is free
    for report in _pinned_everywhere(http, "team/pinned", True):
        assert report["pinned"] == ["team/pinned"], report
        # no replica holds a pin of its own: the validating replica's admin route was asked for none
        pinned = {a for a, slot in report["slots"].items() if slot["pinned"]}
        assert pinned <= set(report["holds"]) and set(report["holds"]) <= {*report["loaded"], "team/pinned"}, report
    assert http.post("/v1/adapters/team/pinned/unpin").status_code == 200
    assert http.delete("/v1/adapters/team/pinned").status_code == 200


def test_a_killed_replica_is_restarted_and_later_requests_succeed(cluster, expected):
    url, http, _ = cluster
    client = _client(url)
    before = _replicas(http)
    victim = before[0]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_send, client, _request(i)) for i in range(80, 120)]
        time.sleep(0.5)
        os.kill(victim["pid"], signal.SIGKILL)
        outcomes = []
        for i, future in zip(range(80, 120), futures, strict=True):
            try:
                outcomes.append((i, future.result()))
            except openai.APIError as err:  # a clear error (503, or a stream's error event), never a wrong answer
                assert getattr(err, "status_code", 503) == 503 and "replica" in err.message, err.message
                outcomes.append((i, None))
    for i, text in outcomes:
        assert text is None or text == expected[i]
    assert sum(text is not None for _, text in outcomes) >= 30  # retried on the survivor
    deadline = time.monotonic() + 120  # the victim's last report stays fresh for up to 2 s after its death
    while True:
        after = _replicas(http, timeout=120)
        if {r["pid"] for r in after}.isdisjoint({victim["pid"]}) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(after) == 2 and victim["pid"] not in {r["pid"] for r in after}  # Serve started a new one
    assert [_send(client, _request(i)) for i in range(80, 100)] == [expected[i] for i in range(80, 100)]


def test_a_killed_directory_is_restarted_and_loses_no_registration(cluster, expected):
    """Every engine replica is killed first and restarted by Serve, so no live replica validated or registered any
    adapter; then the directory is killed and Serve starts a new, empty one. The replicas give back the entries they
    mirrored from their reports, so every adapter stays listed and servable, with the same answers. (Before the
    mirror, replicas gave back only what they had registered from: an adapter validated and served by a replica
    that had died since was lost, depending on which replica Serve had routed it to.)"""
    psutil = pytest.importorskip("psutil")
    url, http, _ = cluster
    client = _client(url)
    before = {m.id for m in client.models.list().data}
    old = {r["pid"] for r in _replicas(http)}
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while True:  # two new replicas, each with the whole directory mirrored from a report
        fresh = [r for r in _replicas(http, timeout=180) if r["pid"] not in old]
        if len(fresh) == 2 and all(r["mirrored"] == len(ADAPTERS) for r in fresh) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(fresh) == 2 and all(r["mirrored"] == len(ADAPTERS) and r["registered"] == 0 for r in fresh), fresh

    def directories() -> set[int]:  # Ray titles an actor's process by its class, plus the method it is running
        pids = set()
        for child in psutil.Process().children(recursive=True):
            try:
                if "AdapterDirectory" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                    pids.add(child.pid)
            except psutil.NoSuchProcess:
                pass
        return pids

    (victim,) = directories()
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # a new directory, and every replica's entries given back to it
        try:
            now = {m.id for m in client.models.list().data}
        except openai.APIError:
            now = set()
        if directories() - {victim} and now == before:
            break
        time.sleep(0.5)
    assert now == before == {NAME, *ADAPTERS}
    assert [_send(client, _request(i)) for i in range(40, 50)] == [expected[i] for i in range(40, 50)]
