from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_KIND_UNSPECIFIED: _ClassVar[StateKind]
    STATE_KIND_ATTENTION_KV: _ClassVar[StateKind]
    STATE_KIND_GDN_RECURRENT: _ClassVar[StateKind]
    STATE_KIND_GDN_CONV: _ClassVar[StateKind]
STATE_KIND_UNSPECIFIED: StateKind
STATE_KIND_ATTENTION_KV: StateKind
STATE_KIND_GDN_RECURRENT: StateKind
STATE_KIND_GDN_CONV: StateKind

class FetchSequenceRequest(_message.Message):
    __slots__ = ("transfer_id", "seq_id", "first_token")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    seq_id: int
    first_token: int
    def __init__(self, transfer_id: _Optional[int] = ..., seq_id: _Optional[int] = ..., first_token: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("kind", "layer", "first_token", "num_tokens", "data", "crc32c")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    kind: StateKind
    layer: int
    first_token: int
    num_tokens: int
    data: bytes
    crc32c: int
    def __init__(self, kind: _Optional[_Union[StateKind, str]] = ..., layer: _Optional[int] = ..., first_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class TransferTotals(_message.Message):
    __slots__ = ("num_chunks", "num_bytes")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    num_bytes: int
    def __init__(self, num_chunks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class FetchSequenceResponse(_message.Message):
    __slots__ = ("chunk", "totals")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    chunk: StateChunk
    totals: TransferTotals
    def __init__(self, chunk: _Optional[_Union[StateChunk, _Mapping]] = ..., totals: _Optional[_Union[TransferTotals, _Mapping]] = ...) -> None: ...
