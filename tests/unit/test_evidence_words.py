"""Evidence in the product is a date, a machine, a command and a figure (or a test name) — never a number from
someone's work log or words about whose machines a figure was measured on. A reader of the repository next year
cannot look up "session 27" or "(s22)"; they can rerun `lorakit bench step ...` on an H100.

The check reads every text file of lorakit/, docs/, tools/, scripts/, tests/ and README.md (this file builds its
patterns so that it does not match itself)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLACES = ("lorakit", "docs", "tools", "scripts", "tests", "README.md")
TEXT = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".js", ".html", ".css"}
S = "s" + "ession"  # spelled apart so the patterns below do not match this file
PATTERNS = [
    (re.compile(rf"\b{S}s?\s+\d+", re.I), "a work-log number"),
    (re.compile(r"\(s\d{2}(?=[,)/])"), "a work-log number"),
    (re.compile(r"\b(?:lent|borrowed)[\s-]+(?:gpu|machine|host|h100|h200|card)s?\b", re.I), "a borrowed machine"),
    (re.compile(r"\bdevice[- ]time\b", re.I), "a borrowed machine's budget"),
    (re.compile(r"\bwork[- ]?log\b", re.I), "a work log"),
]
DOC_ONLY = [(re.compile(r"(?<![\w./-])s\d{2}(?![\w.])"), "a work-log number")]  # "s22" in prose


def offences(text: str, markdown: bool) -> list[tuple[int, str, str]]:
    """(line number, the words, what they are) for each citation the product must not make."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for pat, what in PATTERNS + (DOC_ONLY if markdown else []):
            m = pat.search(line)
            if m:
                out.append((n, m.group(0), what))
    return out


def _files():
    for place in PLACES:
        p = ROOT / place
        if p.is_file():
            yield p
        elif p.is_dir():
            yield from (f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in TEXT
                        and "__pycache__" not in f.parts)


def test_the_product_cites_evidence_by_date_machine_and_command_only():
    found = []
    for f in _files():
        if f == Path(__file__):
            continue
        for n, words, what in offences(f.read_text(encoding="utf-8", errors="replace"), f.suffix == ".md"):
            found.append(f"{f.relative_to(ROOT)}:{n}: {words!r} ({what})")
    assert not found, "cite a date, a machine and a command instead:\n" + "\n".join(found[:40]) + (
        f"\n... and {len(found) - 40} more" if len(found) > 40 else "")


def test_the_check_catches_what_it_is_for():
    planted = f"Measured in {S.title()} 12 on a lent H100 (s22), as the work log says; device time 40 s."
    whats = [w for _, _, w in offences(planted, markdown=True)]
    assert whats.count("a work-log number") >= 2 and "a borrowed machine" in whats and "a work log" in whats
    assert "a borrowed machine's budget" in whats
    fine = "H100 80GB HBM3, 2026-11-26, `lorakit bench step --family flux --res 1024`: 0.427 s/step (fp16, s3cret)"
    assert offences(fine, markdown=True) == []


def test_the_benchmarks_page_holds_current_figures_only():
    # one section per capability with its current figures: what a newer figure replaces goes to the history, dated
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    assert len(page) <= 300, f"docs/benchmarks.md has {len(page)} lines: move superseded figures to " \
                             f"docs/benchmarks-history.md"
    assert (ROOT / "docs" / "benchmarks-history.md").is_file()
