"""deploy/compose.yaml references files that exist."""

from __future__ import annotations

from tests.deploy.files import DEPLOY, documents


def test_compose_references_existing_files():
    compose = documents(DEPLOY / "compose.yaml")[0]
    gateway = compose["services"]["gateway-a"]
    assert (DEPLOY / gateway["build"]["context"] / gateway["build"]["dockerfile"]).is_file()
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), source
