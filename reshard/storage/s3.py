"""The storage interface (reshard.storage.protocol) on S3-compatible object storage: `s3://bucket/key` URLs.

The client is boto3's botocore, chosen by measurement (docs/object-storage.md: ranged GETs at the highest rate
for the least CPU of boto3, obstore and s3fs against the same server) and because it resolves credentials,
region and endpoint through the standard AWS chain (environment incl. AWS_ENDPOINT_URL, config files,
profiles). botocore retries throttling and connection failures with backoff (RETRIES, adaptive mode); a body cut
off mid-read is fetched again here, with backoff too.

Reads are ranged GETs of exactly the bytes asked for: a big read is cut into PART_BYTES ranges fetched
IN_FLIGHT at a time, straight into the caller's memory. Writes are multipart uploads fed by the same front-to-back
stream as a local file (no local copy), PART_BYTES parts, UPLOADS_IN_FLIGHT at once; a stream left on an error
aborts its upload. An object store has no rename: a new destination is written in place, marked unfinished until
its manifest (reshard.execution.staging); replacing a checkpoint, a commit copies the staged objects to their place
server-side, the manifest last, so until the manifest is there nothing at the destination claims to be a checkpoint.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import errno
import hashlib
import io
import json
import os
import posixpath
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from reshard import digests
from reshard.errors import ReshardError
from reshard.storage.names import MANIFEST, UNFINISHED
from reshard.storage.protocol import Found, LockHeld
from reshard.storage.settled import ANSWERS

PART_BYTES = 8 << 20        # a ranged GET's and an upload part's size (S3's smallest part is 5 MiB)
IN_FLIGHT = 8               # GETs at once per reader
MIN_GET_BYTES = 1 << 20     # a read is cut into ranges no smaller than this
RUNS_KEPT = 4               # joined runs of small reads held per reader (at most PART_BYTES each)
UPLOADS_IN_FLIGHT = 2       # parts being uploaded at once per stream (and the buffers they hold)
RETRIES = 8                 # attempts per request (botocore's own backoff), and per body read (ours)
DELETE_BATCH = 1000         # keys per DeleteObjects request (S3's limit)
SMALL_OBJECT = 1 << 20      # within files.settled(), an object opened up to this size is fetched whole, once
SETTLED_BYTES = 64 << 20    # and a settled block holds at most this many bytes of them


def split(url: str) -> tuple[str, str]:
    """(bucket, key) of s3://bucket/key; the key normalized, '' for the bucket itself."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    key = posixpath.normpath(key) if key else ""
    return bucket, "" if key == "." else key


def url_of(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}" if key else f"s3://{bucket}"


_CLIENTS: dict[tuple, object] = {}
_CLIENTS_LOCK = threading.Lock()
# what the standard chain reads from the environment: a client made under other values is not reused
_CHAIN = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL",
          "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


def client():
    """This process's S3 client, for the environment as it is (a forked worker makes its own: a client's
    connections are not shared between processes)."""
    key = (os.getpid(), *(os.environ.get(name) for name in _CHAIN))
    with _CLIENTS_LOCK:
        found = _CLIENTS.get(key)
        if found is None:
            import boto3
            import botocore.config
            config = botocore.config.Config(max_pool_connections=2 * IN_FLIGHT,
                                             retries={"max_attempts": RETRIES, "mode": "adaptive"})
            found = _CLIENTS[key] = boto3.session.Session().client("s3", config=config)
        return found


