"""deploy/Dockerfile copies files that exist and serves on the port the manifests probe."""

from __future__ import annotations

import re

from tests.deploy.files import DEPLOY, ROOT


def test_dockerfile_copies_existing_files():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", dockerfile, flags=re.M):
        for item in src.split():
            assert (ROOT / item).exists(), item
    assert re.search(r"^EXPOSE 8000$", dockerfile, re.M) and '"--port", "8000"' in dockerfile
