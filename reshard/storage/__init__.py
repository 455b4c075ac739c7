"""Where bytes are read from and written to: one interface (protocol.py), the local filesystem (posix.py; its
O_DIRECT write ring in posix_sink.py) and S3-compatible object storage (s3.py) behind it. `files` answers what a
path holds; routing.py reads any path's bytes (`sources()`) and writes where a destination lies (`output_for`);
names.py holds the names the commit protocol gives its files. A new kind of storage is a new module here, nowhere
else: outside this package nothing touches a file itself (tests/test_structure.py)."""
