"""PyTorch Distributed Checkpoint (torch.distributed.checkpoint, FileSystemWriter layout):
`.metadata` (the pickled Metadata, written last: the commit marker) and `__<rank>_<n>.distcp`
files of torch.save archives, one per chunk or value. metadata.py reads and writes `.metadata`
safely; chunkzip.py lays out the archives; reader.py and writer.py map keys to the Catalog."""
