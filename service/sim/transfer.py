"""The simulator's prefill/decode split: roles per worker (`--roles 2P6D`), the transfer
model (bandwidth, latency, handoff sizes from a model's shapes) and the handoff rule the
core uses (service/core/decide/handoff.py). docs/disaggregation.md."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from service.core.decide.handoff import HandoffSettings, ModelShape

# Handoff sizes by model (bf16 KV, fp32 GDN recurrent state, bf16 convolution state).
# Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (2 KV heads x 256); GDN with
# 32 value heads x 128 x 128 and a 4-wide convolution over 2 x 16 x 128 + 32 x 128 channels.
_QWEN3_NEXT_KV = 2 * 2 * 256 * 2
_QWEN3_NEXT_GDN = 32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2
MODEL_SHAPES = {
    "qwen3-next-80b": ModelShape(12, _QWEN3_NEXT_KV, 36, _QWEN3_NEXT_GDN),
    # The same 48 layers, all of them attention: the attention-only model of that size.
    "qwen3-next-80b-attention": ModelShape(48, _QWEN3_NEXT_KV),
    # The A30 profile's model: 28 layers, 4 KV heads x 128.
    "qwen2-7b": ModelShape(28, 2 * 4 * 128 * 2),
}
DEFAULT_MODEL_SHAPE = "qwen3-next-80b"
# The first token id of a handed-off sequence's stand-in prompt (one id per request, above
# every trace token): the receiving engine maps it to the imported context.
HANDOFF_TOKEN = 3 << 30


@dataclass(frozen=True)
class Roles:
    """How many workers run only prompts (the first ones) and only decodes (the rest)."""

    num_prefill: int
    num_decode: int

    @property
    def name(self) -> str:
        return f"{self.num_prefill}P{self.num_decode}D"

    @classmethod
    def parse(cls, text: str, num_workers: int) -> Roles:
        """'2P6D' (or '2p6d'); the two must add up to `num_workers`."""
        match = re.fullmatch(r"(\d+)[pP](\d+)[dD]", text.strip())
        if not match:
            raise ValueError(f"--roles takes NPMD (e.g. 2P6D) or 'search', got {text!r}")
        roles = cls(int(match.group(1)), int(match.group(2)))
        if roles.num_prefill < 1 or roles.num_decode < 1:
            raise ValueError(f"--roles {text}: at least one prefill and one decode worker")
        if roles.num_prefill + roles.num_decode != num_workers:
            raise ValueError(
                f"--roles {text} names {roles.num_prefill + roles.num_decode} workers, "
                f"--workers is {num_workers}"
            )
        return roles

    @classmethod
    def splits(cls, num_workers: int) -> list[Roles]:
        """Every split with fewer prefill than decode workers (what --roles search tries)."""
        return [cls(p, num_workers - p) for p in range(1, (num_workers + 1) // 2)]


@dataclass(frozen=True)
class TransferModel:
    """How long a handoff takes: bytes from the model's shapes, at a rate, plus latency."""

    bytes_per_second: float = 12.5e9  # a 100 Gb/s RDMA link
    shape: ModelShape = field(default_factory=lambda: MODEL_SHAPES[DEFAULT_MODEL_SHAPE])
    shape_name: str = DEFAULT_MODEL_SHAPE
    rule: HandoffSettings = field(default_factory=HandoffSettings)

    def __post_init__(self) -> None:
        if not self.bytes_per_second > 0:
            raise ValueError(f"the transfer rate must be above 0, got {self.bytes_per_second}")

    def seconds(self, num_bytes: int) -> float:
        return num_bytes / self.bytes_per_second + self.rule.latency_seconds


@dataclass
class HandoffCounts:
    """What one run's handoffs moved."""

    num_handoffs: int = 0
    num_colocated: int = 0  # requests the rule kept on a decode worker
    num_bytes: int = 0
    transfer_seconds: float = 0.0
    # Handed-off sequences preempted on a decode worker: resumed there as if their
    # imported pages were still held (the simulator's one optimism, counted here).
    num_receiver_preemptions: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
