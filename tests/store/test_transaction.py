import subprocess
import sys
import textwrap

import pytest

from enjoyln.errors import CheckpointError
from enjoyln.store.transaction import check_out_dir

# In a fresh interpreter: pytest's own threads and handlers change where a signal lands
_SCRIPT = textwrap.dedent("""
    import os, signal, threading
    from enjoyln.store.transaction import signals_held

    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    signal.signal(signal.SIGTERM, stop)
    go = threading.Event()

    def send():  # started before the block, as torch's threads are: it blocks no signal
        go.wait()
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send)
    sender.start()
    done = []
    try:
        with signals_held():
            go.set()
            sender.join()
            for _ in range(100_000):  # bytecode boundaries, where a pending handler would run
                pass
            done.append(True)
    except Stop:
        print("the block finished first" if done else "the handler ran inside the block")
    print("handler restored" if signal.getsignal(signal.SIGTERM) is stop else "handler lost")
""")


def test_a_signal_another_thread_receives_waits_for_the_block():
    """The kernel may hand a process signal to any thread that does not block it (torch's
    workers); Python then runs the handler in the main thread at once, masked or not."""
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.split("\n")[:2] == ["the block finished first", "handler restored"], (
        proc.stdout + proc.stderr
    )


def test_force_says_why_a_directory_is_not_an_enjoyln_output(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"not an enjoyln output \(it has no config\.json\)"):
        check_out_dir(src, out, force=True)
    (out / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(CheckpointError, match=r"\(its config\.json has no enjoyln block\)"):
        check_out_dir(src, out, force=True)
    assert (out / "notes.txt").read_text() == "mine"
