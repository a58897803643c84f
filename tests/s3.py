"""A real S3 API server for the object storage tests: moto's server mode as a child
process on a free port (not a mock of boto3: every call crosses HTTP as it would to AWS)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from app.cli.embedded import free_port

ACCESS_KEY = "llmq-test"
SECRET_KEY = "llmq-test-secret"
REGION = "us-east-1"


@dataclass
class MotoServer:
    url: str
    process: subprocess.Popen[bytes]

    def client(self) -> Any:
        """A boto3 S3 client for this server, configured explicitly (tests do not edit os.environ)."""
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=Config(retries={"max_attempts": 2, "mode": "standard"}),
        )

    def env(self) -> dict[str, str]:
        """How a child process (the API, a worker) is pointed at this server: boto3's own
        variables, as an operator would set them."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL_S3": self.url,
        }

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_moto(log_path: Path) -> MotoServer:
    port = free_port(45700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto server exited with {process.returncode}; see {log_path}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return MotoServer(f"http://127.0.0.1:{port}", process)
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"moto server did not start on port {port}; see {log_path}")
