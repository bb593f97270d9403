"""HangWatchdog in-process: a phase past its limit dumps every thread's stack and exits HUNG;
a phase that returns in time does not; the limit follows the median step time."""

import threading

from harness.exit_codes import HUNG
from harness.health.watchdog import HangWatchdog


def test_a_phase_past_its_limit_dumps_stacks_and_exits_hung(tmp_path):
    exited, reports = threading.Event(), []
    codes = []

    def exit(code):
        codes.append(code)
        exited.set()

    dog = HangWatchdog(tmp_path, factor=10, floor_s=0.2, first_step_s=0.2, rank=3, on_hang=reports.append, exit=exit)
    with dog.watch("step", 7):
        assert exited.wait(60)  # the main thread "hangs" here until the watchdog fires
    assert codes == [HUNG]
    (report,) = reports
    assert (report.phase, report.step, report.limit_s) == ("step", 7, 0.2)
    dump = (tmp_path / report.stacks).read_text()
    assert report.stacks.startswith(str(tmp_path / "hang-rank-00003-pid-"))
    assert "test_a_phase_past_its_limit_dumps_stacks_and_exits_hung" in dump  # the stuck main thread's frame
    assert "hang-watchdog" in dump or "_fire" in dump


def test_phases_that_return_in_time_never_fire(tmp_path):
    codes = []
    dog = HangWatchdog(tmp_path, factor=10, floor_s=30, first_step_s=30, exit=codes.append)
    for step in range(1, 200):
        with dog.watch("step", step):
            pass
        dog.observe_step(0.001)
    dog.close()
    assert codes == [] and not list(tmp_path.iterdir())


def test_the_limit_is_the_larger_of_k_median_steps_and_the_floor(tmp_path):
    dog = HangWatchdog(tmp_path, factor=10, floor_s=2, first_step_s=50, exit=lambda code: None)
    assert dog.limit() == 50  # nothing timed yet in this process
    for seconds in (1.0, 1.0, 100.0):  # one slow outlier does not move the median
        dog.observe_step(seconds)
    assert dog.limit() == 10.0
    assert dog.limit(scale=2) == 20.0 and dog.limit(at_least=99) == 99
    for _ in range(4):  # now the median is 0.01 s
        dog.observe_step(0.01)
    assert dog.limit() == 2  # the floor
    dog.close()
