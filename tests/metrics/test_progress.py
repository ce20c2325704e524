"""The console progress: a live bar on a terminal, plain lines elsewhere (a log file gets
readable lines, not a bar cut to columns)."""

import io

from cadence.metrics import ConsoleProgress

RECORD = {"reward_mean": 0.5, "accuracy": 0.25, "kl": 0.001, "tpspd": 1234.0}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_plain_line_every_few_iterations_and_at_the_last():
    out = io.StringIO()
    progress = ConsoleProgress(10, stream=out, every=4)
    for _ in range(10):
        progress.write(RECORD)
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["4/10", "8/10", "10/10"]
    assert all("reward 0.500  acc 0.250  kl 0.0010  tpspd 1,234" in line for line in lines)
    assert "━" not in out.getvalue()


def test_a_resumed_run_counts_from_where_it_was_and_a_disabled_one_prints_nothing():
    out = io.StringIO()
    progress = ConsoleProgress(40, stream=out, done=38)  # every: a twentieth, 2
    progress.write(RECORD)
    progress.write(RECORD)
    assert out.getvalue().splitlines()[-1].startswith("RL 40/40 ")
    quiet = io.StringIO()
    ConsoleProgress(4, enabled=False, stream=quiet).write(RECORD)
    assert quiet.getvalue() == ""


def test_on_a_terminal_the_live_bar_and_no_plain_lines():
    term = _Terminal()
    progress = ConsoleProgress(4, stream=term, every=1)
    assert progress.live
    progress.write(RECORD)
    progress.close()
    assert "RL 1/4 " not in term.getvalue()
