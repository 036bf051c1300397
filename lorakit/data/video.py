"""Clips: probing, frame sampling and decoding.

A clip is a video file (decoded by PyAV, FFmpeg inside), an animated GIF/WebP (Pillow: FFmpeg's WebP decoder
reads no animation) or a folder of frames. `probe` reads a clip's frame times without decoding it (the
container's packet timestamps) and decodes its first frame (size, and that it decodes at all).

Sampling (`Sampling`, from the `data.frames / fps / start / windows` config keys): a window of n frames at a
target rate takes, for each wanted time start + k / fps, the frame nearest in time; a window is valid when
every wanted time has its own frame within half a target interval (else the source has a gap there — a
variable frame rate — or a rate below the target, and a frame would repeat). Windows are spread evenly from
`start` to the last start that fits. Frame folders carry no timestamps: their frames are read at `fps` frames
per second (24 when `fps` is unset), i.e. consecutively.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.data.images import IMAGE_EXTS, open_image
from lorakit.errors import InputError

ANIMATED_EXTS = (".gif", ".webp")  # decoded with Pillow
CONTAINER_EXTS = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v")  # decoded with PyAV
CLIP_EXTS = CONTAINER_EXTS + ANIMATED_EXTS
FOLDER_FPS = 24.0  # the rate of a frame folder when `fps` is unset (its frames are then read one by one)


class ClipError(InputError):
    """A clip that cannot be read (the message names the file and why)."""


@dataclass
class ClipInfo:
    times: list[float]  # presentation time of every frame, seconds from the first, ascending
    size: tuple[int, int]  # (width, height) as displayed (rotation applied)
    timed: bool = True  # False: a frame folder (times are index / fps)

    @property
    def frames(self) -> int:
        return len(self.times)

    @property
    def fps(self) -> float:
        """The nominal rate: one over the median frame interval."""
        if len(self.times) < 2:
            return 0.0
        gaps = sorted(b - a for a, b in zip(self.times, self.times[1:], strict=False))
        mid = gaps[len(gaps) // 2]
        return 1.0 / mid if mid > 0 else 0.0

    @property
    def duration(self) -> float:
        return self.times[-1] if self.times else 0.0


@dataclass(frozen=True)
class Sampling:
    frames: tuple[int, ...] = (17,)  # frame counts a clip is cut to (each gives its own windows)
    fps: float | None = None  # target rate (None: the clip's own)
    start: float = 0.0  # seconds skipped at the start of every clip
    windows: int = 1  # windows per clip and frame count, spread evenly over the clip

    def to_dict(self) -> dict:
        return {"frames": list(self.frames), "fps": self.fps, "start": self.start, "windows": self.windows}


@dataclass(frozen=True)
class Window:
    start: float  # seconds from the clip's first frame
    indices: tuple[int, ...]  # frames taken, in presentation order

    @property
    def frames(self) -> int:
        return len(self.indices)


@dataclass
class Plan:
    windows: list[Window] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (code, message)


def clip_kind(path: Path) -> str:
    if path.is_dir():
        return "folder"
    return "animated" if path.suffix.lower() in ANIMATED_EXTS else "container"


# ---- probing ----

def probe(path, folder_fps: float | None = None) -> ClipInfo:
    """Frame times and displayed size of a clip. Raises ClipError with the reason when it cannot be read."""
    path = Path(path)
    kind = clip_kind(path)
    if kind == "folder":
        return _probe_folder(path, folder_fps)
    if kind == "animated":
        return _probe_animated(path)
    return _probe_container(path)


def _probe_folder(path: Path, fps: float | None) -> ClipInfo:
    files = frame_files(path)
    if not files:
        raise ClipError(f"{path}: the frame folder holds no images", f"frames are {', '.join(IMAGE_EXTS)} files")
    rate = fps or FOLDER_FPS
    return ClipInfo([i / rate for i in range(len(files))], open_image(files[0]).size, timed=False)


def frame_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")
                  and p.suffix.lower() in IMAGE_EXTS)


def _probe_animated(path: Path) -> ClipInfo:
    from PIL import Image

    try:
        with Image.open(path) as im:
            n = getattr(im, "n_frames", 1)
            times, t = [], 0.0
            for i in range(n):
                im.seek(i)
                im.load()  # WebP sets a frame's duration when it is loaded
                times.append(t)
                t += _frame_ms(im.info.get("duration")) / 1000.0
            size = im.size
    except Exception as e:  # noqa: BLE001 - any decoder failure is this file's problem
        raise ClipError(f"{path}: cannot decode ({type(e).__name__}: {str(e)[:80]})") from None
    return ClipInfo(times, size)


def _frame_ms(duration) -> float:
    """An animation frame's duration; 0 or missing is shown for 100 ms by browsers (and taken so here)."""
    try:
        d = float(duration or 0)
    except (TypeError, ValueError):
        d = 0.0
    return d if d > 10 else 100.0


