"""Progress lines with an ETA (pflseg.progress): what long steps say while they run."""

from pflseg import progress as progress_module
from pflseg.progress import PREFIX, Progress, duration


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_line_every_few_seconds_with_the_eta_from_the_rate_so_far():
    clock, lines = Clock(), []
    p = Progress("site-4 routing: trials", total=40, unit="steps", say=lines.append, every=10, clock=clock)
    for _ in range(9):  # 9 s: silent
        clock.now += 1
        p.step()
    assert lines == []
    clock.now += 1
    p.step()
    assert lines == [f"{PREFIX}site-4 routing: trials 10/40 steps (25 %), 10 s, ETA 30 s"]
    p.done()
    assert lines[-1] == f"{PREFIX}site-4 routing: trials done, 10 steps in 10 s"


def test_short_work_says_nothing_and_unknown_totals_have_no_eta():
    clock, lines = Clock(), []
    with Progress("quick", total=3, say=lines.append, clock=clock) as p:
        p.step(3)
    assert lines == []
    p = Progress("open-ended", say=lines.append, every=5, clock=clock)
    clock.now = 6
    p.step()
    assert lines == [f"{PREFIX}open-ended 1 steps, 6 s"]
    assert (duration(42), duration(150), duration(7200)) == ("42 s", "2.5 min", "2.0 h")


def test_data_synthesis_and_data_check_say_how_far_they_are(tmp_path, monkeypatch):
    """Before: `pflseg data synth --preset demo` was silent for 30 s, `pflseg site check` for 13 s."""
    from pflseg.data import check_dataset, make_synthetic

    monkeypatch.setattr(progress_module, "EVERY", 0.0)  # a line at every step
    lines = []
    root = make_synthetic(tmp_path / "d", n_sites=2, cases=3, size=16, depth=2, say=lines.append)
    assert lines[0].startswith(f"{PREFIX}synthetic prostate data in {root} 1/6 cases (17 %)") and "ETA" in lines[0]
    assert lines[-1].startswith(f"{PREFIX}synthetic prostate data in {root} done, 6 cases in")
    lines.clear()
    assert check_dataset(root, say=lines.append) == []
    assert lines[0].startswith(f"{PREFIX}checking {root} 1/6 images") and "done, 6 images" in lines[-1]
