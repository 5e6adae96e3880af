"""The challenger: shadow scores logged and never used, a canary share of cards routed by
a stable hash, a broken challenger that scoring does not feel, promotion and rollback
through the reload endpoint, and `evaluate --compare` on the logged traffic.

One real service (its decision log on its own Redis-protocol server) over a copy of the
world's model repository, to which the tests add real ONNX models: v2, a logistic model
on a few features in its own order (so it needs its own matrix); v3, one that loads and
warms up but fails on real traffic; v4, one needing a feature nobody produces.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import redis
from onnx import TensorProto, helper

from cli.settings import Settings
from fraud_scoring.features import producible_features
from fraud_scoring.model_repo import ModelError
from fraud_scoring.redis_server import embedded_redis
from service.core.challenger import Challenger, canary_bucket, load_challenger, routed_to_challenger
from service.core.model import load_model
from tests.conftest import Server, World, start_server, stop_server, wait_until
from tests.test_service import held_out_day

# v2's features, deliberately not in the champion's order.
V2_FEATURES = ["card_txn_count_10m", "is_foreign_country", "merchant_fraud_rate_90d", "amount_log"]
V2_WEIGHTS = [0.4, 1.5, 30.0, 0.3]
V2_BIAS = -4.0
REPLAY = {"X-Fraud-Record": "false"}  # the same features every time a row is scored


def _probabilities(graph_nodes: list[onnx.NodeProto], p: str) -> list[onnx.NodeProto]:
    """Nodes turning the column ``p`` (n, 1) into the contract's (n, 2) output."""
    return [
        *graph_nodes,
        helper.make_node("Sub", ["one", p], ["p0"]),
        helper.make_node("Concat", ["p0", p], ["probabilities"], axis=1),
    ]


def _write_model(
    repo: Path, version: str, features: list[str], nodes: list[onnx.NodeProto], inits: list
) -> None:
    """A model version: ``nodes`` map ``input`` (n, k) to ``probabilities`` (n, 2); the
    metadata is the champion's with this version's features and thresholds."""
    graph = helper.make_graph(
        nodes,
        f"challenger-{version}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, len(features)])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, 2])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]), *inits],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    target = repo / "fraud" / version
    target.mkdir(parents=True)
    onnx.save(model, target / "model.onnx")
    meta = json.loads((repo / "fraud" / "1" / "metadata.json").read_text())
    meta.update(
        version=version,
        features=[{"name": f, "dtype": "float32"} for f in features],
        thresholds={"review": 0.3, "decline": 0.7},
        variants={},
        variant_thresholds={},
        calibration={},
        reliability={},
        feature_importance={f: 1 / len(features) for f in features},
    )
    (target / "metadata.json").write_text(json.dumps(meta))


def v2_scores(features: dict[str, float]) -> float:
    z = V2_BIAS + sum(w * features[f] for w, f in zip(V2_WEIGHTS, V2_FEATURES, strict=True))
    return float(1 / (1 + np.exp(-z)))


@pytest.fixture(scope="module")
def repo(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("challenger") / "models"
    shutil.copytree(world.model_repo, root)
    assert (root / "fraud" / "1").is_dir()
    # v2: sigmoid(x @ w + b) on four features.
    _write_model(
        root,
        "2",
        V2_FEATURES,
        _probabilities(
            [
                helper.make_node("MatMul", ["input", "w"], ["z0"]),
                helper.make_node("Add", ["z0", "b"], ["z"]),
                helper.make_node("Sigmoid", ["z"], ["p"]),
            ],
            "p",
        ),
        [
            helper.make_tensor("w", TensorProto.FLOAT, [4, 1], V2_WEIGHTS),
            helper.make_tensor("b", TensorProto.FLOAT, [1], [V2_BIAS]),
        ],
    )
    # v3: looks the score up in a table of one by 1000 x the amount: the warm-up's zeros
    # pass, any real amount (> 0) is an index out of bounds and ONNX Runtime fails the run.
    _write_model(
        root,
        "3",
        ["amount"],
        _probabilities(
            [
                helper.make_node("Mul", ["input", "k"], ["scaled"]),
                helper.make_node("Cast", ["scaled"], ["idx"], to=TensorProto.INT64),
                helper.make_node("Gather", ["table", "idx"], ["p"], axis=0),
                helper.make_node("Reshape", ["p", "shape"], ["p2"]),
            ],
            "p2",
        ),
        [
            helper.make_tensor("k", TensorProto.FLOAT, [], [1000.0]),
            helper.make_tensor("table", TensorProto.FLOAT, [1], [0.1]),
            helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 1]),
        ],
    )
    # v4: v1 asking for a feature the service cannot produce.
    shutil.copytree(root / "fraud" / "1", root / "fraud" / "4")
    meta = json.loads((root / "fraud" / "4" / "metadata.json").read_text())
    meta["version"] = "4"
    meta["features"][-1]["name"] = "no_such_feature"
    (root / "fraud" / "4" / "metadata.json").write_text(json.dumps(meta))
    return root


