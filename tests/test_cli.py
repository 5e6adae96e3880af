"""The ``fraud-scoring`` entry point (``python -m cli``) as a user meets it."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

import service.edge.server
from cli.main import build_parser, main
from cli.settings import Settings
from fraud_scoring import declared as D
from fraud_scoring.redis_server import free_port
from fraud_scoring.settings import read_settings
from service.edge.proto import grpc_predict_v2_pb2 as pb
from service.settings import get_settings
from tests.conftest import World, wait_until


def _cli(args: list[str], tmp_path: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAUD_", "REDIS_"))}
    env["FRAUD_DATA_DIR"] = str(tmp_path)
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        text=True,
        capture_output=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize("command", ["serve", "stream"])
def test_long_running_commands_refuse_without_redis_url(command: str, tmp_path: Path) -> None:
    r = _cli([command], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "REDIS_URL" in r.stderr and "--embedded-redis" in r.stderr


@pytest.mark.parametrize("command", ["serve", "stream"])
def test_long_running_commands_refuse_a_bad_declarations_file_at_start(
    command: str, tmp_path: Path
) -> None:
    bad = tmp_path / "features.yaml"
    doc = yaml.safe_load(D.DEFAULT_PATH.read_text())
    doc["reasons"].append({"code": "X", "when": "no_such_feature > 1", "message": "x"})
    bad.write_text(yaml.safe_dump(doc))
    r = _cli([command, "--embedded-redis"], tmp_path, FRAUD_FEATURES_FILE=str(bad))
    assert r.returncode == 2, r.stderr
    # file:line: field: message (the line of the reason's `when`).
    line = bad.read_text().splitlines().index("  when: no_such_feature > 1") + 1
    assert f"{bad}:{line}: reasons.6.when: unknown name 'no_such_feature'" in r.stderr


def test_every_app_folder_contributes_its_subcommands(tmp_path: Path) -> None:
    r = _cli(["--help"], tmp_path)
    assert r.returncode == 0, r.stderr
    for name in ("simulate", "batch", "train", "evaluate", "serve", "stream", "demo", "emit"):
        assert name in r.stdout
    for command in ("serve", "stream"):
        assert "--embedded-redis" in _cli([command, "--help"], tmp_path).stdout


def test_train_names_a_bad_config_field(tmp_path: Path) -> None:
    bad = tmp_path / "train.yaml"
    bad.write_text("holdout_days: 3\nlightgbm:\n  num_leafs: 63\n")
    r = _cli(["train", "--config", str(bad)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "lightgbm.num_leafs" in r.stderr and str(bad) in r.stderr


def test_version_prints_the_installed_package_version(tmp_path: Path) -> None:
    r = _cli(["--version"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"fraud-scoring {importlib.metadata.version('fraud-scoring')}"


@pytest.mark.parametrize(
    ("variable", "value"),
    [("FRAUD_PORT", "abc"), ("FRAUD_WORKERS", "0"), ("REDIS_URL", "http://localhost")],
)
def test_a_bad_setting_names_its_environment_variable(
    variable: str, value: str, tmp_path: Path
) -> None:
    r = _cli(["serve"], tmp_path, **{variable: value})
    assert r.returncode == 2, r.stderr
    assert f"invalid configuration: {variable}:" in r.stderr


def test_every_emit_flag_has_help_text() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("emit", "serve"):
        for action in sub.choices[name]._actions:
            assert action.help, f"{name} {'/'.join(action.option_strings)} has no help text"


@pytest.fixture
def restored_environ() -> Iterator[None]:
    """This process's environment as it was, and the settings cache cleared, after the
    test: ``serve`` exports its flags into the environment of the process it runs in."""
    saved = dict(os.environ)
    read_settings.cache_clear()
    try:
        yield
    finally:
        for k in [k for k in os.environ if k not in saved and not k.startswith("PYTEST_")]:
            del os.environ[k]
        os.environ.update({k: v for k, v in saved.items() if not k.startswith("PYTEST_")})
        read_settings.cache_clear()


def _only_fraud(**variables: str) -> None:
    for k in [k for k in os.environ if k.startswith("FRAUD_")]:
        del os.environ[k]
    os.environ.update(variables)
    read_settings.cache_clear()


SERVE_VARIABLES = ("FRAUD_HOST", "FRAUD_PORT", "FRAUD_WORKERS", "FRAUD_GRPC_PORT")


def test_serve_flags_override_the_host_and_port_settings(
    monkeypatch: pytest.MonkeyPatch, restored_environ: None
) -> None:
    """The flags given win over the settings, and are exported (with the settings cache
    cleared): the app factory (``get_settings()``) and uvicorn's worker processes (the
    environment) see what uvicorn binds, the gRPC server included."""
    base = {"REDIS_URL": "redis://localhost:6379/0", "FRAUD_HOST": "10.0.0.1"}  # never connected
    seen: list[tuple[Settings, Settings]] = []
    monkeypatch.setattr(service.edge.server, "serve", lambda s: seen.append((s, get_settings())))

    _only_fraud(**base, FRAUD_PORT="9000")
    assert main(["serve", "--host", "0.0.0.0", "--port", "8123", "--grpc-port", "8124"]) == 0
    exported = {k: os.environ.get(k) for k in SERVE_VARIABLES}
    assert exported == {
        "FRAUD_HOST": "0.0.0.0",
        "FRAUD_PORT": "8123",
        "FRAUD_WORKERS": None,
        "FRAUD_GRPC_PORT": "8124",
    }

    _only_fraud(**base, FRAUD_PORT="9000", FRAUD_GRPC_PORT="9001")
    assert main(["serve", "--workers", "3"]) == 0
    assert os.environ["FRAUD_WORKERS"] == "3" and os.environ["FRAUD_HOST"] == "10.0.0.1"

    assert [(s.host, s.port, s.workers, s.grpc_port) for s, _ in seen] == [
        ("0.0.0.0", 8123, 1, 8124),
        ("10.0.0.1", 9000, 3, 9001),
    ]
    for served, app in seen:
        assert app == served  # the app's settings are uvicorn's


@pytest.mark.parametrize("value", ["0", "65536", "abc"])
def test_a_bad_grpc_port_flag_is_named(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--grpc-port", value])
    assert exc.value.code == 2
    assert "argument --grpc-port:" in capsys.readouterr().err


def test_grpc_port_must_not_be_the_http_port(
    caplog: pytest.LogCaptureFixture, restored_environ: None
) -> None:
    _only_fraud(FRAUD_PORT="8200")
    assert main(["serve", "--grpc-port", "8200"]) == 2
    assert "--grpc-port (FRAUD_GRPC_PORT) 8200 is the HTTP port" in caplog.text


@pytest.mark.parametrize("taken", ["http", "grpc", "tls"])
def test_serve_refuses_a_taken_port_or_a_missing_tls_file_in_one_line(
    taken: str, tmp_path: Path
) -> None:
    """A real ``serve``: its HTTP or gRPC port held by another socket, or a TLS file that
    is not there, is exit status 2 and one line naming the setting, before uvicorn starts
    (uvicorn's own failure is status 3, the gRPC server's with a traceback)."""
    port, grpc_port = free_port(), free_port()
    env = _serve_env(tmp_path, FRAUD_HOST="127.0.0.1", FRAUD_PORT=str(port))
    env["FRAUD_GRPC_PORT"] = str(grpc_port)
    if taken == "tls":
        env["FRAUD_GRPC_TLS_CERT"] = str(tmp_path / "absent-cert.pem")
        env["FRAUD_GRPC_TLS_KEY"] = str(tmp_path / "absent-key.pem")
    with socket.socket() as holder:
        if taken != "tls":
            holder.bind(("127.0.0.1", port if taken == "http" else grpc_port))
            holder.listen()
        r = subprocess.run(
            [sys.executable, "-m", "cli", "serve", "--embedded-redis"],
            env=env,
            text=True,
            capture_output=True,
            timeout=120,
        )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    expected = {
        "http": f"cannot listen on 127.0.0.1:{port}: FRAUD_PORT (--port) {port} is taken",
        "grpc": f"FRAUD_GRPC_PORT (--grpc-port) {grpc_port} is taken",
        "tls": "cannot read FRAUD_GRPC_TLS_CERT",
    }[taken]
    assert expected in r.stderr, r.stderr


def _serve_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment without the project's settings, a data dir and an empty
    model repository (no model: live, not ready), and ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FRAUD_", "REDIS_", "PROMETHEUS_MULTIPROC"))
    }
    env.update(
        FRAUD_DATA_DIR=str(tmp_path / "data"), FRAUD_MODEL_REPO=str(tmp_path / "models"), **extra
    )
    return env


def _can_bind(host: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_host_and_grpc_port_flags_bind_the_grpc_server(workers: int, tmp_path: Path) -> None:
    """A real ``serve --host --port --grpc-port``, with FRAUD_HOST saying another address:
    HTTP and gRPC both listen on the flag's host (127.0.0.2, loopback too on Linux), the
    gRPC port not on FRAUD_HOST's. One worker: the app is made in the process that read
    the settings (its cache); two: in worker processes (the environment)."""
    host = "127.0.0.2"
    if not _can_bind(host):
        pytest.skip(f"{host} is not a local address here")
    port, grpc_port = free_port(), free_port()
    env = _serve_env(tmp_path, FRAUD_HOST="127.0.0.1", FRAUD_PORT=str(free_port()))
    argv = [sys.executable, "-m", "cli", "serve", "--embedded-redis", "--host", host]
    argv += ["--port", str(port), "--grpc-port", str(grpc_port), "--workers", str(workers)]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            wait_until(
                lambda: httpx.get(f"http://{host}:{port}/healthz", timeout=1).status_code == 200,
                timeout=120,
                what="/healthz on --host:--port",
                proc=proc,
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log.read_text()}") from None
        with grpc.insecure_channel(f"{host}:{grpc_port}") as channel:
            live = channel.unary_unary(
                "/inference.GRPCInferenceService/ServerLive",
                request_serializer=pb.ServerLiveRequest.SerializeToString,
                response_deserializer=pb.ServerLiveResponse.FromString,
            )
            assert live(pb.ServerLiveRequest(), timeout=30, wait_for_ready=True).live is True
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", grpc_port), timeout=5).close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


ROOT = Path(__file__).resolve().parents[1]


def _healthcheck(dockerfile: str) -> list[str]:
    """The image's HEALTHCHECK command (its exec form)."""
    text = (ROOT / dockerfile).read_text().replace("\\\n", " ")
    (line,) = [x for x in text.splitlines() if x.startswith("HEALTHCHECK ")]
    command: list[str] = json.loads(line.split(" CMD ", 1)[1])
    return command


