#!/usr/bin/env python3
"""Generate the Python gRPC code for every .proto under protos/, next to the .proto.

The output is checked in; `--check` regenerates it into a temporary folder and fails on
any difference (tests/test_generated_code.py runs it). Run after editing a .proto:

    .venv/bin/python scripts/gen_protos.py
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    """Run grpcio-tools' protoc on every proto into out_dir; return the files written."""
    import grpc_tools
    from grpc_tools import protoc  # grpcio-tools; imported here so --help works without it

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see its message above)")
    written = []
    for proto in protos:
        package = proto.parent.relative_to(PROTO_ROOT).parts  # ("lattice", "scheduler", "v1")
        # Each folder on the way down is a regular package, so `import lattice...` works.
        for depth in range(1, len(package) + 1):
            init = out_dir.joinpath(*package[:depth], "__init__.py")
            if not init.exists():
                init.write_text("")
        package_dir = out_dir.joinpath(*package)
        written += sorted(package_dir.glob(proto.stem + "_pb2*"))
    return written


def differences(fresh_root: Path, written: list[Path]) -> list[str]:
    """What protos/ lacks or holds stale against a generation into fresh_root."""
    found = []
    for path in sorted(fresh_root.rglob("*")):
        if path.is_file() and (path in written or path.name == "__init__.py"):
            checked_in = PROTO_ROOT / path.relative_to(fresh_root)
            if not checked_in.exists():
                found.append(f"missing: protos/{path.relative_to(fresh_root)}")
            elif path.name != "__init__.py" and not filecmp.cmp(path, checked_in, shallow=False):
                found.append(f"stale: protos/{path.relative_to(fresh_root)}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=PROTO_ROOT,
        help="output root (default: protos/, beside the sources)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing: regenerate into a temporary folder and exit 1 "
        "if the checked-in code differs",
    )
    args = parser.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            found = differences(Path(tmp), generate(Path(tmp)))
        for line in found:
            print(line)
        if found:
            print("run scripts/gen_protos.py and commit the result", file=sys.stderr)
        return 1 if found else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
