"""Pure logic of the process helpers: lines and blocks of rank output, deferred Ctrl-C."""

from __future__ import annotations

from spark_torch.shared.lines import CONTINUED, MAX_LINE_BYTES, block_lines, last_lines, make_block, split_lines


def test_split_lines_plain_and_crlf() -> None:
    assert split_lines("a\nb\r\nc") == ["a", "b", "c"]
    assert split_lines("a\r\nb\r") == ["a", "b"]
    assert split_lines("") == [""]


def test_split_lines_marks_long_lines() -> None:
    text = "short\n" + "y" * (2 * MAX_LINE_BYTES + 5) + "\nend"
    lines = split_lines(text)
    assert lines[0] == "short" and lines[-1] == "end"
    pieces = lines[1:-1]
    assert [p.endswith(CONTINUED) for p in pieces] == [True, True, False]
    assert sum(p.count("y") for p in pieces) == 2 * MAX_LINE_BYTES + 5
    assert all(len(p) <= MAX_LINE_BYTES + len(CONTINUED) for p in pieces)


def test_blocks() -> None:
    assert make_block("a\r\nb\r") == "a\nb"
    long = make_block("x\n" + "y" * (MAX_LINE_BYTES + 1))
    assert long.split("\n") == ["x", "y" * MAX_LINE_BYTES + CONTINUED, "y"]
    assert block_lines("a\nb\nc") == 3 and block_lines("") == 1
    assert last_lines("a\nb\nc", 2) == ["b", "c"] and last_lines("a", 5) == ["a"]


def test_interrupts_deferred_until_the_block_ends() -> None:
    import os
    import signal

    import pytest

    from spark_torch.node.processes import interrupts_deferred

    done = []
    # Python's own handler, as in a program (a library imported earlier in this test session may
    # have installed another one: the deferral only takes over from the default)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("finished the block first")
        assert done == ["finished the block first"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ranks_last_output_keeps_one_line_per_line() -> None:
    """Blocks arrive without a trailing newline: the last output a stalled rank's stack shows
    keeps them apart ("starting at step 0", "step 20 loss 0.1"; not "starting at step 0step 20 ...")."""
    from spark_torch.node.progress import ProgressWatch

    watch = ProgressWatch({0: "/nonexistent/stack-0"}, interval=60.0, send=lambda snapshot: None)
    watch.wrote(0, "starting at step 0")
    watch.wrote(0, "step 20 loss 0.1\nstep 40 loss 0.05")
    assert watch._ranks[0].output.splitlines() == ["starting at step 0", "step 20 loss 0.1", "step 40 loss 0.05"]
