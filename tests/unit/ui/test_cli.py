"""`lorakit ui` as a user starts it: the run list served within seconds; bound elsewhere, a token."""

import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TOKEN = "a-test-token-of-24-chars"


def _start(*args, token: str | None = TOKEN):
    import os

    env = {k: v for k, v in os.environ.items() if k != "LORAKIT_UI_TOKEN"}
    if token:
        env["LORAKIT_UI_TOKEN"] = token
    return subprocess.Popen([sys.executable, "-m", "lorakit", "ui", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _first_answer(url, p, timeout=30, headers=None):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if p.poll() is not None:
            raise AssertionError(p.communicate()[1])
        try:
            return httpx.get(url, timeout=2, headers=headers), time.time() - t0
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError("lorakit ui did not answer")


@pytest.mark.slow
def test_ui_serves_the_run_list_of_the_demo_soon_after_it_starts(tmp_path):
    from typer.testing import CliRunner

    from lorakit.cli.app import app

    demo = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "demo-out")])  # what `make demo` runs
    assert demo.exit_code == 0, demo.output
    port = _free_port()
    p = _start("--runs", str(tmp_path / "demo-out"), "--port", str(port))
    try:
        r, took = _first_answer(f"http://127.0.0.1:{port}/api/runs", p, headers={"Authorization": f"Bearer {TOKEN}"})
        listed = {x["name"]: x for x in r.json()["runs"]}
        assert r.status_code == 200 and listed["run"]["status"] == "finished" and listed["run"]["family"] == "flux"
        print(f"UI first answer after {took:.2f} s")
        assert took < 10  # 1-2 s measured here; torch is not imported to serve the dashboard
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=30)
    assert f"http://127.0.0.1:{port}/?token={TOKEN}" in out


@pytest.mark.slow
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_ui_prints_a_new_token_each_start_and_asks_for_it_on_every_address(runs, host):
    port = _free_port()
    p = _start("--runs", str(runs), "--port", str(port), "--host", host, token=None)
    try:
        r, _ = _first_answer(f"http://127.0.0.1:{port}/api/runs", p)
        assert r.status_code == 401  # 127.0.0.1 too: any web page the user opens could reach it
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=30)
    token = out.split("every request needs this token (open the link above once: a cookie keeps it): ")[1].split()[0]
    assert len(token) >= 24 and f"?token={token}" in out


def test_ui_refuses_a_missing_runs_folder(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lorakit", "ui", "--runs", str(tmp_path / "nope")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "no such folder" in r.stderr
    r = subprocess.run([sys.executable, "-m", "lorakit", "ui", "--runs", str(tmp_path), "--token", "short"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "at least 16" in r.stderr
