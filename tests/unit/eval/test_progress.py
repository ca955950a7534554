from pflseg.eval.progress import RunProgress


def test_progress_lines_count_jobs_and_estimate_from_the_mean_job_time():
    now, lines = [0.0], []
    steps = RunProgress(4, lines.append, clock=lambda: now[0])
    assert steps.start("fedavg") == "[1/4] fedavg ..."  # no ETA before a job is done
    now[0] = 60.0
    assert steps.done() == 60.0
    steps.start("fedbn")
    now[0] = 180.0  # 120 s: mean 90 s
    steps.done()
    steps.start("fedsm")
    assert lines == ["[1/4] fedavg ...", "[2/4] fedbn ... ETA 3 min", "[3/4] fedsm ... ETA 3 min"]
    now[0] = 200.0
    steps.done()  # mean (60 + 120 + 20) / 3 s, one job left
    assert steps.start("grace") == "[4/4] grace ... ETA 67 s"


def test_a_job_read_back_counts_as_done_but_not_in_the_mean():
    now, lines = [0.0], []
    steps = RunProgress(3, lines.append, clock=lambda: now[0])
    steps.start("fedavg")
    steps.done(timed=False)  # read back from an earlier invocation: no time to learn from
    assert steps.start("fedbn") == "[2/3] fedbn ..."  # no ETA yet
    now[0] = 60.0
    steps.done()
    assert steps.start("fedsm") == "[3/3] fedsm ... ETA 60 s"  # one job left at 60 s each, not 30 s
