"""The OCI image: built with buildah (no daemon), validated with oci-image-tool, unpacked with umoci, and run
with podman to answer /readyz and a chat completion with the embedded default model.

Slow (several minutes: a debootstrap base, the engine environment copied in, a podman run of the engine);
`.ci/run` includes it. APPLIANCE_OCI_WORKDIR keeps buildah's storage between local runs.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from appliance.store import keys
from tests import loopback
from tests.support import REPO, free_port, needs_tools, wait_for

TOOLS = ("buildah", "podman", "umoci", "oci-image-tool", "debootstrap", "runc")
pytestmark = [pytest.mark.packaging, pytest.mark.timeout(2400),  # the first test builds the image
              needs_tools(*TOOLS)]


class Image:
    def __init__(self, work: Path, tag: str) -> None:
        self.work, self.tag = work, tag
        self.ref = tag.rsplit(":", 1)[1]

    @property
    def layout(self) -> Path:
        return self.work / "oci"

    def blob(self, digest: str) -> Path:
        algo, hexd = digest.split(":")
        return self.layout / "blobs" / algo / hexd

    def manifest(self) -> dict:
        index = json.loads((self.layout / "index.json").read_text())
        (entry,) = [m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == self.ref]
        return json.loads(self.blob(entry["digest"]).read_text())

    def config(self) -> dict:
        return json.loads(self.blob(self.manifest()["config"]["digest"]).read_text())

    def run(self, *args: str, **kw) -> subprocess.CompletedProcess:
        # this machine's container sandbox refuses podman's default rlimits (docs/engine-notes.md)
        return self.podman("run", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096", *args, **kw)

    def podman(self, *args: str, **kw) -> subprocess.CompletedProcess:
        base = ["podman", "--root", str(self.work / "storage"), "--runroot", str(self.work / "run"),
                "--storage-driver", "vfs", "--runtime", "runc"]
        return subprocess.run([*base, *args], capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    keep = os.environ.get("APPLIANCE_OCI_WORKDIR")
    work = Path(keep or tmp_path_factory.mktemp("oci"))
    try:
        r = subprocess.run([str(REPO / "packaging/oci/build.sh"), str(work)], capture_output=True, text=True,
                           env={**os.environ, "PYTHON": sys.executable}, timeout=1800)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        yield Image(work, r.stdout.strip().splitlines()[-1])
    finally:
        if not keep:  # several GB of vfs layers: not left behind in pytest's temporary folders
            subprocess.run(["buildah", "--root", str(work / "storage"), "--runroot", str(work / "run"),
                            "--storage-driver", "vfs", "rmi", "--all", "--force"], capture_output=True)
            shutil.rmtree(work, ignore_errors=True)


def test_image_validates_and_carries_its_labels(image: Image):
    r = subprocess.run(["oci-image-tool", "validate", "--type", "image", "--ref", f"name={image.ref}",
                        str(image.layout)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = image.config()
    labels = cfg["config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == image.ref
    assert labels["io.edge-appliance.model.digest"].startswith("sha256:")
    assert labels["io.edge-appliance.kernel-lock.digest"].startswith("sha256:")
    sbom = gzip.decompress(base64.b64decode(labels["io.edge-appliance.sbom.cdx-json-gzip-base64"]))
    assert labels["io.edge-appliance.sbom.digest"] == "sha256:" + hashlib.sha256(sbom).hexdigest()
    bom = json.loads(sbom)
    assert bom["bomFormat"] == "CycloneDX" and any(c["name"] == "torch" for c in bom["components"])
    assert cfg["config"]["User"] == "appliance" and "/var/lib/appliance" in cfg["config"]["Volumes"]


@pytest.fixture(scope="module")
def rootfs(image: Image, tmp_path_factory):
    """The image unpacked by umoci: its files, read without starting a container (with vfs, each container
    is a whole copy of the image)."""
    bundle = tmp_path_factory.mktemp("umoci") / "bundle"
    r = subprocess.run(["umoci", "unpack", "--image", f"{image.layout}:{image.ref}", str(bundle)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    yield bundle / "rootfs"
    shutil.rmtree(bundle, ignore_errors=True)


def test_umoci_unpacks_the_pinned_model_lock_and_sbom(image: Image, rootfs: Path):
    labels = image.config()["config"]["Labels"]
    conf = (rootfs / "etc/appliance/appliance.toml").read_text()
    assert f'digest = "{labels["io.edge-appliance.model.digest"]}"' in conf and 'verify = "fail"' in conf
    lock = json.loads((rootfs / "etc/appliance/kernel-lock.json").read_text())
    assert lock["digest"] == labels["io.edge-appliance.kernel-lock.digest"]
    sbom = (rootfs / "usr/share/edge-appliance/sbom.cdx.json").read_bytes()
    assert "sha256:" + hashlib.sha256(sbom).hexdigest() == labels["io.edge-appliance.sbom.digest"]
    assert (rootfs / "opt/models/default/config.json").is_file()
    monitoring = rootfs / "usr/share/edge-appliance/monitoring"
    assert (monitoring / "alerts.yml").read_bytes() == (REPO / "packaging/monitoring/alerts.yml").read_bytes()
    assert (monitoring / "dashboard.json").is_file()
    site = rootfs / "opt/appliance/lib/python3.11/site-packages"
    assert (site / "appliance/ops/templates/status.html").is_file()
    # the run-time closure only (kernels/runtime.py): the engine's packages in, the suite's tools out
    assert (site / "vllm").is_dir() and (site / "torch").is_dir() and (site / "uvloop").is_dir()
    assert not [p.name for p in site.iterdir() if p.name.split("-")[0] in ("pytest", "mypy", "ruff", "hypothesis")]


def test_podman_runs_it_to_readyz_and_a_chat_completion(image: Image, rootfs: Path, tmp_path: Path):
    state = tmp_path / "state"
    state.mkdir()
    _, secret = keys.create(state / "appliance.db", "podman-test")
    _, admin = keys.create(state / "appliance.db", "technician", admin=True)
    for p in [state, *state.rglob("*")]:
        os.chown(p, 10001, 10001)  # the image's appliance user owns its volume
    port = free_port()
    conf = tmp_path / "appliance.toml"
    shipped = (rootfs / "etc/appliance/appliance.toml").read_text()  # the image's own, on another port
    assert "port = 8000" in shipped, shipped
    conf.write_text(shipped.replace("port = 8000", f"port = {port}"))
    name = f"appliance-test-{port}"
    r = image.run("-d", "--name", name, "--network", "host", "--shm-size", "1g", "-v", f"{state}:/var/lib/appliance",
                     "-v", f"{conf}:/etc/appliance/appliance.toml:ro", image.tag, timeout=600)
    assert r.returncode == 0, r.stderr
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if image.podman("inspect", "-f", "{{.State.Running}}", name).stdout.strip() != "true":
                raise AssertionError("the container exited:\n" + image.podman("logs", name).stderr[-4000:])
            try:
                return loopback.get(f"{url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 600, interval=2, what="the container's /readyz")
        r = loopback.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"}, timeout=120,
                          json={"model": "smollm2-135m-instruct", "max_tokens": 8,
                                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        assert loopback.post(f"{url}/v1/chat/completions", json={}).status_code == 401  # keys off loopback
        # the status page: its template and Jinja2 made it into the image; a browser's Basic credentials
        page = loopback.get(f"{url}/", auth=("technician", admin), timeout=60)
        assert page.status_code == 200 and '<span id="model">smollm2-135m-instruct</span>' in page.text, page.text[:500]
        logs = image.podman("logs", name)
        assert "engine kernels match the lock" in logs.stdout + logs.stderr
    finally:
        image.podman("stop", "-t", "30", name, timeout=120)
        image.podman("rm", "-f", name, timeout=120)


def test_an_altered_layer_fails_validation(image: Image):
    # last in this module: it damages the exported layout
    layer = image.blob(image.manifest()["layers"][-1]["digest"])
    with layer.open("r+b") as f:
        f.seek(layer.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = subprocess.run(["oci-image-tool", "validate", "--type", "image", "--ref", f"name={image.ref}",
                        str(image.layout)], capture_output=True, text=True)
    assert r.returncode != 0
