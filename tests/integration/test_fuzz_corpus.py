"""A corpus of bad files through every entry point: malformed safetensors (named defects and random mutations of
real files), odd images (every Pillow mode, bit depths, EXIF orientations, truncations), configs with every error
class. Each gives exit 1 or 2, one error line naming the file, no traceback, and writes nothing."""

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.errors import InputError, LorakitError
from tests.loras import trained_like

runner = CliRunner()
N_MUTATIONS = 2400


def raw(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def e(dtype="F32", shape=(2,), offs=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offs)}


NAMED = {  # every defect class seen in the issue, plus their neighbours
    "empty": b"",
    "too-short": b"\x01\x02",
    "header-past-end": raw({"a": e()}, b"\0" * 8, length=10_000),
    "huge-header-length": raw({}, length=2**62),
    "header-over-the-limit": raw({}, length=100_000_001),
    "not-json": raw(b"{not json", b""),
    "not-utf8": raw(b"\xff\xfe\x00", b""),
    "list-not-object": raw(b"[1,2]", b""),
    "unknown-dtype": raw({"a": e(dtype="F12")}, b"\0" * 8),
    "dtype-list": raw({"a": e(dtype=["F32"])}, b"\0" * 8),
    "negative-dim": raw({"a": e(shape=(-2,))}, b"\0" * 8),
    "overflowing-shape": raw({"a": e(shape=(2**61, 2**61, 0), offs=(0, 0))}),
    "offsets-out-of-range": raw({"a": e(offs=(0, 800))}, b"\0" * 8),
    "reversed-offsets": raw({"a": e(offs=(8, 0))}, b"\0" * 8),
    "overlap": raw({"a": e(offs=(0, 8)), "b": e(offs=(4, 12))}, b"\0" * 12),
    "gap": raw({"a": e(offs=(8, 16))}, b"\0" * 16),
    "size-mismatch": raw({"a": e(shape=(3,))}, b"\0" * 8),
    "truncated-data": raw({"a": e(shape=(4,), offs=(0, 16))}, b"\0" * 8),
    "duplicate-tensor": raw(b'{"a":' + json.dumps(e()).encode() + b',"a":' + json.dumps(e()).encode() + b"}",
                            b"\0" * 8),
    "duplicate-metadata": raw(b'{"__metadata__":{"k":"1"},"__metadata__":{"k":"2"}}'),
    "metadata-not-strings": raw({"__metadata__": {"k": 1}}),
    "entry-not-object": raw({"a": 5}),
    "deep-nesting": raw(b"[" * 30_000 + b"]" * 30_000),
}


def _valid_lora(tiny, tmp_path) -> bytes:
    return trained_like(tiny, "flux", tmp_path / "valid.safetensors", targets="attention").read_bytes()


def _mutate(blob: bytes, rng: random.Random) -> bytes:
    b = bytearray(blob)
    n = struct.unpack("<Q", b[:8])[0]
    kind = rng.choice(["flip", "header", "length", "truncate", "extend", "splice"])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == "header":
        text = b[8:8 + n].decode("utf-8", "replace")
        for _ in range(rng.randint(1, 3)):
            old = rng.choice(["0", "1", "2", "4", "8", "16", "F32", "BF16", "data_offsets", "shape", "dtype", ",",
                              "]", "[", ":", '"'])
            new = rng.choice(["", "0", "-1", "99999999999", "1e9", "F8_E4M3", "null", "[]", "{}", '"x"', "[[",
                              "2305843009213693952", '"__metadata__"'])
            i = text.find(old, rng.randrange(max(len(text), 1)))
            if i >= 0:
                text = text[:i] + new + text[i + len(old):]
        h = text.encode()
        b = bytearray(struct.pack("<Q", len(h)) + h + bytes(b[8 + n:]))
    elif kind == "length":
        b[:8] = struct.pack("<Q", rng.choice([0, 1, 7, n - 1, n + 1, n * 2, 2**63 - 1, rng.randrange(2**64)]))
    elif kind == "truncate":
        b = b[:rng.randrange(len(b))]
    elif kind == "extend":
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        i, j = sorted(rng.randrange(len(b)) for _ in range(2))
        b = b[:i] + b[j:]
    return bytes(b)


