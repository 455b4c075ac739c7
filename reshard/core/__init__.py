"""The format-free core: the catalog of logical tensors and where their bytes lie, placements (boxes and flat
ranges), the topology, the write requests a writer makes and the plan of byte copies that serves them. Nothing here
imports reshard.formats."""
