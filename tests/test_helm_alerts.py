"""The chart's alert rules, unit-tested with Prometheus's own ``promtool test rules``.

Each rule has a test file ``tests/helm_alerts/<alert>.yaml`` (promtool's format): input
series, and evaluation times at which the alert must fire (with its labels and rendered
description) or stay silent. The rules come from the chart rendered with default
values plus score-stream (``scoreStream.enabled``, off by default); summary and runbook
annotations are left out of what promtool compares (they are fixed text), the
description is kept because it renders ``$value`` and ``$labels``.

promtool comes from Debian's ``prometheus`` package (``scripts/install-promtool.sh``, run
by ``scripts/test.sh``): without it these tests skip, and fail under ``CI=true``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_helm import ROOT, find, missing_tool, render, rendered_case

RULE_TESTS = ROOT / "tests" / "helm_alerts"
OPERATOR = ("monitoring.coreos.com/v1",)
# Fixed text that promtool would otherwise have to be told verbatim.
UNCOMPARED_ANNOTATIONS = ("summary", "runbook", "runbook_url")
# The default values with every optional component that has alerts turned on.
RULES_VALUES = {"scoreStream": {"enabled": True}}


def rule_groups(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (rule,) = find(docs, "PrometheusRule")
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def rule_groups_under_test() -> list[dict[str, Any]]:
    """The rule groups under test (a fresh render: the caller may change them)."""
    return rule_groups(render(RULES_VALUES, api_versions=OPERATOR))


def alert_names() -> list[str]:
    return [r["alert"] for g in rule_groups_under_test() for r in g["rules"]]


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool", path=str(Path(sys.executable).parent)) or shutil.which(
        "promtool"
    )
    if not found:
        missing_tool("promtool not installed: run scripts/install-promtool.sh")
    assert found
    return found


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the rendered rules as a Prometheus rule file (``rules.yaml``, the
    name every test file loads)."""
    groups = rule_groups_under_test()
    for group in groups:
        for r in group["rules"]:
            for name in UNCOMPARED_ANNOTATIONS:
                r["annotations"].pop(name, None)
    folder = tmp_path_factory.mktemp("rules")
    (folder / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    return folder


def test_the_rendered_rules_pass_promtool_check(promtool: str, rules_dir: Path) -> None:
    run = subprocess.run(
        [promtool, "check", "rules", "rules.yaml"],
        cwd=rules_dir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_alert_has_a_rule_test_that_fires_and_one_that_stays_silent() -> None:
    alerts = alert_names()
    assert sorted(p.stem for p in RULE_TESTS.glob("*.yaml")) == sorted(alerts)
    for alert in alerts:
        spec = yaml.safe_load((RULE_TESTS / f"{alert}.yaml").read_text())
        assert spec["rule_files"] == ["rules.yaml"], alert
        checks = [c for t in spec["tests"] for c in t["alert_rule_test"]]
        assert {c["alertname"] for c in checks} == {alert}
        assert any(c.get("exp_alerts") for c in checks), f"{alert}: no case where it fires"
        assert any(not c.get("exp_alerts") for c in checks), f"{alert}: no silent case"


@pytest.mark.parametrize("alert", alert_names())
def test_alert_fires_when_it_should_and_only_then(
    alert: str, promtool: str, rules_dir: Path
) -> None:
    shutil.copy(RULE_TESTS / f"{alert}.yaml", rules_dir)
    run = subprocess.run(
        [promtool, "test", "rules", f"{alert}.yaml"],
        cwd=rules_dir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_updater_absence_is_an_alert_only_where_the_chart_scrapes_the_updater() -> None:
    """absent() would fire forever where the chart's PodMonitor does not scrape it."""

    def stalled(values: dict[str, Any] | None) -> str:
        groups = rule_groups(render(values, api_versions=OPERATOR))
        (expr,) = [
            r["expr"] for g in groups for r in g["rules"] if r["alert"] == "FraudUpdaterStalled"
        ]
        return str(expr)

    assert "absent(" in stalled(None)
    assert "absent(" not in stalled({"metrics": {"serviceMonitor": {"enabled": False}}})


def test_score_stream_alerts_only_with_score_stream() -> None:
    """Off by default: no rule over series nothing exports."""
    default = [r["alert"] for g in rule_groups(rendered_case("default")) for r in g["rules"]]
    stream = [a for a in alert_names() if a.startswith("FraudScoreStream")]
    assert sorted(stream) == [
        "FraudScoreStreamEventTimeLagHigh",
        "FraudScoreStreamOverBudget",
        "FraudScoreStreamPaused",
        "FraudScoreStreamStalled",
        "FraudScoreStreamUncommitted",
    ]
    assert not set(stream) & set(default)
    assert sorted(default + stream) == sorted(alert_names())


def test_score_stream_alerts_read_its_thresholds_and_budget() -> None:
    values = RULES_VALUES | {
        "scoreStream": {"enabled": True, "latencyBudgetMs": 80, "maxWaitMs": 2},
        "metrics": {
            "prometheusRule": {
                "scoreStreamEventTimeLagSeconds": 0.5,
                "scoreStreamOverBudgetRatio": 0.05,
                "scoreStreamUncommittedAgeSeconds": 30,
            }
        },
    }
    rules = {
        r["alert"]: r
        for g in rule_groups(render(values, api_versions=OPERATOR))
        for r in g["rules"]
    }
    assert rules["FraudScoreStreamEventTimeLagHigh"]["expr"].endswith("> 0.5")
    assert rules["FraudScoreStreamOverBudget"]["expr"].endswith("> 0.05")
    assert "(80ms)" in rules["FraudScoreStreamOverBudget"]["annotations"]["description"]
    assert rules["FraudScoreStreamUncommitted"]["expr"].endswith("> 30")


def test_score_stream_alerts_query_what_score_stream_exports() -> None:
    """Every series the score-stream rules read is a family of ``ScoreStreamMetrics``."""
    from prometheus_client import generate_latest

    from streaming.metrics import ScoreStreamMetrics
    from tests.test_helm_monitoring import exported, metric_names

    text = generate_latest(ScoreStreamMetrics.create().registry).decode()
    queried = {
        name
        for g in rule_groups_under_test()
        for r in g["rules"]
        if r["alert"].startswith("FraudScoreStream")
        for name in metric_names(r["expr"])
    }
    assert queried and queried <= exported(text), queried - exported(text)
