"""What executes at run time: the captured step graphs (``graphs``) and the LeanGRPO schedule
runner with its activation store and gradient buffers (``schedule``). The FlashOverlap P2P ops
land here too."""

__all__: list[str] = []
