"""transformers' and huggingface_hub's progress bars and log messages, off while enjoyln works: each
of the many loads would draw a bar or log a load report, burying what enjoyln reports. The
caller's settings come back after, so a user's own ``from_pretrained`` keeps its bars."""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["quiet_libraries", "quiet", "show_library_output"]

_show = False

F = TypeVar("F", bound=Callable[..., Any])


def show_library_output(show: bool) -> None:
    """Let the libraries' bars and logs through (``enjoyln --verbose``), or not (the default).

    >>> show_library_output(False)
    """
    global _show
    _show = show


@contextlib.contextmanager
def quiet_libraries(transformers: bool = True) -> Iterator[None]:
    """Within it, the libraries log errors only, draw no bars and show no Future- or
    DeprecationWarnings; ``transformers=False`` leaves transformers alone (and unimported).

    >>> with quiet_libraries():
    ...     pass
    """
    if _show:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        onnx = logging.getLogger("torch.onnx")
        stack.callback(onnx.setLevel, onnx.level)
        onnx.setLevel(logging.ERROR)
        try:
            from huggingface_hub.utils import (
                are_progress_bars_disabled,
                disable_progress_bars,
                enable_progress_bars,
            )
            from huggingface_hub.utils import logging as hub_logging
        except ImportError:
            pass
        else:
            _silence(
                stack,
                not are_progress_bars_disabled(),
                enable_progress_bars,
                disable_progress_bars,
                hub_logging,
            )
        if transformers:
            try:
                from transformers.utils import logging as tf
            except ImportError:
                pass
            # its switch turns huggingface_hub's bars on too: restored before the hub's own state
            else:
                _silence(
                    stack,
                    tf.is_progress_bar_enabled(),
                    tf.enable_progress_bar,
                    tf.disable_progress_bar,
                    tf,
                )
        yield


def _silence(
    stack: contextlib.ExitStack,
    bars_on: bool,
    enable: Callable[[], None],
    disable: Callable[[], None],
    logs: Any,
) -> None:
    """A library's bars off and its logs errors only, until ``stack`` puts them back as they
    were."""
    stack.callback(lambda: enable() if bars_on else disable())
    stack.callback(logs.set_verbosity, logs.get_verbosity())
    disable()
    logs.set_verbosity(logging.ERROR)


def quiet(fn: F) -> F:
    """``fn`` run within ``quiet_libraries``.

    >>> quiet(lambda: 3)()
    3
    """
    return quiet_libraries()(fn)  # a generator's context manager decorates too, anew for each call
