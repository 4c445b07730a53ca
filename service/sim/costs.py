"""Choosing a cost model: a shipped or given Vidur profile, or a measured step table."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from common import step_table
from service.sim.engine import CostModel
from service.sim.vidur import ProfileError, VidurCostModel

# A model without Gated DeltaNet layers keeps no GDN state: its slots limit nothing but
# the batch, so they default to the reference engine's most on CUDA.
DEFAULT_GDN_SLOTS = 256


@dataclass(frozen=True)
class CostSource:
    """A cost model with what it says about the workers it was measured on."""

    model: CostModel
    name: str
    default_kv_pages: int | None  # None: unknown, --kv-pages needed
    default_gdn_slots: int
    measured_page_size: int | None = None


def shipped_profiles() -> list[str]:
    folder = resources.files(__package__) / "data" / "profiles"
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def load_cost_source(
    *, profile: str | None, step_table_path: str | None, page_size: int
) -> CostSource:
    """The cost model named by --profile (a shipped name or a directory) or --step-table."""
    if step_table_path:
        return _from_step_table(step_table_path, page_size)
    name = profile or "a30-qwen2-7b"
    path = Path(name)
    if not path.is_dir():
        shipped = resources.files(__package__) / "data" / "profiles" / name
        if not shipped.is_dir():
            raise ProfileError(
                f"--profile {name}: neither a directory nor a shipped profile "
                f"({', '.join(shipped_profiles())})"
            )
        path = Path(str(shipped))
    model = VidurCostModel(path)
    return CostSource(model, name, model.shape.default_kv_pages(page_size), DEFAULT_GDN_SLOTS)


def _from_step_table(path: str, page_size: int) -> CostSource:
    try:
        table = step_table.load(path)
    except ValueError as err:
        raise ProfileError(str(err)) from None
    meta = table.meta
    kv_pages = None
    if meta.get("total_kv_pages") and meta.get("page_size"):
        # The same KV memory in pages of the simulated size.
        kv_pages = int(meta["total_kv_pages"]) * int(meta["page_size"]) // page_size
    return CostSource(
        step_table.StepTableModel(table),
        str(path),
        kv_pages,
        int(meta.get("total_gdn_slots") or DEFAULT_GDN_SLOTS),
        meta.get("page_size"),
    )
