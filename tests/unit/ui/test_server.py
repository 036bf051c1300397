"""The dashboard's HTTP API through the framework's test client, and its event stream from a real server."""

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from lorakit.ui.server import create_app  # noqa: E402

LOCAL = "http://127.0.0.1"  # the Host the printed URL names (the guard refuses others)


def test_the_api_lists_runs_and_serves_their_files(runs):
    c = TestClient(create_app(runs), base_url=LOCAL)
    page = c.get("/")
    assert page.status_code == 200 and "/static/app.js" in page.text
    assert c.get("/static/app.js").status_code == 200 and c.get("/static/../server.py").status_code == 404
    listed = {r["name"]: r for r in c.get("/api/runs").json()["runs"]}
    assert listed["done"]["status"] == "finished" and listed["team/stopped"]["status"] == "interrupted"
    d = c.get("/api/run/done").json()
    assert d["samples"] and d["checkpoints"]
    img = c.get("/files/" + d["samples"][-1])
    assert img.status_code == 200 and img.headers["content-type"] == "image/png"
    lora = c.get("/files/done/lora.safetensors")
    assert lora.status_code == 200 and "attachment" in lora.headers.get("content-disposition", "")
    assert [m["step"] for m in c.get("/api/run/done/metrics?since=3").json()["rows"]] == [4]
    assert c.get("/api/run/nothing-here").status_code == 404
    for bad in ("/files/..%2F..%2Fetc%2Fpasswd", "/files/%2Fetc%2Fpasswd"):
        assert c.get(bad).status_code in (403, 404)


def test_bound_elsewhere_every_request_needs_the_token(runs):
    c = TestClient(create_app(runs, token="s3cret"), base_url=LOCAL)
    assert c.get("/api/runs").status_code == 401 and c.get("/").status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    first = c.get("/?token=s3cret", follow_redirects=False)  # the printed link: kept in a cookie, taken off the URL
    assert first.status_code == 303 and first.headers["location"] == "/"
    assert "lorakit_token=s3cret" in first.headers["set-cookie"] and "SameSite=Strict" in first.headers["set-cookie"]
    assert c.get("/api/runs").status_code == 200  # the cookie now
    assert TestClient(create_app(runs, token="s3cret"), base_url=LOCAL).get("/?token=s3cret").status_code == 200


def test_the_event_stream_sends_new_metrics_samples_and_status(runs, tmp_path):
    import httpx
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(runs), host="127.0.0.1", port=0, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    metrics = runs / "broken" / "metrics.jsonl"
    before = metrics.read_text()
    try:
        events = []
        with httpx.stream("GET", f"http://127.0.0.1:{port}/api/events/broken?since=2", timeout=10) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            appended = False
            for line in r.iter_lines():
                if line.startswith("event: "):
                    events.append(line.removeprefix("event: "))
                elif line.startswith("data: ") and events[-1] == "metrics":
                    rows = json.loads(line.removeprefix("data: "))["rows"]
                    assert [x["step"] for x in rows] == [3]
                    break
                if not appended and "status" in events:  # the stream is open: a step lands
                    with open(metrics, "a") as f:
                        f.write(json.dumps({"step": 3, "loss": 1.3, "s_per_step": 0.1}) + "\n")
                    appended = True
        assert events[:1] == ["samples"] or "status" in events
    finally:
        metrics.write_text(before)
        server.should_exit = True
        t.join(timeout=10)


def test_datasets_are_listed_checked_and_their_captions_edited(runs, tmp_path):
    from lorakit.data.demo import make_demo_dataset

    data = make_demo_dataset(tmp_path / "sets" / "shapes", "flat", count=3, size=64)
    (data / "broken.png").write_bytes(b"not a png")
    c = TestClient(create_app(runs, datasets_root=tmp_path / "sets"), base_url=LOCAL)
    listed = {d["name"]: d for d in c.get("/api/datasets").json()["datasets"]}
    import yaml

    used = yaml.safe_load((runs / "done" / "config.resolved.yaml").read_text())["data"]["dirs"][0]
    name = "@" + used.lstrip("/")  # the runs' data folder, outside both roots: named by its absolute path
    assert {k: v["items"] for k, v in listed.items()} == {"shapes": 4, name: 2} and listed[name]["path"] == used
    assert sorted(listed[name]["runs"]) == ["broken", "done", "team/stopped"] and "runs" not in listed["shapes"]
    d = c.get("/api/dataset/" + name).json()
    assert len(d["items"]) == 2 and d["family"] == "flux" and d["check"]["settings"].startswith("the settings of run")
    assert c.get("/dfiles/" + d["items"][0]["file"]).status_code == 200
    assert c.get("/api/dataset/@etc").status_code == 404  # "@" names only the runs' data folders
    (data / "notes.yaml").write_text("secret: 1\n")  # a dataset folder serves its images, clips and captions only
    assert c.get("/dfiles/shapes/notes.yaml").status_code == 404
    d = c.get("/api/dataset/shapes?family=flux").json()
    assert len(d["items"]) == 4 and "flux2-klein" in d["families"]
    codes = {(p["path"], p["code"]) for p in d["check"]["problems"]}
    assert ("broken.png", "unreadable") in codes and ("broken.png", "missing-caption") in codes
    assert c.get("/api/dataset/shapes?family=sdxl").status_code == 400
    stem = d["items"][0]["stem"]
    r = c.put("/api/caption/shapes", json={"stem": stem, "text": "a tiny red square"})
    assert r.status_code == 200 and (data / f"{stem}.txt").read_text() == "a tiny red square"
    assert c.put("/api/caption/shapes", json={"stem": "nope", "text": "x"}).status_code == 400
    assert c.put("/api/caption/shapes", json={"stem": stem, "text": "x" * 20000}).status_code == 400  # > 16384
    assert c.put("/api/caption/shapes", content=b"x" * 70000).status_code == 413  # uploads are size-limited
    assert c.put("/api/caption/../shapes", json={"stem": stem, "text": "x"}).status_code in (403, 404)
    assert c.get(f"/dfiles/shapes/{stem}.png").status_code in (200, 404)
    assert c.get("/dfiles/../../etc/passwd").status_code in (403, 404)


