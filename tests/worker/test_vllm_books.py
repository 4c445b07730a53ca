"""The vLLM engine's books and checks that need no vLLM: how its one block pool becomes KV
pages and GDN slots, its resume points, the version check, the `--engine vllm` flags, the
CPU rewind of a seeded request's dropped sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common.block_hash import block_hashes
from worker_client import cli
from worker_client.engine_vllm import SUPPORTED_VLLM_VERSION
from worker_client.engine_vllm.books import PoolBooks, ResumePoints
from worker_client.engine_vllm.environment import VllmUnavailable, check_version, omp_settings
from worker_client.engine_vllm.generators import keep_dropped_draws


def test_the_pool_sets_aside_each_gdn_slots_blocks_and_the_rest_are_kv_pages():
    books = PoolBooks(
        num_usable_blocks=56, num_mamba_groups=3, blocks_per_state=2, total_gdn_slots=8
    )
    assert books.blocks_per_slot == 6
    assert books.total_kv_pages == 8
    assert books.kv_free_pages(num_free_blocks=56, num_mamba_blocks_held=0) == 8
    # Two sequences hold their states (12 blocks) and 3 attention blocks: 41 free blocks,
    # of which 36 are still set aside for the 6 other slots.
    assert books.kv_free_pages(num_free_blocks=41, num_mamba_blocks_held=12) == 5
    assert books.kv_free_pages(num_free_blocks=3, num_mamba_blocks_held=0) == 0


@dataclass
class _Request:
    """What ResumePoints reads of a vLLM request."""

    all_token_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)


def _request(tokens: list[int], computed: int, hash_block: int) -> _Request:
    hashes = [bytes([i]) for i in range(len(tokens) // hash_block)]  # stand-ins
    return _Request(tokens, computed, hashes)


def test_resume_points_are_the_contracts_hashes_of_blocks_vllm_still_hits():
    points = ResumePoints(block_tokens=4, hash_block_tokens=2)
    tokens = list(range(2, 14))  # 3 blocks of 4
    request, contract = _request(tokens, computed=9, hash_block=2), []
    points.note(request, contract)
    assert contract == block_hashes(tokens[:8], "", 4)
    hits = {2: 8, 4: 8}  # vLLM hits both blocks (by the number of its hashes asked for)
    delta = points.delta(lambda hashes, num_tokens: hits[len(hashes)])
    assert delta.added == tuple(contract) and not delta.removed
    assert points.tokens_of(contract[1]) == 8
    hits[4] = 4  # the second block's GDN state was evicted
    delta = points.delta(lambda hashes, num_tokens: hits[len(hashes)])
    assert delta.removed == (contract[1],) and not delta.added
    full = points.delta(lambda hashes, num_tokens: hits[len(hashes)], full=True)
    assert full.reset and full.added == (contract[0],)


def test_without_an_eviction_only_new_candidates_are_looked_up_in_vllms_cache():
    # vLLM loses a cached block only when it evicts it: until then the points it hit
    # stay hits, so a report looks up only the candidates noted since the last one.
    points = ResumePoints(block_tokens=4, hash_block_tokens=4)
    first, contract = _request(list(range(2, 10)), computed=8, hash_block=4), []
    points.note(first, contract)  # 2 candidates
    asked: list[int] = []

    def hit(hashes, num_tokens):
        asked.append(num_tokens)
        return num_tokens

    assert len(points.delta(hit, evicted=False).added) == 2 and len(asked) == 2
    asked.clear()
    assert points.delta(hit, evicted=False) == points.delta(hit, evicted=False)
    assert asked == []  # nothing new, nothing evicted: no lookup at all
    delta = points.delta(lambda hashes, num_tokens: 4, evicted=True)  # block 2 evicted
    assert delta.removed == (contract[1],)


def test_a_candidate_vllm_never_hit_is_never_reported():
    points = ResumePoints(block_tokens=4, hash_block_tokens=4)
    request, contract = _request(list(range(2, 10)), computed=8, hash_block=4), []
    points.note(request, contract)
    delta = points.delta(lambda hashes, num_tokens: 0)  # computed, but no GDN state kept
    assert not delta.added and not delta.removed
    assert points.tokens_of(contract[1]) is None
    assert not points.delta(lambda hashes, num_tokens: 8, full=True).added


def test_resume_points_beyond_the_registrations_bound_are_not_reported():
    # The scheduler refuses a report that would leave more points than the registration
    # holds (and the worker then stops): vLLM may cache more in its free blocks, so the
    # oldest beyond the bound are dropped, in the same delta.
    points = ResumePoints(block_tokens=4, hash_block_tokens=4, max_points=2)
    request, contract = _request(list(range(2, 14)), computed=12, hash_block=4), []
    points.note(request, contract)  # 3 blocks: 3 candidates, all hit
    delta = points.delta(lambda hashes, num_tokens: num_tokens)
    assert delta.added == tuple(contract[1:]) and not delta.removed
    assert points.tokens_of(contract[0]) is None
    full = points.delta(lambda hashes, num_tokens: num_tokens, full=True)
    assert full.reset and full.added == tuple(contract[1:])


@pytest.mark.parametrize("version", [None, "0.31.1", "0.33.0"])
def test_an_unsupported_vllm_is_one_line_naming_the_supported_one(version):
    with pytest.raises(VllmUnavailable) as err:
        check_version(version)
    assert SUPPORTED_VLLM_VERSION in str(err.value) and "\n" not in str(err.value)


def test_the_supported_vllm_passes_with_or_without_a_local_suffix():
    check_version(SUPPORTED_VLLM_VERSION)
    check_version(f"{SUPPORTED_VLLM_VERSION}+cpu")


def test_engine_vllm_refuses_the_reference_engines_pool_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--worker-id", "w", "--model", "/m", "--engine", "vllm", "--kv-pages", "8"])
    assert "--kv-pages is a reference-engine setting" in capsys.readouterr().err


def test_vllm_flags_without_engine_vllm_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--worker-id", "w", "--model", "tiny", "--num-blocks", "8"])
    assert "add --engine vllm" in capsys.readouterr().err


def test_engine_vllm_without_vllm_installed_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(
        "worker_client.engine_vllm.environment.installed_vllm_version", lambda: None
    )
    assert cli.main(["--worker-id", "w", "--model", "/m", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert f"needs vLLM {SUPPORTED_VLLM_VERSION}" in err and err.count("\n") == 1


def test_past_vllms_step_limits_prefill_chunks_are_refused_before_decodes():
    # A refused decode would recompute all its tokens when it comes back; a refused
    # prefill chunk only what it had prefilled. (No vLLM needed: the limits' check only.)
    from types import SimpleNamespace

    from worker_client.engine_vllm.engine import VllmEngine, _Held
    from worker_client.engine_vllm.settings import VllmSettings

    engine = VllmEngine.__new__(VllmEngine)
    engine.settings = VllmSettings(model="unused", max_num_seqs=8)
    engine._max_tokens_per_step = 300
    engine._held = {
        seq_id: _Held(seq_id, SimpleNamespace(request_id=f"{seq_id}.0")) for seq_id in range(4)
    }
    refusals: list[int] = []
    engine._refuse = lambda seq_id, why, refused: refused.append(seq_id)
    # Two chunks first, as planned; a refused chunk's tokens do not count against the
    # chunk after it.
    plan = {"0.0": 200, "1.0": 200, "4.0": 90, "2.0": 1, "3.0": 1}
    engine._held[4] = _Held(4, SimpleNamespace(request_id="4.0"))
    engine._fit_limits(plan, refusals)
    assert plan == {"0.0": 200, "4.0": 90, "2.0": 1, "3.0": 1}
    assert refusals == [1]


def test_a_cpu_worker_binds_openmp_to_the_cpus_vllm_would_give_its_model_process():
    environ = {"VLLM_CPU_OMP_THREADS_BIND": "2-3,6|0-1"}
    assert omp_settings(environ, cpu_build=True) == {
        "OMP_NUM_THREADS": "3",
        "OMP_PLACES": "{2,3,6}",
        "OMP_PROC_BIND": "true",
    }


def test_openmp_is_left_alone_without_a_cpu_list_on_a_gpu_build_or_when_set_by_hand():
    assert omp_settings({}, cpu_build=True) == {}
    assert omp_settings({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, cpu_build=True) == {}
    assert omp_settings({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, cpu_build=True) == {}
    assert omp_settings({"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, cpu_build=False) == {}
    by_hand = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "1"}
    assert omp_settings(by_hand, cpu_build=True) == {
        "OMP_PLACES": "{0,1}",
        "OMP_PROC_BIND": "true",
    }


class _Runner:
    """The parts of vLLM 0.32's model runner that `keep_dropped_draws` wraps, doing what
    vLLM's do with the generators: `_sample` draws from each request's generator, and
    `_bookkeeping_sync` rewinds the dropped ones by the CUDA generator's offset."""

    def __init__(self, device: str, seeds: list[int], dropped: list[bool]) -> None:
        self.device = torch.device(device)
        generators = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}
        self.input_batch = SimpleNamespace(generators=generators, num_reqs=len(seeds))
        self.discard_request_mask = SimpleNamespace(np=np.array(dropped + [False] * 4))

    def _sample(self) -> dict[int, torch.Tensor]:
        return {i: torch.rand(8, generator=g) for i, g in self.input_batch.generators.items()}

    def _bookkeeping_sync(self) -> str:
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            generator = self.input_batch.generators.get(int(i))
            if generator is not None:
                generator.set_offset(generator.get_offset() - 4)
        return "booked"


