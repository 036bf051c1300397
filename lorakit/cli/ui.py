"""`lorakit ui`: the local web dashboard (the optional extra `lorakit[ui]`: FastAPI and uvicorn)."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import console

HELP = """A web dashboard of the run folders under --runs: status, loss chart (live), sample grids as they appear,
the resolved config and checkpoints to download; and of the dataset folders under --datasets: images and clips with
their captions (edited in place) and the problems `lorakit cache --check` finds. Binds to 127.0.0.1; any other --host needs the token printed at
start on every request. Needs `pip install 'lorakit[ui]'`."""

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def ui(host: str = typer.Option("127.0.0.1", "--host", help="address to bind (another than 127.0.0.1 needs a token)"),
       port: int = typer.Option(7860, "--port", min=1, max=65535, help="port"),
       runs: Path = typer.Option(Path("."), "--runs", help="the folder holding run folders (output.dir of runs)"),
       datasets: Path | None = typer.Option(None, "--datasets", help="the folder holding dataset folders, whose "
                                            "captions the pages edit (default: --runs)"),
       slots: int = typer.Option(0, "--slots", min=0, help="training runs the job queue runs at once (0: one per "
                                 "GPU nvidia-smi lists, one without a GPU)")) -> None:
    import importlib.util
    import secrets

    from lorakit.errors import EnvironmentFault, InputError

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise EnvironmentFault(f"lorakit ui needs {' and '.join(missing)}, not installed here",
                               "pip install 'lorakit[ui]'")
    if not runs.is_dir():
        raise InputError(f"--runs {runs}: no such folder")
    if datasets is not None and not datasets.is_dir():
        raise InputError(f"--datasets {datasets}: no such folder")
    token = None if host in LOOPBACK else secrets.token_urlsafe(24)
    where = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
    console.print(f"lorakit ui: {where}{'?token=' + token if token else ''} (runs under {runs.resolve()}; "
                  "Ctrl-C stops)", soft_wrap=True, markup=False)
    if token:
        console.print(f"bound to {host}: every request needs this token: {token}", soft_wrap=True, markup=False)
    from lorakit.ui.server import serve

    serve(runs, host, port, token, datasets, slots or _gpus())


def _gpus() -> int:
    """GPUs nvidia-smi lists (1 without one): the job queue's default slots, found without importing torch."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return 1
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(1, sum(1 for line in out.splitlines() if line.startswith("GPU ")))