def _through_library(path: Path) -> str:
    """Every reader a command calls first. Returns 'refused' (a named InputError) or 'loaded' (consistently)."""
    from lorakit.cache.store import Store
    from lorakit.convert import lora as L
    from lorakit.io import load, read_header

    try:
        header = read_header(path)
    except InputError as err:
        assert str(path) in err.message, err.message
        for fn in (lambda: load(path), lambda: L.read(path)):  # the same refusal at every entry point
            with pytest.raises(InputError) as ei:
                fn()
            assert str(path) in ei.value.message, ei.value.message
        assert not Store(path.parent).has(path.stem)  # a damaged cache entry counts as missing: re-encoded
        return "refused"
    out = load(path)
    assert set(out) == set(header.tensors)
    try:
        L.read(path)
    except InputError as err:  # a valid file that is not a usable LoRA: named too
        assert str(path) in err.message or "LoRA" in err.message, err.message
    return "loaded"


@pytest.mark.slow
def test_malformed_safetensors_corpus(tiny, tmp_path):
    valid = _valid_lora(tiny, tmp_path)
    rng = random.Random(0)
    blobs = dict(NAMED)
    blobs.update({f"mutation-{i:04d}": _mutate(valid, rng) for i in range(N_MUTATIONS)})
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    outcomes = {"refused": 0, "loaded": 0}
    for name, blob in blobs.items():
        p = corpus / f"{name}.safetensors"
        p.write_bytes(blob)
        outcomes[_through_library(p)] += 1
        if name in NAMED:
            assert outcomes["loaded"] == 0, name  # every named defect is refused
    assert sum(outcomes.values()) >= 2000 and outcomes["refused"] > 1500, outcomes
    # the commands, on every named defect and a sample of mutations: exit 2, one line naming the file
    sample = list(NAMED) + [f"mutation-{i:04d}" for i in random.Random(1).sample(range(N_MUTATIONS), 12)]
    for k, name in enumerate(sample):
        p = corpus / f"{name}.safetensors"
        out = tmp_path / f"out{k}"
        for args, written in ((["bench", "load", p, "--target", "cpu", "--repeats", "1"], None),
                              (["convert", "lora", p, out / "o.safetensors"], out / "o.safetensors"),
                              (["convert", "model", p, out / "m.safetensors"], out / "m.safetensors"),
                              (["convert", "merge", tiny("flux"), p, out / "merged"], out / "merged"),
                              (["infer", tiny("flux"), "-p", "x", "--lora", p, "--steps", "1", "--width", "32",
                                "--height", "32", "-o", out / "img"], out / "img")):
            r = runner.invoke(app, [str(a) for a in args])
            if r.exit_code == 0:  # a mutation that is still a valid file of that kind
                assert name.startswith("mutation"), (name, args, r.output)
                continue
            lines = [ln for ln in r.output.splitlines() if ln.strip()]
            assert r.exit_code in (1, 2) and lines[0].startswith("error:"), (name, args, r.output)
            assert sum(ln.startswith("error:") for ln in lines) == 1 and "Traceback" not in r.output
            assert "bug in lorakit" not in r.output, (name, args, r.output)
            assert p.name in r.output or "LoRA" in r.output, (name, args, r.output)
            assert written is None or not written.exists(), (name, args)  # nothing (half-)written


