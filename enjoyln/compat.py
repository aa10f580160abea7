"""Importing timm and transformers beside a torchvision built for another torch.

PyPI's torchvision wheel is a CUDA build. Beside a CPU torch its C++ library does not load,
and its import then fails on the fake kernels it registers for operators that library defines
("operator torchvision::nms does not exist"). timm imports torchvision, and so does
transformers wherever torchvision is installed, so one mismatched wheel stops every model.

``guard_torchvision`` (run by ``import enjoyln``) makes torchvision's first import skip those
registrations, for operators that do not exist, and nothing else: torchvision then imports
without its C++ operators (detection ops such as ``nms``, which no model enjoyln folds calls),
and one warning says what is wrong and how to install the matching build. A torchvision that
matches torch imports exactly as it would without enjoyln: the guard skips nothing then, and the
module keeps the loader its own finder gave it (``importlib.resources`` and ``importlib.reload``
read it), the guard gone from ``sys.meta_path`` once the import has run.

>>> guard_torchvision()  # before anything imports torchvision
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any, Iterator


class TorchvisionMismatchWarning(UserWarning):
    """torchvision's C++ operators did not load: it was built for another torch."""


def guard_torchvision() -> None:
    """Make torchvision's first import survive a build that does not match torch (see above)."""
    if "torchvision" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds torchvision as the other finders do and wraps its loader, until it has loaded
    (transformers looks it up without importing it, to see whether it is installed)."""

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torchvision":
            return None
        for finder in sys.meta_path:
            spec = (
                None
                if finder is self
                else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            )
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """torchvision's own loader, run with the registrations of missing operators skipped. It hands
    the module its own loader back before running it, and answers for it to anyone who only looks
    the package up (``is_package``, ``get_resource_reader``)."""

    def __init__(self, inner: importlib.abc.Loader, finder: _Finder) -> None:
        self.inner, self.finder = inner, finder

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        try:
            with skip_missing_fakes() as skipped:
                self.inner.exec_module(module)
        finally:  # the first import is guarded, and only that one
            if self.finder in sys.meta_path:
                sys.meta_path.remove(self.finder)
        if skipped:
            warnings.warn(
                mismatch_message(getattr(module, "__version__", "?")),
                TorchvisionMismatchWarning,
                stacklevel=2,
            )


@contextlib.contextmanager
def skip_missing_fakes() -> Iterator[list[str]]:
    """``torch.library.register_fake`` skips a ``torchvision::`` operator that is not defined."""
    import torch.library

    original = torch.library.register_fake
    skipped: list[str] = []

    @functools.wraps(original)
    def register_fake(op: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(op, str) and op.startswith("torchvision::") and not _defined(op):
            skipped.append(op)
            return None if args else (lambda fn: fn)
        return original(op, *args, **kwargs)

    torch.library.register_fake = register_fake
    try:
        yield skipped
    finally:
        torch.library.register_fake = original


def _defined(op: str) -> bool:
    import torch

    try:
        getattr(torch.ops.torchvision, op.split("::", 1)[1].split(".")[0])
    except (AttributeError, RuntimeError):
        return False
    return True


def mismatch_message(torchvision_version: str) -> str:
    """One line: what is wrong, and the command that installs the matching build."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    index = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    build = torch.__version__.split("+")[0]
    return (
        f"torchvision {torchvision_version} was built for another torch than {torch.__version__} "
        "(its C++ "
        "operators did not load); enjoyln imported it without them, which folds, checks and loads "
        "models "
        f"as usual. To fix: pip install torchvision=={major - 2}.{minor + 15}.* --index-url "
        f"https://download.pytorch.org/whl/{index}  (the release for torch {build})"
    )
