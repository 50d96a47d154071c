#!/usr/bin/env python3
"""Regenerates the two example corpora from public-domain texts Debian ships.

Not needed to run the example (the outputs are committed); kept so that anyone can
see exactly where the text came from and rebuild it. Needs the Debian packages
bible-kjv (the `bible` program and its data, bible-kjv-text) and libsqlite3-dev
(/usr/include/sqlite3.h). See README.md beside this file for the licenses.

    apt-get install --no-install-recommends bible-kjv libsqlite3-dev
    .venv/bin/python python_client/examples/data/make_corpus.py
"""
import pathlib
import re
import subprocess

HERE = pathlib.Path(__file__).resolve().parent

# King James Version, 1611: Genesis and Exodus, one verse a line, under a heading
# per chapter. ("Gen1:1-50:26" is the `bible` program's range syntax.)
KJV_BOOKS = [("Genesis", "Gen", 50, 26), ("Exodus", "Exo", 40, 38)]


def make_kjv() -> str:
    out = []
    for title, abbrev, last_chapter, last_verse in KJV_BOOKS:
        spec = f"{abbrev}1:1-{last_chapter}:{last_verse}"
        text = subprocess.run(["bible", "-f", spec], check=True, capture_output=True,
                              text=True).stdout
        chapter = None
        for line in text.splitlines():
            m = re.match(r"^[A-Za-z]+(\d+):(\d+) (.*)$", line)
            if not m:
                continue
            if m.group(1) != chapter:
                chapter = m.group(1)
                out.append(f"\n{title} {chapter}\n")
            out.append(m.group(3).strip())
    return "\n".join(out).lstrip() + "\n"


# The fine-tuning corpus is kept smaller than the base corpus: the first reference
# entries, up to about this many bytes.
SQLITE_MAX_BYTES = 200_000


def make_sqlite_api() -> str:
    """The prose of the C API reference comments ("CAPI3REF") in sqlite3.h."""
    src = pathlib.Path("/usr/include/sqlite3.h").read_text()
    blocks = re.findall(r"/\*\n(\*\* CAPI3REF:.*?)\*/", src, flags=re.S)
    out, size = [], 0
    for block in blocks:
        lines = [re.sub(r"^\*\* ?", "", l) for l in block.splitlines()]
        text = "\n".join(lines)
        text = re.sub(r"CAPI3REF: ", "", text)
        text = re.sub(r"\nKEYWORDS:.*", "", text)
        text = re.sub(r"\nMETHOD:.*", "", text)
        text = re.sub(r"</?[a-zA-Z][^>]*>", "", text)          # HTML tags
        text = text.replace("^(", "").replace(")^", "").replace("^", "")  # requirement marks
        text = re.sub(r"\[([^\]|]*)\|([^\]]*)\]", r"\2", text)  # [target|label]
        text = re.sub(r"\[([^\]]*)\]", r"\1", text)             # [link]
        text = text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
        text = re.sub(r"[ \t]+\n", "\n", text)
        text = re.sub(r"\n{3,}", "\n\n", text).strip()
        out.append(text)
        size += len(text) + 2
        if size >= SQLITE_MAX_BYTES:
            break
    return "\n\n".join(out) + "\n"


def main() -> None:
    (HERE / "kjv_genesis_exodus.txt").write_text(make_kjv())
    (HERE / "sqlite_api_docs.txt").write_text(make_sqlite_api())
    for name in ("kjv_genesis_exodus.txt", "sqlite_api_docs.txt"):
        p = HERE / name
        print(f"{p.name}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
