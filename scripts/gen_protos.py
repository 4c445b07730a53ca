#!/usr/bin/env python3
"""Generate the Python gRPC code for every .proto under protos/, next to the .proto.

The output is checked in; tests/test_generated_code.py regenerates it into a
temporary folder and fails on any difference. Run after editing a .proto:

    python scripts/gen_protos.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    """Run grpcio-tools' protoc on every proto into out_dir; return the files written."""
    from grpc_tools import protoc  # grpcio-tools; imported here so --help works without it
    import grpc_tools

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc", f"-I{PROTO_ROOT}", f"-I{include}",
        f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT,
                        help="output root (default: protos/, beside the sources)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
