from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_MAX_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_PREEMPTED: _ClassVar[FinishReason]
    FINISH_REASON_FAILED: _ClassVar[FinishReason]

class SequenceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEQUENCE_STATE_UNSPECIFIED: _ClassVar[SequenceState]
    SEQUENCE_STATE_QUEUED: _ClassVar[SequenceState]
    SEQUENCE_STATE_PREFILLING: _ClassVar[SequenceState]
    SEQUENCE_STATE_DECODING: _ClassVar[SequenceState]
    SEQUENCE_STATE_FINISHED: _ClassVar[SequenceState]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]

class HandoffDirection(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDOFF_DIRECTION_UNSPECIFIED: _ClassVar[HandoffDirection]
    HANDOFF_DIRECTION_SEND: _ClassVar[HandoffDirection]
    HANDOFF_DIRECTION_RECEIVE: _ClassVar[HandoffDirection]

class HandoffStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDOFF_STATUS_UNSPECIFIED: _ClassVar[HandoffStatus]
    HANDOFF_STATUS_DONE: _ClassVar[HandoffStatus]
    HANDOFF_STATUS_SENDER_UNREACHABLE: _ClassVar[HandoffStatus]
    HANDOFF_STATUS_CHECKSUM_MISMATCH: _ClassVar[HandoffStatus]
    HANDOFF_STATUS_NO_ROOM: _ClassVar[HandoffStatus]
    HANDOFF_STATUS_TIMED_OUT: _ClassVar[HandoffStatus]
    HANDOFF_STATUS_UNKNOWN_SEQUENCE: _ClassVar[HandoffStatus]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_MAX_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_PREEMPTED: FinishReason
FINISH_REASON_FAILED: FinishReason
SEQUENCE_STATE_UNSPECIFIED: SequenceState
SEQUENCE_STATE_QUEUED: SequenceState
SEQUENCE_STATE_PREFILLING: SequenceState
SEQUENCE_STATE_DECODING: SequenceState
SEQUENCE_STATE_FINISHED: SequenceState
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_BOTH: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
HANDOFF_DIRECTION_UNSPECIFIED: HandoffDirection
HANDOFF_DIRECTION_SEND: HandoffDirection
HANDOFF_DIRECTION_RECEIVE: HandoffDirection
HANDOFF_STATUS_UNSPECIFIED: HandoffStatus
HANDOFF_STATUS_DONE: HandoffStatus
HANDOFF_STATUS_SENDER_UNREACHABLE: HandoffStatus
HANDOFF_STATUS_CHECKSUM_MISMATCH: HandoffStatus
HANDOFF_STATUS_NO_ROOM: HandoffStatus
HANDOFF_STATUS_TIMED_OUT: HandoffStatus
HANDOFF_STATUS_UNKNOWN_SEQUENCE: HandoffStatus

class Handoff(_message.Message):
    __slots__ = ("seq_id", "direction", "transfer_id", "peer_worker_id", "peer_address", "num_tokens", "num_generated", "spec", "cached_tokens", "deadline_ms")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    direction: HandoffDirection
    transfer_id: int
    peer_worker_id: str
    peer_address: str
    num_tokens: int
    num_generated: int
    spec: SequenceSpec
    cached_tokens: int
    deadline_ms: int
    def __init__(self, seq_id: _Optional[int] = ..., direction: _Optional[_Union[HandoffDirection, str]] = ..., transfer_id: _Optional[int] = ..., peer_worker_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_generated: _Optional[int] = ..., spec: _Optional[_Union[SequenceSpec, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class HandoffResult(_message.Message):
    __slots__ = ("seq_id", "transfer_id", "status", "num_bytes", "transfer_us", "error_message")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_US_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    transfer_id: int
    status: HandoffStatus
    num_bytes: int
    transfer_us: int
    error_message: str
    def __init__(self, seq_id: _Optional[int] = ..., transfer_id: _Optional[int] = ..., status: _Optional[_Union[HandoffStatus, str]] = ..., num_bytes: _Optional[int] = ..., transfer_us: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "logprobs", "prompt_logprobs", "ignore_eos", "min_new_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int
    prompt_logprobs: int
    ignore_eos: bool
    min_new_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "max_new_tokens", "adapter_id", "priority", "tenant", "sampling", "stop_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    adapter_id: str
    priority: int
    tenant: str
    sampling: SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., adapter_id: _Optional[str] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("seq_id", "queue_position")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    queue_position: int
    def __init__(self, seq_id: _Optional[int] = ..., queue_position: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    def __init__(self, seq_id: _Optional[int] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class GetSequenceRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    def __init__(self, seq_id: _Optional[int] = ...) -> None: ...

class FollowSequenceRequest(_message.Message):
    __slots__ = ("seq_id", "start")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start: int
    def __init__(self, seq_id: _Optional[int] = ..., start: _Optional[int] = ...) -> None: ...

class SequenceInfo(_message.Message):
    __slots__ = ("seq_id", "state", "worker_id", "prompt_len", "prefilled_tokens", "generated_tokens", "finish_reason", "queue_position", "error_message", "cached_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    state: SequenceState
    worker_id: str
    prompt_len: int
    prefilled_tokens: int
    generated_tokens: int
    finish_reason: FinishReason
    queue_position: int
    error_message: str
    cached_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., state: _Optional[_Union[SequenceState, str]] = ..., worker_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., queue_position: _Optional[int] = ..., error_message: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "total_kv_pages", "page_size", "total_gdn_slots", "max_batch_size", "adapters", "cache_block_tokens", "total_snapshot_slots", "max_step_tokens", "role", "transfer_bytes_per_second", "handoff_address", "handoff_bytes_per_token", "handoff_fixed_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GDN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SNAPSHOT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIXED_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    total_kv_pages: int
    page_size: int
    total_gdn_slots: int
    max_batch_size: int
    adapters: _containers.RepeatedScalarFieldContainer[str]
    cache_block_tokens: int
    total_snapshot_slots: int
    max_step_tokens: int
    role: WorkerRole
    transfer_bytes_per_second: float
    handoff_address: str
    handoff_bytes_per_token: float
    handoff_fixed_bytes: float
    def __init__(self, worker_id: _Optional[str] = ..., total_kv_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., total_gdn_slots: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., adapters: _Optional[_Iterable[str]] = ..., cache_block_tokens: _Optional[int] = ..., total_snapshot_slots: _Optional[int] = ..., max_step_tokens: _Optional[int] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., transfer_bytes_per_second: _Optional[float] = ..., handoff_address: _Optional[str] = ..., handoff_bytes_per_token: _Optional[float] = ..., handoff_fixed_bytes: _Optional[float] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("chunk_size", "max_batch_size", "prefill_reserve_pages", "lease_ttl_ms", "incarnation", "accepts_token_runs", "accepts_running_unchanged", "accepts_decide_later", "accepts_answer_due")
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RESERVE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_TOKEN_RUNS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_RUNNING_UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_DECIDE_LATER_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_ANSWER_DUE_FIELD_NUMBER: _ClassVar[int]
    chunk_size: int
    max_batch_size: int
    prefill_reserve_pages: int
    lease_ttl_ms: int
    incarnation: int
    accepts_token_runs: bool
    accepts_running_unchanged: bool
    accepts_decide_later: bool
    accepts_answer_due: bool
    def __init__(self, chunk_size: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., prefill_reserve_pages: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., incarnation: _Optional[int] = ..., accepts_token_runs: _Optional[bool] = ..., accepts_running_unchanged: _Optional[bool] = ..., accepts_decide_later: _Optional[bool] = ..., accepts_answer_due: _Optional[bool] = ...) -> None: ...

class SelectBatchRequest(_message.Message):
    __slots__ = ("worker_id", "waiting", "running", "kv_free_pages", "gdn_free_slots", "finished", "preempted", "draining", "tokens", "incarnation", "idle_wait_ms", "cache", "kv_cached_pages", "cache_misses", "last_step_us", "token_seq_ids", "token_ids", "token_counts", "token_offsets", "running_unchanged_since", "accepts_decode_all_running", "decide_later", "handoffs", "applied_iteration", "answer_due_us")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    GDN_FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    IDLE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_US_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_UNCHANGED_SINCE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_DECODE_ALL_RUNNING_FIELD_NUMBER: _ClassVar[int]
    DECIDE_LATER_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_ITERATION_FIELD_NUMBER: _ClassVar[int]
    ANSWER_DUE_US_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    waiting: _containers.RepeatedScalarFieldContainer[int]
    running: _containers.RepeatedScalarFieldContainer[int]
    kv_free_pages: int
    gdn_free_slots: int
    finished: _containers.RepeatedCompositeFieldContainer[FinishedSequence]
    preempted: _containers.RepeatedScalarFieldContainer[int]
    draining: bool
    tokens: _containers.RepeatedCompositeFieldContainer[TokenUpdate]
    incarnation: int
    idle_wait_ms: int
    cache: CacheReport
    kv_cached_pages: int
    cache_misses: _containers.RepeatedScalarFieldContainer[int]
    last_step_us: int
    token_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    token_offsets: _containers.RepeatedScalarFieldContainer[int]
    running_unchanged_since: int
    accepts_decode_all_running: bool
    decide_later: bool
    handoffs: _containers.RepeatedCompositeFieldContainer[HandoffResult]
    applied_iteration: int
    answer_due_us: int
    def __init__(self, worker_id: _Optional[str] = ..., waiting: _Optional[_Iterable[int]] = ..., running: _Optional[_Iterable[int]] = ..., kv_free_pages: _Optional[int] = ..., gdn_free_slots: _Optional[int] = ..., finished: _Optional[_Iterable[_Union[FinishedSequence, _Mapping]]] = ..., preempted: _Optional[_Iterable[int]] = ..., draining: _Optional[bool] = ..., tokens: _Optional[_Iterable[_Union[TokenUpdate, _Mapping]]] = ..., incarnation: _Optional[int] = ..., idle_wait_ms: _Optional[int] = ..., cache: _Optional[_Union[CacheReport, _Mapping]] = ..., kv_cached_pages: _Optional[int] = ..., cache_misses: _Optional[_Iterable[int]] = ..., last_step_us: _Optional[int] = ..., token_seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., token_offsets: _Optional[_Iterable[int]] = ..., running_unchanged_since: _Optional[int] = ..., accepts_decode_all_running: _Optional[bool] = ..., decide_later: _Optional[bool] = ..., handoffs: _Optional[_Iterable[_Union[HandoffResult, _Mapping]]] = ..., applied_iteration: _Optional[int] = ..., answer_due_us: _Optional[int] = ...) -> None: ...

class CacheReport(_message.Message):
    __slots__ = ("added", "removed", "reset")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    added: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    reset: bool
    def __init__(self, added: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., reset: _Optional[bool] = ...) -> None: ...

class FinishedSequence(_message.Message):
    __slots__ = ("seq_id", "reason", "generated_tokens", "error_message")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    reason: FinishReason
    generated_tokens: int
    error_message: str
    def __init__(self, seq_id: _Optional[int] = ..., reason: _Optional[_Union[FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class TokenUpdate(_message.Message):
    __slots__ = ("seq_id", "token_ids", "offset", "logprobs", "prompt_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SchedulerDecision(_message.Message):
    __slots__ = ("prefill", "decode", "evict", "iteration", "preempt", "decode_all_running", "running_needed", "handoffs")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_FIELD_NUMBER: _ClassVar[int]
    DECODE_ALL_RUNNING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_NEEDED_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillChunk]
    decode: _containers.RepeatedScalarFieldContainer[int]
    evict: _containers.RepeatedScalarFieldContainer[int]
    iteration: int
    preempt: _containers.RepeatedScalarFieldContainer[int]
    decode_all_running: bool
    running_needed: bool
    handoffs: _containers.RepeatedCompositeFieldContainer[Handoff]
    def __init__(self, prefill: _Optional[_Iterable[_Union[PrefillChunk, _Mapping]]] = ..., decode: _Optional[_Iterable[int]] = ..., evict: _Optional[_Iterable[int]] = ..., iteration: _Optional[int] = ..., preempt: _Optional[_Iterable[int]] = ..., decode_all_running: _Optional[bool] = ..., running_needed: _Optional[bool] = ..., handoffs: _Optional[_Iterable[_Union[Handoff, _Mapping]]] = ...) -> None: ...

class PrefillChunk(_message.Message):
    __slots__ = ("seq_id", "chunk_start", "chunk_len", "spec", "cached_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LEN_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    chunk_start: int
    chunk_len: int
    spec: SequenceSpec
    cached_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., chunk_start: _Optional[int] = ..., chunk_len: _Optional[int] = ..., spec: _Optional[_Union[SequenceSpec, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SequenceSpec(_message.Message):
    __slots__ = ("prompt_token_ids", "max_new_tokens", "adapter_id", "sampling", "stop_token_ids")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    adapter_id: str
    sampling: SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., adapter_id: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("requeued",)
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    requeued: int
    def __init__(self, requeued: _Optional[int] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "resume")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    resume: bool
    def __init__(self, worker_id: _Optional[str] = ..., resume: _Optional[bool] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("num_assigned",)
    NUM_ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    num_assigned: int
    def __init__(self, num_assigned: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("seq_id", "token_ids", "finished", "finish_reason", "error_message", "logprobs", "prompt_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: FinishReason
    error_message: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., error_message: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("queue_depth", "num_assigned", "workers", "policy")
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    num_assigned: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    policy: str
    def __init__(self, queue_depth: _Optional[int] = ..., num_assigned: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., policy: _Optional[str] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "num_assigned", "kv_free_pages", "gdn_free_slots", "total_kv_pages", "total_gdn_slots", "iteration", "draining", "seconds_since_last_call", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    GDN_FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GDN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_LAST_CALL_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_assigned: int
    kv_free_pages: int
    gdn_free_slots: int
    total_kv_pages: int
    total_gdn_slots: int
    iteration: int
    draining: bool
    seconds_since_last_call: float
    incarnation: int
    def __init__(self, worker_id: _Optional[str] = ..., num_assigned: _Optional[int] = ..., kv_free_pages: _Optional[int] = ..., gdn_free_slots: _Optional[int] = ..., total_kv_pages: _Optional[int] = ..., total_gdn_slots: _Optional[int] = ..., iteration: _Optional[int] = ..., draining: _Optional[bool] = ..., seconds_since_last_call: _Optional[float] = ..., incarnation: _Optional[int] = ...) -> None: ...