def _reason(e: BaseException) -> tuple[str, int]:
    """(what went wrong in a few words, HTTP status or 0) of a botocore exception."""
    response = getattr(e, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", "")) or type(e).__name__
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


@contextlib.contextmanager
def errors(url: str):
    """botocore's exceptions as reshard's: a missing object is FileNotFoundError (an OSError, as a missing
    file); no credentials, access refused, no such bucket and an unreachable endpoint are one line naming `url`."""
    import botocore.exceptions as be
    try:
        yield
    except be.NoCredentialsError:
        raise ReshardError.at(url, "no AWS credentials found (environment, ~/.aws/credentials or a profile)") \
            from None
    except be.ClientError as e:
        code, status = _reason(e)
        if code == "NoSuchBucket":
            raise ReshardError.at(url, f"no such bucket {split(url)[0]!r}") from None
        if code in ("NoSuchKey", "NotFound", "404") or status == 404:
            raise FileNotFoundError(errno.ENOENT, "no such object", url) from None
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden") \
                or status == 403:
            raise ReshardError.at(url, f"access denied ({code}: check the credentials)") from None
        raise ReshardError.at(url, f"object storage refused the request ({code})") from None
    except (be.EndpointConnectionError, be.ConnectTimeoutError) as e:
        raise ReshardError.at(url, f"cannot reach the object store ({e})") from None
    except be.BotoCoreError as e:
        raise ReshardError.at(url, f"object storage request failed ({e})") from None


def _backoff(attempt: int) -> None:
    time.sleep(min(5.0, 0.1 * 2 ** attempt))


def _read_body(body, out: memoryview) -> int:
    """A GET's body read into `out`; the bytes read."""
    done = 0
    while done < len(out):
        chunk = body.read(min(len(out) - done, 1 << 20))
        if not chunk:
            break
        out[done:done + len(chunk)] = chunk
        done += len(chunk)
    return done


class ObjectTree:
    """The FileTree protocol over an object store: a folder is a key prefix that holds objects."""

    def _head(self, url: str) -> dict | None:
        answers = ANSWERS.get()
        if answers is not None and ("head", url) in answers:
            return answers["head", url]
        bucket, key = split(url)
        head = None
        if key:
            try:
                with errors(url):
                    head = client().head_object(Bucket=bucket, Key=key)
            except FileNotFoundError:
                pass
        if answers is not None:
            answers["head", url] = head
        return head

    def isfile(self, path: str) -> bool:
        return self._head(path) is not None

    def isdir(self, path: str) -> bool:
        bucket, key = split(path)
        with errors(path):
            if not key:
                client().head_bucket(Bucket=bucket)
                return True
        return self._holds_objects(bucket, key + "/", path)

    def exists(self, path: str) -> bool:
        return self.isfile(path) or self.isdir(path)

    def islink(self, path: str) -> bool:
        return False

    def listdir(self, path: str) -> list[str]:
        bucket, key = split(path)
        prefix = key + "/" if key else ""
        folders, files = [], []
        with errors(path):
            pages = client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/")
            for page in pages:
                folders += [p["Prefix"] for p in page.get("CommonPrefixes", ())]
                files += [o["Key"][len(prefix):] for o in page.get("Contents", ())]
        # a folder is a prefix holding objects: a store that keeps a prefix emptied by a delete (SeaweedFS's filer
        # keeps the directory) lists it, as nothing isdir or isfile finds, so `list` after a `prune` would take a
        # deleted `epoch=0-step=2.ckpt/` for a file
        names = [p[len(prefix):].rstrip("/") for p in folders if self._holds_objects(bucket, p, path)] + files
        if not names and key and not self.isfile(path):
            raise FileNotFoundError(errno.ENOENT, "no such folder", path)
        return [n for n in names if n]

    @staticmethod
    def _holds_objects(bucket: str, prefix: str, path: str) -> bool:
        answers = ANSWERS.get()
        if answers is not None and ("holds", bucket, prefix) in answers:
            return answers["holds", bucket, prefix]
        with errors(path):
            holds = bool(client().list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1).get("KeyCount"))
        if answers is not None:
            answers["holds", bucket, prefix] = holds
        return holds

    def keys(self, path: str) -> list[dict]:
        """Every object under the prefix `path` (recursively): S3's listing entries (Key, Size, LastModified)."""
        bucket, key = split(path)
        prefix = key + "/" if key else ""
        out = []
        with errors(path):
            for page in client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                out += page.get("Contents", ())
        return out

    def files_under(self, path: str) -> list[tuple[str, int, float]]:
        """(URL, bytes, upload time) of the object `path`, or of every object under the prefix `path`."""
        bucket, key = split(path)
        under = [(url_of(bucket, o["Key"]), int(o["Size"]), o["LastModified"].timestamp()) for o in self.keys(path)]
        if under:
            return under
        head = self._head(path)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return [(path, int(head["ContentLength"]), head["LastModified"].timestamp())]

    def found_under(self, path: str) -> list[Found]:
        """Every object at or under `path` (no links; what an object takes is what it holds; no folders)."""
        return [Found(url, size, size, mtime, False) for url, size, mtime in self.files_under(path)]

    def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
        """As os.walk, top first, from the listings: `folders` pruned in place is not entered."""
        names = self.listdir(path)
        folders = [n for n in names if self.isdir(posixpath.join(path, n))]
        files = [n for n in names if n not in folders]
        yield path, folders, files
        for name in folders:
            yield from self.walk(posixpath.join(path, name))

    def identity(self, path: str) -> tuple:
        """(ETag, size, upload time in ns): a new PUT changes it; () when there is no such object."""
        head = self._head(path)
        if head is None:
            return ()
        return (head.get("ETag", ""), int(head["ContentLength"]), int(head["LastModified"].timestamp() * 1e9))

    def getsize(self, path: str) -> int:
        head = self._head(path)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return int(head["ContentLength"])

    def mtime_ns(self, path: str) -> int:
        head = self._head(path)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return int(head["LastModified"].timestamp() * 1e9)

    def open(self, path: str, mode: str = "rb", newline: str | None = None, buffering: int = -1,
             random_access: bool = False):
        size = self.getsize(path)
        body = self._fetched(path, size)
        if body is not None:
            return FetchedObject(path, body)
        raw = ObjectReader(path, size)
        return raw if buffering == 0 else io.BufferedReader(raw, buffer_size=1 << 16)

    @staticmethod
    def _fetched(url: str, size: int) -> bytes | None:
        """Within files.settled(): a small object's bytes, fetched whole by its first open (a reader opens the same
        small files again and again, each read a request), while the block holds at most SETTLED_BYTES of them;
        None otherwise."""
        answers = ANSWERS.get()
        if answers is None or size > SMALL_OBJECT:
            return None
        if ("body", url) not in answers and answers.get("held", 0) + size <= SETTLED_BYTES:
            body = bytearray(size)
            got = get_range(url, 0, memoryview(body)) if size else 0
            answers["body", url], answers["held"] = bytes(body[:got]), answers.get("held", 0) + size
        return answers.get(("body", url))