def test_sigterm_after_a_clean_drain_exits_0_and_the_images_probe_follows_it(
    tmp_path: Path,
) -> None:
    """A real ``serve`` (one worker: uvicorn in this process): both images' HEALTHCHECK
    commands, run here with the image's environment variable, pass while it serves; on
    SIGTERM it drains, stops and exits 0 (not 143, death by the signal); then the probe
    fails."""
    port = free_port()
    env = _serve_env(tmp_path, FRAUD_PORT=str(port))
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--embedded-redis"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    probes = {d: _healthcheck(d) for d in ("Dockerfile", "Dockerfile.gpu")}
    probe_env = {**env, "FRAUD_PORT": str(port), "PATH": f"{Path(sys.executable).parent}:/usr/bin"}
    try:
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200,
            timeout=120,
            what="/healthz",
            proc=proc,
        )
        for dockerfile, probe in probes.items():
            ran = subprocess.run(probe, env=probe_env, capture_output=True, timeout=30)
            assert ran.returncode == 0, (dockerfile, ran.stderr)
        proc.terminate()
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Application shutdown complete" in log.read_text()
    ran = subprocess.run(probes["Dockerfile"], env=probe_env, capture_output=True, timeout=30)
    assert ran.returncode == 1


# What the serving image lacks: the training stack (the `train` extra).
_NO_TRAINING_STACK = (
    "import sys\n"
    "for m in {modules!r}: sys.modules[m] = None  # as if not installed\n"
    "from cli.main import main\n"
    "sys.exit(main({argv!r}))\n"
)


