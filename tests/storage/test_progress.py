"""Progress where stderr is not a terminal (a Kubeflow step's log, a pipe): whole lines now and then, never a
bar whose carriage-return redraws pile up into one line of tens of kilobytes."""

from __future__ import annotations

import io

import pytest

from rloo.storage.progress import LineProgress, Progress, is_interactive, progress_bar


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_every_tenth_and_one_at_the_end() -> None:
    out, clock = io.StringIO(), _Clock()
    bar = LineProgress(400, "rloo", "update", file=out, clock=clock)
    for _ in range(400):
        clock.now += 0.5
        bar.set_postfix({"reward": "0.5"}, refresh=False)
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10
    assert "\r" not in out.getvalue()
    assert lines[0] == "rloo: 40/400 updates (10%), 20s elapsed, 2 update/s, about 3m00s left, reward=0.5"
    assert lines[-1] == "rloo: 400/400 updates (100%), 3m20s elapsed, 2 update/s, reward=0.5"


def test_slow_loops_get_a_line_a_minute_and_rates_in_seconds_per_unit() -> None:
    out, clock = io.StringIO(), _Clock()
    bar = LineProgress(1000, "rloo", "update", file=out, clock=clock)
    for _ in range(30):  # 30 updates of 10 s each: 3% of the run, 5 minutes
        clock.now += 10
        bar.update(1)
    clock.now += 600  # nothing moved: no line
    bar.update(0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5, lines
    assert lines[0] == "rloo: 6/1000 updates (1%), 1m00s elapsed, 10 s/update, about 2h45m left"


def test_a_resumed_loop_starts_where_it_was_and_counts_only_its_own_rate() -> None:
    out, clock = io.StringIO(), _Clock()
    bar = LineProgress(100, "rloo", "update", initial=45, file=out, clock=clock)
    for _ in range(5):
        clock.now += 1
        bar.update(1)
    bar.close()
    assert out.getvalue().splitlines() == [
        "rloo: 50/100 updates (50%), 5s elapsed, 1 update/s, about 50s left"
    ]


def test_byte_transfers_in_a_log() -> None:
    out = io.StringIO()
    total = 3 * 2**30
    with Progress(total, "upload model", True, file=out) as bar:
        for _ in range(total // (16 * 2**20)):
            bar.update(16 * 2**20)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and all(len(line) < 200 for line in lines)
    assert lines[-1].startswith("upload model: 3.00 GiB/3.00 GiB (100%), ")
    small = io.StringIO()
    with Progress(2**20, "upload config", True, file=small) as bar:
        bar.update(2**20)
    assert small.getvalue() == ""  # below PROGRESS_MIN_BYTES: nothing


def test_a_terminal_still_gets_a_bar() -> None:
    assert not is_interactive(io.StringIO()) and is_interactive(_Tty())
    assert isinstance(progress_bar(10, "rloo", "update", file=io.StringIO()), LineProgress)
    tty = _Tty()
    bar = progress_bar(10, "rloo", "update", file=tty)
    assert not isinstance(bar, LineProgress)
    bar.update(3)
    bar.close()
    assert "\r" in tty.getvalue()


@pytest.mark.parametrize("n", [0, 1])
def test_tiny_totals(n: int) -> None:
    out = io.StringIO()
    bar = LineProgress(n, "x", "item", file=out)
    bar.update(n)
    bar.close()
    assert len(out.getvalue().splitlines()) == n


def test_library_bars_go_quiet_only_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub's download bars (the pipeline's fetch step, 'rloo train') are off where stderr is a log."""
    import io

    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    from rloo.storage.progress import quiet_library_bars

    enable_progress_bars()
    try:
        monkeypatch.setattr("sys.stderr", io.StringIO())
        quiet_library_bars()
        assert are_progress_bars_disabled()
    finally:
        enable_progress_bars()
