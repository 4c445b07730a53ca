"""How both state stores encode a row's fields: token ids as little-endian uint32
blobs, submit parameters and worker registrations as JSON text."""

from __future__ import annotations

import json
import sys
from array import array
from dataclasses import fields

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
    """Every field of the registration: a recovered worker runs as it registered (its
    cache's block size and snapshot slots decide how its chunks are aligned)."""
    d = {f.name: getattr(r, f.name) for f in fields(WorkerRegistration)}
    d["adapters"] = list(r.adapters)
    d["role"] = r.role.value
    return json.dumps(d)


def registration_from_json(text: str) -> WorkerRegistration:
    """The registration saved; a field saved by no older version keeps its default (roles:
    every worker ran both; the cache fields: saved since wave 4)."""
    d = json.loads(text)
    known = {f.name for f in fields(WorkerRegistration)}
    values = {name: value for name, value in d.items() if name in known}
    values["adapters"] = tuple(d.get("adapters", ()))
    values["role"] = WorkerRole(d.get("role", WorkerRole.BOTH.value))
    return WorkerRegistration(**values)
