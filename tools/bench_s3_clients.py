"""Which S3 client reshard uses, measured: the same object on the same local SeaweedFS (tools/s3_server.py), read
back as ranged GETs of PART bytes with IN_FLIGHT at once (reshard's access pattern: exactly the ranges a plan
needs) and uploaded as a multipart upload of PART-sized parts, by boto3 (botocore), obstore and s3fs.
Wall seconds and this process's CPU seconds per client; the server runs on the same machine, so the figures
compare the clients' own costs, not a network.

    python tools/bench_s3_clients.py [--mib 256] [--repeat 3]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import tempfile
import time

import s3_server

PART = 8 << 20
IN_FLIGHT = 8


def _ranges(size: int):
    return [(lo, min(size, lo + PART)) for lo in range(0, size, PART)]


def boto3_get(server, key: str, size: int) -> int:
    import boto3
    import botocore.config
    client = boto3.client("s3", config=botocore.config.Config(max_pool_connections=IN_FLIGHT))

    def one(r):
        body = client.get_object(Bucket=server.bucket, Key=key, Range=f"bytes={r[0]}-{r[1] - 1}")["Body"]
        return len(body.read())
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        return sum(pool.map(one, _ranges(size)))


def boto3_put(server, key: str, data: bytes) -> None:
    import boto3
    import botocore.config
    client = boto3.client("s3", config=botocore.config.Config(max_pool_connections=IN_FLIGHT))
    upload = client.create_multipart_upload(Bucket=server.bucket, Key=key)["UploadId"]

    def one(i_r):
        i, (lo, hi) = i_r
        etag = client.upload_part(Bucket=server.bucket, Key=key, UploadId=upload, PartNumber=i + 1,
                                  Body=data[lo:hi])["ETag"]
        return {"PartNumber": i + 1, "ETag": etag}
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        parts = list(pool.map(one, enumerate(_ranges(len(data)))))
    client.complete_multipart_upload(Bucket=server.bucket, Key=key, UploadId=upload,
                                     MultipartUpload={"Parts": parts})


def obstore_get(server, key: str, size: int) -> int:
    import obstore
    from obstore.store import S3Store
    store = S3Store(server.bucket, endpoint=server.endpoint, client_options={"allow_http": True})
    starts = [lo for lo, _ in _ranges(size)]
    ends = [hi for _, hi in _ranges(size)]
    # get_ranges fetches them concurrently (object_store coalesces and bounds them itself)
    return sum(len(b) for b in obstore.get_ranges(store, key, starts=starts, ends=ends))


def obstore_put(server, key: str, data: bytes) -> None:
    import obstore
    from obstore.store import S3Store
    store = S3Store(server.bucket, endpoint=server.endpoint, client_options={"allow_http": True})
    obstore.put(store, key, data, chunk_size=PART, max_concurrency=IN_FLIGHT)


def s3fs_get(server, key: str, size: int) -> int:
    import s3fs
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": server.endpoint}, default_block_size=PART)

    def one(r):
        return len(fs.cat_file(f"{server.bucket}/{key}", start=r[0], end=r[1]))
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        return sum(pool.map(one, _ranges(size)))


def s3fs_put(server, key: str, data: bytes) -> None:
    import s3fs
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": server.endpoint}, default_block_size=PART)
    with fs.open(f"{server.bucket}/{key}", "wb", block_size=PART) as f:
        for lo in range(0, len(data), PART):
            f.write(data[lo:lo + PART])


CLIENTS = {"boto3": (boto3_get, boto3_put), "obstore": (obstore_get, obstore_put), "s3fs": (s3fs_get, s3fs_put)}


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    data = os.urandom(args.mib << 20)
    with tempfile.TemporaryDirectory() as tmp, s3_server.running(os.path.join(tmp, "data")) as server:
        os.environ.update(server.env())
        print(f"{args.mib} MiB, parts of {PART >> 20} MiB, {IN_FLIGHT} in flight; best of {args.repeat}")
        print(f"{'client':8} {'GET MB/s':>9} {'GET cpu s':>10} {'PUT MB/s':>9} {'PUT cpu s':>10}")
        for name, (get, put) in CLIENTS.items():
            try:
                puts = [_timed(functools.partial(put, server, f"{name}-{i}", data)) for i in range(args.repeat)]
                gets = [_timed(functools.partial(get, server, f"{name}-0", len(data))) for _ in range(args.repeat)]
            except Exception as e:     # a client that cannot talk to the server is reported, not fatal
                print(f"{name:8} failed: {type(e).__name__}: {e}")
                continue
            (gw, gc), (pw, pc) = min(gets), min(puts)
            mb = len(data) / 1e6
            print(f"{name:8} {mb / gw:9.0f} {gc:10.2f} {mb / pw:9.0f} {pc:10.2f}")


if __name__ == "__main__":
    main()
