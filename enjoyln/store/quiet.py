"""transformers' and huggingface_hub's progress bars and log messages, off while enjoyln works: each of
the many loads would draw a bar or log a load report, burying what enjoyln reports. The caller's settings
come back after, so a user's own ``from_pretrained`` keeps its bars."""

from __future__ import annotations

import contextlib
import functools
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
    """Within it, the libraries log errors only, draw no bars and show no Future- or DeprecationWarnings;
    ``transformers=False`` leaves transformers alone (and unimported).

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
        _silence_hub(stack)
        if transformers:
            _silence_transformers(stack)
        yield


def _silence_hub(stack: contextlib.ExitStack) -> None:
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
        from huggingface_hub.utils import logging as hub_logging
    except ImportError:
        return
    bars_off, level = are_progress_bars_disabled(), hub_logging.get_verbosity()
    stack.callback(lambda: disable_progress_bars() if bars_off else enable_progress_bars())
    stack.callback(hub_logging.set_verbosity, level)
    disable_progress_bars()
    hub_logging.set_verbosity(logging.ERROR)


def _silence_transformers(stack: contextlib.ExitStack) -> None:
    try:
        from transformers.utils import logging as tf_logging
    except ImportError:
        return
    bars_on, level = tf_logging.is_progress_bar_enabled(), tf_logging.get_verbosity()
    # transformers' switch turns huggingface_hub's bars on too: restored before the hub's own state
    stack.callback(lambda: tf_logging.enable_progress_bar() if bars_on else tf_logging.disable_progress_bar())
    stack.callback(tf_logging.set_verbosity, level)
    tf_logging.disable_progress_bar()
    tf_logging.set_verbosity(logging.ERROR)


def quiet(fn: F) -> F:
    """``fn`` run within ``quiet_libraries``.

    >>> quiet(lambda: 3)()
    3
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with quiet_libraries():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
