"""Check built wheels: no zerostack/__init__.py (PEP 420 namespace), and the
fused-adam wheel carries its compiled CPU kernel."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def main(dist: Path) -> int:
    problems = []
    wheels = sorted(dist.glob("*.whl"))
    if not wheels:
        problems.append(f"no wheels in {dist}")
    for wheel in wheels:
        names = zipfile.ZipFile(wheel).namelist()
        if "zerostack/__init__.py" in names:
            problems.append(f"{wheel.name}: ships zerostack/__init__.py (breaks the namespace)")
        if not any(n.startswith("zerostack/") and n.endswith("/__about__.py") for n in names):
            problems.append(f"{wheel.name}: no zerostack/<name>/__about__.py")
        if wheel.name.startswith("zerostack_fused_adam") and not any(
            n.startswith("zerostack/fused_adam/_adam_cpu") and n.endswith(".so") for n in names
        ):
            problems.append(f"{wheel.name}: the compiled CPU kernel is missing")
        print(f"{wheel.name}: {len(names)} files")
    for p in problems:
        print(f"ERROR: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
