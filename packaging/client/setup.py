"""qdelay-client's build: the wire codec extension (paths from this folder) and a check that
the generated gRPC code is there (it is made by `make proto`, never committed)."""

from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
GENERATED = HERE / "../../proto/qdelay/v1/qdelay_pb2.py"
if not GENERATED.exists():
    raise SystemExit(
        "qdelay-client: proto/qdelay/v1/qdelay_pb2.py is missing: run `make proto` in the repository first"
    )

setup(
    ext_modules=[
        # the same extension as the root's qdelay._wire (see its pyproject.toml)
        Extension(
            "qdelay._wire",
            sources=["../../qdelay/_wire.c"],
            include_dirs=["../../segments"],
            depends=["../../segments/layout.h"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
