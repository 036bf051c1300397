"""Clips: probing every container kind, frame sampling (rate, start, windows, frame buckets), the reasons a clip
or window is left out, and decoding the frames the windows name."""

from fractions import Fraction

import numpy as np
import pytest
from PIL import Image

from lorakit.data.video import ClipError, ClipInfo, Sampling, Window, plan, probe, read_window, write_clip


def frames(n, size=(48, 32)):
    """n frames whose red channel counts the frame (so a decoded frame tells its index)."""
    return [Image.new("RGB", size, (i * 15, 80, 160)) for i in range(n)]


def index_of(im) -> int:
    return round(np.asarray(im, dtype=float)[..., 0].mean() / 15)


@pytest.mark.parametrize("ext", [".mp4", ".webm", ".mov", ".mkv", ".gif", ".webp"])
def test_every_clip_kind_probes_and_decodes_the_frames_a_window_names(tmp_path, ext):
    path = write_clip(tmp_path / f"a{ext}", frames(10), fps=10)
    info = probe(path)
    assert info.frames == 10 and info.size == (48, 32) and abs(info.fps - 10) < 0.1
    got = read_window(path, Window(0.0, (0, 3, 9)))
    assert [index_of(im) for im in got] == [0, 3, 9]


def test_a_frame_folder_is_a_clip_read_frame_by_frame(tmp_path):
    d = tmp_path / "clip"
    d.mkdir()
    for i, im in enumerate(frames(6)):
        im.save(d / f"{i:03d}.png")
    info = probe(d)
    assert (info.frames, info.timed, info.size) == (6, False, (48, 32))
    p = plan(info, Sampling(frames=(5,), fps=8, windows=2))  # folders: consecutive frames at any fps
    assert [w.indices for w in p.windows] == [(0, 1, 2, 3, 4), (1, 2, 3, 4, 5)] and p.problems == []
    assert [index_of(im) for im in read_window(d, p.windows[1])] == [1, 2, 3, 4, 5]


def test_target_fps_start_windows_and_frame_buckets():
    info = ClipInfo([i / 24 for i in range(48)], (64, 64))  # 2 s at 24 fps
    p = plan(info, Sampling(frames=(5,), fps=12))  # every other frame
    assert [w.indices for w in p.windows] == [(0, 2, 4, 6, 8)]
    p = plan(info, Sampling(frames=(5,), start=1.0))  # skip the first second
    assert p.windows[0].indices == (24, 25, 26, 27, 28)
    p = plan(info, Sampling(frames=(17,), windows=3))  # spread evenly: first, middle, last that fits
    assert [w.indices[0] for w in p.windows] == [0, 15, 31] and p.windows[-1].indices[-1] == 47
    assert p.problems == []
    p = plan(info, Sampling(frames=(5, 33, 49)))  # frame buckets: a 48-frame clip gives 5 and 33, not 49
    assert sorted(w.frames for w in p.windows) == [5, 33] and p.problems == []


def test_short_low_rate_and_variable_rate_clips_are_named_with_the_reason():
    short = plan(ClipInfo([i / 24 for i in range(9)], (64, 64)), Sampling(frames=(17,)))
    assert short.windows == [] and short.problems[0][0] == "too-short"
    assert "9 frames" in short.problems[0][1] and "17 frames" in short.problems[0][1]
    still = plan(ClipInfo([0.0], (64, 64)), Sampling(frames=(1,)))
    assert still.problems[0][0] == "too-short" and "still image" in still.problems[0][1]
    low = plan(ClipInfo([i / 12 for i in range(40)], (64, 64)), Sampling(frames=(5,), fps=24))
    assert low.windows == [] and low.problems[0][0] == "low-frame-rate" and "12 fps" in low.problems[0][1]
    # a pause in a variable-frame-rate clip: the window across it is left out, the others are kept
    times = [i / 24 for i in range(10)] + [(i + 20) / 24 for i in range(30)]
    vfr = plan(ClipInfo(times, (64, 64)), Sampling(frames=(9,), windows=4))
    assert [c for c, _ in vfr.problems] == ["variable-frame-rate"] and len(vfr.windows) == 3
    assert "frames 9 and 10 are 0.458 s apart" in vfr.problems[0][1]


