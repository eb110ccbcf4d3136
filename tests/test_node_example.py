"""The Node example (grpc-js loading the .proto at run time) against a real server."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from serverproc import ServerProc

NODE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "node")


@pytest.fixture(scope="module")
def node_modules():
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed")
    if not os.path.isdir(os.path.join(NODE_DIR, "node_modules", "@grpc", "grpc-js")):
        # `make test` runs npm ci first; this covers a bare `pytest`
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=NODE_DIR, check=True, timeout=300)


def run_example(address: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["node", "example.js", address],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, **env),
    )


def test_node_example_sends_receives_cancels(tmp_path, node_modules):
    with ServerProc(tmp_path / "data") as srv:
        result = run_example(srv.address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cancelled" in result.stdout and "received" in result.stdout
    assert "node example: OK" in result.stdout


def test_node_example_with_token(tmp_path, node_modules):
    tokens = tmp_path / "tokens"
    tokens.write_text("node-token\n")
    with ServerProc(tmp_path / "data", args=["--auth-token-file", str(tokens)]) as srv:
        refused = run_example(srv.address)
        ok = run_example(srv.address, QDELAY_TOKEN="node-token")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stdout + refused.stderr
    assert ok.returncode == 0, ok.stdout + ok.stderr
