"""The checked-in generated code is exactly what scripts/gen_protos.py produces now."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
GENERATED_PATTERNS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def _load_gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generated_files(root: Path) -> dict[Path, bytes]:
    files = {}
    for pattern in GENERATED_PATTERNS:
        for path in root.rglob(pattern):
            files[path.relative_to(root)] = path.read_bytes()
    return files


def test_checked_in_generated_code_matches_a_fresh_generation(tmp_path):
    written = _load_gen_protos().generate(tmp_path)
    assert written, "gen_protos.generate wrote nothing"

    fresh = _generated_files(tmp_path)
    checked_in = _generated_files(PROTO_ROOT)

    missing = sorted(map(str, fresh.keys() - checked_in.keys()))
    extra = sorted(map(str, checked_in.keys() - fresh.keys()))
    assert not missing, f"generated but not checked in under protos/: {missing}; " \
                        "run scripts/gen_protos.py"
    assert not extra, f"checked in under protos/ but no .proto generates them: {extra}"
    stale = sorted(str(p) for p in fresh if fresh[p] != checked_in[p])
    assert not stale, f"checked-in generated code differs from protoc's output: {stale}; " \
                      "run scripts/gen_protos.py and commit the result"


def test_every_proto_package_folder_is_an_importable_package(tmp_path):
    _load_gen_protos().generate(tmp_path)
    for init in tmp_path.rglob("__init__.py"):
        assert (PROTO_ROOT / init.relative_to(tmp_path)).exists(), \
            f"protos/{init.relative_to(tmp_path)} is missing"
