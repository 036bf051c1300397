"""`lorakit ui`: a local web dashboard over the run folders (FastAPI + uvicorn, the optional extra `lorakit[ui]`).

Pages are static files of this package (no CDN: the machine may be offline; the chart is drawn by its own script).
The API reads run folders through `ui.runs`; live updates are server-sent events. Bound to 127.0.0.1 by default;
bound elsewhere, every request needs the token printed at start (header `Authorization: Bearer T`, `?token=T`
once — kept in a cookie — or that cookie). Every file path is confined to the runs folder.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from lorakit.config.schema import Config
from lorakit.errors import InputError
from lorakit.models.registry import family_names
from lorakit.ui import datasets as D
from lorakit.ui import runs as R
from lorakit.ui.jobs import Queue

STATIC = Path(__file__).parent / "static"
MAX_BODY = 64 * 1024  # bytes a request may send (a caption is the largest thing the pages send)
COOKIE = "lorakit_token"
POLL_S = 0.5  # how often the event stream looks at a run folder


def create_app(runs_root, token: str | None = None, datasets_root=None, slots: int = 1):
    """The ASGI app over the run folders under `runs_root` and the dataset folders under `datasets_root` (default:
    the same folder), with its job queue (`slots` runs at once); token None: no token asked (127.0.0.1)."""
    from contextlib import asynccontextmanager

    root = Path(runs_root).resolve()
    droot = Path(datasets_root).resolve() if datasets_root else root
    queue = Queue(root, slots, (droot,))

    @asynccontextmanager
    async def lifespan(app):
        queue.start()
        yield
        queue.close()

    app = FastAPI(title="lorakit", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.queue = queue

    @app.middleware("http")
    async def need_token(request: Request, call_next):
        if token is None:
            return await call_next(request)
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip() \
            or request.query_params.get("token") or request.cookies.get(COOKIE) or ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            return JSONResponse({"error": "this lorakit ui needs the token printed when it started"}, status_code=401)
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        if int(request.headers.get("content-length") or 0) > MAX_BODY:
            return JSONResponse({"error": f"request body over {MAX_BODY} bytes"}, status_code=413)
        return await call_next(request)

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
        p = STATIC / name
        if p.parent != STATIC or not p.is_file():
            raise HTTPException(404, "no such file")
        return FileResponse(p)

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
            seen, samples, state = max(since, 0), None, None
            while not await request.is_disconnected():
                rows = R.read_metrics(run, seen)
                if rows:
                    seen += len(rows)
                    yield f"event: metrics\ndata: {json.dumps({'next': seen, 'rows': rows})}\n\n"
                now = sorted(p.name for p in (run / "samples").glob("*.png")) if (run / "samples").is_dir() else []
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

    def dataset_of(name: str) -> Path:
        return found(D.dataset_folder, droot, name)

    @app.get("/api/datasets")
    def dataset_list():
        return {"root": str(droot), "datasets": D.find_datasets(droot)}

    @app.get("/api/dataset/{name:path}")
    def dataset_detail(name: str, family: str | None = None):
        folder = dataset_of(name)
        family = family or family_names()[0]  # the registry's first family until the page picks one
        if family not in family_names():
            raise HTTPException(400, f"unknown family {family!r}")
        return {"name": name, "items": D.items(folder, name), "check": D.check(folder, family), "family": family,
                "families": family_names()}

    @app.put("/api/caption/{name:path}")
    async def caption(name: str, request: Request):
        folder = dataset_of(name)
        body = await request.body()
        if len(body) > MAX_BODY:
            raise HTTPException(413, f"request body over {MAX_BODY} bytes")
        try:
            got = json.loads(body)
            stem, text = got["stem"], got["text"]
            if not (isinstance(stem, str) and isinstance(text, str)):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise HTTPException(400, 'send {"stem": "...", "text": "..."}') from None
        try:
            path = D.set_caption(folder, stem, text)
        except InputError as e:
            raise HTTPException(400, e.message) from None
        return {"written": str(path.relative_to(droot)), "chars": len(text)}

    def job_call(fn, *args):
        try:
            return fn(*args)
        except InputError as e:
            return JSONResponse({"error": e.message, "hint": e.hint,
                                 "problems": (getattr(e, "details", None) or {}).get("problems", [e.message])},
                                status_code=400)

    @app.get("/api/jobs")
    def job_list():
        return {"jobs": queue.jobs(), "slots": queue.slots}

    @app.get("/api/schema")
    def schema():
        """The typed config's JSON schema: the job form is generated from it."""
        return Config.model_json_schema()

    @app.post("/api/jobs")
    async def job_submit(request: Request):
        try:
            got = json.loads(await request.body())
            if isinstance(got.get("form"), dict):  # the generated form: its values become a config file
                got["config"] = str(_form_config(root, got["form"]))
            config, sets, resume = got["config"], got.get("sets") or [], bool(got.get("resume", False))
            if not isinstance(config, str) or not all(isinstance(x, str) for x in sets):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise HTTPException(400, 'send {"config": "path/in/the/runs/folder.yaml", "sets": ["key=value"]} or '
                                     '{"form": {section: {field: value}}}') from None
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
            p = R.confined(folder, rel)
        except InputError as e:
            raise HTTPException(403, e.message) from None
        if not p.is_file():
            raise HTTPException(404, "no such file")
        return FileResponse(p, filename=p.name if p.suffix in (".safetensors", ".pt", ".jsonl", ".yaml") else None)

    @app.get("/dfiles/{rel:path}")
    def dataset_files(rel: str):
        return file_in(droot, rel)

    @app.get("/files/{rel:path}")
    def files(rel: str):
        return file_in(root, rel)

    return app


FORMS = ".lorakit-ui-configs"  # configs written from the job form, inside the runs folder


def _form_config(root: Path, form: dict) -> Path:
    """The form's values (only those the user set) as a YAML config file in the runs folder; checked like any
    config when the job is submitted."""
    import yaml

    folder = root / FORMS
    folder.mkdir(exist_ok=True)
    path = folder / f"form-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}.yaml"
    path.write_text(yaml.safe_dump(form, sort_keys=False), encoding="utf-8")
    return path


def serve(runs_root, host: str = "127.0.0.1", port: int = 7860, token: str | None = None, datasets_root=None,
          slots: int = 1) -> None:
    """Serve until interrupted."""
    import uvicorn

    uvicorn.run(create_app(runs_root, token, datasets_root, slots), host=host, port=port, log_level="warning")
