"""The sampling grid a pipeline call runs: the steps asked, or the model's own grid where its pipeline sets one."""

from __future__ import annotations

DEFAULT_STEPS = 28


def sampling_steps(pipe, asked: int | None) -> tuple[int, list[float] | None, str | None]:
    """(steps, sigmas to pass, what was chosen: a line for the user) for the pipeline call. A pipeline with its
    own grid (`sample_sigmas` in its config: Qwen-Image-2.1) ignores num_inference_steps: without --steps that
    grid is used and its length is the steps recorded; with --steps the asked number of evenly spaced sigmas is
    passed (the scheduler shifts them as usual), so that the steps written into the PNG are the steps that ran.
    Said either way."""
    grid = getattr(getattr(pipe, "config", None), "sample_sigmas", None)
    if not grid:
        return asked or DEFAULT_STEPS, None, None
    if asked is None:
        return len(grid), None, f"the model's own {len(grid)} steps (its pipeline's sample_sigmas)"
    return (asked, [1.0 - i * (1.0 - 1.0 / asked) / max(asked - 1, 1) for i in range(asked)],
            f"{asked} evenly spaced steps as asked, not the model's own {len(grid)} (its pipeline's sample_sigmas)")
