"""errors.first_line: the one line a message is cut to, whatever the exception holds."""

from enjoyln.errors import first_line


def test_first_line_of_an_empty_message_is_the_type_or_the_default():
    # `str(exc).splitlines()[0]` raised IndexError here, turning a clear error into a traceback
    assert first_line(KeyError()) == "KeyError"
    assert first_line(OSError(""), "") == ""
    assert first_line(ValueError("  \n")) == "ValueError"


def test_first_line_is_the_first_nonblank_line():
    assert first_line(RuntimeError("\nshape mismatch\n  at layer 3")) == "shape mismatch"
