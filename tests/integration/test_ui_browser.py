"""`lorakit ui` in a real headless Chromium (Debian's chromium + chromedriver, driven by Selenium): the run list of a
folder, then a run page open while a tiny run trains — the loss chart gains points and a sample grid appears without
a reload. Screenshots go to test-artifacts/ui/ (LORAKIT_TEST_ARTIFACTS to put them elsewhere)."""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("selenium")
pytest.importorskip("fastapi")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs chromium and chromedriver (apt-get install "
                                                                    "chromium chromium-driver; .ci/run does)")]
ARTIFACTS = Path(os.environ.get("LORAKIT_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts")) / "ui"


@pytest.fixture
def server(tmp_path):
    import uvicorn

    from lorakit.ui.server import create_app

    root = tmp_path / "runs"
    root.mkdir()
    (tmp_path / "sets").mkdir()
    srv = uvicorn.Server(uvicorn.Config(create_app(root, TOKEN, datasets_root=tmp_path / "sets"), host="127.0.0.1",
                                        port=0, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.02)
    yield root, f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    srv.should_exit = True
    t.join(timeout=10)


TOKEN = "a-browser-test-token-000"  # what `lorakit ui` prints in its link; the page keeps it in a cookie


@pytest.fixture
def browser(server, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1200,1400",
              f"--user-data-dir={tmp_path / 'chromium'}"):
        opts.add_argument(a)
    # Chromium makes its singleton socket's folder in TMPDIR and leaves it: one short folder per test, removed after
    # (a socket's path must stay under 108 bytes: tmp_path is too deep)
    tmp = tempfile.mkdtemp(prefix="lk-chromium-")
    d = webdriver.Chrome(service=Service(DRIVER, env={**os.environ, "TMPDIR": tmp}), options=opts)
    d.set_page_load_timeout(30)
    d.get(server[1] + "/?token=" + TOKEN)  # the printed link: a cookie, and the token taken off the address
    assert d.current_url == server[1] + "/"
    yield d
    d.quit()
    shutil.rmtree(tmp, ignore_errors=True)


def _shot(browser, name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def _text(browser, css: str) -> str:
    """An element's text read in one step (the jobs table is redrawn every second: a found element can go stale)."""
    return browser.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : ''", css)


def _click(browser, css: str) -> None:
    browser.execute_script("document.querySelector(arguments[0]).click()", css)


def _wait(cond, timeout=60, what="the page"):
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            got = cond()
        except StaleElementReferenceException:  # the page replaced the element between finding and reading it
            got = None
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what} did not change within {timeout} s")


def _samples(browser) -> set:
    """The sample grids the run page shows now, read in one go (the page may replace them at any moment)."""
    return set(browser.execute_script(
        "return [...document.querySelectorAll('#latest img')].map(i => i.getAttribute('data-sample'))")) - {None}


def _points(browser) -> str:
    return browser.execute_script("return document.getElementById('points').textContent")


def test_a_training_run_updates_its_page_live(server, browser, tiny, tmp_path):

    from tests.unit.ui.conftest import run_yaml

    root, url = server
    cfg = run_yaml(tmp_path, tiny, root / "live", steps=3000, sampling={"every": 60, "steps": 2},
                   output={"save_every": 100000})
    p = subprocess.Popen([sys.executable, "-m", "lorakit", "train", str(cfg), "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        metrics = root / "live" / "metrics.jsonl"
        _wait(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 120, "metrics.jsonl")

        browser.get(url + "/")
        # the list refreshes while the run goes on: its row is read and clicked by selector, never held
        row = _wait(lambda: browser.execute_script(
            "const r = document.querySelector('tr[data-run=\"live\"]'); return r && r.textContent"), what="the run list")
        assert "running" in row and "flux" in row
        _shot(browser, "run-list")

        _click(browser, 'tr[data-run="live"] a')
        _wait(lambda: "steps" in _points(browser), what="the chart")
        first = int(_points(browser).split()[0])
        grids = _samples(browser)
        url_before = browser.current_url
        # new steps reach the chart and a new sample grid replaces the latest one, without a page load
        _wait(lambda: int(_points(browser).split()[0]) > first + 20, what="the chart")
        _wait(lambda: _samples(browser) - grids, 120, "the sample grid")
        assert browser.current_url == url_before
        assert browser.execute_script("return performance.getEntriesByType('navigation').length") == 1
        assert _wait(lambda: browser.execute_script(  # the new grid loads (read by selector: the page replaces it)
            "const i = document.querySelector('#latest img'); return i && i.complete && i.naturalWidth"),
            what="the sample grid's image") > 0
        summary = browser.execute_script("return document.getElementById('run-summary').textContent")
        assert "running" in summary and int(summary.split("step ")[1].split()[0]) > first  # the header follows
        phases = _text(browser, "#phases")  # the phases as they happened, from the run's phases.jsonl
        assert "cache" in phases and "load model" in phases and "step 1" in phases, phases
        assert "training flux" in _text(browser, "#run-log")  # its infos: the live log
        assert "started outside the dashboard" in _text(browser, "#run-actions")  # no stop for a CLI run
        _shot(browser, "run-page-live")
    finally:
        p.terminate()
        p.communicate(timeout=120)


def test_a_caption_is_edited_in_place_and_the_problems_are_shown(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    from lorakit.data.demo import make_demo_dataset

    root, url = server
    data = make_demo_dataset(tmp_path / "sets" / "shapes", "flat", count=3, size=64)
    (data / "item_000.txt").unlink()  # an uncaptioned image: listed as a problem, captioned from the page
    browser.get(url + "/#/datasets")
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, 'a[data-dataset="shapes"]'), what="the dataset list")[0].click()
    item = _wait(lambda: browser.find_elements(By.CSS_SELECTOR, '.item[data-stem="item_000"]'), what="the items")[0]
    problems = browser.find_element(By.ID, "problems").text
    assert "item_000.png" in problems and "missing-caption" in problems
    assert "no caption" in item.text
    box = item.find_element(By.TAG_NAME, "textarea")
    box.clear()
    box.send_keys("a red circle drawn by hand")
    item.find_element(By.TAG_NAME, "button").click()
    _wait(lambda: "saved" in item.find_element(By.CLASS_NAME, "saved").text, what="the save")
    assert (data / "item_000.txt").read_text(encoding="utf-8") == "a red circle drawn by hand"
    _wait(lambda: "missing-caption" not in browser.find_element(By.ID, "problems").text, what="the problems table")
    assert _wait(lambda: browser.execute_script(  # the thumbnail loads
        "const i = document.querySelector('.item img'); return i && i.complete && i.naturalWidth"), what="a thumbnail")
    _shot(browser, "dataset-caption-edited")


def test_a_job_is_started_and_stopped_from_the_page(server, browser, tiny, tmp_path):
    from selenium.webdriver.common.by import By

    from tests.unit.ui.conftest import run_yaml

    root, url = server
    run_yaml(root, tiny, root / "queued", steps=5000, sampling={"enabled": False}, output={"save_every": 100000})
    browser.get(url + "/#/jobs")
    form = _wait(lambda: browser.find_elements(By.ID, "job-form"), what="the jobs page")[0]
    form.find_element(By.ID, "job-sets").send_keys("lora.rank=0\nschedule.steps=-2")
    form.find_element(By.ID, "job-config").send_keys("queued.yaml")
    form.find_element(By.TAG_NAME, "button").click()
    # refused as the CLI refuses it: every problem listed, nothing queued
    _wait(lambda: "lora.rank" in browser.find_element(By.ID, "job-problems").text, 120, "the problems")
    assert "schedule.steps" in browser.find_element(By.ID, "job-problems").text
    assert not browser.find_elements(By.CSS_SELECTOR, "tr[data-job]")
    sets = browser.find_element(By.ID, "job-sets")
    sets.clear()
    form.find_element(By.TAG_NAME, "button").click()
    _wait(lambda: _text(browser, 'tr[data-job="1"]'), 120, "the job row")
    metrics = root / "queued" / "metrics.jsonl"
    _wait(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 120, "the run's first steps")
    _wait(lambda: "running" in _text(browser, 'tr[data-job="1"]'), what="the state")
    _shot(browser, "job-running")
    _click(browser, 'button[data-stop="1"]')
    _wait(lambda: "interrupted" in _text(browser, 'tr[data-job="1"]'), 120, "the stop (a checkpoint, then exit 75)")
    assert "exit 75" in _text(browser, 'tr[data-job="1"]')
    assert any((root / "queued" / "checkpoints").glob("step-*"))
    _click(browser, 'a[data-log="1"]')
    _wait(lambda: "interrupted" in _text(browser, "#job-log").lower(), what="the job's log")
    _shot(browser, "job-stopped")
    # the run's page: resumed from its checkpoint there, then stopped there
    browser.get(url + "/#/run/queued")
    _wait(lambda: browser.find_elements(By.ID, "run-resume"), what="the run page's resume")
    _click(browser, "#run-resume")
    browser.get(url + "/#/jobs")
    _wait(lambda: "running" in _text(browser, 'tr[data-job="2"]'), 120, "the resumed job")
    # a second resume of the same run (a page left open before the first) is refused, naming the job that holds it
    browser.execute_script("jobAction('/api/jobs/1/resume')")
    refused = _wait(lambda: _text(browser, "#job-problems"), what="the refusal")
    assert "started again by job 2 (running)" in refused, refused
    assert not _text(browser, 'tr[data-job="3"]')  # nothing queued
    browser.get(url + "/#/run/queued")
    _wait(lambda: browser.find_elements(By.ID, "run-stop"), what="the run page's stop")
    _click(browser, "#run-stop")
    browser.get(url + "/#/jobs")
    _wait(lambda: "interrupted" in _text(browser, 'tr[data-job="2"]'), 120, "the stop from the run page")


def test_a_job_is_queued_from_the_form_the_config_schema_generates(server, browser, tiny, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from lorakit.data.demo import make_demo_dataset

    root, url = server
    data = make_demo_dataset(tmp_path / "data", "flat", count=2, size=64)
    browser.get(url + "/#/jobs")
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, '#schema-fields [data-key="model.family"]'), what="the form")
    browser.find_element(By.CSS_SELECTOR, "#job-form-details summary").click()
    keys = {e.get_attribute("data-key") for e in browser.find_elements(By.CSS_SELECTOR, "#schema-fields [data-key]")}
    assert {"model.family", "model.path", "data.dirs", "lora.rank", "schedule.steps", "output.dir"} <= keys

    def field(key):
        return browser.find_element(By.CSS_SELECTOR, f'#schema-fields [data-key="{key}"]')

    field("model.family").send_keys("flux")
    field("model.path").send_keys(str(tiny("flux")))
    field("data.dirs").send_keys(str(data))
    for key, value in {"data.resolution": "64", "data.bucket_min_side": "32", "data.bucket_max_side": "128",
                       "schedule.steps": "5000", "output.dir": str(root / "from-form")}.items():
        field(key).send_keys(value)
    Select(field("sampling.enabled")).select_by_visible_text("false")
    if "profile" in keys:
        field("profile").send_keys("cpu")
    field("lora.rank").send_keys("0")  # refused as the CLI refuses it
    browser.find_element(By.ID, "q-queue").click()
    _wait(lambda: "lora.rank" in _text(browser, "#job-problems"), 120, "the problems")
    field("lora.rank").clear()
    browser.find_element(By.ID, "q-queue").click()
    _wait(lambda: "running" in _text(browser, 'tr[data-job="1"]'), 120, "the job from the form")
    browser.execute_script("window.scrollTo(0, 0)")
    _shot(browser, "job-form")
    metrics = root / "from-form" / "metrics.jsonl"
    _wait(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 120, "the run's first steps")
    _click(browser, 'button[data-stop="1"]')
    _wait(lambda: "interrupted" in _text(browser, 'tr[data-job="1"]'), 120, "the stop")


def test_the_jobs_page_shows_the_machine_and_a_runs_data_folder_is_its_dataset(server, browser, tmp_path):
    """The machine panel beside the jobs (each GPU as nvidia-smi reads it; this machine's answer where it has none,
    and the host's load, memory and disk), refreshed with the jobs; a run's data folder outside the runs folder listed
    as a dataset with the run that trains on it, and checked with that run's settings (64 px items that the
    defaults would refuse)."""
    import yaml
    from selenium.webdriver.common.by import By

    from lorakit.data.demo import make_demo_dataset

    root, url = server
    data = make_demo_dataset(tmp_path / "elsewhere" / "shapes", "flat", count=3, size=64)
    from PIL import Image

    frames = [Image.new("RGB", (64, 64), c) for c in ("red", "blue")]  # a clip, as training reads it: told apart
    frames[0].save(data / "moving.webp", save_all=True, append_images=frames[1:], duration=100)
    (data / "moving.txt").write_text("a red then blue field\n")
    run = root / "small-run"
    run.mkdir()
    (run / "config.resolved.yaml").write_text(yaml.safe_dump(
        {"model": {"family": "flux"}, "schedule": {"steps": 10},
         "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128}}))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.2}\n')

    browser.get(url + "/#/jobs")
    _wait(lambda: "host: load" in _text(browser, "#host"), what="the machine panel")
    gpus = _text(browser, "#gpus")
    assert ("no NVIDIA GPU here" in gpus) if not shutil.which("nvidia-smi") else ("GiB" in gpus and "°C" in gpus)
    assert "GiB available" in _text(browser, "#host") and "free" in _text(browser, "#host")
    _shot(browser, "jobs-machine")

    browser.get(url + "/#/datasets")
    name = "@" + str(data.resolve()).lstrip("/")
    link = _wait(lambda: browser.find_elements(By.CSS_SELECTOR, f'a[data-dataset="{name}"]'), what="the dataset list")
    listed = _text(browser, "#datasets")
    assert str(data.resolve()) in listed and "trained on by small-run" in listed
    _shot(browser, "datasets")
    link[0].click()
    summary = _wait(lambda: _text(browser, "#check-summary"), what="the dataset check")
    assert "3 items train, 1 problems" in summary and "checked with the settings of run small-run" in summary, summary
    assert "moving.webp" in _text(browser, "#problems") and "unsupported-pixels" in _text(browser, "#problems")
    clip = browser.find_element(By.CSS_SELECTOR, '.item[data-stem="moving"]')
    assert "clip" in clip.text and clip.find_element(By.TAG_NAME, "textarea").get_attribute("value") == \
        "a red then blue field"  # the caption as training reads it (no trailing newline)
    assert "clip" not in browser.find_element(By.CSS_SELECTOR, '.item[data-stem="item_000"]').text
    assert _wait(lambda: browser.execute_script(  # the thumbnail loads
        "const i = document.querySelector('.item img'); return i && i.complete && i.naturalWidth"), what="a thumbnail")
    _shot(browser, "dataset-of-a-run")


def test_a_finished_runs_page_has_its_gallery_prompts_chart_hover_and_the_lora(server, browser, tiny, tmp_path):
    """A finished run: every sample grid in a gallery under its step (a click shows it large), the prompts in full,
    the loss chart with a smoothing toggle and the values under the pointer, no val_loss legend where none was
    measured, the phases with their seconds, the LoRA to download and the `lorakit push` command."""
    from selenium.webdriver.common.action_chains import ActionChains
    from typer.testing import CliRunner

    from lorakit.cli.app import app
    from tests.unit.ui.conftest import run_yaml

    root, url = server
    long_prompt = "a very long prompt about a red circle in the middle of a blue field, drawn by hand with care"
    cfg = run_yaml(tmp_path, tiny, root / "done", steps=40, sampling={"every": 20, "steps": 2,
                                                                      "prompts": [long_prompt, "a square"]})
    r = CliRunner().invoke(app, ["train", str(cfg), "--json"])
    assert r.exit_code == 0, r.output
    browser.get(url + "/#/run/done")
    _wait(lambda: "40 steps" in _points(browser), what="the chart")
    import re

    summary = _text(browser, "#run-summary")  # numbers as numbers (a helper's name once shadowed another's)
    assert re.search(r"step 40 / 40 · loss \d\.\d{4} · \d+\.\d{3} s/step", summary), summary
    grids = _wait(lambda: browser.execute_script(
        "return [...document.querySelectorAll('#gallery figcaption')].map(f => f.textContent)"), what="the gallery")
    assert grids == ["step 0", "step 20", "step 40"], grids
    assert _text(browser, "#prompts").splitlines() == [long_prompt, "a square"]  # in full, in the grids' order
    browser.execute_script("document.querySelectorAll('#gallery figure')[0].click()")
    assert browser.execute_script("return document.querySelector('#latest img').getAttribute('data-sample')") \
        .endswith("step-000000.png")
    assert browser.execute_script("return document.querySelector('.legend .val').hidden")  # no validation here
    chart = browser.find_element("id", "chart")
    ActionChains(browser).move_to_element_with_offset(chart, 0, 0).perform()
    hover = _wait(lambda: _text(browser, "#hover"), what="the hover values")
    assert hover.startswith("step ") and "loss " in hover and "smoothed " in hover, hover
    _click(browser, "#smooth")
    ActionChains(browser).move_to_element_with_offset(chart, 5, 0).perform()
    assert "smoothed" not in _wait(lambda: _text(browser, "#hover"), what="the hover values")
    # zoom: a drag across the chart shows those steps, a double-click all of them again
    ActionChains(browser).move_to_element_with_offset(chart, -300, 0).click_and_hold().move_by_offset(300, 0) \
        .release().perform()
    zoomed = _wait(lambda: "double-click: all" in _points(browser) and _points(browser), what="the zoom")
    assert int(zoomed.split()[0]) < 40, zoomed
    ActionChains(browser).double_click(chart).perform()
    _wait(lambda: _points(browser) == "40 steps", what="the whole run again")
    phases = _text(browser, "#phases")
    assert "final checkpoint (step 40)" in phases and "so far" not in phases
    assert "checkpoint (last: step 40) × 20" in phases and "samples (last: step 40) × 3" in phases, phases  # folded
    actions = _text(browser, "#run-actions")
    assert "download the LoRA" in actions and f"lorakit push {root / 'done'} YOU/done" in actions, actions
    _click(browser, "#smooth")
    browser.execute_script("window.scrollTo(0, 0)")
    _shot(browser, "run-page")


def test_a_run_is_started_from_the_new_run_form_with_a_relative_dataset_path(server, browser, tiny, tmp_path):
    """The new-run form: a family picked from the registry (its description shown), a dataset picked from the
    listed ones (its first images and its problems as this family at this resolution would cache it), a preset,
    the dry run's answer (profile and why, the memory estimate) before queueing; then the dataset given as a path
    relative to the runs folder, queued, and the run in the runs list."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from lorakit.data.demo import make_demo_dataset

    root, url = server
    data = make_demo_dataset(tmp_path / "sets" / "shapes", "flat", count=3, size=64)
    browser.get(url + "/#/jobs")
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, '#q-family option[value="flux"]'), what="the families")
    Select(browser.find_element(By.ID, "q-family")).select_by_value("flux")
    assert "FLUX.1" in _text(browser, "#q-about")
    browser.find_element(By.ID, "q-model").send_keys(str(tiny("flux")))
    assert str(data.resolve()) in browser.execute_script(
        "return [...document.querySelectorAll('#q-datasets option')].map(o => o.value)")
    box = browser.find_element(By.ID, "q-data")
    box.send_keys(str(data.resolve()))
    browser.find_element(By.ID, "q-res").send_keys("64")  # a change event: the preview follows
    browser.find_element(By.CSS_SELECTOR, "#job-form-details summary").click()
    for key, value in {"data.bucket_min_side": "32", "data.bucket_max_side": "128"}.items():
        browser.find_element(By.CSS_SELECTOR, f'#schema-fields [data-key="{key}"]').send_keys(value)
    Select(browser.find_element(By.CSS_SELECTOR, '#schema-fields [data-key="sampling.enabled"]')) \
        .select_by_visible_text("false")
    browser.find_element(By.ID, "q-out").click()  # leaves the last field: its change event
    summary = _wait(lambda: "items train" in _text(browser, "#q-check") and _text(browser, "#q-check"),
                    what="the dataset preview")
    assert summary.startswith("3 items train, 0 problems") and "bucket_min_side 32" in summary, summary
    assert _wait(lambda: browser.execute_script(
        "return [...document.querySelectorAll('#q-thumbs img')].filter(i => i.complete && i.naturalWidth).length"),
        what="the thumbnails") == 3
    Select(browser.find_element(By.ID, "q-preset")).select_by_index(1)  # a first try: 100 steps, rank 16
    assert browser.find_element(By.ID, "q-steps").get_attribute("value") == "100"
    box.clear()
    box.send_keys("../sets/shapes")  # relative: to the runs folder
    browser.find_element(By.ID, "q-out").send_keys("from-quick-form")
    browser.find_element(By.ID, "q-check-btn").click()
    estimate = _wait(lambda: "profile" in _text(browser, "#q-estimate") and _text(browser, "#q-estimate"), 120,
                     "the dry run's answer")
    assert "profile cpu" in estimate and "device cpu" in estimate and "the profile's settings: memory" in estimate, \
        estimate
    browser.find_element(By.CSS_SELECTOR, "#job-form-details summary").click()  # the advanced settings folded
    browser.execute_script("window.scrollTo(0, 0)")
    _shot(browser, "new-run-form")
    browser.find_element(By.ID, "q-queue").click()
    _wait(lambda: "running" in _text(browser, 'tr[data-job="1"]') or "finished" in _text(browser, 'tr[data-job="1"]'),
          120, "the job from the new-run form")
    assert browser.find_elements(By.CSS_SELECTOR, 'tr[data-job="1"] a[href="#/run/from-quick-form"]')  # its page
    browser.get(url + "/")
    row = _wait(lambda: _text(browser, 'tr[data-run="from-quick-form"]'), 120, "the run in the runs list")
    assert "flux" in row
    cfg = (root / "from-quick-form" / "config.resolved.yaml").read_text()
    assert "shapes" in cfg and "steps: 100" in cfg
