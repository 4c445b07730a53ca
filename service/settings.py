"""`serve` settings from defaults, a TOML file, environment variables and flags.

Precedence, lowest first: built-in defaults, `--config FILE`, `LATTICE_SCHEDULER_*`
environment variables, command-line flags. Every value is checked before the server
starts; a bad one stops it with a message naming the setting and where it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from service.core import ConfigError, SchedulerConfig
from service.core.registry import policies_help

ENV_PREFIX = "LATTICE_SCHEDULER_"
# gRPC's own default for incoming messages (4 MiB), made explicit.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# grpc takes the option as a C int.
_MAX_GRPC_MESSAGE_BYTES = 2**31 - 1


@dataclass(frozen=True)
class ServeSettings:
    """Process settings of `lattice-scheduler serve`, plus the scheduler's own config."""

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9400
    worker_port: int = 0  # 0: no separate listener for worker traffic
    max_streams: int = 10_000
    max_open_streams: int = 100
    max_threads: int = 64  # no effect since the server runs on one event loop
    grace_seconds: float = 5.0
    log_format: str = "text"
    log_level: str = "INFO"
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_tokens: str = ""
    state_dir: str = ""
    state_fsync: str = "acks"
    state: str = ""
    prefetch: int = 8
    replica_lease_ms: int = 5000
    replica_commit_wait_ms: float = 5.0
    replica_commit_due_wait_ms: float = 10.0
    replica_watch_ms: float = 20.0
    replica_affinity_ms: int = 1000
    replica_streams: str = "owner"
    replica_address: str = ""
    replica_peer_ca: str = ""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    step_table: str = ""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> ServeSettings:
        for name in ("port", "metrics_port", "worker_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                zero = "turns it off" if name == "worker_port" else "picks a free port"
                raise ConfigError(f"{name} must be within 0-65535 (0 {zero}), got {value}")
        if self.max_threads < 2:  # no effect any more; still checked as it always was
            raise ConfigError(f"max_threads must be at least 2, got {self.max_threads}")
        for name in ("max_streams", "max_open_streams"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.worker_port and self.worker_port == self.port:
            raise ConfigError(
                f"worker_port must differ from port ({self.port}); 0 turns the "
                f"separate worker listener off"
            )
        if self.grace_seconds < 0:
            raise ConfigError(f"grace_seconds must not be negative, got {self.grace_seconds}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format must be text or json, got {self.log_format!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(
                f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(
                "tls_cert and tls_key go together (--tls-cert FILE --tls-key "
                "FILE): give both for TLS, or neither for plaintext"
            )
        if self.state_fsync not in ("acks", "always", "never"):
            raise ConfigError(
                f"state_fsync must be acks, always or never, got {self.state_fsync!r}"
            )
        if self.state:
            if not self.state.startswith(("postgresql://", "postgres://")):
                raise ConfigError(
                    f"state must be a PostgreSQL URL (postgresql://USER@HOST:"
                    f"PORT/DB), got {self.state!r}; for one process on local "
                    "files use --state-dir DIR"
                )
            if self.state_dir:
                raise ConfigError(
                    "state (PostgreSQL, replicas) and state_dir (SQLite, one "
                    "process) exclude each other: give one"
                )
        if self.prefetch < 0:
            raise ConfigError(f"prefetch must not be negative, got {self.prefetch}")
        if not 0 <= self.replica_commit_wait_ms <= 100:
            raise ConfigError(
                f"replica_commit_wait_ms must be within 0-100, got {self.replica_commit_wait_ms}"
            )
        if not 0 <= self.replica_commit_due_wait_ms <= 100:
            raise ConfigError(
                "replica_commit_due_wait_ms must be within 0-100, got "
                f"{self.replica_commit_due_wait_ms}"
            )
        if not 1 <= self.replica_watch_ms <= 1000:
            raise ConfigError(
                f"replica_watch_ms must be within 1-1000, got {self.replica_watch_ms}"
            )
        if self.replica_affinity_ms < 0:
            raise ConfigError(
                f"replica_affinity_ms must not be negative, got {self.replica_affinity_ms}"
            )
        if self.replica_streams not in ("owner", "database"):
            raise ConfigError(
                f"replica_streams must be owner or database, got {self.replica_streams!r}"
            )
        if self.replica_lease_ms < 300:
            raise ConfigError(f"replica_lease_ms must be at least 300, got {self.replica_lease_ms}")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca (mTLS) needs TLS: give --tls-cert and --tls-key too")
        if self.replica_peer_ca and not self.tls_cert:
            raise ConfigError(
                "replica_peer_ca is for replicas that serve TLS: give --tls-cert and --tls-key "
                "too (without TLS, replicas relay streams in plaintext)"
            )
        if not 1024 <= self.max_message_bytes <= _MAX_GRPC_MESSAGE_BYTES:
            raise ConfigError(
                f"max_message_bytes must be within 1024-{_MAX_GRPC_MESSAGE_BYTES}, "
                f"got {self.max_message_bytes}"
            )
        self.scheduler.validate()
        return self


_HELP = {
    "host": "address to listen on (gRPC and metrics)",
    "port": "gRPC port; 0 picks a free port and prints it (the metrics port is apart: "
    "--port 0 --metrics-port 0 takes no fixed port)",
    "metrics_port": "Prometheus /metrics port; 0 picks a free port and prints it",
    "worker_port": "also serve the worker RPCs (and health) on this port, apart from "
    "client traffic; 0: none (every RPC is always served on --port)",
    "max_streams": "most Generate and FollowSequence streams open at once (on replicas a "
    "stream of another replica's sequence is one on each); more get RESOURCE_EXHAUSTED at "
    "once",
    "max_open_streams": "most Health.Watch and reflection streams (which need no token) open "
    "at once; more get RESOURCE_EXHAUSTED at once",
    "max_threads": "no effect: the server runs on one event loop, with no thread per call "
    "(kept so that older configs still start)",
    "grace_seconds": "on SIGTERM, seconds in-flight calls get to finish",
    "log_format": "text, or json for one JSON object per line",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "tls_cert": "serve TLS with this certificate chain (PEM); needs --tls-key",
    "tls_key": "private key of --tls-cert (PEM)",
    "tls_client_ca": "require client certificates signed by this CA (PEM): mutual TLS",
    "auth_tokens": "require bearer tokens with roles, from this TOML or JSON file "
    "(see docs/security.md)",
    "state_dir": "keep the queue and every sequence's progress in DIR (SQLite, WAL); a "
    "restart on the same DIR carries on; none: state lives in memory only",
    "state_fsync": "acks: fsync what clients are told OK (Submit, Cancel) before answering; "
    "always: every change; never: none (survives kill -9, not power loss)",
    "state": "share state with other replicas in this PostgreSQL database "
    "(postgresql://USER@HOST:PORT/DB); every replica serves every RPC, workers "
    "belong to the replica they talk to (docs/replicas.md)",
    "prefetch": "replicas: queued sequences each replica claims beyond its workers' free "
    "places (how far admission may drift from the global order)",
    "replica_lease_ms": "replicas: a replica silent this long is presumed dead; another "
    "returns its sequences to the shared queue",
    "replica_affinity_ms": "replicas: a follow-up whose conversation finished last on "
    "another replica (its workers cache the prefix) is left to that replica this long "
    "after its submission before any replica claims it (0: claims ignore caches)",
    "replica_commit_wait_ms": "replicas: how long a group commit waits at most for more "
    "saves to join before it starts; it starts sooner once every worker of the replica has "
    "saved (0: at once; saves made while a commit is in flight join the next one anyway)",
    "replica_commit_due_wait_ms": "replicas: how long a group commit may wait at most when "
    "every worker in it says its answer is due later (workers that overlap their reports "
    "with their steps: answer_due_us), never past a due less a margin (at or below "
    "replica_commit_wait_ms: dues are not taken)",
    "replica_streams": "replicas: how a Generate stream of a sequence another replica owns "
    "gets its tokens: owner (relayed from that replica, FollowSequence; read from PostgreSQL "
    "while it cannot be reached, and with TLS on unless --replica-peer-ca is given) or "
    "database (read from PostgreSQL after each of its commits)",
    "replica_address": "replicas: host:port where the other replicas reach this one's "
    "--port to relay its streams",
    "replica_peer_ca": "replicas with TLS: relay streams from the other replicas over TLS, "
    "trusting this CA (PEM; a private one) for their certificates, which must name the "
    "address each publishes (--replica-address); this replica shows its own --tls-cert to "
    "those that ask for one (mTLS). None: with TLS on, streams of other replicas' sequences "
    "read PostgreSQL",
    "replica_watch_ms": "replicas: how often this replica reads the others' commit numbers "
    "and the newest submit (neither notifies): the most a token streamed here from another "
    "replica's sequence, or a submit made on another replica, waits to be seen, against one "
    "small read of PostgreSQL each time (docs/replicas.md)",
    "max_message_bytes": "largest incoming gRPC message in bytes; a larger one gets "
    "RESOURCE_EXHAUSTED",
    "step_table": "with a latency target: a `lattice-worker profile` step table (JSON) that "
    "each worker's learned step time starts from; none: a cautious default "
    "that steps are measured against from the first one",
    "max_batch_size": "most sequences per worker, when a worker registers with 0",
    "max_worker_batch_size": "the most sequences a worker may ask for at registration; a "
    "larger max_batch_size is cut to this (the answer says so)",
    "chunk_size": "most prompt tokens per prefill chunk",
    "prefill_reserve_pages": "free KV pages below which a non-empty batch admits nothing",
    "max_seq_len": "limit on prompt_len + max_new_tokens",
    "max_queue": "most sequences waiting for admission; more get RESOURCE_EXHAUSTED",
    "max_queue_per_tenant": "most queued sequences per tenant (0: no limit); more get "
    "RESOURCE_EXHAUSTED",
    "lease_ttl_ms": "a worker silent this long is dropped and its sequences requeued",
    "policy": policies_help(),
    "max_num_batched_tokens": "budget, fair: tokens per worker iteration, decodes and prefill "
    "chunks together (at least max_batch_size)",
    "min_prefill_chunk": "budget, fair: no first chunk shorter than this is started "
    "(at most chunk_size)",
    "kv_watermark_pages": "budget, fair: free KV pages kept in reserve on each worker",
    "aging_seconds": "fair: a queued sequence moves up one priority band per this many "
    "seconds waited",
    "tenant_weights": "fair: TOML file of `tenant = weight` lines; a weight-2 tenant is "
    "served twice the tokens of a weight-1 one",
    "max_loras": "most distinct LoRA adapters active on one worker (0: no limit)",
    "tpot_target_ms": "budget, fair: time per output token to keep each step within; each "
    "decision's token budget is then chosen from the worker's learned step "
    "times, up to max_num_batched_tokens if set (0: off, the fixed budget)",
    "ttft_target_ms": "budget, fair: time to first token; each priority band is served "
    "earliest deadline (arrival + target) first, and a request of negative "
    "priority that no worker can start in time is refused with "
    "RESOURCE_EXHAUSTED (0: off)",
    "handoff_min_tokens": "prefill/decode disaggregation: prompts with fewer tokens to "
    "compute stay with a worker that decodes; longer ones go to a prefill-only worker",
    "handoff_rule": "prefill/decode disaggregation: threshold hands off every prompt of at "
    "least handoff_min_tokens; priced hands off only where the transfer pays against the "
    "decode worker's load (needs workers that register their handoff sizes)",
    "prefix_caching": "on: first chunks start from the asking worker's longest resume "
    "point (its prefix cache); off: ignore every cache report",
}

# How a default that depends on other settings reads in --help.
_DEFAULT_TEXT = {
    "max_num_batched_tokens": "2048, or max_batch_size if larger",
    "min_prefill_chunk": "32, or chunk_size if smaller",
    "kv_watermark_pages": "1% of the worker's total pages, at least 1",
    "tenant_weights": "none: every tenant weighs 1",
    "replica_address": "--host, or this host's name when --host is 0.0.0.0 or ::, with the "
    "port it listens on",
}


def setting_fields() -> list[tuple[dataclasses.Field, bool]]:
    """(field, belongs to SchedulerConfig) for every setting."""
    own = [(f, False) for f in fields(ServeSettings) if f.name != "scheduler"]
    return own + [(f, True) for f in fields(SchedulerConfig)]


def add_arguments(parser: argparse.ArgumentParser, *, scheduler_only: bool = False) -> None:
    """Add one flag per setting, plus --config; `scheduler_only`: flags for the settings of
    SchedulerConfig only (the policy's, for `simulate`)."""
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML file of settings (keys as the flags, with _ or -)",
    )
    defaults = ServeSettings()
    for f, in_scheduler in setting_fields():
        if scheduler_only and not in_scheduler:
            continue
        default = getattr(defaults.scheduler if in_scheduler else defaults, f.name)
        default_text = _DEFAULT_TEXT.get(f.name, default if default != "" else "none")
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=None,
            metavar="FILE" if f.name == "tenant_weights" else f.name.upper(),
            help=f"{_HELP[f.name]} (default {default_text}; "
            f"env {ENV_PREFIX}{f.name.upper()})".replace("%", "%%"),
        )


def resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> ServeSettings:
    """Merge defaults, the config file, the environment and the flags; validate.

    A ConfigError names each setting at fault with where its value came from.
    """
    values: dict[str, tuple[object, str]] = {}
    if args.config is not None:
        for key, value in _read_config_file(args.config).items():
            values[key] = (value, f"from {args.config}")
    for f, _ in setting_fields():
        env_name = ENV_PREFIX + f.name.upper()
        if env_name in environ:
            values[f.name] = (environ[env_name], f"env {env_name}")
        flag_value = getattr(args, f.name, None)  # None: a parser with scheduler flags only
        if flag_value is not None:
            values[f.name] = (flag_value, "--" + f.name.replace("_", "-"))
    own, scheduler = {}, {}
    for f, in_scheduler in setting_fields():
        if f.name in values:
            value, source = values[f.name]
            (scheduler if in_scheduler else own)[f.name] = _coerce(f, value, source)
    try:
        return ServeSettings(**own, scheduler=SchedulerConfig(**scheduler)).validate()
    except ConfigError as err:
        sources = {
            f.name: values[f.name][1] if f.name in values else "default"
            for f, _ in setting_fields()
        }
        raise ConfigError(with_sources(str(err), sources)) from None


# A word that may be a setting's name, or a stretch to leave alone: a parenthesised
# remark, a quoted value, or a word inside a flag, path or file name.
_WORD_OR_SKIPPED = re.compile(r"""\([^()]*\)|'[^']*'|"[^"]*"|(?<![\w\-/.])\w+(?![\w\-/])""")
_REMARK = re.compile(r" \(([^()]*)\)")


def with_sources(message: str, sources: Mapping[str, str]) -> str:
    """`message` with the first mention of each setting it names followed by its source.

    `sources` maps setting names to where their values came from. A mention already
    followed by a parenthesised remark gets the source inside it:
    "chunk_size (600) must not exceed max_seq_len (512)" becomes
    "chunk_size (600, --chunk-size) must not exceed max_seq_len (512, default)".
    Names inside parentheses, quotes, flags and paths are not mentions.
    """
    parts, done, seen = [], 0, set()
    for match in _WORD_OR_SKIPPED.finditer(message):
        name = match.group()
        if name not in sources or name in seen:
            continue
        seen.add(name)
        parts.append(message[done : match.end()])
        remark = _REMARK.match(message, match.end())
        if remark:
            parts.append(f" ({remark.group(1)}, {sources[name]})")
            done = remark.end()
        else:
            parts.append(f" ({sources[name]})")
            done = match.end()
    parts.append(message[done:])
    return "".join(parts)


def _read_config_file(path: Path) -> dict[str, object]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config {path}: not valid TOML: {err}") from None
    known = {f.name for f, _ in setting_fields()}
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(
                f"--config {path}: unknown setting {key!r}; known: {', '.join(sorted(known))}"
            )
        out[name] = value
    return out


def read_tenant_weights(value: object, source: str) -> tuple[tuple[str, float], ...]:
    """--tenant-weights FILE: a TOML table of `tenant = weight`, as (tenant, weight) pairs.
    A table given inline in a --config file is taken as it is."""
    if isinstance(value, dict):
        data = value
    else:
        path = Path(str(value))
        try:
            data = tomllib.loads(path.read_text())
        except OSError as err:
            raise ConfigError(
                f"tenant_weights ({source}): cannot read {path}: {err.strerror}"
            ) from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(
                f"tenant_weights ({source}): {path} is not valid TOML: {err}"
            ) from None
    weights = []
    for tenant, weight in data.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(
                f"tenant_weights ({source}): tenant {tenant!r} has weight "
                f"{weight!r}; weights must be positive numbers"
            )
        weights.append((tenant, float(weight)))
    return tuple(weights)


def _coerce(f: dataclasses.Field, value: object, source: str) -> object:
    if f.name == "tenant_weights":
        return read_tenant_weights(value, source)
    kind = {"int": int, "float": float, "str": str}[
        f.type if isinstance(f.type, str) else f.type.__name__
    ]
    if kind is str:
        return str(value)
    try:
        if isinstance(value, bool) or (kind is int and isinstance(value, float)):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{f.name} ({source}) must be {'an integer' if kind is int else 'a number'}, "
            f"got {value!r}"
        ) from None