class FetchedObject(io.BytesIO):
    """A small object read whole (ObjectTree._fetched), as a read-only file named by its URL."""

    def __init__(self, url: str, body: bytes):
        super().__init__(body)
        self.name = url


TREE = ObjectTree()


def get_range(url: str, offset: int, out: memoryview) -> int:
    """Bytes [offset, offset + len(out)) of the object read into `out` by one ranged GET (fetched again, with
    backoff, when the connection drops mid-body); the bytes read (fewer only at the object's end)."""
    bucket, key = split(url)
    import botocore.exceptions as be
    import urllib3.exceptions as ue
    for attempt in range(RETRIES):
        try:
            with errors(url):
                response = client().get_object(Bucket=bucket, Key=key,
                                               Range=f"bytes={offset}-{offset + len(out) - 1}")
            return _read_body(response["Body"], out)
        except (TimeoutError, ConnectionError, be.ResponseStreamingError, be.IncompleteReadError, ue.ProtocolError,
                ue.ReadTimeoutError):
            if attempt == RETRIES - 1:
                raise
            _backoff(attempt)
    raise AssertionError("unreachable")


class ObjectReader(io.RawIOBase):
    """An object as a read-only, seekable raw file: each read one ranged GET (the readers' metadata: headers,
    a zip's central directory, a pickle)."""

    def __init__(self, url: str, size: int):
        super().__init__()
        self.name, self.size, self._pos = url, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, "seek before the start", self.name)
        self._pos = base + offset
        return self._pos

    def readinto(self, out) -> int:
        view = memoryview(out).cast("B")
        n = max(0, min(len(view), self.size - self._pos))
        if n == 0:
            return 0
        got = get_range(self.name, self._pos, view[:n])
        self._pos += got
        return got


