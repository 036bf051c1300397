"""SIGTERM during a command's start: an interrupt at once, or right after the import it landed in."""

import signal
import subprocess
import sys
import time

import pytest

from lorakit.cli import STOP, interrupt


def test_outside_an_import_the_interrupt_is_raised_at_once(monkeypatch):
    monkeypatch.setitem(STOP, "asked", False)
    with pytest.raises(KeyboardInterrupt):
        interrupt(signal.SIGTERM, sys._getframe())
    assert STOP["asked"]


def test_in_the_middle_of_an_import_it_is_asked_again_once_the_import_is_done(tmp_path, monkeypatch):
    (tmp_path / "mid_import_probe.py").write_text("import sys\nFRAME = sys._getframe()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(STOP, "asked", False)
    import mid_import_probe  # its frame, and the import machinery's frames above it

    before = signal.getsignal(signal.SIGALRM)
    try:
        interrupt(signal.SIGTERM, mid_import_probe.FRAME)  # no exception here
        assert STOP["asked"] and 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.05
        assert signal.getsignal(signal.SIGALRM) is interrupt
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        sys.modules.pop("mid_import_probe", None)


_SLOW_IMPORT = """
import signal, sys, time
from lorakit.cli import interrupt
signal.signal(signal.SIGTERM, interrupt)
sys.path.insert(0, sys.argv[1])
try:
    import slow_module
    time.sleep(5)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted after the import" if "slow_module" in sys.modules and slow_module.DONE else "mid-import")
"""


def test_a_signal_during_a_slow_import_interrupts_right_after_it(tmp_path):
    # the module runs ~1.5 s of Python code as it is imported (as torch's registrations do, called from C++); the
    # signal comes 0.3 s into it
    began = tmp_path / "began"
    (tmp_path / "slow_module.py").write_text(
        f"import time\nopen({str(began)!r}, 'w').close()\nt = time.monotonic()\n"
        "while time.monotonic() - t < 1.5:\n    sum(range(1000))\nDONE = True\n")
    p = subprocess.Popen([sys.executable, "-c", _SLOW_IMPORT, str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not began.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert out.strip() == "interrupted after the import", (out, err[-2000:])


_ALARM_IN_THE_EXIT = """
import signal, time
import lorakit.cli as cli
cli.STOP["entry"] = True
say = cli.said
def slow_said():  # the exit's own work, long enough for an interrupt asked again mid-import to come due in it
    say()
    time.sleep(0.3)
cli.said = slow_said
signal.signal(signal.SIGALRM, cli.interrupt)
signal.setitimer(signal.ITIMER_REAL, 0.1)
cli.gone()
"""


def test_an_interrupt_asked_again_after_an_import_does_not_land_in_the_exit():
    """A SIGTERM mid-import asks again 0.05 s later (SIGALRM); where the command was already exiting by then, that
    second KeyboardInterrupt escaped `gone()` and the process ended with -2 after saying 130."""
    p = subprocess.run([sys.executable, "-c", _ALARM_IN_THE_EXIT], capture_output=True, text=True, timeout=60)
    assert p.returncode == 130, (p.returncode, p.stderr[-2000:])
    assert p.stderr.count("interrupted before anything could be saved (exit 130)") == 1
    assert "Traceback" not in p.stderr


def test_the_exit_leaves_a_timer_that_is_not_the_interrupts_alone(monkeypatch):
    """In-process (a host program, typer's runner) `gone()` raises SystemExit(130): a SIGALRM handler and timer of the
    host's own stay as they were."""
    import lorakit.cli as cli

    monkeypatch.setitem(STOP, "entry", False)
    monkeypatch.setitem(STOP, "said", True)

    def hosts(*_):
        pass

    before = signal.signal(signal.SIGALRM, hosts)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)
        with pytest.raises(SystemExit):
            cli.gone()
        assert signal.getsignal(signal.SIGALRM) is hosts and signal.getitimer(signal.ITIMER_REAL)[0] > 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
