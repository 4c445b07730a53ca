"""The checked-in generated code is exactly what scripts/gen_protos.py produces now (run as
the command it is, not loaded as a module)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
GENERATED_PATTERNS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def _gen_protos(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/gen_protos.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("generated")
    done = _gen_protos("--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


def _generated_files(root: Path) -> dict[Path, bytes]:
    files = {}
    for pattern in GENERATED_PATTERNS:
        for path in root.rglob(pattern):
            files[path.relative_to(root)] = path.read_bytes()
    return files


def test_checked_in_generated_code_matches_a_fresh_generation(fresh):
    generated = _generated_files(fresh)
    assert generated, "scripts/gen_protos.py wrote nothing"
    checked_in = _generated_files(PROTO_ROOT)

    missing = sorted(map(str, generated.keys() - checked_in.keys()))
    extra = sorted(map(str, checked_in.keys() - generated.keys()))
    assert not missing, (
        f"generated but not checked in under protos/: {missing}; run scripts/gen_protos.py"
    )
    assert not extra, f"checked in under protos/ but no .proto generates them: {extra}"
    stale = sorted(str(p) for p in generated if generated[p] != checked_in[p])
    assert not stale, (
        f"checked-in generated code differs from protoc's output: {stale}; "
        "run scripts/gen_protos.py and commit the result"
    )


def test_every_proto_package_folder_is_an_importable_package(fresh):
    for init in fresh.rglob("__init__.py"):
        assert (PROTO_ROOT / init.relative_to(fresh)).exists(), (
            f"protos/{init.relative_to(fresh)} is missing"
        )


def test_the_check_mode_agrees_and_writes_nothing():
    before = {p: p.stat().st_mtime_ns for p in PROTO_ROOT.rglob("*_pb2*")}
    done = _gen_protos("--check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p: p.stat().st_mtime_ns for p in PROTO_ROOT.rglob("*_pb2*")} == before
