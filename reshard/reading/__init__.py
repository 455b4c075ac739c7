"""Reading a source checkpoint's bytes, below the formats that read it: fragments of source files viewed in place
(source_bytes: MappedFiles, whole tensors, scalars, replica comparisons), the CRC-32 of every block read checked
against its zip member's (checksums), and whether an output is committed (commit_state: where its manifest lies, the
marker of one written in place and not finished). The readers under reshard/formats/, the commands, execution and
live loading all read through here."""
