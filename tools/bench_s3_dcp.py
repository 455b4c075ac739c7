"""Benchmark: torch's own `dcp.load` of a DCP checkpoint in a bucket through reshard.dcp_reader.Reader, against
s3torchconnector's S3StorageReader and torch's FsspecReader (s3fs), on the same local SeaweedFS server
(tools/s3_server.py) and the same bytes, in one run:

    python tools/bench_s3_dcp.py [--mib 256] [--tensors 4] [--slice] [--repeat 1]

A checkpoint of TENSORS fp32 square tensors (MIB in all, a model state dict: keys model.w0, model.w1...) is
written by dcp.save and uploaded once. Each reader loads it whole (with --slice: only model.w0, a partial load)
in a process of its own, its endpoint a counting TCP relay in front of the server: wall and CPU seconds, peak
RSS, and the bytes that came from the server (response headers included: metadata, listings, every GET),
whatever the client. The readers that are not installed (s3torchconnector, s3fs: not reshard's dependencies)
are reported as such. The server runs on this machine:
loopback is not a network.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading

import s3_server

LOAD = r"""
import json, os, resource, sys, time
import torch
import torch.distributed.checkpoint as dcp
kind, url, names = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
meta_shapes = json.loads(sys.argv[4])
state = {"model": {n: torch.empty(meta_shapes[n]) for n in names}}
if kind == "reshard":
    import reshard.dcp_reader
    reader = reshard.dcp_reader.Reader(url)
elif kind == "s3torchconnector":
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader
    reader = S3StorageReader(os.environ["AWS_REGION"], url, S3ClientConfig(force_path_style=True))
else:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader   # (torch 2.13 exports it no more)
    reader = FsspecReader(url)
start, cpu = time.perf_counter(), time.process_time()
dcp.load(state, storage_reader=reader)
print(json.dumps({"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "checksum": float(sum(float(t.double().sum()) for t in state["model"].values()))}))
"""

SAVE = r"""
import sys, torch
import torch.distributed.checkpoint as dcp
folder, n, side = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
dcp.save({"model": {f"w{i}": torch.randn(side, side) for i in range(n)}}, checkpoint_id=folder)
"""


class Relay:
    """A TCP relay on a free port of 127.0.0.1 to `port`, counting the bytes the server sends back."""

    def __init__(self, port: int):
        self.target, self.received = port, 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                if counted:
                    with self._lock:
                        self.received += len(data)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--slice", action="store_true", help="load only tensors w0 (a partial load)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    side = int(((args.mib << 20) / args.tensors / 4) ** 0.5)
    names = [f"w{i}" for i in range(args.tensors)]
    wanted = names[:1] if args.slice else names
    figures: dict = {"mib": args.mib, "tensors": args.tensors, "side": side, "loaded": wanted, "readers": {}}
    with tempfile.TemporaryDirectory() as tmp, s3_server.running(os.path.join(tmp, "s3")) as server:
        env = {**os.environ, **server.env(), "PYTHONWARNINGS": "ignore"}
        folder = os.path.join(tmp, "dcp")
        subprocess.run([sys.executable, "-c", SAVE, folder, str(args.tensors), str(side)], check=True, env=env)
        url = s3_server.upload(server, folder, "dcp")
        shapes = {n: [side, side] for n in names}
        relay = Relay(int(server.endpoint.rsplit(":", 1)[1]))
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{relay.port}"
        for kind in ("reshard", "s3torchconnector", "fsspec"):
            before = relay.received
            proc = subprocess.run([sys.executable, "-c", LOAD, kind, url, json.dumps(wanted), json.dumps(shapes)],
                                  capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                figures["readers"][kind] = {"error": proc.stderr.strip().splitlines()[-1][:200]}
            else:
                figures["readers"][kind] = {**json.loads(proc.stdout.strip().splitlines()[-1]),
                                            "bytes_in": relay.received - before}
        relay.close()
    mb = args.tensors * side * side * 4 / 1e6
    print(f"{mb:.0f} MB in {args.tensors} tensors; loading {len(wanted)} of them")
    print(f"{'reader':18} {'wall s':>7} {'cpu s':>6} {'MB in':>7} {'RSS MiB':>8}  checksum")
    for kind, f in figures["readers"].items():
        if "error" in f:
            print(f"{kind:18} failed: {f['error']}")
        else:
            print(f"{kind:18} {f['wall']:7.2f} {f['cpu']:6.2f} {f['bytes_in'] / 1e6:7.0f} {f['rss_mib']:8.0f}  "
                  f"{f['checksum']:.6g}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)


if __name__ == "__main__":
    main()