def _open_container(path: Path):
    import av

    try:
        c = av.open(str(path))
    except Exception as e:  # noqa: BLE001 - av raises its own error types per FFmpeg error code
        raise ClipError(f"{path}: cannot open as a video ({_why(e)})") from None
    if not c.streams.video:
        c.close()
        raise ClipError(f"{path}: holds no video stream")
    return c


def _probe_container(path: Path) -> ClipInfo:
    c = _open_container(path)
    try:
        s = c.streams.video[0]
        tb = float(s.time_base) if s.time_base else 0.0
        pts = sorted(p.pts for p in c.demux(s) if p.pts is not None and p.size)
    except Exception as e:  # noqa: BLE001
        raise ClipError(f"{path}: cannot read its packets ({_why(e)})") from None
    finally:
        c.close()
    first = _decode(path, None, limit=1)
    if not first:
        raise ClipError(f"{path}: no frame decodes")
    if pts and tb:
        times = [(p - pts[0]) * tb for p in pts]
    else:  # no timestamps in the container: frames at the stream's rate (decoded to count them)
        n = len(_decode(path, None, keep=False))
        rate = _rate(path) or FOLDER_FPS
        times = [i / rate for i in range(n)]
    return ClipInfo(times, first[0].size)


def _rate(path: Path) -> float:
    c = _open_container(path)
    try:
        s = c.streams.video[0]
        r = s.average_rate or s.guessed_rate or s.base_rate
        return float(r) if r else 0.0
    finally:
        c.close()


# ---- sampling ----

def plan(info: ClipInfo, s: Sampling) -> Plan:
    """The windows of a clip for these settings, and a (code, message) for each window or count it cannot give."""
    out = Plan()
    times = info.times if info.timed else [i / (s.fps or FOLDER_FPS) for i in range(info.frames)]
    if len(times) < 2:
        out.problems.append(("too-short", f"{len(times)} frame: a still image, not a clip"))
        return out
    rate = s.fps or info.fps
    if rate <= 0:
        out.problems.append(("unreadable", "its frame times do not advance (no frame rate)"))
        return out
    if info.timed and s.fps and s.fps > info.fps * 1.01:
        out.problems.append(("low-frame-rate", f"runs at {info.fps:.3g} fps, below the target {s.fps:g} fps: "
                                               "frames would repeat (lower data.fps or leave it unset)"))
        return out
    step = 1.0 / rate
    tol = step * 1e-3
    fitted = []
    for n in sorted(set(s.frames)):
        length = (n - 1) * step
        last = times[-1] - length
        if last < s.start - tol:
            continue
        fitted.append(n)
        starts = [s.start] if s.windows == 1 or last <= s.start + tol else \
            [s.start + (last - s.start) * k / (s.windows - 1) for k in range(s.windows)]
        for t0 in dict.fromkeys(_snap(times, t, tol) for t in starts):  # windows start on a frame
            idx, bad = _window(times, t0, n, step, tol)
            if bad:
                out.problems.append(("variable-frame-rate", f"window at {t0:.2f} s ({n} frames at {rate:g} fps) left out: {bad}"))
            else:
                out.windows.append(Window(round(t0, 6), idx))
    if not fitted:
        n = min(s.frames)
        have = times[-1] - s.start
        out.problems.append(("too-short", f"{info.frames} frames, {max(have, 0):.2f} s after the start offset "
                                          f"{s.start:g} s: shorter than one window of {n} frames "
                                          f"({(n - 1) * step:.2f} s at {rate:g} fps)"))
    return out


def _snap(times: list[float], t: float, tol: float) -> float:
    """The time of the frame nearest t (the earlier one on a tie)."""
    j = bisect.bisect_left(times, t)
    cands = [c for c in (j - 1, j) if 0 <= c < len(times)]
    best = min(cands, key=lambda c: abs(times[c] - t))
    if len(cands) == 2 and abs(abs(times[cands[0]] - t) - abs(times[cands[1]] - t)) <= tol:
        best = cands[0]
    return times[best]


def _window(times: list[float], t0: float, n: int, step: float, tol: float) -> tuple[tuple[int, ...], str]:
    idx = []
    for k in range(n):
        t = t0 + k * step
        j = bisect.bisect_left(times, t)
        j = min((c for c in (j - 1, j) if 0 <= c < len(times)), key=lambda c: abs(times[c] - t))
        if abs(times[j] - t) > step / 2 + tol or (idx and j == idx[-1]):
            lo = max(bisect.bisect_right(times, t) - 1, 0)
            hi = min(lo + 1, len(times) - 1)
            return (), (f"no frame near {t:.3f} s (frames {lo} and {hi} are {times[hi] - times[lo]:.3f} s apart: "
                        "a variable frame rate)")
        idx.append(j)
    return tuple(idx), ""


# ---- decoding ----

