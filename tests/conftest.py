"""Shared fixtures: a real Redis-protocol server, a small simulated world, a trained model.

Everything is built by the project's own code in temporary folders. ``REDIS_URL`` set in
the environment is NOT used by tests: each session starts its own server so tests never
touch a shared database.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from fraud_scoring.redis_clients import is_cluster, sync_client
from fraud_scoring.redis_server import EmbeddedCluster, embedded_cluster, embedded_redis
from service.edge.server import ServiceProcess, ServiceStartError, spawn

SIM_START = date(2026, 1, 1)
SIM_DAYS = 16


@dataclass(frozen=True)
class World:
    data_dir: Path
    model_repo: Path
    redis_url: str
    start: date
    days: int
    # The keys the world's batch runs left in the online store (batch features, markers).
    batch_keys: frozenset[bytes] = frozenset()

    @property
    def last_day(self) -> date:
        return self.start + timedelta(days=self.days - 1)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    with embedded_redis() as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[EmbeddedCluster]:
    """A Redis Cluster of three primaries (no replicas) from the same server binary."""
    with embedded_cluster(primaries=3) as cluster:
        yield cluster


def materialize_world(world: World, url: str) -> None:
    """Empty the online store at ``url`` (one Redis database, or every primary of a
    cluster) and fill it as the world's batch runs did: the batch job's own writer and
    markers, over the snapshots of every day but the held-out last one."""
    from batch_jobs.batch import mark_materialized
    from batch_jobs.daily_features import snapshot_time
    from batch_jobs.materialize import materialize_days
    from fraud_scoring.feast_store import open_store

    client = sync_client(url)
    try:
        if is_cluster(url):
            client.flushall(target_nodes=client.PRIMARIES)
        else:
            client.flushdb()
    finally:
        client.close()
    days = [world.start + timedelta(days=i) for i in range(world.days - 1)]
    store = open_store(world.data_dir, url)
    start, end = snapshot_time(days[0]), snapshot_time(days[-1]) + timedelta(seconds=1)
    materialize_days(store, url, world.data_dir / "features", days, start, end)
    mark_materialized(url, store.project)
    mark_declared(url)  # the declared states stay empty: the tests feed them


def private_db(world: World, db: int) -> str:
    """A Redis database of the world's server holding a copy of the keys its batch runs
    left (not what tests wrote since: session and declared state, claims, logs),
    emptied first, for a module whose writes must leave other tests' state alone.
    Databases 2-5, 7, 8 and 10 are taken by tests."""
    src = redis.Redis.from_url(world.redis_url)
    url = world.redis_url.rsplit("/", 1)[0] + f"/{db}"
    redis.Redis.from_url(url).flushdb()
    pipe = src.pipeline(transaction=False)
    for key in world.batch_keys:
        if not key.startswith((b"{card:", b"{agg:", b"fraud:seen:")):  # the batch's own
            pipe.copy(key, key, destination_db=db, replace=True)
    pipe.execute()
    return url


def mark_declared(url: str) -> None:
    """Set the declared states' backfilled markers (the batch job's backfill sets them;
    without them the service refuses to serve those states)."""
    from fraud_scoring.features import declarations

    client = sync_client(url)
    try:
        for spec in declarations().specs:
            client.set(spec.backfilled_key(), "test")
    finally:
        client.close()


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory, redis_server: str) -> World:
    """Simulate 16 days, compute features for all of them, train a model (about 20 s).

    The online store holds snapshots up to the end of the next-to-last day, so the last
    day is a held-out day that can be scored point-in-time correctly.

    Under pytest-xdist the first worker to ask builds it once for the run (a file lock);
    every worker then gets its own copy of the files and its own server holding the
    same keys, so tests may change their world without touching another worker's.
    """
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        root = tmp_path_factory.mktemp("world")
        build_world(root, redis_server)
        keys = frozenset(redis.Redis.from_url(redis_server).scan_iter(count=1000))
        return World(root / "data", root / "models", redis_server, SIM_START, SIM_DAYS, keys)
    shared = tmp_path_factory.getbasetemp().parent / f"world-{run}"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = (shared / "redis.pickle").exists()
        if not built:
            build_world(shared, redis_server)
            (shared / "redis.pickle").write_bytes(pickle.dumps(dump_keys(redis_server)))
    if built:
        restore_keys(redis_server, pickle.loads((shared / "redis.pickle").read_bytes()))
    root = tmp_path_factory.mktemp("world")
    for part in ("data", "models"):
        shutil.copytree(shared / part, root / part)
    from feature_repo.definitions import apply_definitions
    from fraud_scoring.feast_store import open_store

    # The registry holds each view's source path: point it at this copy.
    apply_definitions(open_store(root / "data", redis_server), root / "data")
    keys = frozenset(redis.Redis.from_url(redis_server).scan_iter(count=1000))
    return World(root / "data", root / "models", redis_server, SIM_START, SIM_DAYS, keys)


def build_world(root: Path, url: str) -> None:
    from batch_jobs.batch import day_range, run_batch
    from batch_jobs.simulate import SimConfig, simulate
    from batch_jobs.train import TrainConfig, train

    # Seed 26: the held-out last day holds all three fraud patterns (checked in a test).
    # 3,000 cards give the model about 290 training frauds: with 2,000 (about 95) the
    # share of held-out fraud it flags swung around 50 % with any change to training.
    cfg = SimConfig(cards=3000, merchants=200, days=SIM_DAYS, start=SIM_START, seed=26)
    simulate(cfg, root / "data" / "raw")
    last = SIM_START + timedelta(days=SIM_DAYS - 1)
    run_batch(root / "data", day_range(SIM_START, last - timedelta(days=1)), url)
    run_batch(root / "data", [last], url, materialize=False)
    train(
        root / "data",
        url,
        root / "models",
        TrainConfig(holdout_days=4, warmup_days=5, max_train_negatives=15_000),
    )


def dump_keys(url: str) -> list[tuple[bytes, int, bytes]]:
    """Every key of the server at ``url`` as (name, ttl in ms or 0, DUMP payload)."""
    client = redis.Redis.from_url(url)
    try:
        names = list(client.scan_iter(count=1000))
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.pttl(name)
            pipe.dump(name)
        replies = pipe.execute()
    finally:
        client.close()
    return [
        (name, max(int(ttl), 0), payload)
        for name, ttl, payload in zip(names, replies[::2], replies[1::2], strict=True)
        if payload is not None  # expired between SCAN and DUMP
    ]


def restore_keys(url: str, keys: list[tuple[bytes, int, bytes]]) -> None:
    client = redis.Redis.from_url(url)
    try:
        pipe = client.pipeline(transaction=False)
        for name, ttl, payload in keys:
            pipe.restore(name, ttl, payload, replace=True)
        pipe.execute()
    finally:
        client.close()


def wait_until(
    cond: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
    proc: subprocess.Popen[bytes] | None = None,
) -> Any:
    """Poll ``cond`` until it returns a truthy value; fail after ``timeout`` seconds, or at
    once if ``proc`` (the process being waited on) exits."""
    end = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        try:
            v = cond()
            if v:
                return v
        except Exception as exc:  # keep polling; report the last error on timeout
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}" + (f": {last_exc!r}" if last_exc else "")
    )


@dataclass
class Server:
    url: str
    process: ServiceProcess
    log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10)


def start_server(world: World, tmp: Path, wait_for: str = "/readyz", **env: str) -> Server:
    """``fraud-scoring serve`` in a subprocess, waiting until ``wait_for`` answers 200;
    if it exits instead, fail at once with its log."""
    log = tmp / f"server-{len(list(tmp.glob('server-*.log')))}.log"
    env = {
        "REDIS_URL": world.redis_url,
        "FRAUD_DATA_DIR": str(world.data_dir),
        "FRAUD_MODEL_REPO": str(world.model_repo),
        "FRAUD_REQUEST_TIMEOUT_MS": "2000",
        # The simulated world lies in the past: lift the live event-time bound (its own
        # tests set it back).
        "FRAUD_MAX_EVENT_SKEW_S": "0",
        # Most tests send one fixed transaction again and again, with other content or
        # to see another model's answer: one id, one transaction is tested on its own
        # (tests/test_idempotency.py), with it on as deployed.
        "FRAUD_IDEMPOTENCY_TTL_S": "0",
        # A spool of its own: the world's data dir is shared by every test's servers.
        "FRAUD_DECISION_SPOOL_DIR": str(log.with_suffix(".spool")),
        **env,
    }
    with open(log, "wb") as out:
        try:
            process = spawn(env, wait_for=wait_for, output=out)
        except ServiceStartError as exc:
            raise AssertionError(f"{exc}:\n{log.read_text()}") from None
    return Server(process.url, process, log)


def stop_server(srv: Server) -> None:
    srv.process.stop(timeout_s=15)


@pytest.fixture(scope="module")
def server(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(world, tmp_path_factory.mktemp("srv"))
    yield srv
    stop_server(srv)


# The quick tier (`./scripts/test.sh --quick`, `-m quick`): tests that need no simulated
# world, no server of their own and no subprocess. A test is quick unless it uses one of
# these fixtures (directly or through another) or its module is marked ``slow``.
HEAVY_FIXTURES = frozenset(
    {"world", "redis_server", "redis_cluster", "stream_redis", "kafka_bootstrap", "server"}
)


# Modules and tests that start a subprocess, a Spark session or a server themselves.
SLOW_MODULES = frozenset(
    {
        "test_feast_cli",
        "test_spark_engine",
        "test_declared_spark",  # a JVM, as test_spark_engine
        "test_redis_cluster",
        "test_packaging",
        "test_updater_readyz",
        "test_decision_log_kafka",
        "test_cli",
        "test_helm_monitoring",
        "test_docs_browser",
    }
)
SLOW_TESTS = ("test_rendered_", "test_helm_test_hook", "test_serve_refuses")


# Seconds a module takes on this project's 2-core machine (setup included; measured with
# `--durations=0`, summed per file, 2026-12-06), for the order below. Others: 5.
MODULE_SECONDS = {
    "test_score_stream": 400,
    "test_feature_vector": 85,
    "test_helm": 67,
    "test_declared_spark": 65,
    "test_training": 48,
    "test_service": 41,
    "test_declared": 60,
    "test_streaming": 32,
    "test_degraded": 25,
    "test_cli": 24,
    "test_openapi": 21,
    "test_decision_log_durability": 17,
    "test_batch_pipeline": 17,
    "test_spark_engine": 16,
    "test_data_contract": 57,
    "test_decision_log_kafka": 14,
    "test_updater_hardening": 13,
    "test_features_cli": 15,
    "test_oip_grpc": 11,
    "test_feast_cli": 10,
    "test_auth": 10,
    "test_tracing": 8,
}


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")


def _longest_first(items: list[pytest.Item]) -> None:
    """Modules in decreasing cost (``scripts/test.sh`` runs them with
    ``--no-loadscope-reorder``: each worker takes the next module as it frees up), the
    second one a module without the simulated world, so that one worker builds the
    world while the other runs it instead of waiting on the world's lock."""
    world = {_module(i) for i in items if "world" in getattr(i, "fixturenames", ())}
    order = sorted(dict.fromkeys(map(_module, items)), key=lambda m: -MODULE_SECONDS.get(m, 5))
    if len(order) > 2 and order[0] in world and order[1] in world:
        free = next((m for m in order if m not in world), None)
        if free is not None:
            order.remove(free)
            order.insert(1, free)
    rank = {m: r for r, m in enumerate(order)}
    items.sort(key=lambda i: rank[_module(i)])  # stable: a module's own order is kept


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_first(items)
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        module = _module(item)
        slow = (
            module in SLOW_MODULES
            or item.name.startswith(SLOW_TESTS)
            or item.get_closest_marker("slow") is not None
        )
        if not names & HEAVY_FIXTURES and not slow:
            item.add_marker(pytest.mark.quick)


@contextlib.contextmanager
def paused(url: str) -> Iterator[None]:
    """The Redis server at ``url`` hangs (SIGSTOP: the kernel accepts connections,
    nothing answers) for the block."""
    pid = int(redis.Redis.from_url(url).info("server")["process_id"])
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def rejections(metrics: str, reason: str) -> float:
    """``fraud_rejections_total`` for ``reason``, summed over model versions (every
    reason is exported from 0 at start)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("fraud_rejections_total{") and f'reason="{reason}"' in line
    )


def chromium() -> str:
    """Debian's chromium for the browser tests (scripts/install-chromium.sh): skipped
    when missing, but failed under ``CI=true``, where the test script installs it."""
    import shutil

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        reason = "no chromium on PATH (apt-get install chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return path
