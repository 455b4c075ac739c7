"""Where bytes are read from and written to: one interface (protocol.py), today's POSIX implementation behind it
(posix.py; its O_DIRECT write ring in posix_sink.py). A new kind of storage is a new module here, nowhere else."""