@pytest.mark.parametrize("argv", [["train"], ["batch"]])
def test_job_commands_without_the_training_stack_say_so_in_one_line(
    argv: list[str], tmp_path: Path
) -> None:
    """In the serving image (no ``train`` extra) a job subcommand answers exit status 2
    and one line pointing at the extra and the jobs image, not a traceback."""
    from cli.main import JOB_MODULES

    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAUD_", "REDIS_"))}
    env["FRAUD_DATA_DIR"] = str(tmp_path)
    code = _NO_TRAINING_STACK.format(modules=sorted(JOB_MODULES), argv=argv)
    r = subprocess.run(
        [sys.executable, "-c", code], text=True, capture_output=True, env=env, timeout=120
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if "ERROR" in x]
    assert f"fraud-scoring {argv[0]} needs '" in line
    assert "serves only" in line and "`train` extra" in line and "jobs image" in line


def _parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_help_texts_show_no_markup() -> None:
    """--help of the command and of every subcommand, as a terminal shows it: no reST
    ``literal`` marks (the top-level description comes from the module's docstring) and
    no Markdown backticks."""
    seen = 0
    for prog, parser in _parsers(build_parser()):
        text = parser.format_help()
        assert "`" not in text, (prog, [line for line in text.splitlines() if "`" in line])
        seen += 1
    assert seen > 10
    top = build_parser().format_help()
    assert "The fraud-scoring command: one subcommand per job." in top


def test_demo_port_is_checked_before_the_demo_runs(tmp_path: Path) -> None:
    """``demo --port``: outside 0-65535, or taken, is exit 2 in one line naming --port,
    at once (not after minutes of simulating and training)."""
    assert "--port" in _cli(["demo", "--help"], tmp_path).stdout
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _cli(["demo", "--port", str(port)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"--port {port}: 127.0.0.1:{port} is in use" in r.stderr, r.stderr
    assert "simulate" not in r.stdout, r.stdout
    r = _cli(["demo", "--port", "70000"], tmp_path)
    assert r.returncode == 2 and "--port must be in 0-65535" in r.stderr, r.stderr


def test_demo_serves_on_the_port_asked(world: World, tmp_path: Path) -> None:
    """The demo's service listens on ``--port`` (and on a free port with 0)."""
    from cli.demo import check_port, serve_on

    env = {
        "REDIS_URL": world.redis_url,
        "FRAUD_DATA_DIR": str(world.data_dir),
        "FRAUD_MODEL_REPO": str(world.model_repo),
        "FRAUD_MAX_EVENT_SKEW_S": "0",
        "FRAUD_DECISION_SPOOL_DIR": str(tmp_path / "spool"),
    }
    port = free_port()
    check_port(port)
    for asked in (port, 0):
        service = serve_on(env, asked)
        try:
            if asked:
                assert service.url == f"http://127.0.0.1:{port}"
            assert httpx.get(f"{service.url}/readyz", timeout=5).status_code == 200
        finally:
            service.stop()
