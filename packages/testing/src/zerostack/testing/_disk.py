"""The page cache, for tests and benchmarks that need a read to go to the disk."""

from __future__ import annotations

import os


def drop_page_cache() -> bool:
    """Write dirty pages out and drop the page cache, so that the next read
    of a file comes from the disk. Returns False where that is not allowed
    (it needs root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
