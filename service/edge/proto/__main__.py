"""Regenerate ``grpc_predict_v2_pb2.py`` and its ``.pyi`` from ``grpc_predict_v2.proto``.

``python -m service.edge.proto`` (needs grpcio-tools: ``pip install -e '.[dev]'``);
``--check`` exits 1, writing nothing, when the checked-in files are not what the
``.proto`` and this generator make. protoc's output is changed in one way: the file's
descriptors go to a private pool (see ``service.edge.proto``), and the files say so.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "grpc_predict_v2.proto"
OUTPUTS = ("grpc_predict_v2_pb2.py", "grpc_predict_v2_pb2.pyi")
DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
PRIVATE_POOL = (
    "# service.edge.proto's generator: a private pool, not the default one (see its\n"
    "# docstring).\n"
    "DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile("
)
HEADER = (
    "# ruff: noqa\n"
    "# fmt: off\n"
    "# Generated from grpc_predict_v2.proto by `python -m service.edge.proto`: do not edit.\n"
)


def generate() -> dict[str, str]:
    """The generated files' names and texts."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as out:
        args = ["protoc", f"-I{HERE}", f"--python_out={out}", f"--pyi_out={out}", PROTO]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {HERE / PROTO}")
        texts = {name: (Path(out) / name).read_text() for name in OUTPUTS}
    py = texts[OUTPUTS[0]]
    if py.count(DEFAULT_POOL) != 1:
        raise SystemExit("protoc's output changed: no single default-pool registration")
    texts[OUTPUTS[0]] = py.replace(DEFAULT_POOL, PRIVATE_POOL)
    return {name: HEADER + text for name, text in texts.items()}


def main(argv: list[str]) -> int:
    texts = generate()
    if "--check" in argv:
        stale = [n for n, t in texts.items() if (HERE / n).read_text() != t]
        for name in stale:
            print(f"{HERE / name} is stale: run python -m service.edge.proto", file=sys.stderr)
        return 1 if stale else 0
    for name, text in texts.items():
        (HERE / name).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
