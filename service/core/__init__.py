"""The scheduling core: no gRPC, no Prometheus; drive it from a test with plain objects."""

from service.core.config import SchedulerConfig
from service.core.decide.policies import FifoPolicy
from service.core.errors import (
    ConfigError,
    InvalidArgument,
    NotFound,
    QueueFull,
    SchedulerError,
    Superseded,
    UnknownWorker,
)
from service.core.observer import EvictReason, RequeueReason, SchedulerObserver
from service.core.persist.replica import ReplicaScheduler
from service.core.scheduler import OutputView, Scheduler
from service.core.types import (
    SEES_ALL,
    Caller,
    Decision,
    FinishedSequence,
    FinishReason,
    PrefillChunk,
    SamplingParams,
    SchedulerStatus,
    SequenceInfo,
    SequenceSpec,
    SequenceState,
    SubmitParams,
    SubmitResult,
    TokenLogprobs,
    TokenRuns,
    TokenUpdate,
    WorkerRegistration,
    WorkerReport,
    WorkerSettings,
    WorkerStatus,
)
from service.core.vocabulary import BlockReason, PreemptReason

__all__ = [
    "SEES_ALL",
    "BlockReason",
    "Caller",
    "ConfigError",
    "Decision",
    "EvictReason",
    "FifoPolicy",
    "FinishReason",
    "FinishedSequence",
    "InvalidArgument",
    "NotFound",
    "OutputView",
    "PrefillChunk",
    "PreemptReason",
    "QueueFull",
    "ReplicaScheduler",
    "RequeueReason",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerObserver",
    "SchedulerStatus",
    "SequenceInfo",
    "SequenceSpec",
    "SequenceState",
    "SubmitParams",
    "SubmitResult",
    "Superseded",
    "TokenLogprobs",
    "TokenRuns",
    "TokenUpdate",
    "UnknownWorker",
    "WorkerRegistration",
    "WorkerReport",
    "WorkerSettings",
    "WorkerStatus",
]
