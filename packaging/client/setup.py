"""qdelay-client's build: the wire codec and handoff extensions (paths from this folder) and a check that
the generated gRPC code is there (it is made by `make proto`, never committed)."""

import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
GENERATED = HERE / "../../proto/qdelay/v1/qdelay_pb2.py"
if not GENERATED.exists():
    raise SystemExit("qdelay-client: proto/qdelay/v1/qdelay_pb2.py is missing: run `make proto` in the repository")


class BuildExt(build_ext):
    """Compiles a copy of each source made under build/: the compiler puts an object file
    at its source's path under build/, and '../../qdelay/_wire.c' would put it beside this
    file, in the repository (setuptools refuses absolute source paths)."""

    def build_extension(self, ext: Extension) -> None:
        copies = []
        for source in ext.sources:
            copy = os.path.join(self.build_temp, "sources", os.path.basename(source))
            self.mkpath(os.path.dirname(copy))
            self.copy_file(source, copy)
            copies.append(copy)
        ext.sources = copies
        super().build_extension(ext)


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        # the same extension as the root's qdelay._wire (see its pyproject.toml)
        Extension(
            "qdelay._wire",
            sources=["../../qdelay/_wire.c"],
            include_dirs=["../../segments"],
            depends=["../../segments/layout.h", "../../segments/pyint.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        # the same extension as the root's qdelay._handoff
        Extension("qdelay._handoff", sources=["../../qdelay/_handoff.c"], extra_compile_args=["-O2"], optional=True),
    ],
)
