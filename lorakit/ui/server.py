"""`lorakit ui`: a local web dashboard over the run folders (FastAPI + uvicorn, the optional extra `lorakit[ui]`).

Pages are static files of this package (no CDN: the machine may be offline; the chart is drawn by its own script).
The API reads run folders through `ui.runs`; live updates are server-sent events. In front of every route stands
`ui.guard` (Host, per-launch token, Origin and body-size checks: a local server is still a server), and every file
the pages read or write goes through `ui.confine` (real paths inside their folder, links included). Malformed
requests are answered 4xx with the reason, never 500.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from lorakit.config.schema import Config
from lorakit.errors import InputError
from lorakit.hardware.profiles import profile_names
from lorakit.models.registry import family_info, family_names
from lorakit.ui import datasets as D
from lorakit.ui import machine as M
from lorakit.ui import runs as R
from lorakit.ui.confine import confined, inside
from lorakit.ui.guard import Guard
from lorakit.ui.jobs import Queue

STATIC = Path(__file__).parent / "static"
MAX_BODY = 64 * 1024  # bytes a request may send (a caption is the largest thing the pages send)
MAX_DEPTH = 16  # nesting a request's JSON may have (the job form's is 3)
POLL_S = 0.5  # how often the event stream looks at a run folder


def json_body(raw: bytes, example: str):
    """A request's JSON: 400 (with `example`) when it is not JSON, nests deeper than MAX_DEPTH, or holds a string
    that is not valid Unicode (a lone surrogate)."""
    try:
        got = json.loads(raw)
    except (ValueError, RecursionError):
        raise HTTPException(400, f"not JSON: send {example}") from None
    stack = [(got, 0)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise HTTPException(400, f"JSON nested deeper than {MAX_DEPTH} levels: send {example}")
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise HTTPException(400, "a string in the request is not valid Unicode (a lone surrogate)") from None
        elif isinstance(x, dict):
            stack += [(k, depth + 1) for k in x] + [(v, depth + 1) for v in x.values()]
        elif isinstance(x, list):
            stack += [(v, depth + 1) for v in x]
    return got


def create_app(runs_root, token: str | None = None, datasets_root=None, slots: int = 1, host: str = "127.0.0.1"):
    """The ASGI app over the run folders under `runs_root` and the dataset folders under `datasets_root`, with its
    job queue (`slots` runs at once), behind `ui.guard.Guard`.

    Args:
        token: the per-launch secret every request must carry (None: none is asked — tests, embedding).
        datasets_root: the folder of dataset folders (default: the runs folder).
        host: the address the server is bound to (which Host headers name this machine).
    """
    from contextlib import asynccontextmanager

    root = Path(runs_root).resolve()
    droot = Path(datasets_root).resolve() if datasets_root else None  # None: the data folders of the runs only
    queue = Queue(root, slots, (droot,) if droot else ())

    @asynccontextmanager
    async def lifespan(app):
        queue.start()
        yield
        queue.close()

    app = FastAPI(title="lorakit", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.queue = queue
    app.add_middleware(Guard, token=token, bound=host, limit=MAX_BODY)

    @app.exception_handler(InputError)
    async def bad_input(request: Request, e: InputError):
        return JSONResponse({"error": e.message, "detail": e.message, "hint": e.hint}, status_code=400)

    @app.exception_handler(HTTPException)
    async def refused(request: Request, e: HTTPException):  # one shape for every refusal: {"error": ...}
        return JSONResponse({"error": e.detail, "detail": e.detail}, status_code=e.status_code)

    def found(get, folder: Path, name: str) -> Path:
        """A run or dataset folder by its name in the lists (404 with the reason when it is not one)."""
        try:
            return get(folder, name)
        except InputError as e:
            raise HTTPException(404, e.message) from None

    def run_of(name: str) -> Path:
        return found(R.run_folder, root, name)

    @app.get("/")
    def index():
        return FileResponse(STATIC / "index.html")

    @app.get("/static/{name}")
    def static(name: str):
        if name not in {p.name for p in STATIC.iterdir()}:  # the package's own files, by name
            raise HTTPException(404, "no such file")
        return FileResponse(STATIC / name)

    @app.get("/api/runs")
    def run_list():
        return {"root": str(root), "runs": [R.summary(r, root) for r in R.find_runs(root)]}

    @app.get("/api/run/{name:path}/metrics")
    def metrics(name: str, since: int = 0):
        rows = R.read_metrics(run_of(name), max(since, 0))
        return {"since": since, "rows": rows}

    @app.get("/api/run/{name:path}")
    def run_detail(name: str):
        return R.detail(run_of(name), root)

    @app.get("/api/events/{name:path}")
    async def events(name: str, request: Request, since: int = 0):
        run = run_of(name)

        async def stream():
            seen, samples, state, told = max(since, 0), None, None, 0
            while not await request.is_disconnected():
                rows = R.read_metrics(run, seen)
                if rows:
                    seen += len(rows)
                    yield f"event: metrics\ndata: {json.dumps({'next': seen, 'rows': rows})}\n\n"
                said = R.read_phases(run, told)  # the run's phases, infos and warnings as they happen
                if said:
                    told += len(said)
                    yield f"event: phases\ndata: {json.dumps({'next': told, 'lines': said})}\n\n"
                now = [p.name for p in R.samples(run)]
                if now != samples:
                    samples = now
                    yield f"event: samples\ndata: {json.dumps([f'{name}/samples/{s}' for s in now])}\n\n"
                st = R.status(run)
                if st != state:
                    state = st
                    yield f"event: status\ndata: {json.dumps(R.summary(run, root))}\n\n"
                await asyncio.sleep(POLL_S)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    def dataset_of(name: str, known: dict | None = None) -> Path:
        """A dataset folder by its name in the list: a data folder of a run (`known`: `D.runs_data`, read here when
        not given), or a folder under --datasets."""
        known = D.runs_data(root) if known is None else known
        if name in known:
            return known[name]["folder"]
        if droot is None or name.startswith(D.OUTSIDE):
            raise HTTPException(404, f"{name}: not a data folder of a run under {root} (name a datasets folder "
                                     "with `lorakit ui --datasets DIR` to browse others)")
        return found(D.dataset_folder, droot, name)

    @app.get("/api/datasets")
    def dataset_list():
        """The folders under --datasets, then the data folders of the runs (each once, with the runs using it)."""
        listed = [{**d, "path": str((droot / d["name"]).resolve())} for d in D.find_datasets(droot)] if droot else []
        by_path = {x["path"]: x for x in listed}
        for name, d in D.runs_data(root).items():
            if str(d["folder"]) in by_path:  # under --datasets too: listed once, with its runs
                by_path[str(d["folder"])]["runs"] = d["runs"]
            else:
                listed.append({"name": name, "path": str(d["folder"]), "items": len(D.media(d["folder"])),
                               "runs": d["runs"]})
        return {"root": str(droot) if droot else None, "datasets": listed}

    @app.get("/api/dataset/{name:path}")
    def dataset_detail(name: str, family: str | None = None, resolution: int | None = None,
                       bucket_min_side: int | None = None, bucket_max_side: int | None = None):
        known = D.runs_data(root)  # read once: the folder, and the run that trains on it
        folder = dataset_of(name, known)
        if family is not None and family not in family_names():
            raise HTTPException(400, f"unknown family {family!r}")
        used = D.run_using(folder, known)  # its family and settings, until the page picks another family
        family = family or (used and (used[1].get("model") or {}).get("family")) or family_names()[0]
        sizes = {"resolution": resolution, "bucket_min_side": bucket_min_side, "bucket_max_side": bucket_max_side}
        return {"name": name, "path": str(folder), "items": D.items(folder, name),
                "check": D.check(folder, family, used, sizes), "family": family, "families": family_names()}

    @app.put("/api/caption/{name:path}")
    async def caption(name: str, request: Request):
        folder = dataset_of(name)
        example = '{"stem": "...", "text": "..."}'
        got = json_body(await request.body(), example)
        try:
            stem, text = got["stem"], got["text"]
            if not (isinstance(stem, str) and isinstance(text, str)):
                raise TypeError
        except (KeyError, TypeError):
            raise HTTPException(400, f"send {example}") from None
        try:
            path = D.set_caption(folder, stem, text)
        except InputError as e:
            raise HTTPException(400, e.message) from None
        return {"written": f"{name}/{path.name}", "chars": len(text)}

    def job_call(fn, *args):
        try:
            return fn(*args)
        except InputError as e:
            return JSONResponse({"error": e.message, "hint": e.hint,
                                 "problems": (getattr(e, "details", None) or {}).get("problems", [e.message])},
                                status_code=400)

    @app.get("/api/machine")
    def machine():
        """Each GPU's memory, utilization, temperature and power, and the job running on it (a job runs on the GPU
        of its slot); the host's load, memory and free disk."""
        got = M.machine(root)
        running = {j["slot"]: j for j in queue.jobs() if j["state"] == "running" and j.get("slot") is not None}
        got["gpus"] = [{**g, "job": {"id": running[g["index"]]["id"], "run": running[g["index"]].get("run")}
                        if g["index"] in running else None} for g in got["gpus"]]
        return got

    @app.get("/api/jobs")
    def job_list():
        return {"jobs": queue.jobs(), "slots": queue.slots}

    @app.get("/api/choices")
    def choices():
        """What the new-run form offers to pick: the families (with what each is), the profiles, the datasets."""
        return {"families": [{"name": f, "description": family_info(f).description} for f in family_names()],
                "profiles": profile_names(), "datasets": dataset_list()["datasets"]}

    @app.post("/api/jobs/check")
    async def job_check(request: Request):
        """The dry run of a form or config, not queued: the profile and why, the memory estimate, notes."""
        config, sets, resume = job_request(json_body(await request.body(), JOB_EXAMPLE))
        return await asyncio.to_thread(job_call, queue.check, config, sets, resume)

    @app.get("/api/schema")
    def schema():
        """The typed config's JSON schema: the job form is generated from it."""
        return Config.model_json_schema()

    def job_request(got: dict) -> tuple[str, list[str], bool]:
        """A job request's config (the form's values written as a config file in the runs folder), sets, resume."""
        try:
            if isinstance(got.get("form"), dict):  # the form: its values become a config file
                got["config"] = str(_form_config(root, got["form"]))
            config, sets, resume = got["config"], got.get("sets") or [], bool(got.get("resume", False))
            if not isinstance(config, str) or not isinstance(sets, list) or not all(isinstance(x, str) for x in sets):
                raise TypeError
        except (KeyError, TypeError, AttributeError):
            raise HTTPException(400, f"send {JOB_EXAMPLE}") from None
        return config, sets, resume

    @app.post("/api/jobs")
    async def job_submit(request: Request):
        config, sets, resume = job_request(json_body(await request.body(), JOB_EXAMPLE))
        return await asyncio.to_thread(job_call, queue.submit, config, sets, resume)

    @app.post("/api/jobs/{job_id}/stop")
    def job_stop(job_id: int):
        return job_call(queue.stop, job_id)

    @app.post("/api/jobs/{job_id}/resume")
    async def job_resume(job_id: int):
        return await asyncio.to_thread(job_call, queue.resume, job_id)

    @app.get("/api/jobs/{job_id}/log")
    def job_log(job_id: int):
        return {"id": job_id, "log": queue.log(job_id)}

    def file_in(folder: Path, rel: str):
        """A file below `folder` (403 outside it, symlinks followed; weights and logs as downloads)."""
        try:
            p = confined(folder, rel)
        except InputError as e:
            raise HTTPException(403, e.message) from None
        if not p.is_file():
            raise HTTPException(404, "no such file")
        return FileResponse(p, filename=p.name if p.suffix in (".safetensors", ".pt", ".jsonl", ".yaml") else None)

    @app.get("/dfiles/{rel:path}")
    def dataset_files(rel: str):
        """An image, clip or caption of a listed dataset folder (nothing else in it is served)."""
        name, _, file = rel.rpartition("/")
        if not name or os.path.splitext(file)[1].lower() not in (*D.MEDIA, ".txt"):
            raise HTTPException(404, "not an image, clip or caption of a dataset")
        return file_in(dataset_of(name), file)

    @app.get("/files/{rel:path}")
    def files(rel: str):
        return file_in(root, rel)

    return app


JOB_EXAMPLE = '{"config": "path/in/the/runs/folder.yaml", "sets": ["key=value"]} or {"form": {section: ' \
              '{field: value}}}'
FORMS = ".lorakit-ui-configs"  # configs written from the job form, inside the runs folder


def _form_config(root: Path, form: dict) -> Path:
    """The form's values (only those the user set) as a YAML config file in the runs folder; checked like any
    config when the job is submitted."""
    import yaml

    folder = inside(root, root / FORMS)  # a link named like it that points out is refused
    folder.mkdir(exist_ok=True)
    path = inside(root, folder / f"form-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}.yaml")
    path.write_text(yaml.safe_dump(form, sort_keys=False), encoding="utf-8")
    return path


def serve(runs_root, host: str = "127.0.0.1", port: int = 7860, token: str | None = None, datasets_root=None,
          slots: int = 1) -> None:
    """Serve until interrupted."""
    import uvicorn

    uvicorn.run(create_app(runs_root, token, datasets_root, slots, host), host=host, port=port, log_level="warning")