@pytest.mark.slow
def test_the_job_form_comes_from_the_config_schema_and_is_checked_as_the_cli_checks(tmp_path):
    c = TestClient(create_app(tmp_path), base_url=LOCAL)
    schema = c.get("/api/schema").json()
    assert {"model", "data", "lora", "schedule", "output"} <= set(schema["properties"])
    r = c.post("/api/jobs", json={"form": {"model": {"family": "flux"}, "lora": {"rank": 0},
                                           "schedule": {"steps": -1}}})
    assert r.status_code == 400
    problems = r.json()["problems"]
    assert any("lora.rank" in p for p in problems) and any("schedule.steps" in p for p in problems)
    written = list((tmp_path / ".lorakit-ui-configs").glob("form-*.yaml"))
    assert len(written) == 1 and "rank: 0" in written[0].read_text()  # the form's values, and only those
    assert c.get("/api/jobs").json()["jobs"] == []  # nothing queued
    assert c.post("/api/jobs", json={"form": "not a mapping"}).status_code == 400


def test_a_demo_report_folder_lists_its_dataset_only_checked_with_its_runs_settings(runs, tmp_path):
    """Served from a demo's report folder (no --datasets): the data folder its run trains on is the one dataset (the
    report's own images and the run folder are not datasets); the dataset is checked with the settings of the run that trains on it (the
    defaults would read its 64 px images as too small: 0 items); a one-frame .webp is an image as training reads it,
    an animated one a clip; captions are shown as training reads them."""
    import yaml
    from PIL import Image

    from lorakit.data.demo import make_demo_dataset

    report = tmp_path / "report"
    data = make_demo_dataset(report / "data", "flat", count=4, size=64)
    (report / "demo.json").write_text("{}")
    Image.new("RGB", (64, 64)).save(report / "samples_base.png")
    cfg = yaml.safe_load((runs / "done" / "config.resolved.yaml").read_text())
    cfg["data"]["dirs"] = [str(data)]
    (report / "run").mkdir()
    (report / "run" / "config.resolved.yaml").write_text(yaml.safe_dump(cfg))
    (report / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    Image.new("RGB", (64, 64)).save(report / "run" / "loss_curve.png")
    frames = [Image.new("RGB", (64, 64), c) for c in ("red", "blue")]
    frames[0].save(data / "moving.webp", save_all=True, append_images=frames[1:], duration=100)
    (data / "moving.txt").write_text("a red then blue field\n")
    c = TestClient(create_app(report), base_url=LOCAL)
    assert c.get("/api/datasets").json()["datasets"] == [{"name": "data", "path": str(data.resolve()), "items": 5,
                                                           "runs": ["run"]}]
    d = c.get("/api/dataset/data").json()
    assert d["family"] == "flux" and d["check"]["settings"] == "the settings of run run"
    assert d["check"]["items"] == 4, d["check"]  # the animated one is named: an image family takes no clips
    assert [(x["path"], x["code"]) for x in d["check"]["problems"]] == [("moving.webp", "unsupported-pixels")]
    kinds = {it["file"].split("/")[-1]: it["kind"] for it in d["items"]}
    assert kinds["moving.webp"] == "clip" and [k for f, k in kinds.items() if f.endswith(".webp")].count("image") == 1
    assert {it["stem"]: it["caption"] for it in d["items"]}["moving"] == "a red then blue field"
    other = c.get("/api/dataset/data?family=qwen-image").json()["check"]  # another family: its own defaults
    assert other["settings"] == "the defaults of qwen-image" and other["items"] == 0  # 64 px: under its smallest


@pytest.mark.slow
def test_the_new_run_form_is_offered_its_choices_and_checked_without_queueing(tmp_path, tiny):
    from lorakit.data.demo import make_demo_dataset
    from lorakit.models.registry import family_names

    data = make_demo_dataset(tmp_path / "data", "flat", count=2, size=64)
    (tmp_path / "runs").mkdir()
    c = TestClient(create_app(tmp_path / "runs"), base_url=LOCAL)
    got = c.get("/api/choices").json()
    assert [f["name"] for f in got["families"]] == family_names() and all(f["description"] for f in got["families"])
    assert "cpu" in got["profiles"] and "rtx4090" in got["profiles"]
    form = {"model": {"family": "flux", "path": str(tiny("flux"))}, "profile": "cpu",
            "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
            "output": {"dir": "checked"}}
    r = c.post("/api/jobs/check", json={"form": form})
    assert r.status_code == 200, r.json()
    assert r.json()["profile"]["profile"] == "cpu" and r.json()["device"] == "cpu"
    assert c.get("/api/jobs").json()["jobs"] == []  # checked, not queued
    bad = c.post("/api/jobs/check", json={"form": {**form, "lora": {"rank": 0}}})
    assert bad.status_code == 400 and any("lora.rank" in p for p in bad.json()["problems"])