class ObjectSource:
    """SourceStorage over an object store: positioned reads as ranged GETs, a big one cut into PART_BYTES ranges
    fetched IN_FLIGHT at a time into the caller's memory. Ranges said to be read (`will_read`) that meet or
    overlap are joined into runs of at most PART_BYTES: a read inside such a run fetches the whole run in one GET
    and the reads after it are served from it (RUNS_KEPT runs held), so many small tensors side by side cost one
    request, and no byte outside what is read is fetched. A window or a view is read into memory (no map of a
    remote object)."""

    def __init__(self):
        self._sizes: dict[str, int] = {}
        self._views: dict[str, bytes] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._runs: dict[str, list[tuple[int, int]]] = {}
        self._held: collections.OrderedDict[tuple[str, int], bytearray] = collections.OrderedDict()

    def will_read(self, path: str, ranges: list[tuple[int, int]]) -> None:
        runs: list[tuple[int, int, int]] = []      # (start, stop, ranges joined)
        for start, stop in sorted(ranges):
            if runs and start <= runs[-1][1] and max(stop, runs[-1][1]) - runs[-1][0] <= PART_BYTES:
                runs[-1] = (runs[-1][0], max(stop, runs[-1][1]), runs[-1][2] + 1)
            else:
                runs.append((start, stop, 1))
        self._runs[path] = [(start, stop) for start, stop, joined in runs if joined > 1]

    def _run_of(self, path: str, offset: int, nbytes: int) -> tuple[int, int] | None:
        runs = self._runs.get(path)
        if not runs:
            return None
        i = bisect.bisect_right(runs, (offset, float("inf"))) - 1
        if i >= 0 and runs[i][0] <= offset and offset + nbytes <= runs[i][1]:
            return runs[i]
        return None

    def _from_run(self, path: str, run: tuple[int, int], offset: int, out: memoryview) -> int:
        key = (path, run[0])
        held = self._held.get(key)
        if held is None:
            held = bytearray(min(run[1], self.size(path)) - run[0])
            del held[get_range(path, run[0], memoryview(held)):]
            self._held[key] = held
            while len(self._held) > RUNS_KEPT:
                self._held.popitem(last=False)
        else:
            self._held.move_to_end(key)
        part = held[offset - run[0]:offset - run[0] + len(out)]
        out[:len(part)] = part
        return len(part)

    def size(self, path: str) -> int:
        found = self._sizes.get(path)
        if found is None:
            found = self._sizes[path] = TREE.getsize(path)
        return found

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        out = memoryview(out).cast("B")
        run = self._run_of(path, offset, len(out))
        if run is not None:
            return self._from_run(path, run, offset, out)
        n = max(0, min(len(out), self.size(path) - offset))
        # a read cut into IN_FLIGHT ranges (none under MIN_GET_BYTES, none over PART_BYTES): one GET's stream
        # is slower than the link; the executor reads one block at a time per file
        step = min(PART_BYTES, max(MIN_GET_BYTES, -(-n // IN_FLIGHT)))
        parts = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
        if len(parts) <= 1:
            return get_range(path, offset, out[:n]) if n else 0
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="s3-get")
        jobs = [self._pool.submit(get_range, path, offset + lo, out[lo:hi]) for lo, hi in parts]
        got = [job.result() for job in jobs]
        return sum(got)

    def read(self, path: str, offset: int, nbytes: int) -> bytes:
        buffer = bytearray(max(0, min(nbytes, self.size(path) - offset)))
        done = self.read_into(path, offset, memoryview(buffer))
        return bytes(buffer[:done])

    @contextlib.contextmanager
    def window(self, path: str, offset: int, nbytes: int):
        buffer = bytearray(nbytes)
        if self.read_into(path, offset, memoryview(buffer)) != nbytes:
            raise ValueError(f"{path}: shorter than byte {offset + nbytes}")
        with memoryview(buffer) as view:
            yield view

    def view(self, path: str) -> bytes:
        """The whole object, fetched once and kept until close()."""
        found = self._views.get(path)
        if found is None:
            found = self._views[path] = self.read(path, 0, self.size(path))
        return found

    def done_with(self, path: str, offset: int, nbytes: int) -> None:
        pass

    def mapped(self, path: str) -> bool:
        return False

    def close(self) -> None:
        self._views.clear()
        self._held.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class UploadStream(io.RawIOBase):
    """An object written front to back as a multipart upload, hashed (reshard.digests) as it goes: PART_BYTES parts,
    UPLOADS_IN_FLIGHT being sent while the next fills. Closed normally, the upload is completed (the object
    appears whole, at once); left on an exception, it is aborted (no object, no parts kept)."""

    def __init__(self, url: str, algorithm: str = digests.DEFAULT):
        super().__init__()
        self.name = url
        self.bucket, self.key = split(url)
        self.size = 0
        self._hasher = digests.new(algorithm)
        self._part = bytearray()
        self._sent: list[Future] = []
        self._pool = ThreadPoolExecutor(max_workers=UPLOADS_IN_FLIGHT, thread_name_prefix="s3-put")
        self._upload: str | None = None
        self._finished = False
        self._digest = ""

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False    # zipfile then streams each member with a data descriptor, as on disk

    def tell(self) -> int:
        return self.size

    def write(self, data) -> int:
        if self._finished:
            raise ValueError(f"{self.name}: write after close")
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        self.size += len(view)
        done = 0
        while done < len(view):
            n = min(PART_BYTES - len(self._part), len(view) - done)
            self._part += view[done:done + n]
            done += n
            if len(self._part) == PART_BYTES:
                self._send()
        return len(view)

    def _send(self) -> None:
        if self._upload is None:
            with errors(self.name):
                self._upload = client().create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"]
        while len([job for job in self._sent if not job.done()]) >= UPLOADS_IN_FLIGHT:
            next(job for job in self._sent if not job.done()).result()
        number, part, self._part = len(self._sent) + 1, bytes(self._part), bytearray()
        self._sent.append(self._pool.submit(self.send_part, number, part))

    def send_part(self, number: int, part: bytes) -> dict:
        with errors(self.name):
            etag = client().upload_part(Bucket=self.bucket, Key=self.key, UploadId=self._upload,
                                        PartNumber=number, Body=part)["ETag"]
        return {"PartNumber": number, "ETag": etag}

    def _complete(self) -> None:
        if self._upload is None:        # smaller than one part: one PUT
            with errors(self.name):
                client().put_object(Bucket=self.bucket, Key=self.key, Body=bytes(self._part))
            return
        if self._part:
            self._send()
        parts = [job.result() for job in self._sent]
        with errors(self.name):
            client().complete_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload,
                                               MultipartUpload={"Parts": parts})

    def abort(self) -> None:
        """Stop: no object is made and the parts sent are dropped."""
        if self._finished:
            return
        self._finished = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload is not None:
            with contextlib.suppress(Exception):
                client().abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload)
        self._part = bytearray()

    def _finish(self) -> None:
        if self._finished:
            return
        try:
            self._complete()
        except BaseException:
            self.abort()
            raise
        self._finished = True
        self._pool.shutdown(wait=True)
        self._digest = self._hasher.hexdigest()
        self._part = bytearray()

    @property
    def digest(self) -> str:
        self._finish()
        return self._digest

    def close(self) -> None:
        if not self.closed:
            try:
                self._finish()
            finally:
                super().close()

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is not None:
            self.abort()
        self.close()
        return None


