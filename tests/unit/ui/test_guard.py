"""The dashboard as a server on someone's machine: every file it reads or writes stays inside its folder (links
included), any other web page's requests are refused (Origin, Host, token), and malformed requests are a 4xx with
the reason — never a 500. One test per endpoint that reads a file."""

import json
import shutil
import threading
import time

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from lorakit.ui.guard import allowed_host, host_name  # noqa: E402
from lorakit.ui.server import create_app  # noqa: E402

LOCAL = "http://127.0.0.1"
SECRET = "the outside file's secret content"


@pytest.fixture
def leaky(runs, tmp_path):
    """A copy of a finished run whose files are links out of the runs folder, beside a dataset whose caption and an
    image are such links, and the outside files they point at."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    (outside / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.99, "secret": SECRET}) + "\n")
    (outside / "config.yaml").write_text(f"model: {{family: flux}}\nschedule: {{steps: 4}}\n# {SECRET}\n")
    shutil.copyfile(next((runs / "done" / "samples").glob("*.png")), outside / "private.png")
    (outside / "ck").mkdir()
    (outside / "ck" / "private-file.bin").write_text(SECRET)
    root = tmp_path / "runs"
    shutil.copytree(runs / "done", root / "leaky", symlinks=True)
    run = root / "leaky"
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(outside / "metrics.jsonl")
    (run / "samples" / "zz-private.png").symlink_to(outside / "private.png")
    (run / "checkpoints" / "step-private").symlink_to(outside / "ck")
    shutil.copytree(runs / "done", root / "linked-config", symlinks=True)
    (root / "linked-config" / "config.resolved.yaml").unlink()
    (root / "linked-config" / "config.resolved.yaml").symlink_to(outside / "config.yaml")
    sets = tmp_path / "sets"
    from lorakit.data.demo import make_demo_dataset

    data = make_demo_dataset(sets / "shapes", "flat", count=2, size=64)
    stem = sorted(data.glob("*.png"))[0].stem
    (data / f"{stem}.txt").unlink(missing_ok=True)
    (data / f"{stem}.txt").symlink_to(outside / "secret.txt")
    (data / "zz-outside.png").symlink_to(outside / "private.png")
    return root, sets, outside, stem


def test_run_files_linked_out_of_the_runs_folder_are_never_read(leaky):
    root, sets, outside, _ = leaky
    c = TestClient(create_app(root, datasets_root=sets), base_url=LOCAL)
    listed = c.get("/api/runs")
    assert listed.status_code == 200 and SECRET not in listed.text and "9.99" not in listed.text
    assert c.get("/api/run/leaky/metrics").json()["rows"] == []  # /api/run/{name}/metrics
    d = c.get("/api/run/leaky")  # /api/run/{name}: config, samples, checkpoints
    assert d.status_code == 200 and SECRET not in d.text and "zz-private" not in d.text
    assert "step-private" not in d.text and "private-file" not in d.text
    linked = c.get("/api/run/linked-config")  # a config that is a link out: not a run folder at all
    assert linked.status_code == 404 and SECRET not in linked.text
    assert c.get("/files/leaky/samples/zz-private.png").status_code == 403  # /files
    assert c.get("/files/leaky/checkpoints/step-private/private-file.bin").status_code == 403
    assert c.get("/files/leaky/metrics.jsonl").status_code == 403


def test_the_event_stream_does_not_follow_links_out(leaky):
    import httpx
    import uvicorn

    root, sets, _, _ = leaky
    server = uvicorn.Server(uvicorn.Config(create_app(root, datasets_root=sets), host="127.0.0.1", port=0,
                                           log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        seen = []
        with httpx.stream("GET", f"http://127.0.0.1:{port}/api/events/leaky?since=0", timeout=10) as r:
            for line in r.iter_lines():
                seen.append(line)
                if line.startswith("event: status"):
                    break
        text = "\n".join(seen)
        assert "event: metrics" not in text and SECRET not in text and "zz-private" not in text
    finally:
        server.should_exit = True
        t.join(timeout=10)


def test_dataset_captions_and_images_linked_out_are_not_read_or_written_through(leaky):
    root, sets, outside, stem = leaky
    c = TestClient(create_app(root, datasets_root=sets), base_url=LOCAL)
    d = c.get("/api/dataset/shapes?family=flux")  # /api/dataset/{name}
    assert d.status_code == 200 and SECRET not in d.text
    items = {it["stem"]: it for it in d.json()["items"]}
    assert items[stem]["caption"] is None and "zz-outside" not in items
    assert c.get("/dfiles/shapes/zz-outside.png").status_code == 403  # /dfiles
    r = c.put("/api/caption/shapes", json={"stem": stem, "text": "overwrite"})  # /api/caption: never through
    assert r.status_code == 400 and "symbolic link" in r.json()["error"]
    assert (outside / "secret.txt").read_text() == SECRET


def test_a_job_log_linked_out_is_not_read(tmp_path):
    from lorakit.ui.jobs import LOGS

    root = tmp_path / "runs"
    (root / LOGS).mkdir(parents=True)
    (tmp_path / "secret.txt").write_text(SECRET)
    (root / LOGS / "job-1.log").symlink_to(tmp_path / "secret.txt")
    c = TestClient(create_app(root), base_url=LOCAL)
    assert c.get("/api/jobs/1/log").json()["log"] == ""  # /api/jobs/{id}/log


def test_a_page_on_another_site_cannot_start_or_stop_a_job(tmp_path):
    c = TestClient(create_app(tmp_path), base_url=LOCAL)
    form = {"form": {"model": {"family": "flux"}}}
    evil = {"Origin": "http://evil.example"}
    r = c.post("/api/jobs", json=form, headers=evil)
    assert r.status_code == 403 and "evil.example" in r.json()["error"]
    # the form post a page can send without asking: text/plain (no preflight) — refused even without an Origin
    r = c.post("/api/jobs", content=json.dumps(form), headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    r = c.post("/api/jobs", content=json.dumps(form), headers={"Content-Type": "text/plain", **evil})
    assert r.status_code == 403
    r = c.post("/api/jobs", json=form, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    assert c.post("/api/jobs/1/stop", headers=evil).status_code == 403
    assert c.put("/api/caption/x", json={"stem": "a", "text": "b"}, headers={"Origin": "null"}).status_code == 403
    assert not (tmp_path / ".lorakit-ui-configs").exists()  # nothing was written
    assert c.get("/api/jobs").json()["jobs"] == []
    same = c.post("/api/jobs", json={"form": "not a mapping"}, headers={"Origin": LOCAL})
    assert same.status_code == 400  # its own page passes the guard (and is then checked as usual)


def test_a_foreign_host_header_is_refused_dns_rebinding(tmp_path):
    app = create_app(tmp_path)
    assert TestClient(app, base_url="http://evil.example:7860").get("/api/runs").status_code == 403
    for ok in ("http://127.0.0.1:7860", "http://localhost:7860", "http://[::1]:7860", "http://127.0.0.2"):
        assert TestClient(app, base_url=ok).get("/api/runs").status_code == 200, ok
    lan = create_app(tmp_path, token="t" * 24, host="192.168.1.5")
    assert TestClient(lan, base_url="http://evil.example").get("/api/runs").status_code == 403
    wild = create_app(tmp_path, token="t" * 24, host="0.0.0.0")  # every address: the token decides
    assert TestClient(wild, base_url="http://any.name").get("/api/runs", headers={
        "Authorization": "Bearer " + "t" * 24}).status_code == 200
    assert host_name("[::1]:80") == "::1" and host_name("Example.COM:1") == "example.com"
    assert allowed_host("127.9.9.9", "127.0.0.1") and not allowed_host("10.0.0.1", "127.0.0.1")


def test_on_127_0_0_1_too_every_request_needs_the_launch_token(runs):
    c = TestClient(create_app(runs, token="k" * 24), base_url=LOCAL)
    assert c.get("/").status_code == 401 and c.get("/api/runs").status_code == 401
    assert c.get("/api/runs", headers={"Cookie": "lorakit_token=wrong"}).status_code == 401
    assert c.get("/api/runs", headers={"Cookie": "lorakit_token=" + "k" * 24}).status_code == 200
    assert c.get("/api/runs", headers={"Cookie": "malformed;;=\x7f"}).status_code == 401


def test_malformed_requests_are_4xx_with_a_reason_never_500(runs, tmp_path):
    c = TestClient(create_app(runs, datasets_root=tmp_path), base_url=LOCAL, raise_server_exceptions=False)
    paths = ["/api/run/a%00b", "/api/run/a%00b/metrics", "/files/done/%00", "/api/dataset/%00x",
             "/api/run/" + "x" * 5000, "/api/run/%ED%A0%80", "/files/%ED%A0%80", "/api/run/done/metrics?since=x"]
    for p in paths:
        r = c.get(p)
        assert 400 <= r.status_code < 500, (p, r.status_code, r.text[:200])
    bodies = [b"{not json", b"[" * 5000 + b"]" * 5000, json.dumps({"config": [[[[[[[[[[[[[[[[[["x"]]]]]]]]]]]]]]]]]]}),
              b'{"stem": "\\ud800", "text": "x"}', b'{"config": "\\ud800.yaml"}', b'{"config": "a\\u0000b"}',
              b'{"form": {"model": {"family": "\\udfff"}}}', b"\xff\xfe"]
    for b in bodies:
        for url, m in (("/api/jobs", c.post), ("/api/caption/x", c.put)):
            r = m(url, content=b, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (url, b[:40], r.status_code, r.text[:200])
    r = c.post("/api/jobs", content=b"{}", headers={"Content-Type": "application/json", "Content-Length": "x"})
    assert 400 <= r.status_code < 500


def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives(tmp_path):
    c = TestClient(create_app(tmp_path), base_url=LOCAL)
    sent = {"n": 0}

    def body():  # no Content-Length: a chunked upload of 20 MB
        for _ in range(320):
            sent["n"] += 1
            yield b"x" * 65536

    r = c.post("/api/jobs", content=body(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "over 65536 bytes" in r.json()["error"]
    assert not (tmp_path / ".lorakit-ui-configs").exists()


def test_one_unreadable_run_folder_is_listed_as_such_and_breaks_nothing(runs, tmp_path):
    root = tmp_path / "runs"
    shutil.copytree(runs / "done", root / "good")
    for name, text in (("bad-yaml", "model: [unclosed\n"), ("not-a-mapping", "- just\n- a list\n"),
                       ("wrong-types", "model: 3\nschedule: {steps: many}\n")):
        shutil.copytree(runs / "done", root / name)
        (root / name / "config.resolved.yaml").write_text(text)
    c = TestClient(create_app(root), base_url=LOCAL)
    r = c.get("/api/runs")
    assert r.status_code == 200
    got = {x["name"]: x for x in r.json()["runs"]}
    assert got["good"]["status"] == "finished"
    for name in ("bad-yaml", "not-a-mapping", "wrong-types"):
        assert got[name]["status"] == "unreadable" and "config.resolved.yaml" in got[name]["error"], got[name]
    assert c.get("/api/run/bad-yaml").status_code == 200  # its page still opens, saying why
