"""Build hook: install ``rpcx-for-torch.pth`` in site-packages beside the package.

Everything else about the build is in pyproject.toml. The ``.pth`` file is rpcx's
start-up hook for ``RPCX_FOR_TORCH`` (see ``rpcx/_startup.py``): Python runs it at
interpreter start-up, and it does nothing unless that variable is set. setuptools has no
declarative way to put a file at the top of site-packages, hence this command.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "rpcx-for-torch.pth"


class BuildWithStartupHook(build_py):
    """``build_py``, plus the start-up hook copied to the top of the build."""

    def run(self) -> None:
        super().run()
        target = self.build_lib
        if getattr(self, "editable_mode", False):
            # An editable wheel is made of what lands in install's directory (the
            # package itself stays in the source tree), so the hook goes there.
            target = self.get_finalized_command("install").install_lib
        self.copy_file(os.path.join("rpcx", PTH), os.path.join(target, PTH),
                       preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildWithStartupHook})