def test_a_variable_frame_rate_file_is_sampled_by_its_timestamps(tmp_path):
    import av

    path = tmp_path / "vfr.mp4"
    stamps = [0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # a gap after frame 5 (1/24 s ticks)
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = 48, 32, "yuv420p"
        s.codec_context.time_base = Fraction(1, 24)
        for i, t in enumerate(stamps):
            f = av.VideoFrame.from_image(frames(16)[i])
            f.pts, f.time_base = t, Fraction(1, 24)
            for pk in s.encode(f):
                c.mux(pk)
        for pk in s.encode():
            c.mux(pk)
    info = probe(path)
    assert [round(t * 24) for t in info.times] == stamps
    across = plan(info, Sampling(frames=(5,), start=0.1))  # frames 2..5, then the gap
    assert across.windows == [] and [c for c, _ in across.problems] == ["variable-frame-rate"]
    after = plan(info, Sampling(frames=(5,), start=0.5))  # tick 12 is the 10th frame
    assert after.problems == [] and after.windows[0].indices == (9, 10, 11, 12, 13)
    assert [index_of(im) for im in read_window(path, after.windows[0])] == [9, 10, 11, 12, 13]


def test_unreadable_clips_raise_clip_errors_naming_the_file(tmp_path):
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00\x01not a video" * 100)
    with pytest.raises(ClipError, match="junk.mp4"):
        probe(junk)
    audio = tmp_path / "sound.mp4"
    import av

    with av.open(str(audio), "w") as c:  # a container holding audio only
        s = c.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for pk in s.encode(frame):
            c.mux(pk)
        for pk in s.encode():
            c.mux(pk)
    with pytest.raises(ClipError, match="no video stream"):
        probe(audio)
    good = write_clip(tmp_path / "cut.mp4", frames(30), fps=10)
    data = good.read_bytes()
    good.write_bytes(data[: len(data) // 3])  # cut off: the index (moov) is at the end, so nothing plays
    with pytest.raises(ClipError, match="cut.mp4"):
        probe(good)


def test_a_window_past_the_decodable_frames_is_a_clip_error(tmp_path):
    path = write_clip(tmp_path / "a.gif", frames(4), fps=10)
    with pytest.raises(ClipError, match="frame 7 does not decode"):
        read_window(path, Window(0.0, (0, 7)))


def test_display_rotation_is_applied(tmp_path):
    import av

    path = tmp_path / "turned.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=10)
        s.width, s.height, s.pix_fmt = 48, 32, "yuv420p"
        s.set_display_rotation(90)  # a phone held upright
        for im in frames(3):
            im.paste((255, 255, 255), (0, 0, 8, 8))  # a white corner: top left as stored
            for pk in s.encode(av.VideoFrame.from_image(im)):
                c.mux(pk)
        for pk in s.encode():
            c.mux(pk)
    assert probe(path).size == (32, 48)  # as players show it
    shown = np.asarray(read_window(path, Window(0.0, (0,)))[0], dtype=float)
    # FFmpeg's player turns a +90 (counter-clockwise) display matrix the same way: the stored top-left corner
    # ends up at the bottom left
    assert shown[-4, 4].mean() > 200 and shown[4, 4].mean() < 200


def test_a_gif_keeps_each_frames_own_colours(tmp_path):
    """The GIF preview's palette comes from a quarter-size copy of each frame (`gif_frame`); a frame full of colours
    still reads back close to itself, and a frame of one colour exactly."""
    yy, xx = np.mgrid[0:96, 0:160]
    rich = [Image.fromarray(np.stack([(xx + 9 * t) % 256, (yy * 2 + t) % 256, (xx + yy) % 256], -1).astype(np.uint8))
            for t in range(3)]
    path = write_clip(tmp_path / "a.gif", rich + [Image.new("RGB", (160, 96), (200, 30, 60))], fps=8)
    back = read_window(path, Window(0.0, (0, 1, 2, 3)))
    for got, want in zip(back[:3], rich, strict=True):
        mse = ((np.asarray(got, float) - np.asarray(want, float)) ** 2).mean()
        assert 10 * np.log10(255**2 / mse) > 30
    assert (np.asarray(back[3]) == (200, 30, 60)).all()