def read_window(path, window: Window):
    """The window's frames as 8-bit RGB PIL images, in order. Raises ClipError if a frame does not decode."""
    path = Path(path)
    kind = clip_kind(path)
    wanted = sorted(set(window.indices))
    if kind == "folder":
        files = frame_files(path)
        got = {i: open_image(files[i]) for i in wanted}
    elif kind == "animated":
        got = _read_animated(path, wanted)
    else:
        got = _read_container(path, wanted)
    missing = [i for i in wanted if i not in got]
    if missing:
        raise ClipError(f"{path}: frame {missing[0]} does not decode (the file ends or is damaged there)")
    return [got[i] for i in window.indices]


def _read_animated(path: Path, wanted: list[int]) -> dict:
    from PIL import Image

    out = {}
    try:
        with Image.open(path) as im:
            for i in range(wanted[-1] + 1):  # sequential: frames may draw over their predecessors
                im.seek(i)
                if i in wanted:
                    out[i] = _rgb(im.convert("RGBA"))
    except EOFError:
        pass
    except Exception as e:  # noqa: BLE001
        raise ClipError(f"{path}: cannot decode ({type(e).__name__}: {str(e)[:80]})") from None
    return out


def _rgb(im):
    from PIL import Image

    bg = Image.new("RGB", im.size, (255, 255, 255))
    bg.paste(im, mask=im.getchannel("A"))
    return bg


def _read_container(path: Path, wanted: list[int]) -> dict:
    return dict(_decode(path, set(wanted), limit=wanted[-1] + 1))


def _decode(path: Path, wanted: set | None, limit: int | None = None, keep: bool = True):
    """Decode frames in presentation order. wanted=None: the first `limit` frames as PIL images (or, keep=False,
    only counted); else [(index, image)] for the wanted indices below `limit`."""
    c = _open_container(path)
    out = []
    try:
        s = c.streams.video[0]
        s.thread_type = "AUTO"
        for i, frame in enumerate(c.decode(s)):
            if limit is not None and i >= limit:
                break
            if wanted is None:
                out.append(_display(frame) if keep else None)
            elif i in wanted:
                out.append((i, _display(frame)))
    except Exception as e:  # noqa: BLE001
        if not out:
            raise ClipError(f"{path}: cannot decode ({_why(e)})") from None
    finally:
        c.close()
    return out


def _why(e: Exception) -> str:
    """FFmpeg's own words for an error (PyAV's message repeats the errno and the file name)."""
    return getattr(e, "strerror", None) or f"{type(e).__name__}: {str(e)[:80]}"


def _display(frame):
    """A decoded frame as shown by players: RGB, turned by the stream's display rotation."""
    im = frame.to_image()
    rot = getattr(frame, "rotation", 0) or 0
    return im.rotate(rot, expand=True) if rot % 360 else im


def gif_frame(im):
    """A frame in a GIF's 256 colours: a median cut of a copy a quarter the size (each side), every pixel then mapped
    to it. Pillow's own conversion cuts all the pixels: 121 frames of 1024x576 took 37.5 s on a 2-core host, this
    6.0 s (31.7 dB from the frames against 32.3; the H100 host spent 48 s on such a clip's .mp4 and GIF)."""
    from PIL import Image

    rgb = im.convert("RGB")
    small = rgb.reduce(4) if min(rgb.size) >= 64 else rgb
    return rgb.quantize(palette=small.quantize(256, method=Image.Quantize.MEDIANCUT), dither=Image.Dither.NONE)


def write_clip(path, frames, fps: float = 24.0, codec: str | None = None, metadata: dict | None = None,
               ext: str | None = None) -> Path:
    """Write PIL frames as a video file (infer, tests, the demo): H.264 in .mp4/.mov/.mkv, VP9 in .webm, GIF/WebP
    animations through Pillow. `metadata`: container tags (e.g. {"comment": ...}); `ext`: the kind of file, when
    the path's own suffix does not say it (a temporary name)."""
    import av

    path = Path(path)
    ext = (ext or path.suffix).lower()
    if ext in ANIMATED_EXTS:
        if ext == ".gif":
            frames = [gif_frame(im) for im in frames]
        frames[0].save(path, format=ext[1:].upper(), save_all=True, append_images=list(frames[1:]),
                       duration=round(1000 / fps), loop=0,
                       **({"lossless": True} if ext == ".webp" else {}))
        return path
    codec = codec or ("libvpx-vp9" if ext == ".webm" else "libx264")
    from fractions import Fraction

    with av.open(str(path), "w", format={".mp4": "mp4", ".m4v": "mp4", ".mov": "mov", ".mkv": "matroska",
                                          ".webm": "webm", ".avi": "avi"}.get(ext)) as c:
        c.metadata.update(metadata or {})
        s = c.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        s.width, s.height = frames[0].size
        s.pix_fmt = "yuv420p"
        if codec == "libx264":
            s.options = {"crf": "1", "preset": "veryfast"}
        for im in frames:
            for packet in s.encode(av.VideoFrame.from_image(im.convert("RGB"))):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return path