class ObjectLock:
    """A lock object: made only where none is (a conditional PUT), deleted on release."""

    def __init__(self, url: str):
        self.url = url
        self._held = True

    def release(self) -> None:
        if self._held:
            with contextlib.suppress(Exception):
                bucket, key = split(self.url)
                client().delete_object(Bucket=bucket, Key=key)
            self._held = False


class ObjectOutput:
    """OutputStorage over an object store (the order: reshard.storage.protocol). Folders are key prefixes, so
    making one does nothing; an object is durable once its PUT or its upload's completion returns, so `sync`
    does nothing; a commit copies server-side (see the module's note)."""

    STREAM_BUFFER_BYTES = PART_BYTES * (UPLOADS_IN_FLIGHT + 1)
    IN_PLACE = True         # no rename: a copy of every object would be the commit (reshard.execution.staging)

    def lock(self, path: str) -> ObjectLock:
        """The lock object, made with If-None-Match (a second writer's PUT fails). A lock left by a process of
        this host that is gone (a killed convert) is taken over; another host's is reported as held."""
        bucket, key = split(path)
        mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        import botocore.exceptions as be
        for _ in range(2):
            try:
                with errors(path):
                    client().put_object(Bucket=bucket, Key=key, Body=mine, IfNoneMatch="*")
                return ObjectLock(path)
            except ReshardError:
                pass
            except be.ClientError:
                pass
            if not self._stale(path):
                raise LockHeld(path)
            self.delete(path)
        raise LockHeld(path)

    def _stale(self, path: str) -> bool:
        try:
            held = json.loads(self.get(path))
        except (OSError, ValueError):
            return True
        if held.get("host") != socket.gethostname():
            return False
        try:
            os.kill(int(held.get("pid", 0)), 0)
        except ProcessLookupError:
            return True
        except (OSError, ValueError):
            return False
        return False

    def make_folder(self, path: str) -> None:
        pass

    def stream(self, path: str, reserve: int = 0, algorithm: str = digests.DEFAULT) -> UploadStream:
        return UploadStream(path, algorithm)

    def sync(self, path: str) -> None:
        pass

    def append(self, path: str, data: bytes) -> None:
        """No append in an object store: each entry (the journal's line per finished file) is an object of its own
        under `path/`, so writers appending at once (torchrun ranks) never overwrite one another's; `get(path)`
        reads them back together."""
        self.put(f"{path}/{hashlib.sha256(data).hexdigest()[:32]}", data)

    def put(self, path: str, data: bytes) -> None:
        bucket, key = split(path)
        with errors(path):
            client().put_object(Bucket=bucket, Key=key, Body=data)

    def copy(self, source: str, path: str) -> None:
        """A file of the source copied: server-side from the same store, else streamed up from disk."""
        if source.startswith("s3://"):     # (this module's own scheme)
            self._copy_object(source, path)
            return
        with open(source, "rb") as f, self.stream(path) as out:
            for block in iter(lambda: f.read(PART_BYTES), b""):
                out.write(block)

    def _copy_object(self, source: str, path: str) -> None:
        (sb, sk), (bucket, key) = split(source), split(path)
        with errors(source):
            client().copy(CopySource={"Bucket": sb, "Key": sk}, Bucket=bucket, Key=key)

    def get(self, path: str) -> bytes:
        """The object's bytes; for what `append` wrote, its entries joined (in key order)."""
        bucket, key = split(path)
        try:
            with errors(path):
                return client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except FileNotFoundError:
            entries = sorted(o["Key"] for o in TREE.keys(path))
            if not entries:
                raise
            return b"".join(self.get(url_of(bucket, entry)) for entry in entries)

    def list(self, folder: str) -> list:
        return TREE.listdir(folder)

    def exists(self, path: str) -> bool:
        return TREE.exists(path)

    def delete(self, path: str) -> None:
        """The object `path` and every object under it, in batched deletes; uploads left unfinished under it
        (a killed run's parts) aborted."""
        bucket, key = split(path)
        if not key:     # (no caller names a bucket itself; deleting one whole is never what was meant)
            raise ReshardError.at(path, "refusing to delete everything in a bucket")
        keys = [key] + [o["Key"] for o in TREE.keys(path)]
        # what claims a checkpoint whole goes first, what says it is unfinished last: killed half way, what is
        # left never reads as complete
        manifests = [k for k in keys if posixpath.basename(k) == MANIFEST]
        markers = [k for k in keys if posixpath.basename(k) == UNFINISHED]
        delete_keys(path, bucket, manifests)
        delete_keys(path, bucket, [k for k in keys if k not in manifests and k not in markers])
        self.drop_unfinished(path)
        delete_keys(path, bucket, markers)

    def drop_unfinished(self, path: str) -> None:
        """Multipart uploads begun at or under `path` and never completed (a killed run's parts) aborted."""
        bucket, key = split(path)
        with errors(path):
            pages = client().get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=key)
            for page in pages:
                for upload in page.get("Uploads", ()):
                    if upload["Key"] == key or upload["Key"].startswith(key + "/"):
                        client().abort_multipart_upload(Bucket=bucket, Key=upload["Key"],
                                                        UploadId=upload["UploadId"])

    def commit(self, staged: str, final: str) -> None:
        """`staged`'s objects copied to `final` server-side (IN_FLIGHT at once), the manifest once all the others
        are there: until it is, nothing at `final` claims to be a checkpoint. An old `final` loses its manifest
        first, then its other objects."""
        (bucket, staged_key), (_, final_key) = split(staged), split(final)
        old = TREE.keys(final)
        if old:
            self.delete(f"{final}/{MANIFEST}")
            delete_keys(final, bucket, [o["Key"] for o in old])
        objects = sorted(TREE.keys(staged), key=lambda o: -o["Size"])
        manifests = [o for o in objects if o["Key"] == f"{staged_key}/{MANIFEST}"]

        def place(entry: dict) -> None:
            rel = entry["Key"][len(staged_key) + 1:]
            self._copy_object(url_of(bucket, entry["Key"]), url_of(bucket, f"{final_key}/{rel}"))
        with ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="s3-copy") as pool:
            for done in [pool.submit(place, o) for o in objects if o not in manifests]:
                done.result()
        for entry in manifests:     # last: the commit
            place(entry)
        self.delete(staged)

    def commit_file(self, staged: str, final: str) -> None:
        self._copy_object(staged, final)
        self.delete(staged)

    def free_bytes(self, folder: str) -> None:
        return None         # an object store states no free space; a full one refuses the PUT

    def put_atomic(self, path: str, data: bytes) -> None:
        self.put(path, data)    # an object appears whole: no sibling to rename

    def set_aside(self, path: str, trash: str) -> str:
        """Nothing moved (no rename): delete() removes a folder's manifest first, so what a kill leaves of it never
        reads as a checkpoint."""
        return path

    def delete_file(self, path: str) -> None:
        """The one object `path` (delete() takes every object under the prefix `path` too)."""
        bucket, key = split(path)
        delete_keys(path, bucket, [key])


def delete_keys(url: str, bucket: str, keys: list) -> None:
    """Delete `keys` of `bucket`, DELETE_BATCH per request; a key that is not there is already deleted."""
    keys = [k for k in dict.fromkeys(keys) if k]
    for lo in range(0, len(keys), DELETE_BATCH):
        batch = [{"Key": k} for k in keys[lo:lo + DELETE_BATCH]]
        with errors(url):
            answer = client().delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
        failed = answer.get("Errors") or []
        if failed:
            first = failed[0]
            raise ReshardError.at(url_of(bucket, first.get("Key", "")), f"cannot delete ({first.get('Code')})")
