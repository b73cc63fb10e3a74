"""The workflow that publishes the image the manifests run: valid for GitHub Actions, building
deploy/Dockerfile, and tagging by the version (a release tag that differs from pyproject's fails)."""

from __future__ import annotations

import fnmatch
import subprocess
import sys

import pytest

from tests.deploy.files import DEPLOY, ROOT, documents, project_version

WORKFLOW = ROOT / ".github" / "workflows" / "image.yml"


def workflow() -> dict:
    return documents(WORKFLOW)[0]


def triggers() -> dict:
    return workflow()[True]  # YAML 1.1 reads the key `on` as true, as PyYAML does


def steps() -> list[dict]:
    return workflow()["jobs"]["image"]["steps"]


def step(uses: str) -> dict:
    return next(s for s in steps() if s.get("uses", "").startswith(uses + "@"))


def test_the_workflow_is_valid_against_the_github_workflow_schema():
    out = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
                          str(WORKFLOW)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_it_builds_the_dockerfile_and_pushes_the_image_the_manifests_name():
    build = step("docker/build-push-action")["with"]
    assert (build["context"], build["file"]) == (".", "deploy/Dockerfile")
    assert (ROOT / build["context"] / build["file"]).is_file()
    kustomize_image = documents(DEPLOY / "k8s" / "kustomization.yaml")[0]["images"][0]["newName"]
    assert step("docker/metadata-action")["with"]["images"] == kustomize_image == "ghcr.io/burstgate/burstgate"
    assert "type=semver,pattern={{version}}" in step("docker/metadata-action")["with"]["tags"]
    assert build["push"] == "${{ github.event_name != 'pull_request' }}"  # pull requests build only
    assert triggers()["push"]["tags"] == ["v*"]


def test_a_pull_request_touching_anything_the_image_copies_builds_it():
    paths = triggers()["pull_request"]["paths"]
    copied = ["pyproject.toml", "deploy/requirements.py", "deploy/Dockerfile", ".dockerignore",
              "gateway/app.py", "backends/native/csrc/bf16.h", "loadtest/cli.py"]
    for path in copied:
        assert any(fnmatch.fnmatch(path, p) for p in paths), path


@pytest.mark.parametrize(("tag", "ok"), [(f"v{project_version()}", True), ("v99.0.0", False), (None, True)])
def test_the_version_step_reads_pyproject_and_refuses_a_tag_that_differs(tmp_path, tag, ok):
    script = next(s for s in steps() if s.get("id") == "version")["run"]
    output = tmp_path / "github_output"
    env = {"PATH": "/usr/bin:/bin", "GITHUB_OUTPUT": str(output),
           "GITHUB_REF": f"refs/tags/{tag}" if tag else "refs/heads/main", "GITHUB_REF_NAME": tag or "main"}
    result = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert (result.returncode == 0) is ok, result.stdout + result.stderr
    assert output.read_text() == f"version={project_version()}\n"
