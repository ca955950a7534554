from pflseg.eval.progress import RunProgress


def test_progress_lines_count_jobs_and_estimate_from_the_mean_job_time():
    now, lines = [0.0], []
    steps = RunProgress(4, lines.append, clock=lambda: now[0])
    assert steps.start("fedavg") == 0.0 and lines[-1] == "[1/4] fedavg ..."  # no ETA before a job is done
    now[0] = 60.0
    assert steps.done() == 60.0
    steps.start("fedbn")
    now[0] = 180.0  # 120 s: mean 90 s
    steps.done()
    steps.start("fedsm")
    assert lines == ["[1/4] fedavg ...", "[2/4] fedbn ... ETA 3 min", "[3/4] fedsm ... ETA 3 min"]
    now[0] = 200.0
    steps.done()  # mean (60 + 120 + 20) / 3 s, one job left
    steps.start("grace")
    assert lines[-1] == "[4/4] grace ... ETA 67 s"


def test_a_job_read_back_counts_as_done_but_not_in_the_mean():
    now, lines = [0.0], []
    steps = RunProgress(3, lines.append, clock=lambda: now[0])
    steps.start("fedavg")
    steps.done(timed=False)  # read back from an earlier invocation: no time to learn from
    steps.start("fedbn")
    assert lines[-1] == "[2/3] fedbn ..."  # no ETA yet
    now[0] = 60.0
    steps.done()
    steps.start("fedsm")
    assert lines[-1] == "[3/3] fedsm ... ETA 60 s"  # one job left at 60 s each, not 30 s


def test_jobs_side_by_side_are_each_timed_from_their_own_start():
    now, lines = [0.0], []
    steps = RunProgress(2, lines.append, clock=lambda: now[0])
    first = steps.start("fedavg")
    now[0] = 10.0
    second = steps.start("fedsm")
    now[0] = 70.0
    assert steps.done(t0=first) == 70.0 and steps.done(t0=second) == 60.0