def _odd_images(folder: Path) -> dict[str, str]:
    """name -> what should happen: 'item' (read, 8-bit RGB) or a problem code."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    want = {}

    def save(name, im, code="item", **kw):
        im.save(folder / name, **kw)
        (folder / (Path(name).stem + ".txt")).write_text(f"a picture called {name}")
        want[Path(name).stem] = code

    rgb = Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8))
    for mode in ("1", "L", "P", "RGB", "RGBA", "LA", "PA", "CMYK", "YCbCr", "I", "F", "I;16", "RGBX", "La", "RGBa"):
        im = rgb.convert(mode) if mode not in ("PA", "La", "RGBa", "I;16") else None
        if mode == "I;16":
            im = Image.fromarray(rng.integers(0, 65536, (40, 48), dtype=np.uint16))
        elif mode == "PA":
            im = rgb.convert("P").convert("PA")
        elif mode in ("La", "RGBa"):
            im = rgb.convert("RGBA").convert(mode)
        fmt = "TIFF" if mode in ("I", "F", "I;16", "CMYK", "YCbCr", "La", "RGBa", "PA", "RGBX") else "PNG"
        # F from 8-bit data holds fractional 0..255 values: 0..1 or 0..255? refused rather than guessed
        try:
            save(f"mode-{mode.replace(';', '_')}.{fmt.lower()}", im, "unsupported-pixels" if mode == "F" else "item",
                 format=fmt)
        except (OSError, ValueError, KeyError):  # Pillow cannot write this mode in this format: nothing to test
            (folder / f"mode-{mode.replace(';', '_')}.{fmt.lower()}").unlink(missing_ok=True)
    for orientation in range(1, 9):
        exif = rgb.getexif()
        exif[0x0112] = orientation
        save(f"exif-{orientation}.jpg", rgb, format="JPEG", exif=exif.tobytes())
    save("float-hdr.tiff", Image.fromarray((rng.random((40, 48)) * 40).astype(np.float32)), "unsupported-pixels")
    save("float-unit.tiff", Image.fromarray(rng.random((40, 48)).astype(np.float32)))
    save("int32-wide.tiff", Image.fromarray(rng.integers(-5, 2**20, (40, 48)).astype(np.int32)), "unsupported-pixels")
    frames = [Image.new("RGB", (40, 48), (i * 50, 0, 0)) for i in range(3)]
    save("animated.gif", frames[0], "unsupported-pixels", save_all=True, append_images=frames[1:])
    save("still.webp", rgb, format="WEBP")
    save("bitmap.bmp", rgb, format="BMP")
    good = (folder / "exif-1.jpg").read_bytes()
    for i, cut in enumerate((0, 10, len(good) // 3, len(good) - 5)):
        (folder / f"truncated-{i}.jpg").write_bytes(good[:cut])
        (folder / f"truncated-{i}.txt").write_text("cut off")
        want[f"truncated-{i}"] = "unreadable" if cut < len(good) - 5 else "item-or-unreadable"
    (folder / "text.png").write_text("not an image at all")
    (folder / "text.txt").write_text("a text file named .png")
    want["text"] = "unreadable"
    return want


def test_odd_images_are_read_right_or_named(tmp_path):
    from lorakit.data.dataset import scan
    from lorakit.data.images import open_image

    want = _odd_images(tmp_path / "odd")
    s = scan(tmp_path / "odd", min_side=16)
    items = {i.stem for i in s.items}
    problems = {Path(p.path).stem: p.code for p in s.problems}
    for stem, code in want.items():
        if code == "item":
            assert stem in items, (stem, problems.get(stem))
            im = open_image(next((tmp_path / "odd").glob(f"{stem}.*[!t]")))
            assert im.mode == "RGB" and im.size in ((48, 40), (40, 48))
        elif code == "item-or-unreadable":
            assert stem in items or problems.get(stem) == "unreadable", stem
        else:
            assert problems.get(stem) == code, (stem, problems.get(stem))
    assert len(items) + len(problems) >= len(want)  # nothing dropped silently
    r = runner.invoke(app, ["cache", str(_cfg(tmp_path, tmp_path / "odd")), "--check", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["items"] == len(s.items)


def _cfg(tmp_path, data) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump({"model": {"family": "flux"}, "data": {"dirs": [str(data)], "resolution": 64,
                                                                       "bucket_min_side": 16}}))
    return p


CONFIGS = {  # every class of config error
    "unknown-key": "model: {family: flux}\nlora: {rnk: 4}\n",
    "wrong-type": "model: {family: flux}\nlora: {rank: big}\n",
    "out-of-range": "model: {family: flux}\nlora: {rank: 0}\n",
    "not-multiple-of-16": "model: {family: flux}\ndata: {resolution: 1000}\n",
    "unknown-family": "model: {family: fluxx}\n",
    "missing-family": "lora: {rank: 4}\n",
    "conflict": "model: {family: flux}\nmethod: full\nmemory: {base_quant: fp8}\n",
    "syntax": "model:\n  family flux\n lora: 3\n",
    "duplicate-key": "model: {family: flux}\nmodel: {family: qwen-image}\n",
    "top-level-list": "- model\n- lora\n",
    "tabs": "model:\n\tfamily: flux\n",
    "bad-override": None,
    "unknown-profile": None,
    # the probe of issue #36: hostile YAML and values no setting means
    "billion-laughs": "model: {family: flux}\na0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10)) + "sampling: {prompts: *a9}\n",
    "deep-list": "[" * 10_000 + "]" * 10_000,
    "deep-mapping": "model: " + "{a: " * 2_000 + "1" + "}" * 2_000 + "\n",
    "huge-file": "model: {family: flux}\n" + "# padding\n" * 200_000,
    "infinite-weight": "model: {family: flux}\ndata: {datasets: [{dir: /tmp, weight: .inf}]}\n",
    "nan-lr": "model: {family: flux}\noptim: {lr: .nan}\n",
    "long-prompt": "model: {family: flux}\nsampling: {prompts: [" + "x" * 20_000 + "]}\n",
    "four-controls": "model: {family: qwen-image-edit-plus}\ndata: {control_dirs: [a, b, c, d]}\n",
}


def test_every_config_error_class_is_one_report(tmp_path):
    for name, text in CONFIGS.items():
        p = tmp_path / f"{name}.yaml"
        p.write_text(text if text is not None else "model: {family: flux}\n")
        extra = {"bad-override": ["--set", "lora.rank"], "unknown-profile": ["--profile", "rtx9090"]}.get(name, [])
        r = runner.invoke(app, ["train", str(p), "--dry-run", *extra])
        assert r.exit_code == 2, (name, r.output)
        assert r.output.splitlines()[0].startswith("error:") and "Traceback" not in r.output, (name, r.output)
    for bad in (tmp_path, tmp_path / "missing.yaml", tmp_path / "latin1.yaml"):
        if bad.name == "latin1.yaml":
            bad.write_bytes(b"model: {family: flux} # \xe9\n")
        r = runner.invoke(app, ["train", str(bad), "--dry-run", "--json"])
        d = json.loads(r.output)
        assert r.exit_code == 2 and bad.name in d["message"], (bad, r.output)


def test_json_errors_carry_no_terminal_codes(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text(CONFIGS["unknown-key"])
    r = runner.invoke(app, ["train", str(p), "--dry-run", "--json"])
    assert "\x1b[" not in r.output and json.loads(r.output)["error"] == "ConfigError"
    assert issubclass(InputError, LorakitError) and torch.tensor(1)  # imports used


@pytest.mark.slow
def test_dashboard_requests_of_every_shape_are_answered_4xx_never_500(tmp_path):
    """The dashboard's request corpus: paths with NUL bytes, undecodable bytes, traversal, links and lengths; bodies
    that are not JSON, too deep, too large (with and without Content-Length), with lone surrogates and wrong types;
    foreign Origins and Hosts. Every answer is 2xx (a legitimate request) or 4xx with a JSON reason — never 5xx."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from lorakit.ui.server import create_app

    (tmp_path / "runs").mkdir()
    c = TestClient(create_app(tmp_path / "runs"), base_url="http://127.0.0.1", raise_server_exceptions=False)
    rng = random.Random(7)
    pieces = ["..", "%2e%2e", "%00", "%ED%A0%80", "%FF", "a" * 300, "~", "%2F", "/", "runs", ".lorakit-ui.sqlite",
              "%C0%AF", "\u00e9", "%F0%9F%98%80", "metrics", "samples", "x.png"]
    routes = ["/api/run/", "/api/events/", "/files/", "/dfiles/", "/api/dataset/", "/api/run/{}/metrics?since=",
              "/static/", "/api/jobs/{}/log?x=", "/?token="]
    for _ in range(400):
        route = rng.choice(routes)
        name = "/".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))
        url = route.format(name) + str(rng.choice([0, -1, "x", 10**30])) if "{}" in route else route + name
        r = c.get(url)
        assert r.status_code < 500, (url, r.status_code, r.text[:200])
    bodies = [b"", b"null", b"[]", b"{}", b"1", b'"x"', b"{" * 3000, b'{"config": 1}', b'{"config": "x", "sets": 5}',
              b'{"config": "x", "sets": [1]}', b'{"form": {"a": {"b": {"c": 1}}}}', b'{"form": []}', b"\xff" * 100,
              b'{"stem": null, "text": "x"}', b'{"stem": "a", "text": ["x"]}', json.dumps({"x": "y" * 70000}).encode(),
              b'{"config": "\\ud83d"}', b'{"config": "../../etc/passwd"}', b'{"config": "/etc/passwd"}']
    for body in bodies:
        for url, send in (("/api/jobs", c.post), ("/api/caption/x", c.put), ("/api/jobs/1/resume", c.post),
                          ("/api/jobs/1/stop", c.post), ("/api/jobs/999999999999999999999/stop", c.post)):
            for headers in ({"Content-Type": "application/json"}, {"Content-Type": "text/plain"},
                            {"Content-Type": "application/json", "Origin": "http://evil.example"},
                            {"Content-Type": "application/json", "Host": "evil.example"}):
                r = send(url, content=body, headers=headers)
                assert r.status_code < 500, (url, body[:40], headers, r.status_code, r.text[:200])
                if r.status_code >= 400 and r.status_code != 404 and r.status_code != 405:
                    assert "error" in r.json() or "detail" in r.json(), (url, r.text[:200])
    assert c.get("/api/jobs").json()["jobs"] == []  # nothing was ever queued