def test_a_cpu_generator_gets_its_dropped_draws_back_instead_of_an_offset_rewind():
    plain = _Runner("cpu", seeds=[7, 8, 9], dropped=[True, False, True])
    plain._sample()
    with pytest.raises(RuntimeError, match="does not use offset"):
        plain._bookkeeping_sync()

    runner = _Runner("cpu", seeds=[7, 8, 9], dropped=[True, False, True])
    generators = dict(runner.input_batch.generators)
    assert keep_dropped_draws(SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))
    first = runner._sample()
    assert runner._bookkeeping_sync() == "booked"
    assert runner.input_batch.generators == generators
    second = runner._sample()
    # A dropped sample's draws come again; a kept one's generator moved on.
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2])
    assert not torch.equal(first[1], second[1])
    assert torch.equal(first[1], torch.rand(8, generator=torch.Generator().manual_seed(8)))


def test_generators_off_the_cpu_are_left_to_vllm_and_an_unknown_runner_is_refused():
    runner = _Runner("cuda", seeds=[7], dropped=[True])
    sample = runner._sample
    assert not keep_dropped_draws(SimpleNamespace(model_runner=runner))
    assert runner._sample == sample
    # vLLM's V2 runner (its default with Triton) has none of the parts, and no rewind.
    for device in ("cuda", "cpu"):
        v2 = SimpleNamespace(device=torch.device(device), sample_tokens=None)
        assert not keep_dropped_draws(SimpleNamespace(model_runner=v2))
    partial = SimpleNamespace(device=torch.device("cpu"), _bookkeeping_sync=None, input_batch=None)
    with pytest.raises(RuntimeError, match="lacks _sample, discard_request_mask"):
        keep_dropped_draws(SimpleNamespace(model_runner=partial))
