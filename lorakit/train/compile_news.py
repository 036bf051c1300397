"""What the background compile (`train.compile_bg`) finished, in words: a call's description, the compile cache's
hits, and the line a run says once every block call it met runs compiled."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorakit.train.compile_bg import BackgroundCompile


def summary(what: tuple) -> str:
    """A description in words: the block kind, its largest input's shape (the image tokens: what tells buckets
    apart), grad mode."""
    import math

    shapes = [m[1] for m in _flat(what[3]) + _flat(what[4]) if isinstance(m, tuple) and m and m[0] == "T"]
    big = "x".join(str(n) for n in max(shapes, key=math.prod)) if shapes else "-"
    return f"{what[0]} {big}" + ("" if what[2] else " (no grad)")


def _flat(m) -> list:
    if isinstance(m, tuple) and m and m[0] == "T":
        return [m]
    if isinstance(m, tuple):
        return [x for v in m for x in _flat(v)]
    return []


def cache_news() -> str:
    """How many of the process's Inductor graphs came from the compile cache (", 8 of 8 graphs from the compile
    cache"), how many were traced again first (left out of AOTAutograd's: `gpu.compile_cache`); "" if none."""
    from torch._dynamo.utils import counters

    hit, miss = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    again = counters["aot_autograd"]["autograd_cache_bypass"]
    said = f", {again} traced again first (not in AOTAutograd's cache)" if again else ""
    return f", {hit} of {hit + miss} graphs from the compile cache{said}" if hit + miss else ""


def news(bg: BackgroundCompile, ready: list, step: int, info, note) -> list:
    """What the background compile finished, said (`info`) once nothing is left to it (every block call met so far
    runs compiled from `step` on); a failed one at once (`note`: the run compiles it itself at its next call).
    Returns what is still to be said."""
    said = bg.ahead.news() if bg.ahead else None  # the separate compile process ended (train.precompile)
    if said:
        (info if bg.ahead.state().get("ok") else note)(said)  # ok once its training graphs are in the cache
    for x in ready:
        if x.failed:
            note(f"the background compile of {summary(x.what)} failed ({x.failed}); the run compiles it at its "
                 "next call")
    done = [x for x in ready if not x.failed]
    if bg.pending or not done:
        return done
    beside, taken = bg.taken_beside_grid, sum(not x.later for x in done)
    how = ("compiled in the background" if not bg.handed_back else
           "taken from the compile cache between two steps" if not beside else
           "taken from the compile cache while the grid rendered" if beside == taken else
           f"taken from the compile cache, {beside} of {taken} while the grid rendered")
    later = sum(x.later for x in done)
    info(f"{how} ({sum(x.seconds for x in done):.1f} s{cache_news()}): "
         f"{', '.join(summary(x.what) for x in done if not x.later)}; the blocks run compiled from step {step}"
         + (f"; the grid's {later} call(s) take theirs from the cache at the next grid" if later else ""))
    return []
