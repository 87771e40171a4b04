"""Words users do not know, kept out of the repository (run by `nox -s lint`).

Code, docs, errors and help texts name the sources users know (ColossalAI's
docs, DeepSpeed's config, torch's API), not this project's internal
vocabulary. Prints each offending line and exits 1 when there is one.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# "the seed" was the project's name for the ColossalAI code it re-implements;
# "the seed of every RNG" (a random seed) is fine.
BANNED = [
    (re.compile(r"\bthe\s+seed's", re.IGNORECASE), "name the source (e.g. ColossalAI's)"),
    (
        re.compile(r"\bthe\s+seed\b(?!'s)(?!\s+of\s+every)(?!\s*=)", re.IGNORECASE),
        "name the source (e.g. ColossalAI)",
    ),
]
SUFFIXES = (".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".json")
SKIP = {"tools/check_words.py"}


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    found = 0
    for name in listed:
        if not name.endswith(SUFFIXES) or name in SKIP or not (root / name).is_file():
            continue
        text = (root / name).read_text(encoding="utf-8", errors="replace")
        for pattern, fix in BANNED:
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                print(f"{name}:{line}: {match.group(0)!r}: {fix}")
                found += 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
