"""Driving `lorakit train` as a separate process, as a scheduler or a user's Ctrl-C does."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path


def interrupt_train(config: Path, out_dir: Path, sig: int = signal.SIGINT, after_steps: int = 2,
                    timeout: float = 120) -> tuple[subprocess.CompletedProcess, dict]:
    """Start `lorakit train CONFIG --json`, send `sig` once `after_steps` steps are in metrics.jsonl, and
    return the finished process and the JSON it printed."""
    p = subprocess.Popen([sys.executable, "-m", "lorakit", "train", str(config), "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    metrics = Path(out_dir) / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < after_steps):
        time.sleep(0.05)
    p.send_signal(sig)
    out, err = p.communicate(timeout=timeout)
    done = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return done, (json.loads(out) if p.returncode in (0, 75) else {})
