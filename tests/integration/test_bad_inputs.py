"""Bad inputs and machine faults, as a user meets them: exit 2 for bad input, 1 for the machine, one line naming
the file, no traceback, nothing half-written. One test per defect found by trying 38 of them (issue #15)."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.data.demo import make_demo_dataset
from lorakit.plan.resolve import resolve
from tests.loras import trained_like
from tests.runs import interrupt_train

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error(r, *words, code=2):
    """Exit code, a single `error:` line (+ its hint), every word present, no traceback, not called a bug."""
    out = r.output
    assert r.exit_code == code, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert sum(ln.startswith("error:") for ln in lines) == 1, out
    assert "Traceback" not in out and "bug in lorakit" not in out, out
    for w in words:
        assert str(w) in out, (w, out)


def run_cfg(tmp_path, tiny, family="flux", steps=3, **over):
    data = tmp_path / "data"
    if not data.exists():
        make_demo_dataset(data, "flat", count=3, size=64)
    cfg = {"profile": "cpu", "model": {"family": family, "path": str(tiny(family))},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "lora": {"rank": 4}, "schedule": {"steps": steps}, "sampling": {"enabled": False},
           "output": {"dir": str(tmp_path / "out"), "save_every": 1, "keep_last": 5}}
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# 1. malformed safetensors: lorakit's validation runs first at every entry point


def test_bench_load_names_a_malformed_file_instead_of_calling_it_a_bug(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    one_error(cli("bench", "load", bad, "--target", "cpu", "--repeats", "1"), bad, "not UTF-8 JSON")


# 2. high-bit-depth and float images


def test_16_bit_and_float_images_are_scaled_not_clipped_or_refused(tmp_path):
    from lorakit.data.images import PixelError, open_image

    ramp = np.linspace(0, 65535, 256, dtype=np.float64).reshape(16, 16)
    Image.fromarray(ramp.astype(np.uint16)).save(tmp_path / "g16.png")  # mode I;16
    got = np.asarray(open_image(tmp_path / "g16.png"))[..., 0].astype(float)
    assert np.abs(got - ramp / 257).max() <= 0.5 and (got == 255).mean() < 0.01  # was: 99% clipped to 255
    Image.fromarray((ramp / 65535).astype(np.float32)).save(tmp_path / "f01.tif")  # mode F in 0..1
    assert np.abs(np.asarray(open_image(tmp_path / "f01.tif"))[..., 0] - ramp / 257).max() <= 0.51
    Image.fromarray((ramp * 4).astype(np.float32)).save(tmp_path / "hdr.tif")
    with pytest.raises(PixelError, match="scale cannot be known"):
        open_image(tmp_path / "hdr.tif")
    Image.fromarray((ramp * 1000).astype(np.int32)).save(tmp_path / "i32.tif")
    with pytest.raises(PixelError, match="32-bit integer"):
        open_image(tmp_path / "i32.tif")


# 3. ordinary faults are named, not called bugs


@pytest.mark.slow
def test_damaged_state_pt_is_named(tmp_path, tiny):
    path = run_cfg(tmp_path, tiny, steps=2)
    assert cli("train", path, "--json").exit_code == 0
    ck = tmp_path / "out" / "checkpoints" / "step-000002"
    (ck / "state.pt").write_bytes((ck / "state.pt").read_bytes()[:200])
    one_error(cli("train", path, "--resume", ck), ck / "state.pt", "damaged checkpoint state")


def test_non_utf8_config_and_hostile_headers(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("model: {family: flux}\n# caf\xe9\n".encode("latin-1"))
    one_error(cli("train", p, "--dry-run"), "latin1.yaml", "not UTF-8")
    import struct

    for name, header in (("dtype-list", {"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}),
                         ("overflow", {"a": {"dtype": "F32", "shape": [2**61, 2**61, 0], "data_offsets": [0, 0]}})):
        raw = json.dumps(header).encode()
        f = tmp_path / f"{name}.safetensors"
        f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8 * (name == "dtype-list"))
        one_error(cli("convert", "lora", f, tmp_path / "o.safetensors"), f, "not a valid safetensors file")
    deep = b"[" * 50_000 + b"]" * 50_000
    f = tmp_path / "deep.safetensors"
    f.write_bytes(struct.pack("<Q", len(deep)) + deep)
    one_error(cli("convert", "lora", f, tmp_path / "o.safetensors"), f, "nests too deeply")
    assert not (tmp_path / "o.safetensors").exists()


def _small_disk(tmp_path, kib: int):
    """A real tmpfs of `kib` KiB (root may mount one), else None."""
    mnt = tmp_path / f"disk{kib}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(mnt)], capture_output=True)
    return mnt if r.returncode == 0 else None


def _umount(mnt):
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _cli_process(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "lorakit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


def _one_error_process(p, *words, code=1):
    err = p.stderr
    assert p.returncode == code, (p.returncode, p.stdout[-2000:], err[-3000:])
    assert "Traceback" not in err and "bug in lorakit" not in err, err
    assert sum(ln.startswith("error:") for ln in err.splitlines()) == 1, err
    for w in words:
        assert str(w) in err, (w, err)


@pytest.mark.slow
def test_a_full_disk_during_cache_and_train_is_a_machine_fault_naming_the_file(tmp_path, tiny):
    mnt = _small_disk(tmp_path, 64)
    if mnt is None:  # no mount here: the same failure, simulated where the write happens
        from lorakit.errors import EnvironmentFault
        from lorakit.io import save

        real_open = open

        def full(path, mode="r", *a, **kw):
            if "w" in mode and ".tmp" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_open(path, mode, *a, **kw)

        import builtins

        builtins.open = full
        try:
            with pytest.raises(EnvironmentFault, match="no space left.*x.safetensors"):
                save({"a": torch.ones(4)}, tmp_path / "x.safetensors")
        finally:
            builtins.open = real_open
        return
    try:
        path = run_cfg(tmp_path, tiny, steps=2, output={"dir": str(mnt / "out")})
        p = _cli_process("cache", path)
        _one_error_process(p, "no space left on the device while writing", str(mnt))
        path = run_cfg(tmp_path, tiny, steps=2, output={"dir": str(mnt / "out")},
                       data={"cache_dir": str(tmp_path / "cache")})
        p = _cli_process("train", path)  # the cache fits elsewhere; checkpoints do not
        _one_error_process(p, "no space left on the device while writing", str(mnt))
    finally:
        _umount(mnt)


# 4. TensorBoard's writer thread on a full disk: one warning, no traceback (covered by the test above, and here
# directly: a writer that fails turns TensorBoard off, metrics.jsonl goes on)


def test_a_failing_tensorboard_writer_is_one_warning(tmp_path, monkeypatch):
    from lorakit.train.report import MetricsLog

    seen = []
    log = MetricsLog(tmp_path, None, warn=seen.append)
    if log.tb is None:
        pytest.skip("tensorboard is not installed")

    def broken(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(log.tb, "add_scalar", broken)
    log.write({"step": 1, "loss": 0.5})
    log.write({"step": 2, "loss": 0.4})
    log.close()
    assert len(seen) == 1 and "TensorBoard logging turned off" in seen[0] and log.tb is None
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


# 5. a damaged newest checkpoint: resume from the newest intact one, with a warning naming the damaged one


@pytest.mark.slow
def test_resume_latest_skips_a_damaged_newest_checkpoint(tmp_path, tiny):
    path = run_cfg(tmp_path, tiny, steps=3)
    assert cli("train", path, "--json").exit_code == 0
    cks = tmp_path / "out" / "checkpoints"
    newest = cks / "final" / "state.pt"  # a finished run's newest checkpoint
    whole = newest.read_bytes()
    newest.write_bytes(whole[: len(whole) // 3])
    r = cli("train", path, "--resume", "latest", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["steps"] == 3 and res["resumed"] and any("final" in w and "damaged" in w for w in res["warnings"])
    newest.write_bytes(whole[: len(whole) // 3])  # (the run above wrote final again)
    r = cli("train", path, "--resume", "latest")  # shown to people as a warning line
    assert "warning:" in r.output and "final" in r.output


# 6. SIGTERM: saved, then a non-zero exit a scheduler understands; a signal after the last step keeps the LoRA


@pytest.mark.slow
def test_sigterm_saves_and_exits_75(tmp_path, tiny):
    path = run_cfg(tmp_path, tiny, steps=100000, output={"save_every": 0})
    p, res = interrupt_train(path, tmp_path / "out", signal.SIGTERM, after_steps=2)
    assert p.returncode == 75, p.stderr
    assert res["interrupted"] and (tmp_path / "out" / "checkpoints" / f"step-{res['steps']:06d}").is_dir()


def test_a_signal_after_the_last_step_still_writes_the_lora(tmp_path, tiny):
    from lorakit.config import assemble
    from lorakit.events import Events
    from lorakit.train.loop import run

    cfg, prov = assemble(run_cfg(tmp_path, tiny, steps=2), [], None)

    class LastStep(Events):
        def step(self, step, total, rec):
            if step == total:
                os.kill(os.getpid(), signal.SIGINT)  # arrives during the last step's bookkeeping

    res = run(resolve(cfg), events=LastStep())
    assert not res["interrupted"] and Path(res["lora"]).is_file()


# 7. temporary files a kill -9 left behind are removed by the next run


def test_orphan_temporary_files_are_cleaned_by_the_next_run(tmp_path, tiny):
    path = run_cfg(tmp_path, tiny, steps=1)
    out = tmp_path / "out"
    for name in (".lora.safetensors.abc123.tmp", "checkpoints/step-000001/.state.pt.x9y8.tmp",
                 "cache/.manifest.json.k2j3.tmp", "cache/items/.0123abcd.safetensors.q1w2.tmp"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(b"half-written")
    r = cli("train", path, "--json")
    assert r.exit_code == 0, r.output
    assert not list(out.rglob("*.tmp"))
    assert any("temporary file" in w for w in json.loads(r.output)["warnings"])


# 8. a FIFO is refused, not read forever


def test_a_fifo_is_refused_everywhere(tmp_path):
    fifo = tmp_path / "x.safetensors"
    os.mkfifo(fifo)
    for args in (("convert", "lora", fifo, tmp_path / "o.safetensors"), ("bench", "load", fifo, "--target", "cpu"),
                 ("convert", "model", fifo, tmp_path / "m.safetensors")):
        one_error(cli(*args), fifo, "not a regular file")
    pt = tmp_path / "cache"
    pt.mkdir()
    os.mkfifo(pt / "a.pt")
    one_error(cli("convert", "cache", pt), pt / "a.pt", "not a regular file")


# 9. duplicates are refused, never last-one-wins


def test_duplicate_names_are_refused(tmp_path):
    import struct

    from lorakit.io.header import MAX_HEADER

    assert MAX_HEADER == 100_000_000  # the safetensors reference implementation's limit
    e = '{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
    for name, text in (("tensor", f'{{"a":{e},"a":{e}}}'),
                       ("metadata", f'{{"__metadata__":{{"x":"1"}},"__metadata__":{{"x":"2"}},"a":{e}}}')):
        f = tmp_path / f"{name}.safetensors"
        f.write_bytes(struct.pack("<Q", len(text)) + text.encode() + b"\0" * 8)
        one_error(cli("convert", "lora", f, tmp_path / "o.safetensors"), f, "twice")
    p = tmp_path / "dup.yaml"
    p.write_text("model:\n  family: flux\nlora:\n  rank: 8\n  rank: 32\n")
    one_error(cli("train", p, "--dry-run"), "dup.yaml", "duplicate key 'rank'", "line 5")


# 10. a LoRA of NaNs is refused, not turned into black pictures


def test_non_finite_lora_is_refused(tmp_path, tiny):
    from lorakit.io import load, save

    src = trained_like(tiny, "flux", tmp_path / "l.safetensors", targets="attention")
    sd = load(src, copy=True)
    k = next(k for k in sd if "lora_B" in k)
    sd[k][0, 0] = float("nan")
    save(sd, tmp_path / "nan.safetensors", metadata={"format": "pt"})
    one_error(cli("convert", "lora", tmp_path / "nan.safetensors", tmp_path / "o.safetensors"), "nan.safetensors",
              "NaN or infinite")
    one_error(cli("infer", tiny("flux"), "-p", "x", "--lora", tmp_path / "nan.safetensors", "-o", tmp_path / "i"),
              "NaN or infinite")
    assert not (tmp_path / "o.safetensors").exists() and not (tmp_path / "i").exists()


# 11. every file in a dataset is used or reported


def test_files_a_dataset_does_not_use_are_reported(tmp_path):
    from lorakit.data.dataset import scan

    d = make_demo_dataset(tmp_path / "d", "flat", count=2, size=64)
    Image.new("RGB", (64, 64)).save(d / "scan.bmp")
    (d / "scan.TXT").write_text("a bitmap with an upper-case caption extension")
    Image.new("RGB", (64, 64)).save(d / "still.gif")
    (d / "still.txt").write_text("a still gif")
    frames = [Image.new("RGB", (64, 64), (i * 40, 0, 0)) for i in range(3)]
    frames[0].save(d / "anim.gif", save_all=True, append_images=frames[1:])
    (d / "anim.txt").write_text("an animated gif")
    (d / "lonely.txt").write_text("a caption without an image")
    (d / "notes.json").write_text("{}")
    (d / "folder.png").mkdir()
    os.symlink(d / "missing.png", d / "dangling.png")
    (d / ".DS_Store").write_bytes(b"\0")
    s = scan(d, min_side=32)
    got = {(p.code, Path(p.path).name) for p in s.problems}
    assert got == {("orphan-caption", "lonely.txt"), ("unused-file", "notes.json"), ("not-a-file", "folder.png"),
                   ("broken-link", "dangling.png"), ("hidden-files", "d"), ("unsupported-pixels", "anim.gif")}
    assert {"scan", "still"} <= {i.stem for i in s.items}  # .bmp, .gif and a .TXT caption are used


# 12. every path problem at once, in --dry-run too


def test_dry_run_reports_every_path_problem_at_once(tmp_path):
    p = tmp_path / "run.yaml"
    (tmp_path / "a-file").write_text("x")
    p.write_text(yaml.safe_dump({"model": {"family": "flux", "path": str(tmp_path / "no-model")},
                                 "data": {"dirs": [str(tmp_path / "no-data"), str(tmp_path / "a-file")]},
                                 "output": {"dir": str(tmp_path / "a-file")}}))
    r = cli("train", p, "--dry-run", "--json")
    assert r.exit_code == 2
    probs = json.loads(r.output)["problems"]
    assert len(probs) == 4 and sum(x.startswith("data.dirs") for x in probs) == 2
    assert any("model.path: no such folder" in x for x in probs) and any(x.startswith("output.dir") for x in probs)
    r = cli("cache", p, "--json")  # cache checks the model too (it encodes with it)
    assert r.exit_code == 2 and len(json.loads(r.output)["problems"]) == 4


# 13. smaller: a folder as config, a YAML syntax hint, pickle refusals in one clean line


def test_small_messages(tmp_path):
    one_error(cli("train", tmp_path, "--dry-run"), "is a folder, not a config file")
    p = tmp_path / "syntax.yaml"
    p.write_text("model:\n  family flux\n lora: 3\n")
    r = cli("train", p, "--dry-run")
    one_error(r, "line 3", "hint:")
    pt = tmp_path / "legacy"
    pt.mkdir()
    import pathlib

    torch.save({"latents": torch.zeros(1), "x": pathlib.PurePosixPath("pickled")}, pt / "a.pt")
    r = cli("convert", "cache", pt, "--json")
    msg = json.loads(r.output)["message"]
    assert r.exit_code == 2 and "\x1b[" not in msg and "refused" in msg
    assert msg.endswith(")") and len(msg) < 400  # whole words, closed, no terminal colour codes
