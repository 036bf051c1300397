"""`lorakit.cli.entry`: how a `lorakit` process ends."""

import os
import subprocess
import sys

import pytest

from lorakit.cli import entry

_RUN = ("import atexit, os, sys; atexit.register(lambda: print('interpreter teardown')); "
        "import lorakit.cli.app as app; command = app.main\n"
        "def main():  # a rank whose WORLD_SIZE the command itself sets, as `srun lorakit train` does (dist.from_slurm)\n"
        "    os.environ.update({k[len('LATER_'):]: v for k, v in os.environ.items() if k.startswith('LATER_')})\n"
        "    command()\n"
        "app.main = main\n"
        "sys.argv = ['lorakit', 'train', '--help']; from lorakit.cli.entry import main; main()")


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "1"}, {"WORLD_SIZE": "2"}, {"LATER_WORLD_SIZE": "2"}])
def test_a_rank_of_several_processes_ends_with_its_output_and_code_but_without_the_teardown(env):
    env = {**{k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}, **env}
    p = subprocess.run([sys.executable, "-c", _RUN], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Usage" in p.stdout  # what the command printed was flushed before the process ended
    assert ("interpreter teardown" in p.stdout) == (env.get("WORLD_SIZE") == "1")


def test_leave_gives_the_exit_code_python_would(monkeypatch, capsys):
    ended = []

    class Ended(Exception):
        pass

    def _exit(code):
        ended.append(code)
        raise Ended

    monkeypatch.setattr(entry.os, "_exit", _exit)
    for code in (None, 0, 75, 2, "the reason"):
        with pytest.raises(Ended):
            entry.leave(code)
    assert ended == [0, 0, 75, 2, 1]
    assert "the reason" in capsys.readouterr().err
