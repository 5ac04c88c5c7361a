"""The documentation stays true: README size, relative links, the environment table, the README example.

- README.md stays a ten-minute read (at most 12,000 bytes).
- Every relative link in README.md, CONTRIBUTING.md and docs/*.md points at a file or folder of the
  repository, and every ``#anchor`` at a heading of its target page.
- Every variable of ``underlay.utils.env.ENV_VARS`` has a row, with its default, in
  docs/configuration.md; every row of the library's table there is a variable of ``ENV_VARS``.
- The API example of the README runs as written on the CPU and exports a model transformers loads.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import underlay
from underlay.utils.env import ENV_VARS

ROOT = Path(__file__).resolve().parents[2]
README_MAX_BYTES = 12_000


_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose_lines(text: str) -> list[str]:
    """The lines of a markdown page outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def _links(text: str) -> list[str]:
    """Targets of the inline links of a page, code excluded."""
    return [m.group(1) for line in _prose_lines(text) for m in _LINK.finditer(_INLINE_CODE.sub("", line))]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    """The anchors of the headings of a page (a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _broken_links(page: Path, text: str | None = None) -> list[str]:
    """``page: target (why)`` for every relative link of ``page`` (its ``text``, read from the file when
    ``None``) that does not resolve."""
    text = page.read_text(encoding="utf-8") if text is None else text
    broken = []
    for target in _links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        if not path_part:
            if anchor not in _anchors(text):
                broken.append(f"{page.name}: {target} (no heading #{anchor} on this page)")
            continue
        dest = (page.parent / path_part).resolve()
        try:
            rel = dest.relative_to(ROOT).as_posix()
        except ValueError:
            broken.append(f"{page.name}: {target} (outside the repository)")
            continue
        if not dest.exists():
            broken.append(f"{page.name}: {target} (no file {rel})")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{page.name}: {target} (no heading #{anchor} in {rel})")
    return broken


def test_readme_is_a_ten_minute_read() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes (limit {README_MAX_BYTES}): move detail to a docs/ page and link it"
    )


def test_relative_links_resolve() -> None:
    pages = _doc_pages()
    assert len(pages) > 5 and all(p.is_file() for p in pages[:2]), pages
    assert len(_links((ROOT / "README.md").read_text(encoding="utf-8"))) >= 10  # the parser finds links
    broken = [b for page in pages for b in _broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_checker_reports_missing_files_and_anchors() -> None:
    """The checker itself, on a page that is not on disk: a missing file, a missing anchor on another
    page and on this one are reported; existing targets, an allowed missing file, code and URLs are not."""
    text = (
        "# Probe page\n\n[a](no_such_page.md) [b](architecture.md#no-such-heading) [c](architecture.md#errors)\n"
        "[d](../scripts/test_gpu.sh) [e](#probe-page) [f](#nowhere) `[g](not_a_link.md)` [h](https://x.org/y)\n"
        "```\n[i](in_code.md)\n```\n"
    )
    broken = _broken_links(ROOT / "docs" / "probe.md", text)
    assert [b.split(" (")[0] for b in broken] == [
        "probe.md: no_such_page.md",
        "probe.md: architecture.md#no-such-heading",
        "probe.md: #nowhere",
    ], broken


def _env_rows(text: str) -> dict[str, list[str]]:
    """``{name: cells}`` of the table rows whose first cell is a backticked ``UNDERLAY_*`` name."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\|\s*`(UNDERLAY_[A-Z0-9_]+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def _library_table(text: str) -> str:
    """The ``## Environment variables`` section up to its first sub-section: the library's own table."""
    start = text.index("\n## Environment variables\n")
    end = text.index("\n### ", start)
    return text[start:end]


def test_every_env_var_is_documented() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = _env_rows(text)
    own = {n: v for n, v in ENV_VARS.items() if v.owner == "underlay"}
    missing = sorted(n for n in own if n not in rows)
    assert not missing, f"docs/configuration.md has no table row for {missing} (underlay.utils.env.ENV_VARS)"
    # variables underlay reads but another program owns are named in the table of those
    others = sorted(n for n in ENV_VARS if n not in own and f"`{n}`" not in text)
    assert not others, f"docs/configuration.md does not name {others}, which underlay reads"
    wrong_default = sorted(
        n for n, var in own.items() if n in rows and var.default and var.default not in " ".join(rows[n][1:2])
    )
    assert not wrong_default, (
        f"docs/configuration.md states another default than ENV_VARS for {wrong_default}"
    )
    library = _env_rows(_library_table(text))
    unknown = sorted(n for n in library if n not in ENV_VARS)
    assert not unknown, f"docs/configuration.md documents {unknown}, which underlay.utils.env does not define"
    assert len(library) >= 10


@pytest.mark.slow
def test_readme_example_runs_on_cpu(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## The API in 30 lines") :]
    start = section.index("```python\n") + len("```python\n")
    code = section[start : section.index("\n```", start)]
    assert 20 <= len(code.splitlines()) <= 40, "the README example is meant to be about 30 lines"
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNDERLAY_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    src = str(Path(underlay.__file__).resolve().parents[1])
    env.update(
        UNDERLAY_DEVICE="cpu",
        PYTHONPATH=os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])]),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("cpu {'loss': ") and "skipped=False" in lines[0], proc.stdout
    assert lines[1].startswith("['model.embed_tokens.weight'"), proc.stdout

    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf", output_loading_info=True)
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers == 2
    assert not info["missing_keys"] and not info["unexpected_keys"], info