@pytest.fixture(scope="module")
def log_url() -> Iterator[str]:
    with embedded_redis() as url:
        yield url


@pytest.fixture(scope="module")
def srv(
    world: World, repo: Path, log_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    s = start_server(
        world,
        tmp_path_factory.mktemp("challenger-srv"),
        FRAUD_MODEL_REPO=str(repo),
        FRAUD_MODEL_VERSION="1",
        FRAUD_CHALLENGER_VERSION="2",
        FRAUD_DECISION_LOG_URL=log_url,
        # Generous: a loaded test machine must not turn shadow scores into timeouts.
        FRAUD_CHALLENGER_TIMEOUT_MS="5000",
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def rows(world: World) -> list[dict]:
    """Held-out transactions with both labels: every fraud of the day and 90 others."""
    day = held_out_day(world)
    frauds = [r for r in day if r["is_fraud"]]
    assert len(frauds) >= 5
    return frauds[:30] + [r for r in day if not r["is_fraud"]][:90]


def lineup(s: Server, body: dict[str, Any] | None) -> dict[str, Any]:
    with s.client() as c:
        r = c.post(
            "/v1/models/reload", json=body or None, headers={"Content-Type": "application/json"}
        )
    assert r.status_code == 200, r.text
    return r.json()


def score_all(s: Server, txns: list[dict], prefix: str) -> dict[str, dict]:
    """Score ``txns`` (replay mode) under ids ``prefix + id``; answers by original id."""
    out = {}
    with s.client() as c:
        for i in range(0, len(txns), 25):
            chunk = [
                {**t, "transaction_id": prefix + t["transaction_id"]} for t in txns[i : i + 25]
            ]
            r = c.post("/v1/score/batch", json={"transactions": chunk}, headers=REPLAY)
            assert r.status_code == 200, r.text
            out.update({a["transaction_id"][len(prefix) :]: a for a in r.json()["results"]})
    return out


def logged(url: str, prefix: str, n: int) -> dict[str, dict]:
    """The log's entries under ``prefix``, once all ``n`` are in; by original id."""

    def read() -> dict[str, dict]:
        client = redis.Redis.from_url(url)
        try:
            es = [json.loads(f[b"d"]) for _, f in client.xrange("decisions")]
        finally:
            client.close()
        return {
            e["transaction_id"][len(prefix) :]: e
            for e in es
            if e["transaction_id"].startswith(prefix)
        }

    return wait_until(lambda: (e := read()) and len(e) >= n and e, what=f"{n} entries {prefix}")


def metric(s: Server, name: str, labels: str = "") -> float:
    with s.client() as c:
        text = c.get("/metrics").text
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_shadow_scores_are_logged_and_never_change_a_decision(
    srv: Server, rows: list[dict], log_url: str
) -> None:
    assert (
        lineup(srv, {"challenger_version": "2", "canary_percent": 0})["challenger_version"] == "2"
    )
    shadowed = score_all(srv, rows, "sh-")
    assert lineup(srv, {"challenger_version": None})["challenger_version"] is None
    alone = score_all(srv, rows, "nc-")
    # The answers with and without a challenger are the same, field for field.
    for tid, a in shadowed.items():
        b = alone[tid]
        for key in ("decision", "score", "reasons", "model_version", "features"):
            assert a[key] == b[key], (tid, key)
        assert a["model_version"] == "1"
    entries = logged(log_url, "sh-", len(rows))
    for tid, e in entries.items():
        assert (e["score"], e["decision"], e["model_version"]) == (
            shadowed[tid]["score"],
            shadowed[tid]["decision"],
            "1",
        )
        assert e["routed_to"] == "champion"
        assert (e["champion_version"], e["champion_score"]) == ("1", e["score"])
        assert e["challenger_version"] == "2"
        # v2 scored its own vector, built from the same feature values the champion saw.
        assert e["challenger_score"] == pytest.approx(v2_scores(e["features"]), rel=1e-5)
    assert len({e["challenger_score"] for e in entries.values()}) > 1
    without = logged(log_url, "nc-", len(rows))
    assert all(e["challenger_score"] is None for e in without.values())
    assert metric(srv, "fraud_challenger_scored_total") >= len(rows)


def test_canary_routing_is_stable_per_card_and_near_the_share(
    srv: Server, rows: list[dict], log_url: str, world: World
) -> None:
    # The hash is fixed (blake2b), not Python's per-process salted hash(): pinned here,
    # so a change to it (which would move cards between models) fails this test.
    assert canary_bucket("c0000001") == 2173
    cards = [f"c{i:07d}" for i in range(20_000)]
    for pct in (1, 10, 30):
        share = np.mean([routed_to_challenger(c, pct) for c in cards])
        assert abs(share - pct / 100) < 0.01 + pct / 1000, pct
    assert not any(routed_to_challenger(c, 0) for c in cards)
    assert all(routed_to_challenger(c, 100) for c in cards)

    lineup(srv, {"challenger_version": "2", "canary_percent": 30})
    try:
        day = held_out_day(world)
        first = score_all(srv, day[:300], "cn-")
        again = score_all(srv, day[:300], "cn2-")
    finally:
        lineup(srv, {"canary_percent": 0})
    by_card: dict[str, set[str]] = {}
    for t in day[:300]:
        a = first[t["transaction_id"]]
        # The service (another process) routes exactly as this process computes it.
        expected = "2" if routed_to_challenger(t["card_id"], 30) else "1"
        assert a["model_version"] == again[t["transaction_id"]]["model_version"] == expected
        by_card.setdefault(t["card_id"], set()).add(a["model_version"])
    assert all(len(v) == 1 for v in by_card.values())  # one model per card
    share = np.mean([v == {"2"} for v in by_card.values()])
    assert 0.15 < share < 0.45, share
    entries = logged(log_url, "cn-", 300)
    routed = [e for e in entries.values() if e["routed_to"] == "challenger"]
    assert routed and len(routed) < len(entries)
    for e in entries.values():
        decider = "2" if e["routed_to"] == "challenger" else "1"
        assert e["model_version"] == decider
        assert e["champion_version"] == "1" and e["challenger_version"] == "2"
        assert e["champion_score"] is not None and e["challenger_score"] is not None
    for e in routed:
        # The challenger's score and thresholds decided, on its own vector.
        assert list(e["features"]) == V2_FEATURES
        assert e["score"] == e["challenger_score"]
        assert e["score"] == pytest.approx(v2_scores(e["features"]), rel=1e-5)
        by_threshold = (
            "decline" if e["score"] >= 0.7 else "review" if e["score"] >= 0.3 else "approve"
        )
        order = ["approve", "review", "decline"]
        assert order.index(e["decision"]) >= order.index(by_threshold)  # rules only add


def test_promotion_and_rollback_through_the_reload_endpoint(srv: Server, rows: list[dict]) -> None:
    promoted = lineup(srv, {"version": "2", "challenger_version": None, "canary_percent": 0})
    assert promoted == {
        "previous_version": "1",
        "serving_version": "2",
        "challenger_version": None,
        "canary_percent": 0.0,
    }
    try:
        assert {a["model_version"] for a in score_all(srv, rows[:10], "pr-").values()} == {"2"}
    finally:
        back = lineup(srv, {"version": "1", "challenger_version": "2"})
    assert (back["serving_version"], back["challenger_version"]) == ("1", "2")
    assert {a["model_version"] for a in score_all(srv, rows[:10], "rb-").values()} == {"1"}
    with srv.client() as c:
        refused = c.post("/v1/models/reload", json={"challenger_version": "4"})
        assert refused.status_code == 409, refused.text
        assert refused.json()["serving_version"] == "1"
        message = refused.json()["detail"][0]["message"]
        assert "challenger refused" in message and "no_such_feature" in message
        for bad, field in (
            ({"canary_percent": 101}, "canary_percent"),
            ({"canary_percent": False}, "canary_percent"),
            ({"version": "two"}, "version"),
            ({"challenger": "2"}, "challenger"),
        ):
            r = c.post("/v1/models/reload", json=bad)
            assert r.status_code == 422, r.text
            assert [e["field"] for e in r.json()["detail"]] == [field]
    # Nothing changed: a plain reload keeps the lineup.
    assert lineup(srv, None)["challenger_version"] == "2"


def test_a_broken_challenger_does_not_fail_scoring(
    srv: Server, rows: list[dict], log_url: str, repo: Path
) -> None:
    baseline = score_all(srv, rows, "bb-")  # v1 deciding, v2 in shadow
    before = metric(srv, "fraud_challenger_errors_total", '{reason="inference"}')
    lineup(srv, {"challenger_version": "3", "canary_percent": 50})
    try:
        answers = score_all(srv, rows, "br-")
    finally:
        lineup(srv, {"challenger_version": "2", "canary_percent": 0})
    # Every card the canary would give to v3 was decided by v1, exactly as without it.
    for tid, a in answers.items():
        assert (a["model_version"], a["decision"], a["score"]) == (
            "1",
            baseline[tid]["decision"],
            baseline[tid]["score"],
        )
    assert metric(srv, "fraud_challenger_errors_total", '{reason="inference"}') > before
    entries = logged(log_url, "br-", len(rows))
    assert all(
        e["challenger_score"] is None and e["routed_to"] == "champion" for e in entries.values()
    )
    # A challenger that cannot load is refused with the reason, at start as on reload.
    settings = Settings(model_repo=repo, challenger_version="4", execution_provider="cpu")
    ch = Challenger(settings)
    ch.load()
    assert ch.current is None
    assert "no_such_feature" in (ch.readiness() or "")
    with pytest.raises(ModelError, match=r"challenger refused.*no_such_feature"):
        load_challenger(settings, "4")
    assert load_model(repo, "fraud", "2", producible_features()).meta.feature_names == V2_FEATURES


def test_evaluate_compare_reports_both_versions_on_the_logged_traffic(
    srv: Server,
    rows: list[dict],
    log_url: str,
    repo: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cli.main import main
    from fraud_scoring.settings import read_settings

    shadowed = score_all(srv, rows, "cmp-")
    with srv.client() as c:
        for t in rows:
            body = {
                "transaction_id": "cmp-" + t["transaction_id"],
                "label": "fraud" if t["is_fraud"] else "legitimate",
                "source": "chargeback",
                "time": t["event_time"],
            }
            assert c.post("/v1/feedback", json=body).status_code == 200
    entries = logged(log_url, "cmp-", len(rows))
    assert all(e["challenger_score"] is not None for e in entries.values())
    today = datetime.now(UTC).date().isoformat()
    monkeypatch.setenv("FRAUD_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FRAUD_MODEL_REPO", str(repo))
    monkeypatch.setenv("FRAUD_DECISION_LOG_URL", log_url)
    read_settings.cache_clear()
    try:
        assert main(["decisions", "compact", "--date", today]) == 0
        capsys.readouterr()
        assert main(["evaluate", "--compare", "1", "2", "--from", today, "--to", today]) == 0
        printed = capsys.readouterr().out
        assert main(["evaluate", "--compare", "1", "2", "--from", today]) == 2
    finally:
        read_settings.cache_clear()
    path = Path(printed.strip().splitlines()[-1].removeprefix("comparison: "))
    report = json.loads(path.read_text())
    assert "ROC AUC" in printed and "disagree on" in printed
    # Every entry of this day with both scores; the labelled ones are this test's.
    paired = [e for e in _log_entries(log_url) if e.get("challenger_version") == "2"]
    assert report["rows"] == len(paired)
    assert report["labelled"] == len(rows)
    assert report["frauds"] == sum(bool(t["is_fraud"]) for t in rows)
    v1, v2 = report["models"]["1"], report["models"]["2"]
    assert v1["thresholds"] != v2["thresholds"]
    for m in (v1, v2):
        assert 0 <= m["roc_auc"] <= 1 and 0 <= m["pr_auc"] <= 1
        assert sum(m["decision_mix"].values()) == pytest.approx(1)
    matrix = report["disagreement"]["matrix"]
    assert sum(sum(r.values()) for r in matrix.values()) == report["rows"]
    assert report["disagreement"]["rows"] == report["rows"] - sum(matrix[d][d] for d in matrix)
    # The champion's figures from this test's own rows, computed here independently.
    from sklearn.metrics import roc_auc_score

    ours = [entries[t["transaction_id"]] for t in rows]
    y = [int(t["is_fraud"]) for t in rows]
    assert [e["score"] for e in ours] == [shadowed[t["transaction_id"]]["score"] for t in rows]
    labelled_ids = {"cmp-" + t["transaction_id"] for t in rows}
    assert labelled_ids <= {e["transaction_id"] for e in paired}
    assert v1["roc_auc"] == pytest.approx(roc_auc_score(y, [e["score"] for e in ours]))
    assert v2["roc_auc"] == pytest.approx(roc_auc_score(y, [e["challenger_score"] for e in ours]))


def _log_entries(url: str) -> list[dict]:
    client = redis.Redis.from_url(url)
    try:
        return [json.loads(f[b"d"]) for _, f in client.xrange("decisions")]
    finally:
        client.close()
