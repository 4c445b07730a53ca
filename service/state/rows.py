"""How both state stores encode a row's fields: token ids as little-endian uint32
blobs, submit parameters and worker registrations as JSON text."""

from __future__ import annotations

import json
import sys
from array import array

from service.core import SubmitParams
from service.core.types import SamplingParams, WorkerRegistration, WorkerRole


def pack_token_ids(token_ids) -> bytes:
    packed = array("I", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(blob) -> list[int]:
    """`blob`: bytes, or a buffer such as the memoryview psycopg returns."""
    packed = array("I")
    packed.frombytes(bytes(blob))
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def params_json(p: SubmitParams) -> str:
    s = p.sampling
    return json.dumps(
        {
            "request_id": p.request_id,
            "max_new_tokens": p.max_new_tokens,
            "adapter_id": p.adapter_id,
            "priority": p.priority,
            "tenant": p.tenant,
            # Rows saved before the sampling fields grew hold the first four; the rest default.
            "sampling": [
                s.temperature,
                s.top_p,
                s.top_k,
                s.seed,
                s.logprobs,
                s.prompt_logprobs,
                s.ignore_eos,
                s.min_new_tokens,
            ],
            "stop_token_ids": list(p.stop_token_ids),
            "principal": p.principal,
        }
    )


def params_from_row(text: str, prompt: bytes) -> SubmitParams:
    d = json.loads(text)
    return SubmitParams(
        prompt_token_ids=tuple(unpack_token_ids(prompt)),
        max_new_tokens=d["max_new_tokens"],
        request_id=d["request_id"],
        adapter_id=d["adapter_id"],
        priority=d["priority"],
        tenant=d["tenant"],
        sampling=SamplingParams(*d["sampling"]),
        stop_token_ids=tuple(d["stop_token_ids"]),
        # Saved before sequences had principals: the one principal of a scheduler without
        # authentication; with tokens on, only admin sees them.
        principal=d.get("principal", ""),
    )


def registration_json(r: WorkerRegistration) -> str:
    return json.dumps(
        {
            "worker_id": r.worker_id,
            "total_kv_pages": r.total_kv_pages,
            "page_size": r.page_size,
            "total_gdn_slots": r.total_gdn_slots,
            "max_batch_size": r.max_batch_size,
            "adapters": list(r.adapters),
            "role": r.role.value,
            "transfer_bytes_per_second": r.transfer_bytes_per_second,
        }
    )


def registration_from_json(text: str) -> WorkerRegistration:
    d = json.loads(text)
    return WorkerRegistration(
        worker_id=d["worker_id"],
        total_kv_pages=d["total_kv_pages"],
        page_size=d["page_size"],
        total_gdn_slots=d["total_gdn_slots"],
        max_batch_size=d["max_batch_size"],
        adapters=tuple(d["adapters"]),
        # Saved before roles: every worker ran both.
        role=WorkerRole(d.get("role", WorkerRole.BOTH.value)),
        transfer_bytes_per_second=d.get("transfer_bytes_per_second", 0.0),
    )
