"""`lorakit ui`: the local web dashboard (the optional extra `lorakit[ui]`: FastAPI and uvicorn)."""

from __future__ import annotations

from pathlib import Path

import typer

from lorakit.cli.common import console

HELP = """A web dashboard of the run folders under --runs: status, loss chart (live), sample grids as they appear,
the resolved config and checkpoints to download; of the dataset folders (those the runs train on, and those under
--datasets): images and clips with their captions (edited in place) and the problems `lorakit cache --check` finds;
the job queue and each GPU's memory, load and temperature. Binds to 127.0.0.1. Every request needs the secret made at
start: open the link printed (it is then kept in a cookie), or send `Authorization: Bearer TOKEN`; requests naming
another host, and changes asked by another site's page, are refused. Needs `pip install 'lorakit[ui]'`."""


def ui(host: str = typer.Option("127.0.0.1", "--host", help="address to bind (another than 127.0.0.1 needs a token)"),
       port: int = typer.Option(7860, "--port", min=1, max=65535, help="port"),
       runs: Path = typer.Option(Path("."), "--runs", help="the folder holding run folders (output.dir of runs)"),
       datasets: Path | None = typer.Option(None, "--datasets", help="the folder holding dataset folders, whose "
                                            "captions the pages edit (default: only the data folders of the runs under --runs)"),
       slots: int = typer.Option(0, "--slots", min=0, help="training runs the job queue runs at once (0: one per "
                                 "GPU nvidia-smi lists, one without a GPU)"),
       token: str | None = typer.Option(None, "--token", envvar="LORAKIT_UI_TOKEN",
                                        help="the secret every request needs (default: a new random one per start; "
                                             "set one to keep a bookmark working across restarts)")) -> None:
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
    if token is not None and len(token) < 16:
        raise InputError(f"--token: {len(token)} characters; a token that guards a server needs at least 16",
                         "leave --token out for a random one")
    token = token or secrets.token_urlsafe(24)
    where = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
    console.print(f"lorakit ui: {where}?token={token} (runs under {runs.resolve()}; Ctrl-C stops)", soft_wrap=True,
                  markup=False)
    console.print(f"every request needs this token (open the link above once: a cookie keeps it): {token}",
                  soft_wrap=True, markup=False)
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
