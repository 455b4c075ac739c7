"""v0.2's public path of reshard.dcp_reader (`reshard.dcp.Reader("ckpt/")`), kept so scripts written against v0.2's
README still run."""
from reshard.live.storage_reader import Reader

__all__ = ["Reader"]
